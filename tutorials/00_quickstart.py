"""Tutorial 0: quickstart, the vLLM-shaped API: generate, sample, stop, chat, stream.

Goal: use minipaged the way an application would. ``LLM`` is the offline front
door (a list of prompts in, a list of RequestOutputs out); ``SamplingParams``
says how each request picks tokens and when it stops; ``llm.chat`` applies the
model's chat template; ``LLMEngine`` with ``OutputKind.DELTA`` streams text as
it is produced; ``get_stats()`` reports what the engine did.

The OS analogy: this is the system-call layer. Programs ask for work through a
small stable interface and never see page tables or the scheduler; everything
the other tutorials take apart happens underneath these calls; start here to
see what the engine is for, then read tutorials 1 to 12 to see how it works.

Run it:  python tutorials/00_quickstart.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import math
import os

from minipaged import LLM, OutputKind, SamplingParams

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
llm = LLM(MODEL, device="cpu")
tokenizer = llm.get_tokenizer()
generated = 0  # every token sampled in this tutorial, to check get_stats() at the end


def generate(prompts, params):
    global generated
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generated += sum(len(o.outputs[0].token_ids) for o in outputs)
    return outputs


print(f"1. Greedy generation of a batch ({MODEL})")
prompts = ["The capital of France is", "def fibonacci(n):"]
greedy = SamplingParams(temperature=0.0, max_tokens=8)
outputs = generate(prompts, greedy)
for out in outputs:
    c = out.outputs[0]
    print(f"  {out.prompt!r} -> {c.text!r}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
assert [o.prompt for o in outputs] == prompts                      # same order as the prompts
assert all(len(o.outputs[0].token_ids) <= greedy.max_tokens for o in outputs)

print("\n2. Sampling: temperature and top-p, made reproducible by a per-request seed")
alone = {}
for seed in (1, 2):
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=8)
    out = generate(prompts[0], sampled)[0].outputs[0]
    alone[seed] = out.token_ids
    print(f"  seed {seed}: {out.text!r}")
seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8)
# The seed belongs to the request, so the batch around it changes nothing.
in_batch = generate(prompts[::-1], [greedy, seeded])[1].outputs[0].token_ids
print(f"  seed 1 again, inside a batch: identical to seed 1 alone = {alone[1] == in_batch}")
assert alone[1] == in_batch

print("\n3. Stop strings: the text ends where a stop string would begin")
full = outputs[0].outputs[0].text
# End at the first sentence or line break; another model may need another stop string.
stops = [s for s in (".", "\n") if s in full] or [full[len(full) // 2]]
stopped = generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, stop=stops))[0].outputs[0]
cut = min(full.index(s) for s in stops)
print(f"  without stop: {full!r}")
print(f"  stop={stops}: {stopped.text!r}  finish_reason={stopped.finish_reason}, "
      f"stop_reason={stopped.stop_reason!r}")
assert stopped.text == full[:cut] and stopped.finish_reason == "stop" and stopped.stop_reason in stops

print("\n4. Log-probabilities: the model's own view of each token and its rivals")
scored = generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
for token, top in zip(scored.token_ids, scored.logprobs):
    rivals = ", ".join(f"{tokenizer.decode([t])!r}: {lp:.2f}" for t, lp in
                       sorted(top.items(), key=lambda kv: -kv[1]))
    print(f"  chose {tokenizer.decode([token])!r:12} logprob {top[token]:6.2f}   top: {rivals}")
    assert top[token] == max(top.values())                # greedy takes the most likely token
total = sum(top[t] for t, top in zip(scored.token_ids, scored.logprobs))
print(f"  cumulative_logprob {scored.cumulative_logprob:.3f} = sum of the chosen logprobs {total:.3f}")
assert math.isclose(scored.cumulative_logprob, total, rel_tol=1e-4, abs_tol=1e-4)

print("\n5. Chat: a multi-turn conversation through the model's chat template")
chat_params = SamplingParams(temperature=0.0, max_tokens=24)
messages = [{"role": "user", "content": "What is the capital of France?"}]
for follow_up in ("What language do people speak there?", None):
    reply = llm.chat(messages, chat_params, use_tqdm=False)[0]
    generated += len(reply.outputs[0].token_ids)
    print(f"  user: {messages[-1]['content']}\n  assistant: {reply.outputs[0].text!r} "
          f"(finish_reason={reply.outputs[0].finish_reason})")
    messages.append({"role": "assistant", "content": reply.outputs[0].text})
    if follow_up:
        messages.append({"role": "user", "content": follow_up})
print("  the second prompt, as the model saw it:")
print("    " + reply.prompt.replace("\n", "\n    "))
# The model keeps no memory between calls: the whole conversation is the prompt.
assert all(m["content"].strip() in reply.prompt for m in messages[:-1])

print("\n6. Streaming: LLMEngine.step() with OutputKind.DELTA returns only the new text")
engine = llm.llm_engine
engine.add_request("stream", prompts[1], SamplingParams(temperature=0.0, max_tokens=greedy.max_tokens,
                                                        output_kind=OutputKind.DELTA))
pieces = []
while engine.has_unfinished_requests():
    for out in engine.step():
        pieces.append(out.outputs[0].text)
        generated += len(out.outputs[0].token_ids)
print("  deltas: " + " | ".join(repr(p) for p in pieces))
print(f"  joined == the non-streamed greedy text: {''.join(pieces) == outputs[1].outputs[0].text}")
assert "".join(pieces) == outputs[1].outputs[0].text

print("\n7. get_stats(): the engine's counters")
stats = llm.get_stats()
for key in ("num_steps", "prompt_tokens", "generation_tokens", "kv_blocks_peak", "kv_blocks_total",
            "kv_blocks_used", "num_running", "num_waiting", "num_preemptions"):
    print(f"  {key:18} {stats[key]}")
print(f"  {'ttft_mean':18} {stats['ttft_mean']:.3f} s")
assert stats["generation_tokens"] == generated                # every sampled token is counted
assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
print("\nDone: the same calls as vLLM's offline API, on a paged KV cache you can read.")
print("""
Exercises:
  1. Generate the same prompt with temperature 0.8 and seeds 1, 2 and 1 again. Which outputs
     match, and why does a seed make a sampled request reproducible inside any batch?
  2. Add stop=["."] to the greedy SamplingParams of step 1. What are finish_reason and
     stop_reason now, and is the stop string part of the text?""")
