"""Tutorial 5: many requests, one pool: continuous batching.

Goal: step LLMEngine by hand on SmolLM2-135M-Instruct and watch the scheduler
work: requests of different lengths are admitted (prefill), decode together one
token per step, leave as soon as they finish, and a late arrival joins the
running batch at once. Then measure what that buys over static batching, where
a batch must finish completely before the next one starts.

The OS analogy: the scheduler is the process scheduler and the block manager
the memory manager. Every step is a scheduling tick: each running process (a
request) gets one quantum (one token), a new process can be admitted at any
tick if memory allows, and an exiting process returns its frames (KV blocks) at
once, for the next one to use. What happens when memory runs out is tutorial 8.

Run it:  python tutorials/05_continuous_batching.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import os

from minipaged import LLMEngine, SamplingParams

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

print("\n3. Continuous against static batching: 8 requests, at most 4 running at once")
# Static batching (what a plain model server does): take 4 requests, run them until the LAST one
# finishes, then take the next 4. Finished requests sit in the batch doing nothing. Continuous
# batching refills a slot the step after it frees up.
LENGTHS = [3, 12, 4, 9, 2, 11, 5, 8]          # max_tokens of each request (EOS ignored)
PROMPT = "Write a list of fruits:"
batch_params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]


def occupancy(engine: LLMEngine, groups_of: list[list[int]]) -> tuple[int, list[int], dict]:
    """Run the requests in the given groups (a group starts when the previous one is done);
    return the steps taken, the requests running after each step and the outputs."""
    steps, running, done = 0, [], {}
    for group in groups_of:
        for i in group:
            engine.add_request(f"r{i}", PROMPT, batch_params[i])
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            steps += 1
            running.append(len(engine.scheduler.running))
    return steps, running, done


CONT_MAX_SEQS = 4                              # the continuous engine's max_num_seqs
cont_engine = LLMEngine(MODEL, device="cpu", block_size=8, num_blocks=64, max_num_seqs=CONT_MAX_SEQS)
cont_steps, cont_running, cont_out = occupancy(cont_engine, [list(range(len(LENGTHS)))])
static_engine = LLMEngine(MODEL, device="cpu", block_size=8, num_blocks=64, max_num_seqs=4)
static_steps, _, static_out = occupancy(static_engine, [[0, 1, 2, 3], [4, 5, 6, 7]])
# Under static batching each group occupies 4 slots until its longest member is done.
static_slot_steps = 4 * (max(LENGTHS[:4]) + max(LENGTHS[4:]))
print(f"  output lengths {LENGTHS} = {sum(LENGTHS)} tokens")
print(f"  static batching:     {static_steps} steps; slots held {static_slot_steps} slot-steps for "
      f"{sum(LENGTHS)} tokens ({sum(LENGTHS) / static_slot_steps:.0%} busy)")
print(f"  continuous batching: {cont_steps} steps; running per step {cont_running}")
print(f"  steps: continuous {cont_steps}, static {static_steps}")
assert static_steps == max(LENGTHS[:4]) + max(LENGTHS[4:])   # one prefill step gives each first token
assert max(cont_running) == min(CONT_MAX_SEQS, len(LENGTHS))
if CONT_MAX_SEQS >= 4 and len(set(LENGTHS)) > 1:   # same slots, unequal lengths: refilling wins
    assert cont_steps < static_steps
print(f"  same greedy tokens either way: {cont_out == static_out}")
assert cont_out == static_out and len(cont_out) == len(LENGTHS)
print("\nDone: continuous batching admits work every step and frees memory the moment a request ends.")
print("""
Exercises:
  1. Change LENGTHS to eight equal values. How many steps does each policy take now, and why is
     continuous batching's advantage all about unequal lengths?
  2. Set CONT_MAX_SEQS = 2 (the static batches keep 4). How do the steps and the running list
     change, and can continuous batching with 2 slots still beat static batching with 4?""")
