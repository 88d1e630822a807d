"""Tutorial 3: continuous batching and preemption on the real model.

Goal: step LLMEngine by hand on SmolLM2-135M-Instruct and watch the scheduler
work: requests of different lengths are admitted (prefill), decode together one
token per step, leave as soon as they finish, and a late arrival joins the
running batch at once. Then shrink the KV pool until the engine has to preempt,
and check that preemption by recomputation changes no output token.

The OS analogy: the scheduler is the process scheduler and the block manager
the memory manager. A running process asks for one more page per step; when
memory runs out, the youngest process is killed and restarted later from its
saved state (its tokens): the engine drops its KV blocks and recomputes them.
Here preemption_mode="recompute" asks for exactly that. The engine can also
swap the blocks out to CPU memory and back, as an OS pages a process out; its
default, "auto", swaps long requests and recomputes short ones. Tutorial 5
shows both.

Run it:  python tutorials/03_continuous_batching.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import os

from minipaged import LLMEngine, SamplingParams
from minipaged.block_manager import blocks_for

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
# request id: (prompt, max_tokens). EOS is ignored, so each length is exact.
REQUESTS = {
    "A": ("The capital of France is", 6),
    "B": ("def fibonacci(n):", 10),
    "C": ("Once upon a time, in a small village by the sea, there lived", 5),
    "D": ("The three primary colors are", 7),
}
LATE = "D"          # arrives while the others are already decoding
LATE_STEP = 2


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], list]:
    """Feed REQUESTS to the engine, step it until done; return the token ids and the plans."""
    plans = []
    schedule = engine.scheduler.schedule

    def schedule_and_keep():  # peek at each decision the scheduler makes
        plan = schedule()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = schedule_and_keep
    tokens: dict[str, list[int]] = {}

    def add(rid: str) -> None:
        prompt, max_tokens = REQUESTS[rid]
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       ignore_eos=True))

    for rid in REQUESTS:
        if rid != LATE:
            add(rid)
    step = 0
    while step < LATE_STEP or engine.has_unfinished_requests():
        step += 1
        if step == LATE_STEP:
            add(LATE)
            print(f"  -- request {LATE} arrives --")
        outputs = engine.step()
        plan = plans[-1]
        ran = ", ".join(f"{s.group.request_id}:{'prefill' if s.is_prefill else 'decode'}"
                        f"({s.num_new_tokens})" for s in plan.scheduled)
        sched = engine.scheduler
        line = (f"  step {step:2}  ran [{ran}]  running {[g.request_id for g in sched.running]}"
                f"  waiting {[g.request_id for g in sched.waiting]}"
                f"  KV blocks {engine.get_stats()['kv_blocks_used']}/{engine.block_manager.num_blocks}")
        if plan.preempted:
            line += f"  PREEMPTED {[g.request_id for g in plan.preempted]}"
        print(line)
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
                print(f"           {out.request_id} finished: {out.outputs[0].text!r}")
        engine.block_manager.check_invariants()
    engine.scheduler.schedule = schedule
    return tokens, plans


engine = LLMEngine(MODEL, device="cpu", block_size=8, num_blocks=64)
print(f"1. An engine with plenty of KV memory ({MODEL}, block_size {engine.block_manager.block_size}, "
      f"{engine.block_manager.num_blocks} blocks)")
prompt_len = {rid: len(engine.tokenize(p).token_ids) for rid, (p, _) in REQUESTS.items()}
for rid, (prompt, max_tokens) in REQUESTS.items():
    print(f"  request {rid}: {prompt_len[rid]:2} prompt tokens, {max_tokens} new tokens"
          + (f" (arrives at step {LATE_STEP})" if rid == LATE else ""))

print("\n2. Step by step: who runs, who waits, how many KV blocks are in use")
big_tokens, plans = run(engine)
stats = engine.get_stats()
# Continuous batching: one step mixes a newcomer's prefill with the others' decodes.
mixed = [i + 1 for i, p in enumerate(plans)
         if any(s.is_prefill for s in p.scheduled) and any(not s.is_prefill for s in p.scheduled)]
print(f"  steps mixing a prefill with decodes: {mixed}")
print(f"  {stats['num_steps']} steps, peak {stats['kv_blocks_peak']} blocks, "
      f"{stats['kv_blocks_used']} in use at the end, {stats['num_preemptions']} preemptions")
assert mixed and stats["num_preemptions"] == 0 and stats["kv_blocks_used"] == 0
assert all(len(big_tokens[rid]) == n for rid, (_, n) in REQUESTS.items())
# Each step decodes every running request at once: far fewer steps than generated tokens.
assert stats["num_steps"] < sum(n for _, n in REQUESTS.values())

TINY_BLOCK = 4
print(f"\n3. A tiny pool: block_size {TINY_BLOCK}, just enough blocks for the first three prompts, "
      "preemption_mode='recompute'")
# The pool is full right after the first prefills. Each request then writes at
# least 4 more positions (max_tokens >= 5; the last sampled token is never
# written), and 4 consecutive positions always start a new block of 4, so
# someone asks for a block before anyone has finished and freed one.
assert min(n for _, n in REQUESTS.values()) >= TINY_BLOCK + 1
tiny_blocks = sum(blocks_for(prompt_len[rid], TINY_BLOCK) for rid in REQUESTS if rid != LATE)
tiny = LLMEngine(MODEL, device="cpu", block_size=TINY_BLOCK, num_blocks=tiny_blocks,
                 preemption_mode="recompute")  # drop a victim's blocks, never swap them
print(f"  {tiny_blocks} blocks = {tiny_blocks * TINY_BLOCK} token slots; the longest request alone needs "
      f"{max(prompt_len[rid] + n - 1 for rid, (_, n) in REQUESTS.items())}, all four together "
      f"{sum(prompt_len[rid] + n - 1 for rid, (_, n) in REQUESTS.items())}")
small_tokens, tiny_plans = run(tiny)
tiny_stats = tiny.get_stats()
print(f"  {tiny_stats['num_steps']} steps, {tiny_stats['num_preemptions']} preemptions, "
      f"peak {tiny_stats['kv_blocks_peak']}/{tiny_blocks} blocks")
assert tiny_stats["num_preemptions_recompute"] == tiny_stats["num_preemptions"] > 0
assert tiny_stats["blocks_swapped_out"] == 0 and tiny_stats["kv_blocks_used"] == 0
# Admission is strict first-come-first-served: a request that does not fit blocks those behind it.
first_run = {}
for i, p in enumerate(tiny_plans, start=1):
    for s in p.scheduled:
        first_run.setdefault(s.group.request_id, i)
waited = {rid: first_run[rid] - (LATE_STEP if rid == LATE else 1) for rid in REQUESTS}
print(f"  steps each request waited before its first prefill: {waited}")
assert any(waited.values())

print("\n4. What recomputation costs: a preempted request prefills its prompt AND its output again")
redo = [(s.group.request_id, s.num_new_tokens) for p in tiny_plans for s in p.scheduled
        if s.is_prefill and s.num_new_tokens > prompt_len[s.group.request_id]]
for rid, n in redo:
    print(f"  {rid} re-prefilled {n} tokens: {prompt_len[rid]} prompt + {n - prompt_len[rid]} generated")
assert redo
victims = [g.request_id for p in tiny_plans for g in p.preempted]
for rid in sorted(set(victims)):
    print(f"  {rid} was preempted {victims.count(rid)} time(s)")
if max(victims.count(rid) for rid in victims) > 1:
    # Admission keeps only `watermark_blocks` free for the running requests to grow into.
    print(f"  admission kept {tiny.block_manager.watermark_blocks} of {tiny_blocks} blocks in reserve, "
          "so a request re-admitted into a full pool can be evicted again at once")
assert len(victims) == tiny_stats["num_preemptions"]

print("\n5. Same greedy tokens, big pool or tiny pool")
for rid in REQUESTS:
    same = big_tokens[rid] == small_tokens[rid]
    print(f"  {rid}: {tiny.tokenizer.decode(small_tokens[rid])!r:45} identical: {same}")
    assert same, (rid, big_tokens[rid], small_tokens[rid])
print("\nDone: continuous batching admits work every step; preemption trades compute for memory.")
