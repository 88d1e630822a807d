"""The whole engine on a tiny random Llama, against the dense reference model."""

import dataclasses

import numpy as np
import pytest

from minipaged import LLMEngine, OutputKind, RequestError, SamplingParams
from minipaged.config import ConfigError
from tiny_model import make_llm
from minipaged.engine.sampler import log_softmax

NEAR_TIE = 1e-3


def assert_greedy(reference, prompt, tokens):
    """Each generated token is the reference's argmax on the same prefix (or a near-tie)."""
    logits = reference.logits(list(prompt) + list(tokens))          # (len, vocab)
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        best = int(row.argmax())
        assert token == best or row[best] - row[token] < NEAR_TIE, (
            f"step {i}: engine chose {token}, reference {best} (margin {row[best] - row[token]:.3g})")


def random_prompts(n, seed, lo=1, hi=60, vocab=259):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("block_size,num_blocks,max_num_seqs", [
    (16, None, 256),   # everything fits: one prefill batch, then batched decode
    (1, None, 3),      # one token per block; at most three sequences at a time
    (4, 40, 256),      # a pool so small that requests wait and get preempted
])
def test_greedy_matches_reference(tiny_model_dir, reference, block_size, num_blocks, max_num_seqs):
    llm = make_llm(tiny_model_dir, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    prompts = random_prompts(8, seed=block_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
        assert_greedy(reference, prompt, out.outputs[0].token_ids)
    stats = llm.get_stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0   # everything freed
    if num_blocks == 40:
        assert stats["num_preemptions"] > 0
    llm.llm_engine.block_manager.check_invariants()


def test_batch_composition_does_not_change_tokens(tiny_model_dir):
    prompts = random_prompts(6, seed=3)
    llm = make_llm(tiny_model_dir)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
    small = make_llm(tiny_model_dir, block_size=2, num_blocks=40).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for a, b, c in zip(together, alone, small):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_logprobs_match_reference(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    ref = log_softmax(reference.logits(prompt + out.token_ids).astype(np.float32))
    for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert len(top) in (5, 6) and token in top
        for t, lp in top.items():
            assert abs(lp - row[t]) < 1e-4
        engine_top5 = sorted(top, key=top.get, reverse=True)[:5]
        ref_top5 = np.argsort(-row)[:5]
        if set(engine_top5) != set(ref_top5.tolist()):   # only a near-tie at the 5th place may differ
            assert abs(row[ref_top5[4]] - row[engine_top5[4]]) < 1e-4
    expected_sum = sum(top[t] for t, top in zip(out.token_ids, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(expected_sum, abs=1e-5)


def test_chat_and_text_prompts(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    tok = llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    expected = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert out[0].prompt_token_ids == expected
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], use_tqdm=False)
    assert len(two) == 2
    text = llm.generate(["hello", "world!"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in text] == ["hello", "world!"]
    assert text[0].prompt_token_ids == tok.encode("hello")
    assert text[0].outputs[0].text == tok.decode(text[0].outputs[0].token_ids, skip_special_tokens=True)


def test_stop_rules(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5)[0]}
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = base[0].outputs[0].token_ids

    # stop_token_ids: ends at the first occurrence, the token is kept in token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at

    # min_tokens: the stop token cannot end the output before min_tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=first + 2,
                                              stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_at not in out.token_ids[:first + 1]

    # stop strings: text is cut before the stop string (or kept with include_stop_str_in_output)
    text = base[0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                and text[i:i + 2].strip() == text[i:i + 2])
    cut = text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop,
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut + len(stop)]


def test_eos_stops_unless_ignored(tiny_model_dir, reference):
    """Force EOS to be the greedy choice by making it the only allowed token (top_k over a ban)."""
    llm = make_llm(tiny_model_dir)
    prompts = random_prompts(30, seed=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    eos = llm.get_tokenizer().eos_token_id
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped, "the tiny model should emit EOS for some prompt"
    for o in stopped:
        assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
    p = [p for p, o in zip(prompts, outs) if o.outputs[0].finish_reason == "stop"][0]
    full = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 40 and full.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir):
    prompts = random_prompts(4, seed=2)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=10, ignore_eos=True, seed=123)
    a = make_llm(tiny_model_dir).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = make_llm(tiny_model_dir, block_size=4).generate({"prompt_token_ids": prompts[2]}, params, use_tqdm=False)
    assert a[2].outputs[0].token_ids == b[0].outputs[0].token_ids
    # without a per-request seed the LLM seed decides, reproducibly
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    c = make_llm(tiny_model_dir, seed=5).generate([{"prompt_token_ids": p} for p in prompts], unseeded, use_tqdm=False)
    d = make_llm(tiny_model_dir, seed=5).generate([{"prompt_token_ids": p} for p in prompts], unseeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in c] == [o.outputs[0].token_ids for o in d]


def test_top_k_one_is_greedy(tiny_model_dir):
    prompt = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    llm = make_llm(tiny_model_dir)
    greedy = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    sampled = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert sampled == greedy


def test_streaming_deltas_add_up(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu")
    prompts = ["abc", "hello there", "x"]
    deltas = {i: "" for i in range(3)}
    tokens = {i: [] for i in range(3)}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                     output_kind=OutputKind.DELTA))
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[int(out.request_id)] += out.outputs[0].text
            tokens[int(out.request_id)] += out.outputs[0].token_ids
            if out.finished:
                finished.add(out.request_id)
    assert finished == {"0", "1", "2"}
    llm = make_llm(tiny_model_dir)
    final = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(final):
        assert deltas[i] == out.outputs[0].text and tokens[i] == out.outputs[0].token_ids


def test_abort_frees_blocks_in_any_state(tiny_model_dir, reference):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=20, block_size=4, max_num_seqs=2)
    prompts = random_prompts(4, seed=8, lo=10, hi=20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.step()                                    # 0 and 1 run, 2 and 3 wait
    engine.abort_request("3")                        # waiting
    engine.abort_request("0")                        # running
    engine.abort_request("nope")                     # unknown ids are ignored
    engine.block_manager.check_invariants()
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert set(results) == {"1", "2"}
    for rid in ("1", "2"):
        assert_greedy(reference, prompts[int(rid)], results[rid])
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups and not engine.generators


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(logprobs=-1), "logprobs"), (dict(temperature="hot"), "temperature"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_invalid_sampling_params_fail_at_construction(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_bad_requests_are_refused_and_harm_no_one(tiny_model_dir, reference):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=12, block_size=4, max_model_len=64)
    good = random_prompts(1, seed=12, lo=5, hi=6)[0]
    engine.add_request("good", good, GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("a", "", GREEDY)
    with pytest.raises(RequestError, match="65 tokens.*max_model_len=64"):
        engine.add_request("b", [5] * 65, GREEDY)
    with pytest.raises(RequestError, match="token id 999 is outside the vocabulary"):
        engine.add_request("c", [5, 999], GREEDY)
    with pytest.raises(RequestError, match="pool has only"):
        engine.add_request("d", [5] * 40, SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("good", [5], GREEDY)
    with pytest.raises(RequestError, match="string or a list of token ids"):
        engine.add_request("e", 3.5, GREEDY)
    out = None
    while engine.has_unfinished_requests():
        out = engine.step() or out
    assert out[0].request_id == "good"
    assert_greedy(reference, good, out[0].outputs[0].token_ids)
    assert engine.block_manager.num_used_blocks == 0


def test_llm_generate_validates_everything_before_queueing(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    with pytest.raises(RequestError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False)) == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=12), "power of two"), (dict(num_blocks=0), "num_blocks"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_model_len=10_000), "max_position_embeddings"),
    (dict(device="tpu"), "device"), (dict(dtype="float16"), "not supported on the CPU"),
    (dict(kv_cache_space=-1.0), "kv_cache_space"),
])
def test_bad_engine_config(tiny_model_dir, kwargs, match):
    with pytest.raises((ValueError, ConfigError), match=match):
        make_llm(tiny_model_dir, **kwargs)


def test_stats(tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_blocks=64, block_size=4)
    llm.generate([{"prompt_token_ids": [5] * 9}] * 3, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    for key in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "kv_blocks_peak", "kv_usage"):
        assert key in stats
    assert stats["kv_blocks_total"] == 64
    # three sequences of 9 + 12 - 1 = 20 cached tokens at the end: 5 blocks each
    assert stats["kv_blocks_peak"] == 15 and stats["kv_usage"] == 0.0
    assert stats["generation_tokens"] == 36 and stats["prompt_tokens"] == 27


# ---------------------------------------------------------------- regressions from review


def test_streamed_text_never_shows_what_a_stop_string_cuts(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5)[0]}
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[6:9]                                   # three characters in the middle
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    engine.add_request("d", prompt, dataclasses.replace(params, output_kind=OutputKind.DELTA))
    engine.add_request("c", prompt, params)
    deltas, cumulative = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "d":
                deltas += out.outputs[0].text
            else:
                cumulative.append(out.outputs[0].text)
    final = text[:text.index(stop)]
    assert deltas == final and cumulative[-1] == final
    assert all(final.startswith(c) for c in cumulative)        # never shows text that is later cut
    assert not engine.output_processor._reported


def test_stop_token_text_is_left_out_unless_asked(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": random_prompts(1, seed=5)[0]}
    tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(t for t in tokens[3:] if 35 <= t < 129)     # a printable ASCII byte token
    cut = tokens.index(stop_at)
    for include in (False, True):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[stop_at], include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[:cut + 1]               # the stop token id is reported
        kept = tokens[:cut + 1] if include else tokens[:cut]
        assert out.text == tok.decode(kept, skip_special_tokens=True)


def test_min_tokens_does_not_change_logprobs(tiny_model_dir, reference):
    """Bans steer the choice, but logprobs stay the model's own distribution."""
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, seed=6)[0]
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=3, logprobs=3, min_tokens=3, stop_token_ids=[40]), use_tqdm=False)[0]
    ref = log_softmax(reference.logits(prompt + out.outputs[0].token_ids).astype(np.float32))
    for i, top in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + i]
        assert all(abs(lp - row[t]) < 1e-4 for t, lp in top.items())
        assert eos not in out.outputs[0].token_ids and 40 not in out.outputs[0].token_ids


def test_a_failed_step_changes_nothing(tiny_model_dir, reference, monkeypatch):
    engine = LLMEngine(str(tiny_model_dir), device="cpu")
    prompts = random_prompts(3, seed=13)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt                   # e.g. Ctrl-C in the middle of the model
        return real(*args)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    for i, p in enumerate(prompts):
        assert len(results[str(i)]) == 12
        assert_greedy(reference, p, results[str(i)])
    assert engine.block_manager.num_used_blocks == 0


def test_generate_ignores_other_requests_and_cleans_up(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    llm.llm_engine.add_request("someone-else", [5, 6, 7], SamplingParams(max_tokens=2))
    out = llm.generate({"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=30, ignore_eos=True),
                       use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 30
    with pytest.raises(ValueError, match="seed"):
        llm.generate([{"prompt_token_ids": [5]}] * 2, [GREEDY, SamplingParams(seed=-1)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("bad,match", [
    (dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"), (dict(seed=-1), "seed"),
    (dict(temperature=float("inf")), "temperature"), (dict(stop="x", detokenize=False), "detokenize"),
])
def test_more_invalid_sampling_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_tiny_temperature_is_greedy(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    greedy = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiny = llm.generate(prompt, SamplingParams(temperature=1e-320, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert tiny == greedy


def test_more_bad_requests(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    with pytest.raises(RequestError, match="prompt_token_ids must be a list"):
        llm.generate({"prompt_token_ids": 5}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(tiny_model_dir, max_model_len=0)
    with pytest.raises(ValueError, match="could not allocate a KV pool"):
        make_llm(tiny_model_dir, kv_cache_space=1e9)


def test_a_delta_stream_reports_each_samples_finish_once(tiny_model_dir):
    """OutputKind.DELTA with n = 3: a sample that finishes early is reported finished once, then
    left out of the later reports (vLLM's deltas); CUMULATIVE keeps every sample in every report."""
    engine = make_llm(tiny_model_dir).llm_engine
    stops = list(range(3, 90))                 # a third of the vocabulary: the samples end apart
    early = 0
    for seed in range(8):
        params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=30, stop_token_ids=stops)
        engine.add_request("d", "2+2?", dataclasses.replace(params, output_kind=OutputKind.DELTA))
        engine.add_request("c", "2+2?", dataclasses.replace(params, output_kind=OutputKind.CUMULATIVE))
        finished_at, tokens, last = {}, {i: [] for i in range(3)}, None
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.request_id == "c":
                    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
                    last = out
                    continue
                for c in out.outputs:
                    assert c.index not in finished_at, f"sample {c.index} reported after its finish"
                    tokens[c.index] += c.token_ids
                    if c.finish_reason:
                        finished_at[c.index] = step
        assert sorted(finished_at) == [0, 1, 2]
        assert [tokens[i] for i in range(3)] == [c.token_ids for c in last.outputs]   # the same samples
        early += len(set(finished_at.values())) > 1
    assert early >= 1
