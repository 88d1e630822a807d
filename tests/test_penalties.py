"""Penalties, logit_bias and prompt_logprobs (issue 14, item 4), against independent oracles.

The oracles are plain NumPy loops over the dense float64 reference model's logits
(model/reference.py), written from vLLM's rules, not from the sampler's code:

- repetition_penalty r, for every token in the prompt or the output so far:
  logit / r if logit > 0, else logit * r;
- then frequency_penalty f and presence_penalty p, for every token in the output:
  logit - f * count - p;
- logit_bias is added before the penalties (vLLM applies it as a logits processor first);
- prompt_logprobs[j] = log_softmax(logits at position j - 1)[prompt[j]], None for j = 0.

Greedy decoding must pick the oracle's argmax at every step, on the engine's own prefix
(a near-tie of 1e-3 may go either way, as in test_engine.py), and the reported
logprobs stay the model's own.
"""

import argparse
import json
from collections import Counter

import numpy as np
import pytest

from minipaged import BeamSearchParams, LLMEngine, OutputKind, RequestError, SamplingParams
from minipaged.engine.sampler import Sampler, SampleRequest
from minipaged.entrypoints.args import add_sampling_flags, sampling_params
from minipaged.model.config import LlamaConfig, read_generation_defaults
from minipaged.model.errors import ModelFormatError
from minipaged.model.random_llama import write_tiny_llama
from minipaged.model.reference import DenseReference
from minipaged.model.weights import load_checkpoint
from tiny_model import make_llm
from minipaged.sampling_params import derive_seed

NEAR_TIE = 1e-3
VOCAB = 259


@pytest.fixture(scope="module")
def calm_reference(calm_model_dir):
    """The penalties are a few units: they change choices only where logits are a few units apart."""
    return DenseReference(LlamaConfig.from_dir(calm_model_dir), load_checkpoint(calm_model_dir))


def prompts_of(n, seed, lo=4, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def oracle_logits(row, prompt, output, params: SamplingParams):
    """One row of float64 logits after logit_bias and the penalties, element by element."""
    x = np.array(row, dtype=np.float64)
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def oracle_log_softmax(row):
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def assert_oracle_greedy(reference, prompt, tokens, params):
    """Every token is the oracle's argmax given the engine's own prefix (or a near-tie)."""
    logits = reference.logits(list(prompt) + list(tokens))                     # (len, vocab)
    for i, token in enumerate(tokens):
        row = oracle_logits(logits[len(prompt) - 1 + i], prompt, tokens[:i], params)
        best = int(row.argmax())
        assert token == best or row[best] - row[token] < NEAR_TIE, (
            f"step {i}: engine chose {token}, oracle {best} (margin {row[best] - row[token]:.3g})")


def greedy(**kwargs):
    return SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", 16), ignore_eos=True, **kwargs)


def assert_idle(llm):
    engine = llm.llm_engine
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()


# ----------------------------------------------------------- penalties and logit_bias

PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.6),                          # < 1 favours what was seen
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(presence_penalty=-2.0, frequency_penalty=0.5),   # negative presence favours repeats
    dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4),
    dict(repetition_penalty=1.2, logit_bias={7: 4.0, 100: -3.0, 200: 2.5}),
]


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_greedy_with_penalties_matches_the_oracle(calm_model_dir, calm_reference, penalties):
    reference = calm_reference
    llm = make_llm(calm_model_dir)
    prompts = prompts_of(4, seed=len(str(penalties)))
    plain, params = greedy(), greedy(**penalties)
    # the penalised requests share the batch with plain ones, which must not change
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                        [params] * len(prompts) + [plain] * len(prompts), use_tqdm=False)
    changed = 0
    for prompt, out, base in zip(prompts, outs[:len(prompts)], outs[len(prompts):]):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 16
        assert_oracle_greedy(reference, prompt, tokens, params)
        assert_oracle_greedy(reference, prompt, base.outputs[0].token_ids, plain)
        changed += tokens != base.outputs[0].token_ids
    assert changed, "the penalties changed no token: the test would prove nothing"
    assert_idle(llm)


def test_penalties_count_each_sample_and_survive_preemption(calm_model_dir):
    """n samples each count their own output; a tiny pool (preemption) changes nothing."""
    prompt = prompts_of(1, seed=21)[0]
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3)
    big = make_llm(calm_model_dir).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    small_llm = make_llm(calm_model_dir, block_size=2, num_blocks=40, max_num_seqs=4)
    crowd = [{"prompt_token_ids": p} for p in prompts_of(3, seed=22)]
    small = small_llm.generate([{"prompt_token_ids": prompt}, *crowd],
                               [params] + [greedy(repetition_penalty=1.2)] * 3, use_tqdm=False)[0]
    assert small_llm.get_stats()["num_preemptions"] > 0
    for i, (a, b) in enumerate(zip(big.outputs, small.outputs)):
        assert a.token_ids == b.token_ids
        # sample i draws what an n=1 request with its derived seed draws
        alone = make_llm(calm_model_dir).generate(
            {"prompt_token_ids": prompt}, SamplingParams(
                n=1, temperature=0.8, seed=derive_seed(5, i), max_tokens=12, ignore_eos=True,
                repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == a.token_ids
    assert_idle(small_llm)


def test_logit_bias_of_100_makes_greedy_pick_the_token(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir)
    prompt = prompts_of(1, seed=3)[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=6, logit_bias={42: 100.0}, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 6
    # the reported logprobs are the model's own, not the biased ones
    raw = reference.logits(prompt + out.token_ids)
    for i, top in enumerate(out.logprobs):
        expected = oracle_log_softmax(raw[len(prompt) - 1 + i])[42]
        assert list(top) == [42] and abs(top[42] - expected) < 1e-4
        assert expected < -0.5                      # 42 was not the model's own choice
    assert out.cumulative_logprob == pytest.approx(sum(t[42] for t in out.logprobs), abs=1e-5)
    # -100 on the plain greedy choice: never picked
    base = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=6), use_tqdm=False)[0].outputs[0]
    banned = base.token_ids[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=6, logit_bias={banned: -100}),
                       use_tqdm=False)[0].outputs[0]
    assert banned not in out.token_ids
    assert_oracle_greedy(reference, prompt, out.token_ids, greedy(logit_bias={banned: -100}))
    assert_idle(llm)


def test_penalised_logprobs_stay_the_models_own(calm_model_dir, calm_reference):
    reference = calm_reference
    llm = make_llm(calm_model_dir)
    prompt = prompts_of(1, seed=8)[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=8, repetition_penalty=1.8, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    raw = reference.logits(prompt + out.token_ids)
    for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs)):
        row = oracle_log_softmax(raw[len(prompt) - 1 + i])
        for t, lp in top.items():
            assert abs(lp - row[t]) < 1e-4


def test_bans_win_over_bias_and_penalties(tiny_model_dir):
    """min_tokens bans EOS to -inf: a +100 bias and a negative penalty cannot bring it back."""
    llm = make_llm(tiny_model_dir)
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate({"prompt_token_ids": prompts_of(1, seed=1)[0]},
                       SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logit_bias={eos: 100},
                                      presence_penalty=-2.0, repetition_penalty=0.5),
                       use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:4] and out.token_ids[4] == eos and out.finish_reason == "stop"


def test_sampler_only_adjusts_the_rows_that_ask():
    """Rows without a penalty or a bias are not touched (and their tokens not even read)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)

    class Unreadable:
        def __iter__(self):
            raise AssertionError("the tokens of a request without penalties were read")

        def __len__(self):
            raise AssertionError("the tokens of a request without penalties were read")

    plain = SamplingParams(temperature=0)
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=1.0,
                            presence_penalty=0.5, logit_bias={3: 1.5})
    gen = np.random.default_rng(0)
    requests = [SampleRequest(plain, gen, [], Unreadable(), Unreadable()),
                SampleRequest(params, gen, [], [1, 2, 2], [2, 5, 5, 5]),
                SampleRequest(plain, gen, [], Unreadable(), Unreadable())]
    results = Sampler()(logits, requests)
    for i in (0, 2):
        assert results[i].token_id == int(logits[i].argmax())
    expected = oracle_logits(logits[1].astype(np.float64), [1, 2, 2], [2, 5, 5, 5], params)
    assert results[1].token_id == int(expected.argmax())


# ----------------------------------------------------------- prompt_logprobs

def assert_prompt_logprobs(reference, prompt, prompt_logprobs, k):
    """Entry j is log_softmax(reference logits at j - 1): the prompt token and the top k."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    logits = reference.logits(prompt)                                           # (P, vocab)
    for j in range(1, len(prompt)):
        row = oracle_log_softmax(logits[j - 1])
        entry = prompt_logprobs[j]
        assert prompt[j] in entry and len(entry) in (k, k + 1)
        for token, lp in entry.items():
            assert abs(lp - row[token]) < 1e-4, (j, token)
        top = list(entry)[:k]                        # the top k, most likely first, then the token
        assert [entry[t] for t in top] == sorted((entry[t] for t in top), reverse=True)
        if k:   # they are the reference's top k (but for a near-tie at the k-th place)
            kth = np.sort(row)[-k]
            assert all(row[t] >= kth - 1e-4 for t in top)


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4),   # chunks of <= 8 tokens
    dict(enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2, block_size=2),
], ids=["whole", "chunked-8", "chunked-5"])
def test_prompt_logprobs_match_the_reference(tiny_model_dir, reference, engine_kwargs):
    llm = make_llm(tiny_model_dir, **engine_kwargs)
    prompts = prompts_of(3, seed=30, lo=2, hi=30) + [[17]]           # a one-token prompt too
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (0, 2, 5, 1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, sp in zip(prompts, outs, params):
        assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, sp.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == 3
    assert outs[3].prompt_logprobs == [None]
    # a request that asks for none gets none
    (plain,) = llm.generate({"prompt_token_ids": prompts[0]}, greedy(max_tokens=2), use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert_idle(llm)


def test_prompt_logprobs_with_prefix_caching(tiny_model_dir, reference):
    """A cached prefix has K/V but no logits: the request computes its whole prompt, and
    the blocks it fills serve later requests as usual."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True, block_size=4)
    engine = llm.llm_engine
    prompt = prompts_of(1, seed=31, lo=30, hi=31)[0]
    first = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=4), use_tqdm=False)[0]
    hits = engine.get_stats()["prefix_cache_hits"]
    asked = llm.generate({"prompt_token_ids": prompt + [9]},
                         greedy(max_tokens=4, prompt_logprobs=3), use_tqdm=False)[0]
    assert engine.get_stats()["prefix_cache_hits"] == hits           # it took no hit
    assert_prompt_logprobs(reference, prompt + [9], asked.prompt_logprobs, 3)
    again = llm.generate({"prompt_token_ids": prompt + [9, 10]}, greedy(max_tokens=4), use_tqdm=False)[0]
    assert engine.get_stats()["prefix_cache_hits"] > hits            # others still hit
    assert again.prompt_logprobs is None
    assert first.outputs[0].token_ids == llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=4),
                                                      use_tqdm=False)[0].outputs[0].token_ids
    assert_idle(llm)


def test_prompt_logprobs_through_recomputation(tiny_model_dir, reference):
    """Preempted by recomputation mid-prompt, a request asks only for the rows it lacks."""
    llm = make_llm(tiny_model_dir, block_size=2, num_blocks=30, max_num_seqs=4, preemption_mode="recompute",
                   enable_chunked_prefill=True, max_num_batched_tokens=6, enable_prefix_caching=True)
    prompts = prompts_of(4, seed=33, lo=12, hi=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions_recompute"] > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, 2)
    assert_idle(llm)


def test_prompt_logprobs_per_output_kind_with_samples(tiny_model_dir, reference):
    """CUMULATIVE: every report has them; DELTA: the first report only; n > 1: once a request."""
    engine = LLMEngine(str(tiny_model_dir), device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=8,
                       max_num_seqs=4)
    prompt = prompts_of(1, seed=34, lo=20, hi=21)[0]
    for kind in OutputKind:
        engine.add_request(kind.value, prompt, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4,
                                                              ignore_eos=True, prompt_logprobs=1, output_kind=kind))
    reports = {kind.value: [] for kind in OutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports[out.request_id].append(out)
    cumulative, delta, final = (reports[k.value] for k in
                                (OutputKind.CUMULATIVE, OutputKind.DELTA, OutputKind.FINAL_ONLY))
    assert len(cumulative) == 4 and len(delta) == 4 and len(final) == 1
    for out in cumulative + final + delta[:1]:
        assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, 1)
        assert len(out.outputs) == 2
    assert all(out.prompt_logprobs is None for out in delta[1:])
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups


def test_beam_search_still_works_beside_prompt_logprobs(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir)
    prompt = prompts_of(1, seed=35)[0]
    engine = llm.llm_engine
    engine.add_beam_request("beam", prompt, BeamSearchParams(beam_width=3, max_tokens=5))
    engine.add_request("plp", prompt, greedy(max_tokens=5, prompt_logprobs=2, repetition_penalty=1.3))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done["beam"].outputs) == 3 and done["beam"].prompt_logprobs is None
    assert_prompt_logprobs(reference, prompt, done["plp"].prompt_logprobs, 2)
    assert_idle(llm)


# ----------------------------------------------------------- bad values

@pytest.mark.parametrize("bad,match", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3.0"),
    (dict(presence_penalty=True), r"presence_penalty must be a finite number, got True \(a bool"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number, got nan"),
    (dict(repetition_penalty=0), r"repetition_penalty must be > 0 \(1 = off\), got 0.0"),
    (dict(repetition_penalty=-1.1), r"repetition_penalty must be > 0 \(1 = off\), got -1.1"),
    (dict(repetition_penalty="1.1"), "repetition_penalty must be a finite number, got '1.1'"),
    (dict(logit_bias=[(1, 2.0)]), r"logit_bias must be a dict of \{token id: bias\} or None, got \[\(1, 2.0\)\]"),
    (dict(logit_bias={"5": 1.0}), r"logit_bias keys must be non-negative integer token ids, got '5' \(str\)"),
    (dict(logit_bias={True: 1.0}), r"logit_bias keys must be non-negative integer token ids, got True \(bool\)"),
    (dict(logit_bias={1.0: 1.0}), r"logit_bias keys must be non-negative integer token ids, got 1.0 \(float\)"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias keys must be non-negative integer token ids, got -1 \(int\)"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be in \[-100, 100\], got 101"),
    (dict(logit_bias={5: -1e9}), r"logit_bias\[5\] must be in \[-100, 100\], got -1000000000.0"),
    (dict(logit_bias={5: float("inf")}), r"logit_bias\[5\] must be a finite number, got inf"),
    (dict(logit_bias={5: "up"}), r"logit_bias\[5\] must be a finite number, got 'up'"),
    (dict(logit_bias={5: None}), r"logit_bias\[5\] must be a finite number, got None"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be a non-negative integer or None, got -1"),
    (dict(prompt_logprobs=True), r"prompt_logprobs must be an integer or None, got True \(a bool"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs must be an integer or None, got 2.0"),
])
def test_bad_values_are_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match="invalid SamplingParams: " + match):
        SamplingParams(**bad)


def test_good_values_are_normalised():
    p = SamplingParams(presence_penalty=np.float32(0.5), frequency_penalty=1, repetition_penalty=np.int64(2),
                       logit_bias={np.int64(5): np.float32(-1.5), 6: 100}, prompt_logprobs=np.int16(3))
    assert (type(p.presence_penalty), type(p.frequency_penalty), type(p.repetition_penalty)) == (float,) * 3
    assert p.logit_bias == {5: -1.5, 6: 100.0} and all(type(k) is int for k in p.logit_bias)
    assert all(type(v) is float for v in p.logit_bias.values())
    assert type(p.prompt_logprobs) is int and p.prompt_logprobs == 3
    caller = {7: 1.0}
    q = SamplingParams(logit_bias=caller)
    caller[8] = 2.0                                      # the params keep their own copy
    assert q.logit_bias == {7: 1.0}
    assert SamplingParams().logit_bias is None and not SamplingParams().has_penalties


def test_engine_refuses_out_of_range_ids_and_too_many_prompt_logprobs(tiny_model_dir):
    llm = make_llm(tiny_model_dir, max_logprobs=4)
    engine = llm.llm_engine
    with pytest.raises(RequestError, match=rf"logit_bias: token id {VOCAB} is outside the vocabulary "
                                           rf"\(ids 0..{VOCAB - 1}\)"):
        engine.add_request("a", [5, 6], SamplingParams(logit_bias={3: 1.0, VOCAB: 2.0}))
    with pytest.raises(RequestError, match=r"prompt_logprobs=5 is more than max_logprobs=4 \(an engine option"):
        engine.add_request("b", [5, 6], SamplingParams(prompt_logprobs=5))
    assert_idle(llm)
    (out,) = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1, logit_bias={VOCAB - 1: 100},
                                                                       prompt_logprobs=4), use_tqdm=False)
    assert out.outputs[0].token_ids == [VOCAB - 1] and len(out.prompt_logprobs[1]) in (4, 5)
    assert_idle(llm)


# ----------------------------------------------------------- generation_config.json defaults

def test_generation_defaults_read_only_what_the_file_sets(tmp_path, tiny_model_dir):
    assert read_generation_defaults(tiny_model_dir) == {}            # eos only
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50,
        "repetition_penalty": 1.05, "max_new_tokens": 256, "min_p": None}))
    assert read_generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50,
                                                  "repetition_penalty": 1.05, "max_tokens": 256}
    assert read_generation_defaults(tmp_path / "nowhere") == {}
    for bad, match in [({"top_k": 5.5}, "top_k must be an integer, got 5.5"),
                       ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
                       ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True")]:
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelFormatError, match=match):
            read_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="is not valid JSON"):
        read_generation_defaults(tmp_path)


def chat_args(*argv, repetition_penalty=1.1):
    parser = argparse.ArgumentParser()
    add_sampling_flags(parser, max_tokens=512, temperature=0.2, top_p=0.9, repetition_penalty=repetition_penalty)
    return parser.parse_args(list(argv))


def test_flags_beat_the_model_which_beats_the_commands_defaults():
    model = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.3, "max_tokens": 100}
    p = sampling_params(chat_args("--temperature", "0.9", "--max-tokens", "7"), model)
    assert (p.temperature, p.max_tokens) == (0.9, 7)                          # the user's flags
    assert (p.top_k, p.repetition_penalty) == (20, 1.3)                       # the model's
    assert (p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty) == (0.9, 0.0, 0.0, 0.0)   # chat's own
    p = sampling_params(chat_args())
    assert (p.temperature, p.top_p, p.max_tokens, p.repetition_penalty) == (0.2, 0.9, 512, 1.1)
    p = sampling_params(chat_args("--repetition-penalty", "1", "--presence-penalty", "0.5",
                                  "--frequency-penalty", "-0.5"), model)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.5, -0.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5 \(the model's "
                                         r"generation_config.json set top_p=1.5; pass the flag to override it\)"):
        sampling_params(chat_args(), {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"repetition_penalty must be > 0 \(1 = off\), got 0.0$"):
        sampling_params(chat_args("--repetition-penalty", "0"), {"top_p": 0.5})


def test_the_engine_exposes_the_models_generation_defaults(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7,
                                                                  "top_k": 40, "max_new_tokens": 9}))
    engine = LLMEngine(str(model_dir), device="cpu")
    assert engine.generation_defaults == {"temperature": 0.7, "top_k": 40, "max_tokens": 9}
    assert engine.tokenizer.eos_token_id == 2
