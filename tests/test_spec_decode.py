"""Speculative decoding (n-gram drafts): the proposer against a plain oracle, the rejection rule
against the distributions it must reproduce, and the engine: greedy outputs identical with and
without speculation (k = 1..8, adaptive or not, under preemption, with n > 1, prefix caching
and chunked prefill), sampled outputs distributed identically (a chi-square test over
thousands of seeds), and the page tables rolled back exactly after every step."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import LLM, LLMEngine, SamplingParams
from minipaged.config import ConfigError, SpeculativeConfig
from minipaged.engine.spec_decode.ngram_proposer import propose_ngram
from minipaged.engine.spec_decode.rejection_sampler import verify_coupled, verify_greedy, verify_sampled
from minipaged.engine.spec_decode.decoder import best_draft_length, expected_tokens
from minipaged.memory.block_manager import blocks_for

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
# prompts whose continuations repeat (the tiny model falls into loops) and one that does not
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]},
           {"prompt_token_ids": list(range(3, 40))},
           {"prompt_token_ids": [11, 12, 11, 12, 11]},
           {"prompt_token_ids": [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed prompt_lookup_max"),
    ({"typo": 1}, "unknown keys ['typo']"),
    ({"method": "draft_model"}, "needs a model"),
    ({"model": "x"}, "only for method 'draft_model'"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_speculative_configs_are_named(value, message):
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.from_value(value)
    assert message in str(err.value)


def test_the_engine_refuses_what_speculation_cannot_combine_with(tiny_model_dir):
    for kwargs, message in ((dict(num_scheduler_steps=4), "multi-step"),
                            (dict(kv_allocator="contiguous"), "paged allocator"),
                            (dict(sparse_attention_budget=64), "sparse_attention_budget do not combine")):
        with pytest.raises(ConfigError, match=message):
            LLMEngine(str(tiny_model_dir), device="cpu", speculative_config=NGRAM, **kwargs)
    assert SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3


# ---------------------------------------------------------------- the proposer


def naive_ngram(tokens, k, min_n, max_n):
    """The latest earlier match of the longest suffix n-gram; its continuation, read from the
    text extended by the proposal itself."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                text = list(tokens)
                for j in range(k):
                    text.append(text[start + n + j])
                return text[len(tokens):]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 8), st.integers(1, 3),
       st.integers(0, 3))
def test_ngram_proposals_match_the_naive_search(tokens, k, min_n, extra):
    assert propose_ngram(tokens, k, min_n, min_n + extra) == naive_ngram(tokens, k, min_n, min_n + extra)


def test_ngram_proposals_continue_the_text():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 4) == [4, 1, 2]
    assert propose_ngram([7, 7], 3, 1, 4) == [7, 7, 7]          # a loop one period back
    assert propose_ngram([1, 2, 3], 3, 1, 4) == []              # nothing repeats: no draft


# ---------------------------------------------------------------- the rule


def test_greedy_verification_keeps_the_agreeing_prefix():
    assert verify_greedy([4, 5, 9, 1], [4, 5, 6]).token_ids == [4, 5, 9]       # 2 stand, then the target's
    assert verify_greedy([4, 5, 6, 1], [4, 5, 6]).token_ids == [4, 5, 6, 1]    # all stand, then the bonus
    assert verify_greedy([3, 5], [4]).num_accepted == 0


def chi_square_threshold(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (z = 3.09), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity(counts_a: np.ndarray, counts_b: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square statistic that two samples come from one distribution, and its df."""
    keep = (counts_a + counts_b) > 0
    a, b = counts_a[keep].astype(float), counts_b[keep].astype(float)
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = (((a - expected_a) ** 2 / expected_a) + ((b - expected_b) ** 2 / expected_b)).sum()
    return float(stat), int(keep.sum()) - 1


@pytest.mark.parametrize("draft_kind", ["one-hot", "one-hot coupled", "draft distribution"])
def test_rejection_sampling_reproduces_the_target_distribution(draft_kind):
    """Emitted tokens: the first is distributed as p_0, and after an accepted x_0 the next as
    p_1, whatever the drafts: a goodness-of-fit test on 20,000 draws over 5 tokens."""
    rng = np.random.default_rng(0)
    p = np.array([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.05, 0.5, 0.1], [0.2] * 5])   # (3, 5)
    q = np.array([[0.6, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.6, 0.1]])                 # (2, 5)
    first, second = np.zeros(5), np.zeros(5)
    for _ in range(20_000):
        if draft_kind == "one-hot":
            drafts, draft_probs = [1, 0], None
        else:
            drafts = [int(rng.choice(5, p=q[0])), int(rng.choice(5, p=q[1]))]
            draft_probs = q
        verdict = (verify_coupled(p, drafts, rng) if draft_kind == "one-hot coupled"
                   else verify_sampled(p, drafts, rng, draft_probs))
        first[verdict.token_ids[0]] += 1
        if verdict.num_accepted >= 1 and len(verdict.token_ids) > 1:
            second[verdict.token_ids[1]] += 1
    for counts, want in ((first, p[0]), (second, p[1])):
        expected = want * counts.sum()
        stat = float(((counts - expected) ** 2 / expected).sum())
        assert stat < chi_square_threshold(4), (counts, expected, stat)


def test_the_adaptive_rule():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert best_draft_length(0.05, 8, row_cost=0.1) == 0          # guesses that rarely stand: none
    assert best_draft_length(0.95, 8, row_cost=0.06) >= 6         # a copying task: many
    ks = [best_draft_length(rate, 8, 0.1) for rate in np.linspace(0, 1, 21)]
    assert ks == sorted(ks)                                       # k grows with the rate
    assert best_draft_length(0.6, 8, row_cost=0.8) < best_draft_length(0.6, 8, row_cost=0.06)


# ---------------------------------------------------------------- the engine


def run(model_dir, prompts, params, **kwargs):
    llm = LLM(str(model_dir), device="cpu", kv_cache_space=0.01, swap_space=0.01, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs], llm.llm_engine


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir):
    return run(tiny_model_dir, PROMPTS, GREEDY)[0]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_outputs_are_identical_with_speculation(tiny_model_dir, greedy_reference, k, adaptive):
    got, engine = run(tiny_model_dir, PROMPTS, GREEDY,
                      speculative_config={"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive})
    assert got == greedy_reference
    stats = engine.get_stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0   # it did speculate
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=24, block_size=4, preemption_mode="swap"),
    dict(num_blocks=24, block_size=4, preemption_mode="recompute"),
    dict(num_blocks=24, block_size=4, preemption_mode="auto", enable_prefix_caching=True),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4, block_size=4),
    dict(enable_prefix_caching=True, block_size=2),
])
def test_greedy_outputs_are_identical_under_preemption_caching_and_chunking(tiny_model_dir, kwargs):
    prompts = PROMPTS + PROMPTS[:2]                     # repeats: prefix-cache hits
    want, plain = run(tiny_model_dir, prompts, GREEDY, **kwargs)
    got, engine = run(tiny_model_dir, prompts, GREEDY, speculative_config=NGRAM, **kwargs)
    assert got == want
    if "preemption_mode" in kwargs:
        assert engine.scheduler.num_preemptions > 0
    assert engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_parallel_samples_speculate_each_on_its_own(tiny_model_dir):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    first, engine = run(tiny_model_dir, PROMPTS, params, speculative_config=NGRAM)
    again, _ = run(tiny_model_dir, PROMPTS, params, speculative_config=NGRAM)
    assert first == again                                 # per-request seeds stay reproducible
    assert all(len(c) == 24 for o in first for c in o)
    assert engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0


def test_stops_inside_accepted_drafts_and_max_tokens(tiny_model_dir, greedy_reference):
    """A stop token or max_tokens reached among the drafts that stand ends the sequence there."""
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    want, _ = run(tiny_model_dir, PROMPTS, params)
    got, _ = run(tiny_model_dir, PROMPTS, params, speculative_config=NGRAM)
    assert got == want and all(len(c) == 7 for o in got for c in o)
    stop = greedy_reference[0][0][5]                        # a token the first prompt produces
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    want, _ = run(tiny_model_dir, PROMPTS, params)
    got, _ = run(tiny_model_dir, PROMPTS, params, speculative_config=NGRAM)
    assert got == want


def test_rollback_leaves_exactly_the_blocks_the_accepted_tokens_need(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=2, swap_space=0.01,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 8, "adaptive": False})
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    rolled_back = 0
    while engine.has_unfinished_requests():
        engine.step()
        bm = engine.block_manager
        bm.check_invariants([s for g in engine.scheduler.running for s in g.seqs])
        held = set()
        for group in engine.scheduler.running:
            for seq in group.unfinished_seqs():
                table = bm.tables[seq.seq_id]
                assert table.num_tokens == seq.num_computed_tokens == seq.num_tokens - 1
                assert len(table) == blocks_for(seq.num_computed_tokens, bm.block_size)
                held.update(table.block_ids)
        assert bm.num_used_blocks == len(held)            # nothing else is held: no leak
        stats = engine.get_stats()["spec_decode"]
        rolled_back = stats["num_draft_tokens"] - stats["num_accepted_tokens"]
    assert rolled_back > 0                                # rejections happened and were undone
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.one_tier   # the rule is the tier's to follow, not to change: ~20 s of CI time a tier
def test_seeded_samples_are_the_tokens_drawn_without_speculation(calm_model_dir):
    """n-gram drafts are one-hot, and their rule draws each position's token as the target
    itself would, with the uniform number it would use (rejection_sampler.verify_coupled): so
    8,000 seeded requests at temperature 1 give exactly the tokens they give without
    speculation, while drafts are made nearly every step and stand about a third of the
    time. The prompt repeats a few likely tokens (logit_bias) of the calm tiny model (logits
    of a few units, so the bias dominates without deciding). The same holds with the
    adaptive rule, whose draft lengths depend on the batch."""
    likely = [20, 21, 22]
    prompt = {"prompt_token_ids": likely * 3 + likely[:2]}
    n = 8000

    def sample(count, **kwargs):
        llm = LLM(str(calm_model_dir), device="cpu", num_blocks=4096, block_size=4, **kwargs)
        params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=i,
                                 logit_bias={t: 8.0 for t in likely}) for i in range(count)]
        outs = llm.generate([prompt] * count, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine

    plain, _ = sample(n)
    # fixed k in batches of 256; adaptive in batches of 8 (in big batches it rightly drafts nothing)
    for count, adaptive, batch in ((n, False, 256), (1500, True, 8)):
        spec, engine = sample(count, max_num_seqs=batch, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "adaptive": adaptive})
        stats = engine.get_stats()["spec_decode"]
        accepted, rejected = stats["num_accepted_tokens"], stats["num_draft_tokens"] - stats["num_accepted_tokens"]
        assert accepted > count / 8 and rejected > count / 8, stats          # both outcomes, many times
        assert spec == plain[:count], sum(a != b for a, b in zip(spec, plain))


def test_stats_and_log_line_report_speculation(tiny_model_dir):
    _, engine = run(tiny_model_dir, PROMPTS, GREEDY, speculative_config=NGRAM)
    stats = engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    assert 1.0 <= stats["mean_accepted_length"] <= 5.0
    assert "Speculative decoding: acceptance" in engine.metrics.log_line(engine.get_stats())
    _, plain = run(tiny_model_dir, PROMPTS[:1], GREEDY)
    assert plain.get_stats()["spec_decode"] is None


@pytest.mark.slow
@pytest.mark.one_tier   # SmolLM2 on the plain tier: tests/test_tiers.py
def test_smollm2_greedy_is_identical_with_speculation():
    """The real model, on a task n-gram lookup suits (repeating a passage) and a free one, with
    n-gram drafts and with itself as the draft model."""
    prompts = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
               "Write a short poem about the sea."]
    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_space=0.25)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
    for config in ({"method": "ngram", "num_speculative_tokens": 5},
                   # the target as its own draft: every draft stands
                   {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 3,
                    "adaptive": False}):
        spec = LLM("smollm2-135m-instruct", device="cpu", kv_cache_space=0.25, speculative_config=config)
        got = [o.outputs[0].token_ids for o in spec.chat(messages, params, use_tqdm=False)]
        assert got == want, config["method"]
        stats = spec.llm_engine.get_stats()["spec_decode"]
        assert stats["num_accepted_tokens"] > 0
        if config["method"] == "draft_model":
            assert stats["acceptance_rate"] > 0.99, stats     # float sums may flip a rare near-tie
        del spec


# ---------------------------------------------------------------- a draft model


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A different, smaller Llama with the same (byte-level) tokenizer: a weak draft."""
    from minipaged.model.random_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), seed=5, num_hidden_layers=1)


def draft_config(model, k=4, adaptive=False):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "adaptive": adaptive}


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_target_as_its_own_draft_is_always_accepted(tiny_model_dir, greedy_reference, k):
    """The pipes work: a draft that is the target proposes the target's own greedy tokens."""
    got, engine = run(tiny_model_dir, PROMPTS, GREEDY, speculative_config=draft_config(tiny_model_dir, k))
    assert got == greedy_reference
    stats = engine.get_stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0, stats
    assert engine.draft.cache.num_blocks == engine.cache.num_blocks           # one block id, two frames
    assert engine.draft.cache.num_cpu_blocks == engine.cache.num_cpu_blocks


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(num_blocks=24, block_size=4, preemption_mode="swap"),
    dict(num_blocks=24, block_size=4, preemption_mode="recompute"),
    dict(enable_prefix_caching=True, block_size=2),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4, block_size=4),
])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_outputs_are_identical_with_a_draft_model(tiny_model_dir, draft_dir, kwargs, adaptive):
    prompts = PROMPTS + PROMPTS[:2]
    want, _ = run(tiny_model_dir, prompts, GREEDY, **kwargs)
    got, engine = run(tiny_model_dir, prompts, GREEDY, speculative_config=draft_config(draft_dir, 4, adaptive),
                      **kwargs)
    assert got == want
    if "preemption_mode" in kwargs:
        assert engine.scheduler.num_preemptions > 0
    assert engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_the_draft_pool_holds_only_what_stood(tiny_model_dir, draft_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=2, swap_space=0.01,
                       speculative_config=draft_config(draft_dir, 6))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        for group in engine.scheduler.running:
            for seq in group.unfinished_seqs():
                assert seq.draft_num_computed_tokens <= seq.num_computed_tokens
                assert engine.block_manager.tables[seq.seq_id].num_tokens == seq.num_computed_tokens
    assert engine.get_stats()["spec_decode"]["num_accepted_tokens"] < engine.get_stats()["spec_decode"]["num_draft_tokens"]


def test_sampled_outputs_with_a_draft_model_are_distributed_as_without(calm_model_dir, tmp_path):
    """The rejection rule with a real q: a different calm model drafts, with the same bias and
    temperature. 6,000 seeded requests with and without it; tokens binned as 20, 21, 22 or
    other; at output positions 1 to 3 (position 0 comes from the prompt's pass) the two runs'
    distributions pass a chi-square test of homogeneity at p = 0.001 (Wilson-Hilferty
    threshold: 16.5 for 3 degrees of freedom). Measured by hand, the same test fails for a rule
    that resamples a rejection from p instead of p - q (statistic 119) or that ignores q in
    the acceptance (25)."""
    from minipaged.model.random_llama import write_tiny_llama

    draft = write_tiny_llama(tmp_path / "calm-draft", seed=3, embed_scale=0.2, num_hidden_layers=1)
    likely = [20, 21, 22]
    prompt = {"prompt_token_ids": likely * 3 + likely[:2]}
    n = 6000

    def sample(**kwargs):
        llm = LLM(str(calm_model_dir), device="cpu", num_blocks=4096, block_size=4, **kwargs)
        params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i,
                                 logit_bias={t: 8.0 for t in likely}) for i in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        tokens = np.array([o.outputs[0].token_ids for o in outs])
        return np.select([tokens == t for t in likely], [0, 1, 2], 3), llm.llm_engine

    plain, _ = sample()
    spec, engine = sample(speculative_config=draft_config(draft, 3))
    stats = engine.get_stats()["spec_decode"]
    accepted, rejected = stats["num_accepted_tokens"], stats["num_draft_tokens"] - stats["num_accepted_tokens"]
    assert accepted > 300 and rejected > 300, stats          # both branches of the rule, many times
    for position in (1, 2, 3):
        stat, df = homogeneity(np.bincount(plain[:, position], minlength=4),
                               np.bincount(spec[:, position], minlength=4))
        assert stat < chi_square_threshold(df), (position, stat, df)


def test_a_draft_model_that_cannot_draft_is_refused_before_loading(tiny_model_dir, tmp_path):
    from minipaged.model.random_llama import write_tiny_llama

    wide = write_tiny_llama(tmp_path / "wide", vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens, the target 259"):
        LLMEngine(str(tiny_model_dir), device="cpu", speculative_config=draft_config(wide))
    short = write_tiny_llama(tmp_path / "short", max_position_embeddings=64)
    with pytest.raises(ConfigError, match="handles 64 positions, fewer than max_model_len"):
        LLMEngine(str(tiny_model_dir), device="cpu", speculative_config=draft_config(short))
    with pytest.raises(Exception, match="nowhere"):
        LLMEngine(str(tiny_model_dir), device="cpu", speculative_config=draft_config(tmp_path / "nowhere"))


def test_the_spec_decode_bench_runs_three_engines_side_by_side(tmp_path, monkeypatch):
    """``bench spec-decode``'s machinery on the tiny model, with short tasks: every task for every
    variant, the same greedy tokens as without speculation, and speculation measured."""
    from minipaged.model.random_llama import write_tiny_llama
    from minipaged.tools import spec_bench

    tiny_model_dir = write_tiny_llama(tmp_path / "tiny-4k", max_position_embeddings=4096)   # byte tokens

    monkeypatch.setattr(spec_bench, "SINGLE_STREAM_MAX_TOKENS", 12)
    monkeypatch.setattr(spec_bench, "CHAT_PROMPTS", spec_bench.CHAT_PROMPTS[:2])
    report = spec_bench.run_spec_bench(
        dict(model=str(tiny_model_dir), device="cpu", kv_cache_space=0.05, swap_space=0.01, log_stats_interval=0),
        dict(num_prompts=3, min_prompt_len=8, max_prompt_len=16, output_len=10))
    rows = {(r["task"], r["variant"]): r for r in report["rows"]}
    assert set(rows) == {(t, v) for t in ("grounded", "chat", "throughput") for v in ("off", "ngram", "adaptive")}
    assert all(r["same_tokens_as_off"] for r in rows.values())
    assert rows["grounded", "off"]["acceptance_rate"] is None
    assert rows["throughput", "ngram"]["generated_tokens"] == 30
    assert any(r["acceptance_rate"] for r in rows.values())
    assert report["variants"]["ngram"]["num_speculative_tokens"] == spec_bench.BENCH_DRAFT_TOKENS


# ---------------------------------------------------------------- drafts are optional work


def decoding_group(rid: int, prompt_len: int, manager):
    """A request whose prompt is cached and whose first token is sampled: it decodes next."""
    from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

    seq = Sequence(rid, list(range(prompt_len)), output_token_ids=[1])
    group = SequenceGroup(str(rid), [seq], SamplingParams(max_tokens=50))
    manager.allocate(group)
    seq.num_computed_tokens = prompt_len
    group.set_status(SequenceStatus.RUNNING)
    return group


def test_drafts_never_cost_another_request_a_block_or_a_prefill_chunk():
    from minipaged.config import SchedulerConfig
    from minipaged.memory.block_manager import BlockManager
    from minipaged.scheduler.scheduler import Scheduler

    # Blocks: 3 of 4 slots. A (earlier) and B each need one more slot; A's 4 drafts would take the last
    # free block, which B's plain decode needs: B must still run, and A speculate only in what is left.
    manager = BlockManager(3, 4, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(64, max_num_seqs=8, max_num_batched_tokens=64), manager)
    a, b = decoding_group(0, 2, manager), decoding_group(1, 4, manager)
    scheduler.running = [a, b]
    a.arrival_index, b.arrival_index = 0, 1
    a.seqs[0].draft_token_ids = [5, 5, 5, 5]
    plan = scheduler.schedule()
    assert not plan.preempted and {i.group.request_id for i in plan.scheduled} == {"0", "1"}
    assert len({i.group.request_id: i for i in plan.scheduled}["0"].draft_token_ids) == 1   # A's own block only
    # A token budget of 8: four decodes with 4 drafts each leave a waiting prompt its chunk
    manager = BlockManager(64, 4, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(64, max_num_seqs=8, max_num_batched_tokens=8,
                                          enable_chunked_prefill=True), manager)
    groups = [decoding_group(i, 6, manager) for i in range(4)]
    for i, g in enumerate(groups):
        g.arrival_index = i
        g.seqs[0].draft_token_ids = [5] * 4
    scheduler.running = groups
    from minipaged.sequence import Sequence, SequenceGroup

    scheduler.add_seq_group(SequenceGroup("long", [Sequence(99, list(range(40)))], SamplingParams(max_tokens=4)))
    plan = scheduler.schedule()
    chunk = [i for i in plan.scheduled if i.group.request_id == "long"]
    assert chunk and chunk[0].num_new_tokens == 4            # 8 - 4 decodes: the prompt's chunk first
    assert plan.num_batched_tokens <= 8 and sum(len(i.draft_token_ids) for i in plan.scheduled) == 0
