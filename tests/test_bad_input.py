"""Bad input is refused before anything is queued, with a sentence that names it (issue 13).

Every case here once escaped as an IndexError from the sampler, a TypeError from deep
inside ``dataclasses.replace``, the tokenizer or a Jinja template, or was silently
accepted. Each must now be a ValueError (RequestError, ConfigError) or TypeError whose
message names the field or the offending value, raised before the engine queues
anything; afterwards the engine still serves and holds no KV block. The last test
throws random, partly invalid requests at one engine (hypothesis):
MINIPAGED_FUZZ_EXAMPLES=3000 runs more of them by hand.
"""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minipaged import LLM, BeamSearchParams, LLMEngine, OutputKind, RequestError, SamplingParams
from minipaged.config import ConfigError, EngineConfig
from minipaged.entrypoints.args import engine_kwargs
from minipaged.entrypoints.cli import build_parser, main
from minipaged.model.tokenizer import Tokenizer

VOCAB = 259           # the tiny model: 3 specials + 256 bytes
MAX_MODEL_LEN = 32
NUM_BLOCKS = 48       # block_size 4: a sequence of 32 tokens needs 8, so n <= 6 fits
ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """One engine for the whole module: every test leaves it idle, which is the point."""
    # a small swap pool: check_invariants walks every block of both pools after each example
    return LLM(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=NUM_BLOCKS,
               max_model_len=MAX_MODEL_LEN, swap_space=0.001)


def assert_idle_and_serving(llm):
    """Nothing queued, no KV block held; a normal request runs; then idle again."""
    engine = llm.llm_engine
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, ONE, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups


# ----------------------------------------------------------- 1. out-of-vocabulary stop ids

@pytest.mark.parametrize("min_tokens", [0, 2])
def test_out_of_vocabulary_stop_token_ids_are_refused(llm, min_tokens):
    params = SamplingParams(max_tokens=4, min_tokens=min_tokens, stop_token_ids=[10**9])
    with pytest.raises(RequestError, match=r"stop_token_ids: token id 1000000000 is outside the "
                                           r"vocabulary \(ids 0\.\.258\)"):
        llm.generate("Hi", params, use_tqdm=False)
    with pytest.raises(RequestError, match="stop_token_ids: token id 259 "):
        llm.llm_engine.add_request("oov", [5], SamplingParams(stop_token_ids=[40, VOCAB]))
    assert_idle_and_serving(llm)


def test_the_last_vocabulary_id_is_a_valid_stop_id(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[VOCAB - 1]),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 2
    assert_idle_and_serving(llm)


# ----------------------------------------------------------- 2. params that are not SamplingParams

def test_params_that_are_not_sampling_params(llm):
    with pytest.raises(RequestError, match="sampling params must be a SamplingParams, got dict"):
        llm.generate("Hi", {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(RequestError, match=r"sampling_params\[1\]: sampling params must be a "
                                           r"SamplingParams, got dict"):
        llm.generate(["Hi", "Ho"], [ONE, {"max_tokens": 3}], use_tqdm=False)
    with pytest.raises(RequestError, match=r"got BeamSearchParams; for beam search call LLM\.beam_search\(\)"):
        llm.generate("Hi", BeamSearchParams(beam_width=2, max_tokens=2), use_tqdm=False)
    with pytest.raises(RequestError, match="got BeamSearchParams"):
        llm.llm_engine.add_request("beam", "Hi", BeamSearchParams(beam_width=2, max_tokens=2))
    # an empty dict is not the default either (it used to be, through `params or SamplingParams()`)
    with pytest.raises(RequestError, match="got dict"):
        llm.llm_engine.add_request("empty-dict", "Hi", {})
    with pytest.raises(RequestError, match="needs a BeamSearchParams, got SamplingParams"):
        llm.beam_search("Hi", ONE, use_tqdm=False)
    assert_idle_and_serving(llm)


def test_none_in_a_list_of_params_is_the_default(llm):
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}], [None, ONE],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) <= SamplingParams().max_tokens
    assert len(outs[1].outputs[0].token_ids) == 1
    assert_idle_and_serving(llm)


# ----------------------------------------------------------- 3. max_logprobs

def test_logprobs_above_max_logprobs_are_refused(llm):
    with pytest.raises(RequestError, match=r"logprobs=21 is more than max_logprobs=20"):
        llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    with pytest.raises(RequestError, match=r"logprobs=1000000 is more than max_logprobs=20"):
        llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=10**6), use_tqdm=False)
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2, logprobs=20), use_tqdm=False)
    assert all(20 <= len(top) <= 21 for top in out[0].outputs[0].logprobs)
    assert_idle_and_serving(llm)


def test_max_logprobs_is_an_engine_option(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=16, block_size=4, max_logprobs=2)
    assert engine.config.max_logprobs == 2
    with pytest.raises(RequestError, match="logprobs=3 is more than max_logprobs=2"):
        engine.add_request("x", [5], SamplingParams(max_tokens=1, logprobs=3))
    uncapped = LLM(str(tiny_model_dir), device="cpu", num_blocks=16, block_size=4, max_logprobs=-1)
    out = uncapped.generate([5], SamplingParams(temperature=0, max_tokens=1, logprobs=10**6), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) == VOCAB          # -1: no cap, the whole vocabulary


@pytest.mark.parametrize("bad", [-2, True, 2.0, "20", None])
def test_bad_max_logprobs(tiny_model_dir, bad):
    with pytest.raises(ConfigError, match="max_logprobs must be an integer"):
        LLMEngine(str(tiny_model_dir), device="cpu", max_logprobs=bad)
    assert EngineConfig(max_logprobs=np.int64(5)).max_logprobs == 5


def test_max_logprobs_flag():
    args = build_parser().parse_args(["generate", "hi", "--max-logprobs", "5"])
    assert engine_kwargs(args)["max_logprobs"] == 5
    args = build_parser().parse_args(["chat"])
    assert engine_kwargs(args)["max_logprobs"] == 20


# ----------------------------------------------------------- 4. text that is not valid Unicode

def test_a_prompt_with_a_lone_surrogate(llm):
    unicode = r"the prompt is not valid Unicode text: '\\ud[89a-f][0-9a-f]{2}' at index \d+ cannot be encoded as UTF-8"
    for prompt in ("abc\ud800def", {"prompt": "\udfff"}, ["ok", "abc\ud800def"]):
        with pytest.raises(RequestError, match=unicode):
            llm.generate(prompt, ONE, use_tqdm=False)
    with pytest.raises(ValueError, match=r"encode\(\) takes valid Unicode text: '\\ud800' at index 3"):
        llm.get_tokenizer().encode("abc\ud800def")
    assert_idle_and_serving(llm)


# ----------------------------------------------------------- 5. chat messages

@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] is None \(NoneType\)"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], r"messages\[1\] has no 'content'"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": 3, "content": "hi"}], r"messages\[0\]\['role'\] is 3 \(int\)"),
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\['role'\] is 'wizard'; the chat template knows "
                                            r"the roles system, user, assistant$"),
    ([{"role": "tool", "content": "42"}], r"messages\[0\]\['role'\] is 'tool'"),   # this template has no tool
    ([{"role": "user", "content": "hi"}, "hello"], r"messages\[1\] is a str"),
    ([{"role": "user", "content": "a\ud800"}], r"messages\[0\]\['content'\] is not valid Unicode text"),
    ("hello", "messages must be a conversation"),
    (None, "messages must be a conversation"),
    ([[{"role": "user", "content": "hi"}], [{"role": "user", "content": []}]],
     r"conversation 1: .*messages\[0\]\['content'\] is \[\] \(list\)"),
])
def test_chat_messages_are_checked_before_rendering(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, ONE, use_tqdm=False)
    assert_idle_and_serving(llm)


def test_the_tool_role_is_allowed_when_the_template_uses_it(llm):
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}[tool] {% endif %}"
                "{{ m['content'] }}\n{% endfor %}")
    tok = Tokenizer(llm.get_tokenizer().backend, chat_template=template)
    assert tok.chat_roles() == ("system", "user", "assistant", "tool")
    assert tok.apply_chat_template([{"role": "tool", "content": "42"}], add_generation_prompt=False) == "[tool] 42\n"
    assert llm.get_tokenizer().chat_roles() == ("system", "user", "assistant")


# ----------------------------------------------------------- 6. numpy integers are integers

def test_numpy_integers_are_ints(llm):
    (out,) = llm.generate([np.int64(5), np.int64(6)], ONE, use_tqdm=False)   # one prompt, not two
    assert out.prompt_token_ids == [5, 6] and all(type(t) is int for t in out.prompt_token_ids)
    (out,) = llm.generate((5, np.int32(6)), ONE, use_tqdm=False)            # a tuple is one prompt too
    assert out.prompt_token_ids == [5, 6]
    outs = llm.generate([[np.int64(5)], {"prompt_token_ids": list(np.arange(3, 6))}], ONE, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5], [3, 4, 5]]
    params = SamplingParams(seed=np.int64(3), stop_token_ids=[np.int64(40)], max_tokens=np.int64(2),
                            temperature=np.float32(0.5))
    assert type(params.seed) is int and params.stop_token_ids == [40] and type(params.stop_token_ids[0]) is int
    a = llm.generate([5, 6], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([5, 6], dataclasses.replace(params, seed=3), use_tqdm=False)[0].outputs[0].token_ids
    assert a == b                                               # the same seed, the same tokens
    assert_idle_and_serving(llm)


def test_a_bool_is_not_a_token_id(llm):
    with pytest.raises(RequestError, match=r"must hold only ints, got True \(bool\) at index 1"):
        llm.generate({"prompt_token_ids": [5, True]}, ONE, use_tqdm=False)
    with pytest.raises(RequestError, match=r"got 2\.0 \(float\) at index 0"):
        llm.llm_engine.add_request("f", [2.0], ONE)
    assert_idle_and_serving(llm)


# ----------------------------------------------------------- 7. loose types in the params

@pytest.mark.parametrize("bad,match", [
    (dict(n=True), r"n must be an integer, got True \(a bool is not a number here\)"),
    (dict(top_k=True), "top_k must be an integer, got True"),
    (dict(seed=True), "seed must be an integer or None, got True"),
    (dict(logprobs=True), "logprobs must be an integer or None, got True"),
    (dict(max_tokens=False), "max_tokens must be an integer, got False"),
    (dict(min_tokens=np.True_), "min_tokens must be an integer"),
    (dict(temperature=True), "temperature must be a finite number, got True"),
    (dict(top_p=np.True_), "top_p must be a finite number"),
    (dict(max_tokens=4.0), "max_tokens must be an integer, got 4.0"),
    (dict(n=np.float64(2)), "n must be an integer"),
    (dict(temperature="0.5"), "temperature must be a finite number, got '0.5'"),
    (dict(temperature=10**400), r"temperature must be a finite number, got 1000.*\.\.\.$"),   # too big for a float
    (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
    (dict(detokenize=1), "detokenize must be True or False, got 1"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be True or False, got None"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be True or False"),
    (dict(stop_token_ids=[40, True]), r"stop_token_ids must be a list of non-negative integers, got True at index 1"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be a list of non-negative integers, got 1.0 at index 0"),
    (dict(stop_token_ids=np.array([1])), "stop_token_ids must be a list"),
    (dict(stop=np.array(["a"])), "stop must be a non-empty string or a list of them"),
    (dict(output_kind="delta"), "output_kind must be an OutputKind, got 'delta'"),
])
def test_sampling_params_types_are_checked(bad, match):
    with pytest.raises(ValueError, match="invalid SamplingParams: " + match):
        SamplingParams(**bad)


def test_numpy_scalars_become_python_numbers():
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int8(5),
                       min_p=np.float16(0.125), seed=np.uint64(2**63), max_tokens=np.int16(3),
                       min_tokens=np.int64(1), logprobs=np.int32(2), ignore_eos=np.True_,
                       detokenize=np.bool_(True))
    for name, kind in [("n", int), ("temperature", float), ("top_p", float), ("top_k", int),
                       ("min_p", float), ("seed", int), ("max_tokens", int), ("min_tokens", int),
                       ("logprobs", int), ("ignore_eos", bool), ("detokenize", bool)]:
        assert type(getattr(p, name)) is kind, name
    assert p.seed == 2**63 and p.min_p == 0.125 and p.temperature == 0.5
    assert type(SamplingParams(temperature=1).temperature) is float    # an int is a fine float


@pytest.mark.parametrize("bad,match", [
    (dict(beam_width=True, max_tokens=2), "beam_width must be an integer, got True"),
    (dict(beam_width=2, max_tokens=True), "max_tokens must be an integer, got True"),
    (dict(beam_width=2.0, max_tokens=2), "beam_width must be an integer, got 2.0"),
    (dict(beam_width=2, max_tokens=2, ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
    (dict(beam_width=2, max_tokens=2, length_penalty=True), "length_penalty must be a finite number, got True"),
    (dict(beam_width=2, max_tokens=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_width=0, max_tokens=2), "beam_width must be a positive integer, got 0"),
])
def test_beam_search_params_types_are_checked(bad, match):
    with pytest.raises(ValueError, match="invalid BeamSearchParams: " + match):
        BeamSearchParams(**bad)


def test_beam_search_params_take_numpy_scalars(llm):
    p = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int32(2), ignore_eos=np.True_,
                         length_penalty=np.float32(0.5))
    assert (type(p.beam_width), type(p.max_tokens), type(p.ignore_eos), type(p.length_penalty)) == (
        int, int, bool, float)
    (out,) = llm.beam_search([np.int64(5), np.int64(6)], p, use_tqdm=False)
    assert len(out.sequences) == 2
    assert_idle_and_serving(llm)


# ----------------------------------------------------------- (a) the CLI checks sampling flags first

@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--temperature", "-1"], "error: invalid SamplingParams: temperature must be >= 0"),
    (["generate", "hi", "--n", "0"], "error: invalid SamplingParams: n must be a positive integer"),
    (["generate", "hi", "--beam-width", "0"], "error: invalid BeamSearchParams: beam_width must be a positive"),
    (["generate", "hi", "--beam-width", "2", "--show-blocks"], "error: --show-blocks steps the engine by hand"),
    (["chat", "--top-p", "0"], "error: invalid SamplingParams: top_p must be in (0, 1]"),
    (["generate", "hi", "--max-logprobs", "-5"], "error: max_logprobs must be an integer >= 0"),
    (["chat", "--repetition-penalty", "0"], "error: invalid SamplingParams: repetition_penalty must be > 0"),
    (["generate", "hi", "--presence-penalty", "3"], "error: invalid SamplingParams: presence_penalty must be in"),
    (["generate", "hi", "--frequency-penalty", "-2.5"], "error: invalid SamplingParams: frequency_penalty must be"),
])
def test_cli_checks_sampling_flags_before_loading(args, message, capsys):
    # a model that does not exist: had the engine been built first, the error would name it
    assert main([*args, "--model", "no-such-model", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message)


# ----------------------------------------------------------- (b) max_tokens is capped by max_model_len

def test_max_tokens_is_capped_to_what_max_model_len_leaves(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1000, min_tokens=900, ignore_eos=True)
    group = engine._make_group("capped", [5] * 10, params)            # built, not queued
    assert (group.sampling_params.max_tokens, group.sampling_params.min_tokens) == (MAX_MODEL_LEN - 10,) * 2
    assert (params.max_tokens, params.min_tokens) == (1000, 900)     # the caller's object is untouched
    assert engine._make_group("last", [5] * (MAX_MODEL_LEN - 1), params).sampling_params.max_tokens == 1
    with pytest.raises(RequestError, match=f"the prompt has {MAX_MODEL_LEN} tokens, more than max_model_len="
                                           f"{MAX_MODEL_LEN} allows: it must leave room for at least one generated"):
        engine._make_group("full", [5] * MAX_MODEL_LEN, params)       # vLLM's rule: no room, no request
    (out,) = llm.generate([5] * 10, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - 10 and out.outputs[0].finish_reason == "length"
    # the footprint check counts the capped number, and says so
    with pytest.raises(RequestError, match=r"7 samples x 31 cached tokens: prompt 10 \+ max_tokens 22 "
                                           r"\(all that max_model_len=32 leaves\) - 1"):
        llm.generate([5] * 10, dataclasses.replace(params, n=7), use_tqdm=False)
    assert_idle_and_serving(llm)


def test_a_request_that_fits_before_the_cap_still_fits(llm):
    """The cap changes no footprint: min(prompt + max_tokens, max_model_len) - 1 both ways."""
    engine = llm.llm_engine
    group = engine._make_group("six", [5] * 10, SamplingParams(n=6, max_tokens=10**9))
    assert group.sampling_params.max_tokens == MAX_MODEL_LEN - 10 and len(group.seqs) == 6


# ----------------------------------------------------------- the fuzz: random, partly invalid requests

FUZZ_EXAMPLES = int(os.environ.get("MINIPAGED_FUZZ_EXAMPLES", "300"))

# Per field: values that should run, and values that must be refused (wrong type, a bool
# for a number, out of range, None where None means nothing). Numpy scalars are on both sides.
GOOD = {
    "n": st.one_of(st.integers(1, 3), st.sampled_from([np.int64(2), 7])),   # 7 samples do not fit the pool
    "temperature": st.one_of(st.sampled_from([0.0, 0.5, 1, np.float32(0.7), np.int64(1), 1e-320]),
                             st.floats(0, 1e6)),
    "top_p": st.one_of(st.sampled_from([1.0, 0.5, np.float64(0.9), 1]), st.floats(1e-9, 1)),
    "top_k": st.one_of(st.integers(-1, 300), st.sampled_from([np.int32(3)])),
    "min_p": st.one_of(st.sampled_from([0.0, 0.1, np.float16(0.05), 1, 0]), st.floats(0, 1)),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from([np.int64(3), np.uint64(5)])),
    "stop": st.sampled_from([None, "a", ["a", "b"], ("x",), ["\ud800"], []]),
    "stop_token_ids": st.sampled_from([None, [], [40], [VOCAB - 1], [np.int64(40)], (2,), [0, 2]]),
    "ignore_eos": st.sampled_from([True, False, np.True_]),
    "max_tokens": st.one_of(st.integers(1, 3), st.sampled_from([np.int64(2), 10**6])),  # 10**6: capped
    "min_tokens": st.sampled_from([0, 1, 2, np.int8(1)]),
    "logprobs": st.one_of(st.none(), st.integers(0, 20), st.sampled_from([np.int64(2)])),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20), st.sampled_from([np.int64(1)])),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([0, np.float32(1.5)])),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, np.float64(0.5)])),
    "repetition_penalty": st.one_of(st.floats(1e-3, 10), st.sampled_from([1, np.float32(1.2)])),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
                            st.sampled_from([{np.int64(5): np.float32(3)}, {VOCAB - 1: 100}, {}])),
    "include_stop_str_in_output": st.sampled_from([True, False, np.False_]),
    "skip_special_tokens": st.sampled_from([True, False]),
    "detokenize": st.sampled_from([True, False, np.True_]),
    "output_kind": st.sampled_from(list(OutputKind)),
}
BAD = {
    "n": st.one_of(st.integers(-3, 0), st.sampled_from([True, 1.5, None, "2", np.float64(2)])),
    "temperature": st.one_of(st.floats(max_value=-1e-300), st.sampled_from(
        [float("nan"), float("inf"), True, "hot", None, 10**400, np.True_])),
    "top_p": st.one_of(st.floats(-2, 0), st.floats(1.0001, 3), st.sampled_from([True, None, float("nan")])),
    "top_k": st.one_of(st.integers(-10**30, -2), st.sampled_from([True, 2.5, None, "5"])),
    "min_p": st.one_of(st.floats(1.0001, 3), st.floats(-3, -1e-9), st.sampled_from([True, None])),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64),
                      st.sampled_from([True, 1.5, "1", np.float32(1)])),
    "stop": st.sampled_from([[""], "", 5, ["a", 5], np.array(["a"]), {"a"}]),
    "stop_token_ids": st.sampled_from([[-1], [True], 40, "40", [1.0], np.array([1]), [None]]),
    "ignore_eos": st.sampled_from(["no", 0, 1, None]),
    "max_tokens": st.one_of(st.integers(max_value=0), st.sampled_from([True, 2.0, None, "2"])),
    "min_tokens": st.one_of(st.integers(-5, -1), st.integers(10**6 + 1, 10**9),   # above any good max_tokens
                            st.sampled_from([True, None, 1.0])),
    "logprobs": st.one_of(st.integers(max_value=-1), st.sampled_from([True, 2.0, "1"])),
    "prompt_logprobs": st.one_of(st.integers(max_value=-1), st.sampled_from([True, 2.0, "1"])),
    "presence_penalty": st.one_of(st.floats(2.0001, 1e9), st.floats(-1e9, -2.0001),
                                  st.sampled_from([True, None, float("nan"), "1"])),
    "frequency_penalty": st.one_of(st.floats(2.0001, 1e9), st.sampled_from([np.True_, float("inf"), None])),
    "repetition_penalty": st.one_of(st.floats(-10, 0), st.sampled_from([True, None, float("nan"), "1.1"])),
    "logit_bias": st.sampled_from([{"5": 1.0}, {True: 1.0}, {5: 101}, {5: float("nan")}, {-1: 1.0}, [(5, 1.0)],
                                   {5: None}, {2.0: 1.0}, 5]),
    "include_stop_str_in_output": st.sampled_from(["yes", 1, None]),
    "skip_special_tokens": st.sampled_from([None, 1, "true"]),
    "detokenize": st.sampled_from(["false", 0]),
    "output_kind": st.sampled_from(["delta", None, 1]),
}
# out of range for this engine only: refused at add_request
BAD_HERE = {"stop_token_ids": st.sampled_from([[VOCAB], [10**9], [40, 10**12]]),
            "logprobs": st.sampled_from([21, 10**6]),
            "prompt_logprobs": st.sampled_from([21, 10**6]),
            "logit_bias": st.sampled_from([{VOCAB: 1.0}, {3: 1.0, 10**9: -1.0}])}


def bad_value(name):
    return st.one_of(BAD[name], BAD_HERE[name]) if name in BAD_HERE else BAD[name]


def mostly(good, bad, odds: int = 3):
    """``good`` ``odds`` times out of ``odds + 1``, else ``bad``."""
    return st.sampled_from([True] * odds + [False]).flatmap(lambda ok: good if ok else bad)


good_kwargs = st.fixed_dictionaries({}, optional=GOOD)
one_bad_kwargs = st.tuples(good_kwargs, st.sampled_from(sorted(GOOD))).flatmap(     # one planted fault
    lambda kw_name: bad_value(kw_name[1]).map(lambda value: {**kw_name[0], kw_name[1]: value}))
chaos_kwargs = st.fixed_dictionaries({}, optional={name: mostly(GOOD[name], bad_value(name), odds=9)
                                                   for name in GOOD})

surrogate_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=5),
                           st.sampled_from(["\ud800", "\udfff", "\udc80"]), st.text(max_size=5))
good_ids = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
                     st.lists(st.integers(0, VOCAB - 1).map(np.int64), min_size=1, max_size=8))
bad_id = st.one_of(st.integers(min_value=VOCAB), st.integers(max_value=-1), st.just(True), st.floats(0, 10),
                   st.none(), st.just("a"), st.just([5]))
bad_nonempty_ids = st.one_of(
    st.tuples(good_ids, st.integers(0, 30), bad_id).map(                  # a good list, one bad id in it
        lambda t: t[0][:t[1]] + [t[2]] + t[0][t[1]:]).filter(lambda ids: len(ids) <= MAX_MODEL_LEN),
    st.lists(st.integers(0, VOCAB - 1), min_size=MAX_MODEL_LEN + 1, max_size=40))   # too long
bad_ids = st.one_of(bad_nonempty_ids, st.just([]))
good_text = st.text(min_size=1, max_size=20)
bad_text = st.one_of(surrogate_text, st.just(""), st.text(min_size=40, max_size=60))
good_prompt = st.one_of(good_text, good_ids, st.fixed_dictionaries({"prompt": good_text}),
                        st.fixed_dictionaries({"prompt_token_ids": good_ids}),
                        st.tuples(st.integers(0, VOCAB - 1)))
bad_prompt = st.one_of(
    bad_text, bad_nonempty_ids,       # ([] alone is a batch of no prompts, which is fine: see the dicts)
    st.fixed_dictionaries({"prompt": st.one_of(bad_text, good_ids, st.none(), st.integers())}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(bad_ids, good_text, st.none(), st.integers())}),
    st.just({}), st.just({"text": "hi"}),
    st.fixed_dictionaries({"prompt": good_text, "prompt_token_ids": bad_ids}))
good_shapes = st.one_of(good_prompt, st.lists(good_prompt, min_size=1, max_size=3))
bad_shapes = st.one_of(
    bad_prompt,
    st.tuples(st.lists(good_prompt, max_size=2), st.integers(0, 2), bad_prompt).map(   # one bad in a batch
        lambda t: t[0][:t[1]] + [t[2]] + t[0][t[1]:]),
    st.lists(st.lists(good_ids, max_size=2), min_size=1, max_size=2),                 # nested too deep
    st.none(), st.integers(), st.floats(), st.just(b"bytes"), st.just(np.array([5, 6])))
one_prompt = mostly(good_prompt, bad_prompt)
chaos_shapes = st.one_of(one_prompt, st.lists(one_prompt, max_size=3), bad_shapes)   # [] is no prompt at all

# what each example plants: nothing, one bad field, one bad prompt, or anything anywhere
MODES = {"clean": (good_kwargs, good_shapes), "bad field": (one_bad_kwargs, good_shapes),
         "bad prompt": (good_kwargs, bad_shapes), "chaos": (chaos_kwargs, chaos_shapes)}


ERROR_WORDS = tuple(f"{name} must" for name in GOOD) + (
    "logprobs=", "stop_token_ids:", "logit_bias keys must", "logit_bias[", "logit_bias:", "stop strings need detokenize", "sampling params", "sampling_params[",
    "prompt", "token id", "token-id", "KV blocks", "max_model_len", "Unicode")


def names_something(err: Exception) -> bool:
    return any(word in str(err) for word in ERROR_WORDS)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(mode=st.sampled_from(sorted(MODES)), data=st.data(),
       api=st.sampled_from(["generate", "generate list", "engine"]))
def test_fuzz_random_requests_run_or_are_refused_cleanly(llm, mode, data, api):
    """Random, partly invalid requests either run (at most a few tokens) or are refused with a
    ValueError/TypeError that names the field or the prompt; the engine is left idle either way."""
    engine = llm.llm_engine
    param_kwargs, prompt_shapes = MODES[mode]
    prompts = data.draw(prompt_shapes, label="prompts")
    batch = isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, dict, list, tuple))
    count = len(prompts) if batch else 1
    planted = mode in ("bad field", "bad prompt")   # these must be refused
    # one keyword set, or (generate list) one per prompt, now and then one too many or too few;
    # None (the default) for some, except where it would hide the planted field
    sizes = mostly(st.just(count), st.integers(0, 4)) if api == "generate list" else st.just(1)
    entry = param_kwargs if mode == "bad field" else mostly(param_kwargs, st.none(), odds=5)
    kwargs = data.draw(st.lists(entry, min_size=(size := data.draw(sizes)), max_size=size), label="kwargs")
    raw = data.draw(mostly(st.just(False), st.just(True), odds=9), label="pass the dicts as they are")
    try:
        # None stays None (the default); a dict of fields becomes SamplingParams, or is passed raw
        params = [k if k is None or raw else SamplingParams(**k) for k in kwargs]
        if api == "engine":
            engine.add_request("fuzz", prompts, params[0] if params else None)
            reports = []
            while engine.has_unfinished_requests():
                reports += engine.step()
            # every report so far (DELTA: each holds only what its step added), or the last
            delta = (params[0] or SamplingParams()).output_kind == OutputKind.DELTA
            results = [[c for out in (reports if delta else reports[-1:]) for c in out.outputs]]
            wanted = [params[0]]
        else:
            sampling = params if api == "generate list" else params[0]
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            results = [out.outputs for out in outputs]
            wanted = params if api == "generate list" else [params[0]] * len(outputs)
    except (ValueError, TypeError) as err:    # RequestError and ConfigError are ValueErrors
        assert names_something(err), f"{type(err).__name__}: {err}"
        event(f"{mode}: refused ({type(err).__name__})")
    else:
        assert not planted, f"{mode}: accepted {prompts!r} with {kwargs!r}"
        event(f"{mode}: ran")
        for completions, sp in zip(results, wanted):
            sp = sp or SamplingParams()
            tokens = {}
            for c in completions:
                tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
                if sp.logprobs is not None:
                    assert all(len(top) <= sp.logprobs + 1 for top in c.logprobs)
            assert sorted(tokens) == list(range(sp.n))
            assert all(1 <= t <= min(sp.max_tokens, MAX_MODEL_LEN) for t in tokens.values()), tokens
            assert {c.finish_reason for c in completions if c.finish_reason} <= {"stop", "length"}
        for out, sp in zip(outputs if api != "engine" else [], wanted):   # one prompt_logprobs entry a token
            sp = sp or SamplingParams()
            assert (out.prompt_logprobs is None) == (sp.prompt_logprobs is None)
            if out.prompt_logprobs is not None:
                assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
                assert all(len(e) <= sp.prompt_logprobs + 1 for e in out.prompt_logprobs[1:])
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, ONE, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert engine.block_manager.num_used_blocks == 0 and not engine.groups


def test_more_samples_than_max_num_seqs_are_refused(tiny_model_dir):
    """n (or beam_width) sequences must run together; above max_num_seqs they never could
    (the request used to wait forever)."""
    small = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                swap_space=0.001, max_num_seqs=2)
    with pytest.raises(RequestError, match=r"n=3 sequences can never run at once: max_num_seqs=2"):
        small.generate([5, 6], SamplingParams(n=3, max_tokens=2), use_tqdm=False)
    with pytest.raises(RequestError, match=r"n=3 sequences can never run at once: max_num_seqs=2"):
        small.beam_search([[5, 6]], BeamSearchParams(beam_width=3, max_tokens=2), use_tqdm=False)
    assert len(small.generate([5, 6], SamplingParams(n=2, max_tokens=2), use_tqdm=False)[0].outputs) == 2
    assert_idle_and_serving(small)
