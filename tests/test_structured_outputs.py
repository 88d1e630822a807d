"""Structured outputs in the engine: every kind of constraint, checked by an independent judge.

The outputs of the tiny random model (a byte-level tokenizer: one token per byte) are judged by
tools that know nothing of llguidance: ``jsonschema`` for JSON Schemas, Python's ``re`` for
regexes, set membership for choices, and, for greedy decoding under a choice, the dense
reference model restricted to the tokens a hand-written prefix check allows. The rest of the
engine must not move a constrained request's tokens: preemption (swap, recompute), prefix
caching, chunked prefill and speculative decoding give the same tokens as a plain run. The
cache_salt is checked here too, at the block manager and through the engine.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged import LLM, SamplingParams
from minipaged.engine.input_processor import RequestError
from minipaged.engine.sampler import apply_grammar_masks
from minipaged.memory.block_manager import BlockManager
from minipaged.sampling_params import StructuredOutputsParams
from minipaged.sequence import Sequence, SequenceGroup

SO = StructuredOutputsParams
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-[0-9]{3}(x|yz)?"
CHOICES = ["ab", "abc", "b"]
PROMPTS = [{"prompt_token_ids": list(range(5 + i, 17 + 2 * i))} for i in range(4)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", swap_space=0.002, num_blocks=1024, block_size=4)


def generate(llm, constraint, n=1, temperature=1.0, seed=0, max_tokens=200, prompts=PROMPTS, **extra):
    params = SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens,
                            structured_outputs=constraint, **extra)
    return [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


# ---------------------------------------------------------------- each kind, judged independently
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    for c in generate(llm, SO(json=PERSON), n=2, temperature=temperature):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
        assert c.text == json.dumps(json.loads(c.text), ensure_ascii=False)   # compact: ", " and ": " only


def test_json_schema_as_text_and_json_object(llm):
    for c in generate(llm, SO(json=json.dumps(PERSON)), seed=1):
        jsonschema.validate(json.loads(c.text), PERSON)
    small = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
             "additionalProperties": False}
    # any JSON object: the random model may write a long one; what it wrote so far must parse
    # as a prefix, and every finished one is an object
    for c in generate(llm, SO(json_object=True), seed=2, max_tokens=60):
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    for c in generate(llm, SO(json=small, disable_any_whitespace=False), seed=3, max_tokens=400):
        if c.finish_reason == "stop":
            assert json.loads(c.text)["k"] in (1, 2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_full_match(llm, temperature):
    outs = generate(llm, SO(regex=REGEX), n=3, temperature=temperature, seed=4)
    for c in outs:
        assert re.fullmatch(REGEX, c.text), c.text
        assert c.finish_reason == "stop"


def test_choice_ends_the_request_when_the_grammar_does(llm, tiny_model_dir):
    """A choice that no other choice extends stops at once with "stop": no EOS token needed."""
    eos = llm.get_tokenizer().eos_token_id
    for c in generate(llm, SO(choice=CHOICES), n=4, seed=5):
        assert c.text in CHOICES and c.finish_reason == "stop"
        if c.text in ("abc", "b"):                # nothing can follow: the grammar ended it
            assert eos not in c.token_ids and len(c.token_ids) == len(c.text)


def test_lark_and_gbnf_grammars(llm):
    lark = 'start: item ("," item)*\nitem: /[0-9]/ | "x"'
    for c in generate(llm, SO(grammar=lark), seed=6, max_tokens=40):
        if c.finish_reason == "stop":
            assert re.fullmatch(r"([0-9]|x)(,([0-9]|x))*", c.text), c.text
        else:
            assert re.fullmatch(r"(([0-9]|x),)*([0-9]|x)?,?", c.text), c.text
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    assert {c.text for c in generate(llm, SO(grammar=gbnf), n=2, seed=7)} <= {"yes", "no", "maybe"}


def test_greedy_choice_is_the_argmax_over_the_allowed_tokens(llm, reference):
    """At temperature 0 each token is the dense reference's argmax among the tokens a hand-made
    prefix check allows (the next byte of every choice the text begins, and EOS once the text
    is a whole choice): the mask lets through exactly those. A whole choice that no other
    extends ends the request with no token more."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 15 + 7 * i))} for i in range(6)]
    for prompt, c in zip(prompts, generate(llm, SO(choice=CHOICES), temperature=0.0, prompts=prompts)):
        ids, text, want = list(prompt["prompt_token_ids"]), "", []
        while True:
            nexts = {x[len(text)] for x in CHOICES if x.startswith(text) and len(x) > len(text)}
            if not nexts:
                break
            allowed = {tok.encode(ch)[0] for ch in nexts} | ({eos} if text in CHOICES else set())
            row = reference.logits(ids)[-1]
            token = max(allowed, key=lambda t: row[t])
            want.append(token)
            if token == eos:
                break
            ids.append(token)
            text += tok.decode([token])
        assert c.token_ids == want, (c.text, tok.decode(want))


class DeviceArrays:
    """numpy under another name: the sampler then takes its device path (the packed words sent
    and unpacked with shifts, as on a GPU with CuPy)."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("xp", [np, DeviceArrays()], ids=["host", "device-path"])
def test_masks_apply_as_the_numpy_oracle(xp):
    """apply_grammar_masks on a (N, V) batch against a per-token loop over the bits."""
    rng = np.random.default_rng(0)
    n, vocab = 5, 70
    logits = rng.standard_normal((n, vocab)).astype(np.float32)
    bits = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)   # (R, ceil(70/32))
    bits[2] = 0
    bits[2, 1] = 1 << 4                                    # row 4: only token 36
    rows = [0, 2, 4]
    banned = logits.copy()
    banned[4, 36] = -np.inf                                # a ban hid all the grammar allows
    got = banned.copy()
    apply_grammar_masks(got, logits, rows, bits, xp)
    want = banned.copy()
    for r, row in enumerate(rows):
        for t in range(vocab):
            if not (int(bits[r, t // 32]) >> (t % 32)) & 1:
                want[row, t] = -np.inf
    want[4] = np.where(np.arange(vocab) == 36, logits[4], -np.inf)   # the grammar's rule wins
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- with the rest of the engine
def test_samples_keep_their_own_grammar_state(llm):
    """n = 6 samples of one prompt fork copy-on-write; each follows the regex on its own (a
    high temperature, as the tiny model's logits are tens apart, so they diverge)."""
    outs = generate(llm, SO(regex=REGEX), n=6, seed=8, temperature=50.0, prompts=PROMPTS[:1])
    assert len({c.text for c in outs}) > 1
    assert all(re.fullmatch(REGEX, c.text) for c in outs)


@pytest.fixture(scope="module")
def plain_run(tiny_model_dir):
    """The constrained requests without preemption, caching or speculation: the oracle."""
    return run_mixed(LLM(str(tiny_model_dir), device="cpu", swap_space=0.002, num_blocks=512, block_size=4))


def run_mixed(llm) -> list[list[int]]:
    """A JSON, a regex and a choice request per prompt, seeded and greedy, all in one batch."""
    batch, params = [], []
    for i, p in enumerate(PROMPTS * 2):
        for j, constraint in enumerate((SO(json=PERSON), SO(regex=REGEX), SO(choice=CHOICES))):
            batch.append(p)
            params.append(SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=10 * i + j, max_tokens=80,
                                         structured_outputs=constraint))
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=26, preemption_mode="swap"),
    dict(num_blocks=26, preemption_mode="recompute"),
    dict(enable_prefix_caching=True, num_blocks=512),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=6, num_blocks=512),
    dict(num_blocks=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}),
], ids=["swap", "recompute", "prefix-caching", "chunked-prefill", "ngram-spec"])
def test_the_engine_changes_no_constrained_token(tiny_model_dir, plain_run, kwargs):
    llm = LLM(str(tiny_model_dir), device="cpu", swap_space=0.002, block_size=4, **kwargs)
    assert run_mixed(llm) == plain_run
    stats = llm.get_stats()
    if "preemption_mode" in kwargs:
        assert stats["num_preemptions"] > 0
    if "speculative_config" in kwargs:
        assert stats["spec_decode"]["num_draft_tokens"] > 0
    assert stats["kv_blocks_used"] == 0
    llm.llm_engine.block_manager.check_invariants()


def test_draft_model_drafts_are_checked_against_the_grammar(tiny_model_dir, plain_run):
    """The target as its own (unconstrained) draft: drafts the grammar forbids are rejected at
    verification, the grammar state rolls back with them. Greedy rows give the plain run's
    tokens; sampled rows (rejection sampling draws differently) still satisfy their judges."""
    llm = LLM(str(tiny_model_dir), device="cpu", swap_space=0.002, block_size=4, num_blocks=512,
              speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                  "num_speculative_tokens": 3, "adaptive": False})
    got = run_mixed(llm)
    tok = llm.get_tokenizer()
    for index, (tokens, want) in enumerate(zip(got, plain_run)):
        i, kind = divmod(index, 3)
        if i % 2:                                    # greedy
            assert tokens == want
        text = tok.decode([t for t in tokens if t != tok.eos_token_id])
        if kind == 0:
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert re.fullmatch(REGEX, text) if kind == 1 else text in CHOICES
    stats = llm.get_stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]    # some drafts broke the grammar


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("constraint, message", [
    (SO(json={"type": "foo"}), "JSON schema cannot be compiled"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(regex="[a-"), "regex cannot be compiled"),
    (SO(grammar="start: b"), "grammar cannot be compiled"),
])
def test_bad_constraints_are_refused_before_queueing(llm, constraint, message):
    engine = llm.llm_engine
    with pytest.raises(RequestError, match=message):
        engine.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests() and "bad" not in engine.groups
    assert re.fullmatch(REGEX, generate(llm, SO(regex=REGEX), prompts=PROMPTS[:1])[0].text)


@pytest.mark.parametrize("fields, message", [
    (dict(), "got none"),
    (dict(regex="a", choice=["a"]), "would conflict"),
    (dict(choice=[]), "non-empty list"),
    (dict(json=3), "JSON Schema"),
    (dict(regex="a", disable_any_whitespace="no"), "True or False"),
])
def test_malformed_structured_outputs_params(fields, message):
    with pytest.raises(ValueError, match=message):
        SO(**fields)
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


# ---------------------------------------------------------------- hypothesis: random small schemas
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 300)),
    st.just({"type": "boolean"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.one_of(st.integers(-9, 9), st.sampled_from(["x", "yy", "z z"])),
                                                min_size=1, max_size=4, unique=True)),
    st.just({"type": "null"}),
)


def objects(children):
    return st.builds(
        lambda props, required: {"type": "object", "properties": props,
                                 "required": sorted(k for k in props if required.get(k, True)),
                                 "additionalProperties": False},
        st.dictionaries(st.sampled_from(["a", "b", "c", "d e"]), children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "c", "d e"]), st.booleans()))


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    objects(children), st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                                 children, st.integers(0, 3))), max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_random_small_schemas_give_valid_json(llm, schema, seed):
    """Any small schema of objects, arrays, bounded strings, ranges, enums, booleans and nulls:
    the sampled output is JSON that jsonschema accepts."""
    c = generate(llm, SO(json=schema), seed=seed, max_tokens=400, prompts=PROMPTS[:1])[0]
    assert c.finish_reason == "stop", (schema, c.text)
    jsonschema.validate(json.loads(c.text), schema)


# ---------------------------------------------------------------- cache_salt
def test_salts_keep_tenants_apart_in_the_block_manager():
    """The same prompt under two salts shares no block; under one salt (or none) it does."""
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    prompt = list(range(3, 23))

    def admit(i, salt):
        group = SequenceGroup(f"r{i}", [Sequence(i, list(prompt), cache_salt=salt)], SamplingParams())
        bm.allocate(group)
        bm.cache_full_blocks(group.seqs[0], len(prompt))
        return group.num_cached_tokens

    assert admit(0, "tenant-a") == 0
    assert admit(1, "tenant-a") == 16           # the full blocks before the last token
    assert admit(2, "tenant-b") == 0
    assert admit(3, None) == 0
    assert admit(4, None) == 16
    bm.check_invariants()


def test_cache_salt_through_the_engine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", swap_space=0.002, num_blocks=256, block_size=4,
              enable_prefix_caching=True)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(salt):
        p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        out = llm.generate(p, params, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = run("a")
    assert first[0] == 0
    assert run("a") == (36, first[1])            # the same tenant hits, and the tokens are the same
    assert run("b") == (0, first[1])             # another tenant does not
    before = llm.get_stats()["prefix_cache_hits"]
    assert run(None)[0] == 0 and llm.get_stats()["prefix_cache_hits"] == before
    for bad in ("", 5):
        with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
            llm.llm_engine.add_request("x", {"prompt_token_ids": prompt, "cache_salt": bad}, params)


def test_beams_carry_the_salt(tiny_model_dir):
    """A beam forked after the prompt keeps its request's salt (its first block may be named after the fork)."""
    from minipaged import LLMEngine
    from minipaged.engine.beam_search import BeamSearchParams

    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=128, block_size=4, swap_space=0.002,
                       enable_prefix_caching=True)
    engine.add_beam_request("b", {"prompt_token_ids": [5, 6], "cache_salt": "s"}, BeamSearchParams(3, 8))
    salts = set()
    while engine.has_unfinished_requests():
        salts |= {seq.cache_salt for seq in engine.groups["b"].seqs} if "b" in engine.groups else set()
        engine.step()
    assert salts == {"s"}


def test_a_broken_grammar_aborts_its_sequence(llm):
    """If llguidance's matcher breaks (one of its limits), the sequence ends "abort", not "stop"."""
    from minipaged.engine.output_processor import OutputProcessor
    from minipaged.engine.sampler import SampleResult
    from minipaged.sequence import SequenceStatus

    class Broken:
        error = None
        is_finished = False

        def accept(self, token):
            self.error = "parser limit reached"
            return False

    seq = Sequence(0, [5, 6], grammar=Broken())
    group = SequenceGroup("r", [seq], SamplingParams(max_tokens=10))
    OutputProcessor(llm.get_tokenizer(), {2}, 64).append(group, seq, SampleResult(40, -1.0, None))
    assert seq.status == SequenceStatus.FINISHED_ABORTED
