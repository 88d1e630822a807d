"""SmolLM2-135M-Instruct through the paged engine against an independent implementation.

../shared/golden (copied to tests/golden) holds Hugging Face transformers' float32
greedy outputs for the same GGUF. Rule (the project's test strategy): greedy tokens match;
where they diverge, the reference's top-2 logit margin at that step is below 1e-3.
"""

import numpy as np
import pytest

from minipaged import LLM, SamplingParams

pytestmark = pytest.mark.slow
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m-instruct", device="cpu", kv_cache_space=0.25)


def check_against_golden(case, token_ids):
    for step, (got, want) in enumerate(zip(token_ids, case["new_ids"])):
        if got != want:
            margin = case["top2_margin_per_step"][step]
            assert margin < NEAR_TIE, (f"{case['name']}: step {step} gave {got}, golden {want}, "
                                       f"but the reference margin there is {margin}")
            return step          # after a legitimate near-tie flip the continuations differ
    return len(case["new_ids"])


def test_greedy_continuations_match_golden(smollm2, golden):
    cases = golden["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5,
                            skip_special_tokens=False)
    outputs = smollm2.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outputs):
        completion = out.outputs[0]
        agreed = check_against_golden(case, completion.token_ids)
        if agreed == len(case["new_ids"]):
            assert completion.text == case["new_text"]
        # top-5 at step 0 and 8: same ids in the same order, same logit gaps (log-probs differ
        # from logits by one constant per step, so gaps compare directly)
        for step in ("0", "8"):
            if int(step) >= agreed:
                continue
            want = case["top5"][step]
            top = completion.logprobs[int(step)]
            got_ids = sorted(top, key=top.get, reverse=True)[:5]
            assert got_ids == want["ids"]
            got_gaps = np.array([top[i] for i in got_ids]) - top[got_ids[0]]
            want_gaps = np.array(want["logits"]) - want["logits"][0]
            np.testing.assert_allclose(got_gaps, want_gaps, atol=2e-3)


def test_chat_prompt_tokens_and_answer(smollm2, golden):
    case = next(c for c in golden["prompts"] if c["chat_template"])
    out = smollm2.chat([{"role": "user", "content": case["text"]}],
                       SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
    assert out.prompt_token_ids == case["prompt_ids"]
    assert out.outputs[0].finish_reason == "stop"          # EOS ends the answer
    assert out.outputs[0].text == case["new_text_until_eos"]


def test_batched_with_small_blocks_and_preemption(golden):
    """The golden prompts with block size 4 in a pool too small for all of them at once."""
    llm = LLM("smollm2-135m-instruct", device="cpu", block_size=4, num_blocks=20)
    cases = golden["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outputs):
        check_against_golden(case, out.outputs[0].token_ids)
    assert llm.get_stats()["num_preemptions"] > 0


def test_smollm2_answers_in_the_asked_json_shape(smollm2):
    """The real model, sampled, under a JSON Schema and a regex: every answer is complete and
    valid by jsonschema and re (structured outputs, docs/structured_outputs.md)."""
    import json
    import re

    import jsonschema

    from minipaged.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "country", "population"], "additionalProperties": False}
    asks = [([{"role": "user", "content": "Name a large city, its country and population, as JSON."}],
             StructuredOutputsParams(json=schema)),
            ([{"role": "user", "content": "What time is it? Answer as HH:MM."}],
             StructuredOutputsParams(regex=r"([01][0-9]|2[0-3]):[0-5][0-9]"))]
    for messages, constraint in asks:
        params = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=120, structured_outputs=constraint)
        for c in smollm2.chat(messages, params, use_tqdm=False)[0].outputs:
            assert c.finish_reason == "stop", c.text
            if constraint.json is not None:
                jsonschema.validate(json.loads(c.text), schema)
            else:
                assert re.fullmatch(constraint.regex, c.text)
