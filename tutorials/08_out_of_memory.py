"""Tutorial 8: running out of memory: FCFS, preemption, swap against recompute.

Goal: give the engine a KV pool too small for its requests and watch what it
does. Admission is first come, first served; when a running request needs a
block and none is free, the request that arrived LAST is preempted. Its blocks
are either dropped and recomputed later from its tokens (preemption_mode=
"recompute"), or paged out to a swap pool in CPU memory and back in, bit for
bit ("swap"); "auto", the default, picks per request. Every variant produces
the same greedy tokens as a pool big enough never to preempt, and get_stats()
says what each one cost.

The OS analogy: swapping is paging a whole process out to the swap partition;
recomputation is killing it and re-running it from its input. An OS must swap,
but an engine can re-run a request from its tokens, which for a short one costs
less than copying its pages. FCFS with "youngest out first" keeps the oldest
requests moving, so none of them starves.

Run it:  python tutorials/08_out_of_memory.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import os

from minipaged import LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np
from minipaged.memory.block_manager import blocks_for
from minipaged.scheduler.scheduler import AUTO_RECOMPUTE_MAX_TOKENS
from minipaged.sequence import SequenceStatus

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
LONG = ("Paging lets an operating system run more processes than fit in its memory: when memory "
        "runs out, the pages of a process that is waiting are written to a swap file on disk, and "
        "read back in when it runs again, and the process never notices. Explain in one short "
        "sentence why this works so well:")
# request id: (prompt, max_tokens). EOS is ignored, so each length is exact.
REQUESTS = {"A": ("The capital of France is", 6), "B": (LONG, 6), "C": ("def fibonacci(n):", 6)}
BLOCK, SWAP_GIB = 8, 0.01


def kv_at(cache, table: list[int], n: int) -> np.ndarray:
    """K/V of positions 0..n-1 read through a block table: (n, layers, 2, kv_heads, head_dim)."""
    pos = np.arange(n)
    return cache[:, :, np.asarray(table)[pos // BLOCK], :, pos % BLOCK, :]


def work(plan, stars: bool = False) -> str:
    """What a step computed, request:tokens (* where the next token was then sampled)."""
    return " ".join(f"{x.group.request_id}:{x.num_new_tokens}{'*' * (stars and x.do_sample)}"
                    for x in plan.scheduled)


def run(engine: LLMEngine, requests: dict, arrive_at: dict | None = None):
    """Step until idle; return ({rid: token ids}, one record per step). Checks the bits of every swap."""
    arrive_at, bm, cache, steps = arrive_at or {}, engine.block_manager, engine.cache, []
    saved = {}  # rid -> (its cached tokens, their K/V read on the device just before swap-out)
    schedule = engine.scheduler.schedule

    def schedule_and_look():  # sees the plan before the engine copies a block or runs the model
        plan = schedule()
        rec = {"plan": plan, "preempted": [], "swapped_in": {}, "verified": []}
        to_device = {cpu: dev for dev, cpu in plan.blocks_to_swap_out}
        for g in plan.preempted:
            seq = g.seqs[0]
            how = "swap" if seq.status is SequenceStatus.SWAPPED else "recompute"
            rec["preempted"].append((g.request_id, how, seq.num_tokens))
            if how == "swap":  # its table points at CPU blocks now; the data is still on the device
                n, old_table = seq.num_computed_tokens, [to_device[b] for b in bm.block_table(seq)]
                saved[g.request_id] = (n, kv_at(cache.kv_cache, old_table, n))
        for rid in saved:
            if engine.groups[rid].seqs[0].status is SequenceStatus.RUNNING:  # swapped in by this plan
                rec["swapped_in"][rid] = list(bm.block_table(engine.groups[rid].seqs[0]))
        steps.append(rec)
        return plan

    engine.scheduler.schedule = schedule_and_look
    tokens, step = {}, 0
    while step < max(arrive_at.values(), default=1) or engine.has_unfinished_requests():
        step += 1
        for rid, (prompt, n) in requests.items():
            if arrive_at.get(rid, 1) == step:
                engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                               ignore_eos=True))
        outputs, rec = engine.step(), steps[-1]
        rec.update(sampled=[o.request_id for o in outputs], stats=engine.get_stats(), queues={
            q: [g.request_id for g in getattr(engine.scheduler, q)] for q in ("running", "waiting", "swapped")})
        for rid, how, _ in rec["preempted"]:  # after swap-out, the CPU pool holds those very bits
            if how == "swap":
                seq, (n, kv) = engine.groups[rid].seqs[0], saved[rid]
                assert np.array_equal(kv_at(cache.cpu_cache, bm.block_table(seq), n), kv)
        for rid, table in rec["swapped_in"].items():  # after swap-in, new device blocks (the step wrote only n)
            n, kv = saved.pop(rid)
            rec["verified"].append((rid, n, np.array_equal(kv_at(cache.kv_cache, table, n), kv)))
        tokens.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
        bm.check_invariants()
    engine.scheduler.schedule = schedule
    return tokens, steps


big = LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=64)
prompt_len = {rid: len(big.tokenize(p).token_ids) for rid, (p, _) in REQUESTS.items()}
expected, _ = run(big, REQUESTS)  # the reference: this pool never preempts
tiny_blocks = sum(blocks_for(prompt_len[rid], BLOCK) for rid in REQUESTS)
print(f"1. FCFS and preemption by recomputation ({MODEL}): prompts of {prompt_len} tokens, "
      f"block_size {BLOCK}, {tiny_blocks} device blocks (just the prompts)")
recompute = LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=tiny_blocks,
                      preemption_mode="recompute")  # drop a victim's blocks, never swap them
results = {"recompute": run(recompute, REQUESTS)}
arrival = list(REQUESTS)
for i, rec in enumerate(results["recompute"][1], start=1):
    plan, s = rec["plan"], rec["stats"]
    queues = "  ".join(f"{q} {' '.join(ids) or '-':5}" for q, ids in rec["queues"].items() if q != "swapped")
    print(f"  step {i:2}  ran {work(plan):12} {queues} blocks {s['kv_blocks_used']:2}/{s['kv_blocks_total']}"
          + "".join(f"  PREEMPTED {rid} ({held} tokens dropped)" for rid, _, held in rec["preempted"]))
    for rid, _, _ in rec["preempted"]:  # the victim arrived after every request still running
        assert all(arrival.index(rid) > arrival.index(r) for r in rec["queues"]["running"]), (rid, rec["queues"])
redo = [(x.group.request_id, x.num_new_tokens) for rec in results["recompute"][1] for x in rec["plan"].scheduled
        if x.is_prefill and x.num_new_tokens > prompt_len[x.group.request_id]]
for rid, n in redo:
    print(f"  {rid} came back and re-prefilled {n} tokens: its {prompt_len[rid]} prompt tokens + "
          f"{n - prompt_len[rid]} it had generated")
assert redo and recompute.get_stats()["num_preemptions_recompute"] > 0

print("\n2. Swapping: the same pool, preemption_mode='swap'")
swap = LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=tiny_blocks, swap_space=SWAP_GIB,
                 preemption_mode="swap")
c, bpb, item = swap.model_config, swap.cache.bytes_per_block, swap.cache.kv_cache.dtype.itemsize
print(f"  a block: {BLOCK} tokens x {c.num_hidden_layers} layers x K,V x {c.num_key_value_heads} kv heads x "
      f"{c.head_dim} x {item} bytes = {bpb} bytes; swap_space {SWAP_GIB} GiB = "
      f"{swap.cache.num_cpu_blocks} CPU blocks")
assert bpb == BLOCK * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * item
results["swap"] = run(swap, REQUESTS)
for i, rec in enumerate(results["swap"][1], start=1):
    plan, s = rec["plan"], rec["stats"]
    queues = "  ".join(f"{q} {' '.join(ids) or '-':5}" for q, ids in rec["queues"].items())
    print(f"  step {i:2}  ran {work(plan):12} {queues} device {s['kv_blocks_used']:2}/{s['kv_blocks_total']}"
          f"  cpu {s['cpu_kv_blocks_used']:2}/{s['cpu_kv_blocks_total']}"
          + (f"  out {plan.blocks_to_swap_out}" if plan.blocks_to_swap_out else "")
          + (f"  in {plan.blocks_to_swap_in}" if plan.blocks_to_swap_in else ""))
    for rid, n, same in rec["verified"]:
        print(f"           {rid} is back: K/V of its {n} cached tokens, read through its new table "
              f"{rec['swapped_in'][rid]}, bit-identical to before swap-out: {same}")
verified = [same for rec in results["swap"][1] for _, _, same in rec["verified"]]
assert verified and all(verified) and swap.get_stats()["num_preemptions_recompute"] == 0

print(f"\n3. preemption_mode='auto': a victim holding <= AUTO_RECOMPUTE_MAX_TOKENS = "
      f"{AUTO_RECOMPUTE_MAX_TOKENS} tokens is recomputed (one short prefill), a longer one swapped")
engines = {"swap": swap, "recompute": recompute}
for mode in ("auto",):
    engines[mode] = LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=tiny_blocks,
                              swap_space=SWAP_GIB, preemption_mode=mode)
    results[mode] = run(engines[mode], REQUESTS)
# (in any mode, a victim the CPU pool cannot hold is recomputed; this swap pool holds them all)
events = [(i, *e) for i, rec in enumerate(results["auto"][1], start=1) for e in rec["preempted"]]
for i, rid, how, held in events:
    rule = "<=" if held <= AUTO_RECOMPUTE_MAX_TOKENS else "> "
    print(f"  step {i:2}: {rid} holds {held:2} tokens, {rule} {AUTO_RECOMPUTE_MAX_TOKENS} -> {how}")
    assert how == ("recompute" if held <= AUTO_RECOMPUTE_MAX_TOKENS else "swap")
assert {how for _, _, how, _ in events} == {"swap", "recompute"}

print("\n4. The same workload three ways: what preemption cost (re-prefilled = prefill beyond the prompts)")
print(f"  {'mode':10} {'steps':>5} {'swaps':>5} {'recomputes':>10} {'re-prefilled':>12} "
      f"{'blocks out/in':>13} {'MiB out/in':>11}")
cost = {}
for mode, engine in engines.items():
    s = engine.get_stats()
    cost[mode] = (s["prompt_tokens"] - sum(prompt_len.values()), s["bytes_swapped_out"])
    print(f"  {mode:10} {s['num_steps']:5} {s['num_preemptions_swap']:5} {s['num_preemptions_recompute']:10} "
          f"{cost[mode][0]:12} {s['blocks_swapped_out']:7}/{s['blocks_swapped_in']:<5} "
          f"{s['bytes_swapped_out'] / 2**20:5.2f}/{s['bytes_swapped_in'] / 2**20:.2f}")
    assert s["bytes_swapped_out"] == s["bytes_swapped_in"] == s["blocks_swapped_out"] * bpb
    assert s["kv_blocks_used"] == s["cpu_kv_blocks_used"] == 0
assert cost["swap"][0] == 0 and cost["recompute"][1] == 0 < cost["recompute"][0]
assert cost["auto"][0] < cost["recompute"][0] and cost["auto"][1] < cost["swap"][1]
for rid in REQUESTS:
    same = all(results[m][0][rid] == expected[rid] for m in engines)
    print(f"  {rid}: {big.tokenizer.decode(expected[rid])!r:38} same in all three as the big pool: {same}")
    assert same, rid

print("\nDone: when memory runs out, the youngest request gives its blocks back; swapping trades")
print("copies for compute, recomputation compute for copies, and no output token changes.")
print("""
Exercises:
  1. What if the swap space cannot hold a victim? Read Scheduler._preempt in
     minipaged/scheduler/scheduler.py and predict what preemption_mode="swap" does then, and which
     get_stats() counters show it; tutorial 12 (step 5) runs exactly that case to check.
  2. Give request A max_tokens=40. Which request is preempted, and how many times? Why is it
     never A, the first to arrive?""")
