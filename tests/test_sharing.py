"""Sharing memory: parallel sampling with copy-on-write, beam search, prefix caching.

Each is checked against an independent oracle: beam search against a brute-force
beam search over the dense reference model; prefix caching and copy-on-write
against runs that share nothing; n samples against n separately seeded requests.
"""

import numpy as np
import pytest

from minipaged import LLM, BeamSearchParams, LLMEngine, SamplingParams
from minipaged.model.config import LlamaConfig
from minipaged.model.reference import DenseReference
from minipaged.model.weights import load_checkpoint
from minipaged.engine.sampler import log_softmax
from minipaged.sampling_params import derive_seed

SWAP_GIB = 0.002
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def calm_reference(calm_model_dir):
    return DenseReference(LlamaConfig.from_dir(calm_model_dir), load_checkpoint(calm_model_dir))


def llm(model_dir, **kwargs):
    return LLM(str(model_dir), device="cpu", swap_space=SWAP_GIB, **kwargs)


def shared_prefix_prompts(n, seed, prefix_len=40):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, size=prefix_len).tolist()
    return [{"prompt_token_ids": prefix + rng.integers(3, 259, size=int(rng.integers(1, 20))).tolist()}
            for _ in range(n)]


# ---------------------------------------------------------------- beam search


def brute_force_beam_search(reference, prompt, width, max_tokens, eos, ignore_eos, length_penalty):
    """The same rule as vLLM's beam search, on the dense model, with nothing shared or cached."""
    beams, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            row = log_softmax(reference.logits(tokens)[-1:])[0]
            for t in sorted(range(len(row)), key=lambda t: (-row[t], t))[:2 * width]:
                if t == eos and not ignore_eos:
                    finished.append((tokens + [t], cum + float(row[t]), True))
                else:
                    candidates.append((tokens + [t], cum + float(row[t])))
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:width]
    pool = finished + [(t, c, False) for t, c in beams]
    pool.sort(key=lambda h: -h[1] / (len(h[0]) - h[2]) ** length_penalty)
    return [(t, c) for t, c, _ in pool[:width]]


@pytest.mark.parametrize("width,ignore_eos,length_penalty", [(1, True, 1.0), (3, False, 1.0), (4, True, 0.5)])
def test_beam_search_equals_brute_force(calm_model_dir, calm_reference, width, ignore_eos, length_penalty):
    engine = llm(calm_model_dir, block_size=4)
    rng = np.random.default_rng(width)
    prompts = [rng.integers(3, 259, size=int(rng.integers(2, 11))).tolist() for _ in range(3)]
    params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=ignore_eos, length_penalty=length_penalty)
    outputs = engine.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = brute_force_beam_search(calm_reference, prompt, width, 5, 2, ignore_eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-5)
            assert seq.text == engine.get_tokenizer().decode(seq.tokens, skip_special_tokens=True)
    if not ignore_eos:   # the EOS path (finished hypotheses) was exercised
        assert any(s.finish_reason == "stop" for o in outputs for s in o.sequences)
    stats = engine.get_stats()
    assert stats["kv_blocks_used"] == 0
    engine.llm_engine.block_manager.check_invariants()


def test_beams_share_their_prefix_and_prune_at_once(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, swap_space=SWAP_GIB)
    engine.add_beam_request("b", list(range(3, 40)), BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step()
        bm = engine.block_manager
        group = engine.groups["b"]
        assert len(group.seqs) == 4
        tables = [bm.block_table(s) for s in group.seqs]
        # the 9 full prompt blocks (36 tokens) are one physical copy held by all four beams
        assert all(t[:9] == tables[0][:9] for t in tables)
        assert all(bm.allocator.ref_counts[b] == 4 for b in tables[0][:9])
        assert bm.num_used_blocks < bm.num_mapped_blocks
        bm.check_invariants(group.seqs)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_beam_search_under_preemption(tiny_model_dir):
    prompts = [list(range(3, 20)), list(range(50, 63)), list(range(100, 109))]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    big = llm(tiny_model_dir, block_size=2).beam_search([{"prompt_token_ids": p} for p in prompts], params,
                                                       use_tqdm=False)
    for mode in ("swap", "recompute"):
        small = llm(tiny_model_dir, block_size=2, num_blocks=40, preemption_mode=mode)
        out = small.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [[s.tokens for s in o.sequences] for o in out] == [[s.tokens for s in o.sequences] for o in big]
        assert small.get_stats()["num_preemptions"] > 0


# ---------------------------------------------------------------- parallel sampling


def test_sample_i_equals_a_request_seeded_with_its_derived_seed(tiny_model_dir):
    engine = llm(tiny_model_dir, block_size=4)
    prompt = {"prompt_token_ids": list(range(40, 58))}
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=10, seed=7, ignore_eos=True)
    out = engine.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1          # the samples differ
    for i, completion in enumerate(out.outputs):
        alone = engine.generate(prompt, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10,
                                                       seed=derive_seed(7, i), ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == alone.token_ids
        # float32 logits from a batch of 4 and of 1 (BLAS picks other kernels): the engine's 1e-4 rule
        assert completion.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
    again = engine.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_samples_share_the_prompt_and_copy_on_write(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, swap_space=SWAP_GIB)
    prompt = list(range(40, 58))                       # 18 tokens: 4 full blocks + 2 tokens
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    engine.add_request("n", prompt, params)
    engine.step()                                      # one prefill for all three
    bm, group = engine.block_manager, engine.groups["n"]
    tables = [list(bm.block_table(s)) for s in group.seqs]
    assert tables[0] == tables[1] == tables[2]          # forked: the same five blocks
    assert all(bm.allocator.ref_counts[b] == 3 for b in tables[0])
    assert engine.get_stats()["prompt_tokens"] == 18    # the prompt was computed once
    engine.step()                                       # each writes into the shared 5th block
    tables = [list(bm.block_table(s)) for s in group.seqs]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]    # full blocks stay shared forever
    assert len({t[4] for t in tables}) == 3                   # the partial one was copied on write
    for _ in range(4):
        engine.step()
    # after divergence each sample's KV equals what it holds when run alone
    for i, seq in enumerate(group.seqs):
        solo = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, swap_space=SWAP_GIB)
        solo.add_request("s", prompt, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                      seed=derive_seed(3, i)))
        for _ in range(6):
            solo.step()
        solo_seq = solo.groups["s"].seqs[0]
        assert solo_seq.token_ids == seq.token_ids
        n = seq.num_computed_tokens
        mine = kv_of(engine, seq, n)
        theirs = kv_of(solo, solo_seq, n)
        np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=1e-5)


def kv_of(engine, seq, num_tokens):
    """(layers, 2, num_tokens, kv_heads, head_dim): a sequence's cached K/V through its table."""
    table = engine.block_manager.block_table(seq)
    size = engine.block_manager.block_size
    blocks = engine.cache.kv_cache[:, :, table]               # (L, 2, blocks, heads, size, dim)
    per_token = blocks.transpose(0, 1, 2, 4, 3, 5).reshape(blocks.shape[0], 2, -1, blocks.shape[3], blocks.shape[5])
    assert len(table) * size >= num_tokens
    return per_token[:, :, :num_tokens]


def test_n_with_preemption_changes_no_token(tiny_model_dir):
    prompts = [{"prompt_token_ids": list(range(3 + 9 * i, 20 + 9 * i))} for i in range(3)]
    params = SamplingParams(n=3, temperature=0.8, max_tokens=8, seed=11, ignore_eos=True)
    big = llm(tiny_model_dir, block_size=2).generate(prompts, params, use_tqdm=False)
    for mode in ("swap", "recompute", "auto"):
        small = llm(tiny_model_dir, block_size=2, num_blocks=45, preemption_mode=mode)
        out = small.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in out] == [[c.token_ids for c in o.outputs] for o in big]
        assert small.get_stats()["num_preemptions"] > 0


# ---------------------------------------------------------------- prefix caching


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(block_size=2, num_blocks=60, preemption_mode="recompute"),
    dict(block_size=2, num_blocks=60, preemption_mode="swap"),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8),
])
def test_prefix_caching_changes_no_token(tiny_model_dir, kwargs):
    prompts = shared_prefix_prompts(8, seed=1)
    expected = [o.outputs[0].token_ids for o in llm(tiny_model_dir, **kwargs).generate(prompts, GREEDY, use_tqdm=False)]
    cached = llm(tiny_model_dir, enable_prefix_caching=True, **kwargs)
    for _ in range(2):                                  # cold, then warm
        got = [o.outputs[0].token_ids for o in cached.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
    stats = cached.get_stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
    cached.llm_engine.block_manager.check_invariants()


def test_prefix_hits_save_compute_and_the_last_token_is_recomputed(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, swap_space=SWAP_GIB,
                       enable_prefix_caching=True)
    prompt = list(range(3, 35))                         # 32 tokens: exactly 8 full blocks
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    stats = engine.get_stats()
    # 7 blocks hit; the 8th holds the last token, which must be computed for logits
    assert stats["prefix_cache_hits"] == 28
    assert stats["prompt_tokens"] == 32 + 4


def test_freed_cached_blocks_count_as_free_and_are_evicted_oldest_first(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=12, swap_space=SWAP_GIB,
                       enable_prefix_caching=True)
    bm = engine.block_manager
    for rid, start in (("a", 3), ("b", 100)):
        engine.add_request(rid, list(range(start, start + 16)), SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    assert bm.num_free_blocks == 12 and len(bm.cache.evictable) == 8  # parked, yet free
    names_a = [bm.cache.name_of[b] for b in list(bm.cache.evictable)[:4]]   # parked first: oldest
    names_b = [bm.cache.name_of[b] for b in list(bm.cache.evictable)[4:]]
    engine.add_request("c", list(range(200, 216)), SamplingParams(temperature=0, max_tokens=1))
    engine.step()                                       # takes the 4 plain free blocks first
    assert all(n in bm.cache.block_of for n in names_a + names_b)
    engine.add_request("d", list(range(150, 166)), SamplingParams(temperature=0, max_tokens=1))
    engine.step()                                       # now 4 evictions: a's, the least recently used
    assert not any(n in bm.cache.block_of for n in names_a)
    assert all(n in bm.cache.block_of for n in names_b)
    engine.add_request("b2", list(range(100, 116)), SamplingParams(temperature=0, max_tokens=1))
    engine.step()                                       # b's prompt is still cached: a hit
    assert engine.get_stats()["prefix_cache_hits"] == 12
    bm.check_invariants()


def test_memory_saved_by_sharing_is_reported(tiny_model_dir):
    engine = llm(tiny_model_dir, block_size=4)
    engine.generate({"prompt_token_ids": list(range(3, 43))},
                    SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True), use_tqdm=False)
    stats = engine.get_stats()
    # 40-token prompt (10 blocks) shared by 4 samples of 7 cached outputs each
    assert stats["kv_blocks_unshared_peak"] == 4 * 12
    assert stats["kv_blocks_peak"] == 10 + 4 * 2
