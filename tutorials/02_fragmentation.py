"""Tutorial 2: the three fragmentations of contiguous allocation, measured.

Goal: before PagedAttention, a serving system gave every request one contiguous
stretch of KV memory, big enough for the longest it could ever become, set
aside when the request was admitted. Here the same six requests run on
SmolLM2-135M-Instruct under the same KV budget (24 blocks of 4 token slots)
three times: with minipaged's contiguous baseline allocator reserving
max_model_len per request, with it reserving prompt + max_tokens, and with the
paged allocator. The engine classifies every slot of its pool at the start of
each step (after scheduling, before the model runs), and we draw the pool to see
where the memory goes:

  used       the slot holds a token's K and V;
  reserved   empty now, but its request will write it before it ends;
  internal   held by a request that will never write it (internal fragmentation);
  external   free, yet the request waiting at the head of the queue cannot use
             it, because no free run of blocks is long enough (external
             fragmentation).

utilization = used / allocated: the share of the memory handed out that holds
K/V. Paging hands out one block at a time, when the last one is full, so the
only empty slots it holds are at the tail of each sequence's last block.

The OS analogy: the contiguous allocator is memory management without virtual
memory. A process is loaded into one partition; fixed, equal partitions waste
what the process does not fill (internal fragmentation), and variable-size
partitions leave holes between them that together would fit a new process but
one by one are too small (external fragmentation). Paging cuts memory into
frames and maps a process's pages to any free frames: external fragmentation
disappears and internal fragmentation shrinks to part of one page per process.

The trace sets ignore_eos, so every request runs to exactly max_tokens and the
schedule, hence every number printed, does not depend on what the model says.

Run it:  python tutorials/02_fragmentation.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Raise MAX_MODEL_LEN to 96 without touching the trace or the pool. How many requests
     does each allocator run at once now, and which of them did not care at all?
  2. A request may end long before max_tokens (at its end-of-sequence token). Emulate it: in the
     "prompt + max_tokens" run, call engine.abort_request("D") once D has 12 output tokens
     (in run()'s loop, after engine.step(): D's group in engine.scheduler.running counts them
     in seqs[0].num_output_tokens). How many slots of D's run were never written? Did any
     step of engine.kv_history count them as internal, and why can no allocator know them
     in advance?
"""

import os

from minipaged import LLMEngine, SamplingParams
from minipaged.memory.block_manager import blocks_for

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK_SIZE = 4
NUM_BLOCKS = 24            # the KV budget: 96 token slots, the same for every allocator
MAX_MODEL_LEN = 48
# request id: (prompt tokens, max_tokens), in order of arrival; all arrive at once.
TRACE = {"C": (9, 5), "B": (7, 24), "A": (11, 13), "D": (6, 33), "E": (13, 10), "F": (5, 18)}
SNAP_STEP = 3              # when we look at the pool of each allocator
ALLOCATORS = {
    "contiguous, reserve max_model_len": dict(kv_allocator="contiguous", contiguous_reserve="max_model_len"),
    "contiguous, reserve prompt + max_tokens": dict(kv_allocator="contiguous", contiguous_reserve="max_tokens"),
    "paged": dict(kv_allocator="paged"),
}
TEXT = ("Rain had fallen on the old market all night, and in the morning the stalls opened late. "
        "The baker sold warm bread to the first few customers while the fishmonger argued with a gull. ")


def horizon(prompt_len: int, max_tokens: int) -> int:
    """Slots a request will ever fill: everything but its last sampled token, which is never cached."""
    return max(prompt_len, min(prompt_len + max_tokens, MAX_MODEL_LEN) - 1)


def classify(engine: LLMEngine) -> tuple[list[str], dict[str, dict[str, int]]]:
    """One character per slot of the pool, and per request its used / reserved / internal slots.

    A running request's blocks are its page table followed by the part of its reservation it
    has not reached yet (empty for paging). Slot j of its i-th block is position i*B + j.
    """
    bm = engine.block_manager
    cells = ["." * BLOCK_SIZE for _ in range(bm.num_blocks)]
    per_request = {}
    for group in engine.scheduler.running:
        seq = group.seqs[0]
        rid = group.request_id
        end = horizon(seq.num_prompt_tokens, group.sampling_params.max_tokens)
        counts = {"used": 0, "reserved": 0, "internal": 0}
        for i, block in enumerate(bm.block_table(seq) + bm.reserved_blocks(seq)):
            row = ""
            for j in range(BLOCK_SIZE):
                pos = i * BLOCK_SIZE + j
                kind = "used" if pos < seq.num_computed_tokens else "reserved" if pos < end else "internal"
                counts[kind] += 1
                row += {"used": rid.upper(), "reserved": rid.lower(), "internal": "-"}[kind]
            cells[block] = row
        per_request[rid] = counts
    return cells, per_request


def draw(engine: LLMEngine, indent: str = "    ") -> dict[str, dict[str, int]]:
    """Print the pool, 12 blocks a line, and check our tally against the engine's own."""
    cells, per_request = classify(engine)
    for first in range(0, len(cells), 12):
        last = min(first + 12, len(cells)) - 1
        print(f"{indent}blocks {first:2}-{last:2}  " + " ".join(cells[first:last + 1]))
    slots = engine.get_stats()["kv_slots"]
    for kind in ("used", "reserved", "internal"):
        assert sum(c[kind] for c in per_request.values()) == slots[kind], (kind, slots)
    assert engine.block_manager.num_free_blocks * BLOCK_SIZE == slots["free"]
    return per_request


def free_runs(engine: LLMEngine) -> list[tuple[int, int]]:
    """(first block, length) of every run of consecutive free blocks."""
    runs, start = [], None
    counts = engine.block_manager.allocator.ref_counts
    for block in range(len(counts) + 1):
        free = block < len(counts) and counts[block] == 0
        if free and start is None:
            start = block
        if not free and start is not None:
            runs.append((start, block - start))
            start = None
    return runs


def run(label: str, kwargs: dict) -> tuple[LLMEngine, dict]:
    """Feed TRACE to a fresh engine and step it to the end; keep what the lessons need."""
    engine = LLMEngine(MODEL, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                       max_model_len=MAX_MODEL_LEN, track_fragmentation=True, **kwargs)
    ids = engine.tokenize(TEXT).token_ids
    longest = len(TRACE) + max(prompt_len for prompt_len, _ in TRACE.values())
    ids = ids * (longest // len(ids) + 1)         # long enough for every prompt, whatever the tokenizer
    for offset, (rid, (prompt_len, max_tokens)) in enumerate(TRACE.items()):
        engine.add_request(rid, ids[offset:offset + prompt_len],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    seen = {"tokens": {}, "external": None, "tails": []}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                seen["tokens"][out.request_id] = out.outputs[0].token_ids
        running = [g.request_id for g in engine.scheduler.running]
        waiting = [g.request_id for g in engine.scheduler.waiting]
        if step == SNAP_STEP:
            print(f"\n  {label}, after step {step}: running {running}, waiting {waiting}")
            seen["snapshot"] = draw(engine)
            slots = engine.get_stats()["kv_slots"]
            print(f"    slots: {slots['used']} used, {slots['reserved']} reserved, {slots['internal']} internal, "
                  f"{slots['free']} free of {NUM_BLOCKS * BLOCK_SIZE}; utilization {slots['utilization']:.0%}")
        slots = engine.get_stats()["kv_slots"]
        if slots["external"] and seen["external"] is None:   # the first time a free slot is stranded
            seen["external"] = (step, running, waiting, classify(engine)[0], free_runs(engine), slots)
        bm = engine.block_manager
        if engine.kv_allocator == "paged":   # its empty slots: those after the last token of each table
            seen["tails"] += [len(bm.block_table(g.seqs[0])) * BLOCK_SIZE - g.seqs[0].num_computed_tokens
                              for g in engine.scheduler.running]
        bm.check_invariants()
    seen["stats"] = engine.get_stats()
    return engine, seen


print(f"1. One trace, one budget ({MODEL}): {NUM_BLOCKS} blocks x {BLOCK_SIZE} slots = "
      f"{NUM_BLOCKS * BLOCK_SIZE} KV slots, max_model_len {MAX_MODEL_LEN}")
for rid, (prompt_len, max_tokens) in TRACE.items():
    end = horizon(prompt_len, max_tokens)
    print(f"  {rid}: prompt {prompt_len:2}, max_tokens {max_tokens:2} -> at most {end:2} cached tokens "
          f"= {blocks_for(end, BLOCK_SIZE):2} blocks")
need = sum(blocks_for(horizon(*r), BLOCK_SIZE) for r in TRACE.values())
print(f"  all {len(TRACE)} at their longest would need {need} blocks: more than the pool, so they must take turns")
assert need > NUM_BLOCKS and all(blocks_for(horizon(*r), BLOCK_SIZE) <= NUM_BLOCKS for r in TRACE.values())

print(f"\n2. The pool after step {SNAP_STEP}, three ways. Legend: the request's letter in capitals = "
      "slot holds K/V (used),\n   lower case = reserved (will be written), '-' = internal fragmentation "
      "(held, never written), '.' = free")
results = {label: run(label, kwargs) for label, kwargs in ALLOCATORS.items()}
MML, MAXTOK, PAGED = ALLOCATORS
run_len = MAX_MODEL_LEN // BLOCK_SIZE

print(f"\n3. Reserving max_model_len: every request takes {run_len} blocks, whatever it needs")
snap = results[MML][1]["snapshot"]
for rid, counts in snap.items():
    print(f"  {rid}: {counts['used']:2} used, {counts['reserved']:2} reserved, {counts['internal']:2} internal "
          f"of its {sum(counts.values())} slots")
assert all(sum(c.values()) == MAX_MODEL_LEN for c in snap.values())
assert all(c["internal"] == MAX_MODEL_LEN - horizon(*TRACE[rid]) for rid, c in snap.items())
mml_stats = results[MML][1]["stats"]
print(f"  so only {NUM_BLOCKS // run_len} requests ever run at once; equal runs always fit each other's "
      f"holes: external fragmentation {mml_stats['fragmentation']['external_fraction_of_pool']:.0%}")
assert mml_stats["max_concurrent_requests"] == NUM_BLOCKS // run_len
assert mml_stats["fragmentation"]["external_fraction_of_pool"] == 0

print("\n4. Reserving prompt + max_tokens: no over-sized runs, but runs of different sizes leave holes")
step, running, waiting, cells, runs, slots = results[MAXTOK][1]["external"]
head = waiting[0]
head_blocks = blocks_for(horizon(*TRACE[head]), BLOCK_SIZE)
free_blocks = sum(length for _, length in runs)
print(f"  after step {step}: running {running}, waiting {waiting}")
for first in range(0, NUM_BLOCKS, 12):
    print(f"    blocks {first:2}-{first + 11:2}  " + " ".join(cells[first:first + 12]))
print(f"  {head} needs {head_blocks} contiguous blocks; {free_blocks} blocks are free, in runs of "
      + ", ".join(f"{length} (blocks {start}-{start + length - 1})" for start, length in runs))
print(f"  so {slots['external']} free slots are stranded (external fragmentation) and {head} waits")
assert free_blocks >= head_blocks > max(length for _, length in runs)
assert slots["external"] == slots["free"] == free_blocks * BLOCK_SIZE
maxtok_snap = results[MAXTOK][1]["snapshot"]
assert all(c["internal"] == blocks_for(horizon(*TRACE[r]), BLOCK_SIZE) * BLOCK_SIZE - horizon(*TRACE[r])
           for r, c in maxtok_snap.items())   # only the rounding up to whole blocks is never used

print("\n5. Paging: nothing is set aside; each sequence holds whole blocks up to its last token")
tails = results[PAGED][1]["tails"]
paged_stats = results[PAGED][1]["stats"]
print(f"  after every step, the empty slots a sequence holds: at most {max(tails)} (block_size {BLOCK_SIZE}), "
      f"{sum(tails) / len(tails):.2f} on average")
assert max(tails) < BLOCK_SIZE
history = results[PAGED][0].kv_history
assert all(h.internal <= (BLOCK_SIZE - 1) * h.running_requests for h in history)
print(f"  all {paged_stats['max_concurrent_requests']} requests ran at once, with "
      f"{paged_stats['num_preemptions']} preemptions")
assert paged_stats["max_concurrent_requests"] == len(TRACE) and paged_stats["num_preemptions"] == 0

print("\n6. The whole run, averaged over steps (utilization = used / allocated, at the start of each step)")
print(f"  {'allocator':40} {'steps':>5} {'at once':>7} {'util.':>6} {'reserved':>8} {'internal':>8} "
      f"{'external*':>9}")
summary = {}
for label, (engine, seen) in results.items():
    stats = seen["stats"]
    f = stats["fragmentation"]
    summary[label] = (stats["num_steps"], stats["max_concurrent_requests"], f["utilization"])
    print(f"  {label:40} {stats['num_steps']:5} {stats['max_concurrent_requests']:7} {f['utilization']:6.1%} "
          f"{f['reserved_fraction_of_allocated']:8.1%} {f['internal_fraction_of_allocated']:8.1%} "
          f"{f['external_fraction_of_pool']:9.1%}")
print("  (reserved and internal: share of the allocated slots; *external: share of the whole pool)")
print("  paging's 'reserved' is the slots a step is about to write, counted before it writes them")
steps = {label: s[0] for label, s in summary.items()}
util = {label: s[2] for label, s in summary.items()}
assert util[PAGED] > util[MAXTOK] > util[MML]
assert steps[PAGED] < steps[MAXTOK] < steps[MML]
print(f"  paging finished the trace in {steps[PAGED]} steps, against {steps[MAXTOK]} and {steps[MML]}")

print("\n7. Same greedy tokens from every allocator: where K/V live changes nothing in the math")
tokens = {label: seen["tokens"] for label, (_, seen) in results.items()}
finished = set(TRACE).intersection(*tokens.values())   # a request aborted in some run has no output
same = all(tokens[label][rid] == tokens[PAGED][rid] for label in tokens for rid in finished)
print(f"  identical outputs for all {len(finished)} requests: {same}")
if finished != set(TRACE):
    print(f"  (not compared: {sorted(set(TRACE) - finished)}, aborted before the end in some run)")
assert same and set(tokens[PAGED]) == set(TRACE)
print("\nDone: reservation, internal and external fragmentation are what contiguous allocation costs; "
      "paging keeps only the tail of each last block.")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
