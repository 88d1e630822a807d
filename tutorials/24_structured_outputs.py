"""Tutorial 24: structured outputs, tool calls and cache_salt: a protection mask on every token.

Goal: make the model answer in a shape a program can read (JSON for a schema, a regex, one of a
few choices, a call to a named function) without hoping it will, and keep two tenants' cached
prompts apart. We:

1. compile a JSON Schema with the engine's grammar compiler (llguidance) and walk it by hand: at
   each step the grammar's bitmask over the 49,152-token vocabulary, how many tokens it allows,
   the model's favourite against the best allowed one;
2. generate under a JSON Schema, a regex and a choice with ``SamplingParams(structured_outputs=
   StructuredOutputsParams(...))``: every answer parses, and a choice ends the request the
   moment the grammar does (finish_reason "stop", no end-of-sequence token needed);
3. sample n = 3 answers of one prompt: the samples share the prompt's KV blocks copy-on-write,
   but each has its own place in the grammar;
4. build a tool call the way the server does for ``tool_choice="required"``: a grammar from the
   tools' parameter schemas, the answer parsed into calls;
5. send one long prompt as two tenants with ``cache_salt``: the same tenant hits the prefix
   cache, the other does not;
6. time free sampling against a schema (a ratio, not asserted; ``bench structured`` measures it).

The OS analogy: protection bits. Each page-table entry says what a process may do with a page,
and the MMU checks every access; here a mask says which tokens a sequence may produce next, and
the sampler checks every token. A tool call is a system call: the model asks, the client runs
it. And ``cache_salt`` is a namespace for the page cache: clouds stopped merging identical pages
across virtual machines (KSM) when the time a write took was found to reveal whether another
tenant held the same page; a prompt's time to first token would reveal a shared prefix the same way.

Run it:  python tutorials/24_structured_outputs.py   (SmolLM2-135M-Instruct, ~15 s)

Exercises (also printed at the end):
  1. Set ``disable_any_whitespace=False`` in step 2's JSON request and sample 8 answers. How many
     finish within max_tokens, and how long are they? (docs/structured_outputs.md has our count.)
  2. Step 1 computes one mask at a time. Where in ``LLMEngine._run_model`` could the masks of a
     batch be computed while the model's forward pass runs, and what would that hide?
"""

import json
import os
import re
import time

from minipaged import LLM, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np

from minipaged.engine.sampler import apply_grammar_masks
from minipaged.entrypoints.tool_calls import calls_from_text, check_tools, tool_constraint
from minipaged.sampling_params import StructuredOutputsParams

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

llm = LLM(MODEL, kv_cache_space=0.25, enable_prefix_caching=True)
engine = llm.llm_engine
tok = llm.get_tokenizer()
vocab = engine.model_config.vocab_size


def chat_ids(text: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


# ---------------------------------------------------------------- 1. the mask, by hand
print("1. A JSON Schema's mask, step by step (greedy)")
schema = StructuredOutputsParams(json=PERSON)
grammar = engine.grammars.matcher(engine.grammars.compile(schema))   # a fresh matcher, walked by hand
ids = chat_ids("Tell me about a person, as JSON.")
greedy = SamplingParams(temperature=0.0, max_tokens=1)
constrained = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=60,
                                                                   structured_outputs=schema),
                           use_tqdm=False)[0].outputs[0].token_ids
overridden = 0
for step, token in enumerate(constrained[:10]):
    bits = engine.grammars.masks_for([grammar])[0]                    # (W,) int32, one bit a token
    allowed = np.unpackbits(bits.view(np.uint8), count=vocab, bitorder="little")   # (V,) 0 / 1
    # the mask applied to a row of logits as the sampler does: only allowed tokens stay finite
    row = np.zeros((1, vocab), dtype=np.float32)
    apply_grammar_masks(row, row, [0], bits[None, :])
    assert int(np.isfinite(row).sum()) == int(allowed.sum()) and allowed[token]
    # the model's own favourite after the same tokens, with no grammar
    favourite = llm.generate({"prompt_token_ids": ids + constrained[:step]}, greedy,
                             use_tqdm=False)[0].outputs[0].token_ids[0]
    if allowed[favourite]:
        assert token == favourite         # greedy under a mask: the favourite whenever it is allowed
    overridden += token != favourite
    print(f"   step {step}: {int(allowed.sum()):6d} of {vocab} tokens allowed; the model's favourite "
          f"{tok.decode([favourite])!r:10} -> {tok.decode([token])!r}")
    assert grammar.accept(token)
print(f"   so far {tok.decode(constrained[:10])!r}: the mask overrode the model at {overridden} of 10 steps")


# ---------------------------------------------------------------- 2. generate under constraints
print("\n2. JSON, a regex and a choice through SamplingParams(structured_outputs=...)")
asks = [("Tell me about a person, as JSON.", StructuredOutputsParams(json=PERSON)),
        ("What time is it? Answer as HH:MM.", StructuredOutputsParams(regex=r"([01][0-9]|2[0-3]):[0-5][0-9]")),
        ("Is the sky blue on a clear day?", StructuredOutputsParams(choice=["yes", "no"]))]
for question, constraint in asks:
    c = llm.generate({"prompt_token_ids": chat_ids(question)},
                     SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=constraint),
                     use_tqdm=False)[0].outputs[0]
    print(f"   {constraint.kind:6} -> {c.text!r} (finish_reason={c.finish_reason}, {len(c.token_ids)} tokens)")
    assert c.finish_reason == "stop"
    if constraint.kind == "json":
        person = json.loads(c.text)
        assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.regex, c.text)
    else:
        assert c.text in constraint.choice and tok.eos_token_id not in c.token_ids
        print(f"   the choice ended the request itself: {len(c.token_ids)} token(s), no end-of-sequence token")

# ---------------------------------------------------------------- 3. n samples, n grammar states
print("\n3. n = 3 samples of one prompt, each with its own grammar state")
outs = llm.generate({"prompt_token_ids": chat_ids("Invent a person, as JSON.")},
                    SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=80,
                                   structured_outputs=StructuredOutputsParams(json=PERSON)), use_tqdm=False)[0]
for c in outs.outputs:
    print(f"   sample {c.index}: {c.text}")
    assert set(json.loads(c.text)) == {"name", "age"}

# ---------------------------------------------------------------- 4. a tool call
print("\n4. tool_choice='required': the tools' schemas as one grammar, the answer as calls")
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]
constraint = tool_constraint("required", check_tools(tools))
prompt = tok.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                 add_generation_prompt=True, tools=tools)
c = llm.generate({"prompt_token_ids": tok.encode(prompt, add_special_tokens=False)},
                 SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=constraint),
                 use_tqdm=False)[0].outputs[0]
calls = calls_from_text("required", c.text)
print(f"   the model wrote {c.text!r}")
assert c.finish_reason == "stop" and calls, "the answer is a whole JSON array of calls"
for call in calls:
    print(f"   -> call {call['function']['name']}({call['function']['arguments']})")
    assert call["function"]["name"] in ("get_weather", "add")
    json.loads(call["function"]["arguments"])

# ---------------------------------------------------------------- 5. two tenants
print("\n5. cache_salt: one long system prompt, two tenants")
system = "You are the assistant of a small bakery. You know its opening hours and its bread. " * 6
shared = chat_ids("When do you open?", system)
seen = {}
for tenant in ("tenant-a", "tenant-a", "tenant-b"):
    out = llm.generate({"prompt_token_ids": shared, "cache_salt": tenant},
                       SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    print(f"   {tenant}: {out.num_cached_tokens:3d} of {len(shared)} prompt tokens found in the prefix cache")
    seen.setdefault(tenant, []).append(out.num_cached_tokens)
assert seen["tenant-a"][0] == 0 and seen["tenant-a"][1] >= len(shared) - 16 and seen["tenant-b"] == [0]

# ---------------------------------------------------------------- 6. what it costs
print("\n6. what the grammar costs: 8 requests of 32 tokens, free and under a schema (timed, not asserted)")
long_schema = {"type": "array", "minItems": 64, "items": PERSON}
prompts = [{"prompt_token_ids": chat_ids(f"List people number {i}, as JSON.")} for i in range(8)]
times = {}
for label, so in (("free", None), ("JSON", StructuredOutputsParams(json=long_schema))) * 2:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True,
                                         structured_outputs=so), use_tqdm=False)
    times.setdefault(label, []).append(time.perf_counter() - start)
print(f"   free {min(times['free']):.2f} s, JSON {min(times['JSON']):.2f} s: "
      f"JSON / free = {min(times['JSON']) / min(times['free']):.2f}x (best of 2 each)")

print("\nExercises:")
print("  1. Set disable_any_whitespace=False in step 2's JSON request and sample 8 answers. How many")
print("     finish within max_tokens, and how long are they? (docs/structured_outputs.md has our count.)")
print("  2. Step 1 computes one mask at a time. Where in LLMEngine._run_model could the masks of a")
print("     batch be computed while the model's forward pass runs, and what would that hide?")
