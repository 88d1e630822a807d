"""Tutorial 17: demand paging, or swapping out only the blocks a step lacks.

Goal: when the pool runs out, take back only what is needed. Full swapping (tutorial 8) pages a
victim out whole, every block, and brings every block back before it runs again, even when the
step that ran short needed one block. An operating system pages at the granularity of a page:
each page-table entry has a present bit, and a process can have part of its memory on disk.
``preemption_mode="partial"`` gives the block table the same bit. We:

1. run three requests in a pool too small for them, with partial preemption, and catch the
   first step that pages a victim out: its block table with its present bits (which entries
   moved to the CPU pool), and how many blocks the step lacked;
2. catch the step that pages it back in: only the missing entries are copied, and their K/V
   come back bit for bit;
3. run the same requests with full swapping and compare the blocks moved and the tokens.

The OS analogy: demand paging. A page-table entry is present or not; a process whose pages
are all present runs; one missing pages waits for them (here the whole sequence waits, since
attention reads every block of its context on every step, so its working set is all of it).
The scheduler resumes it only with a little headroom, so that bringing it back does not force
the next step to page it out again: the OS's defence against thrashing.

Run it:  python tutorials/17_demand_paging.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Give the pool 8 more blocks. How many partial preemptions remain, and how many blocks
     move?
  2. Why does a partly resident request give up its blocks before a running one is preempted?
     What would happen to the earliest request if it did not?
"""

import os

from minipaged import LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK = 4
PROMPTS = {"A": "The history of paging in operating systems begins with the Atlas computer, which",
           "B": "A block table maps each logical block of a sequence to a physical block, so that",
           "C": "When memory runs short, the operating system chooses a victim and"}
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def entries(table) -> str:
    """A block table's entries: a device block as its number, a paged-out one as cN (CPU block N)."""
    return " ".join(str(b) if present else f"c{b}" for b, present in zip(table.block_ids, table.present))


def run(mode: str, verbose: bool):
    engine = LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=28, swap_space=0.02,
                       preemption_mode=mode, log_stats_interval=0)
    bm, cache = engine.block_manager, engine.cache
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, PARAMS)
    schedule, seen = engine.scheduler.schedule, {"out": False, "in": False}
    saved = {}   # CPU block -> the K/V of the device block it copied, read just before the copy

    def schedule_and_look():   # the plan, before the engine copies a block or runs the model
        plan = schedule()
        if plan.blocks_to_swap_out:
            for device, cpu in plan.blocks_to_swap_out:
                saved[cpu] = cache.kv_cache[:, :, device].copy()
            if verbose and not seen["out"]:
                seen["out"] = True
                group = plan.preempted[-1] if plan.preempted else engine.scheduler.swapped[-1]
                seen["victim"] = group
                table = bm.tables[group.seqs[0].seq_id]
                print(f"  step {engine.metrics.num_steps + 1}: the pool is full; {group.request_id} (the latest "
                      f"arrival) gives up {len(plan.blocks_to_swap_out)} block(s): {plan.blocks_to_swap_out} "
                      "(device, CPU)")
                print(f"    {group.request_id}'s table now: {entries(table)}  (present bits "
                      f"{''.join('1' if p else '0' for p in table.present)})")
                print(f"    {table.num_present} of its {len(table)} blocks stay resident; it waits in the swapped queue")
        if plan.blocks_to_swap_in:
            same = all(np.array_equal(cache.cpu_cache[:, :, cpu], saved[cpu]) for cpu, _ in plan.blocks_to_swap_in)
            assert same, "a block changed in the swap pool"
            victim = seen.get("victim")
            if verbose and not seen["in"] and victim is not None and bm.is_resident(victim.seqs[0]):
                seen["in"] = True
                print(f"  step {engine.metrics.num_steps + 1}: room again; only the missing entries come back: "
                      f"{plan.blocks_to_swap_in} (CPU, device), their K/V bit for bit")
        return plan

    engine.scheduler.schedule = schedule_and_look
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if verbose and seen["in"] is True:
            seen["in"] = "shown"
            victim = seen["victim"]
            table = bm.tables[victim.seqs[0].seq_id]
            print(f"    {victim.request_id}'s table after: {entries(table)}  (every entry present: it runs again)")
    bm.check_invariants()
    return outputs, engine.get_stats()


print("1-2. Partial preemption, step by step")
partial, stats_partial = run("partial", verbose=True)
print(f"  whole run: {stats_partial['num_preemptions']} preemptions, {stats_partial['blocks_swapped_out']} blocks "
      f"out, {stats_partial['blocks_swapped_in']} in")

print("\n3. Against full swapping, same requests, same pool")
full, stats_full = run("swap", verbose=False)
for label, stats in (("swap", stats_full), ("partial", stats_partial)):
    print(f"  {label:>8}: {stats['num_preemptions']:>2} preemptions, {stats['blocks_swapped_out']:>3} blocks out, "
          f"{stats['blocks_swapped_in']:>3} in ({stats['bytes_swapped_out'] / 2**20:.1f} MiB out)")
assert partial == full, "demand paging changed a token"
assert stats_partial["blocks_swapped_out"] == stats_partial["blocks_swapped_in"] > 0
print(f"  the same tokens: {partial == full}")

print("""
Done: a present bit per table entry lets a request keep most of its blocks while it waits,
and only what a step lacks moves, out and back.
Exercises:
  1. Give the pool 8 more blocks. How many partial preemptions remain, and how many blocks
     move?
  2. Why does a partly resident request give up its blocks before a running one is preempted?
     What would happen to the earliest request if it did not?""")
