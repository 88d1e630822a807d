"""Tutorial 11: choosing a block size, measured from 4 to 64 tokens.

Goal: block_size is the one number every other part of the engine is built
around, and vLLM ships 16. Here the same seeded workload runs on
SmolLM2-135M-Instruct five times, with block_size 4, 8, 16, 32 and 64 and the
same KV budget in token slots, and the engine itself tells us what each size
costs: slots left empty at the end of each sequence's last block (internal
fragmentation), how long the block tables grow, how many requests the budget
holds at once, how much of a shared system prompt the prefix cache can reuse
(it only reuses whole blocks), and how long a step and its paged attention take.
The five engines are stepped in turn, one step each, so background noise on the
machine hits all of them alike; the timings are printed as ratios, never
asserted, because they depend on the machine. Everything else is asserted.

The OS analogy: block_size is the page size. Small pages waste little memory
inside the last page of a process but need big page tables and more lookups
(TLB misses, in hardware); huge pages make tables short and memory walks fast,
but a process that touches one byte of a 2 MiB page still owns all of it, and
two processes can only share a page if all of it is identical.

Run it:  python tutorials/11_choosing_a_block_size.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Double SLOTS. Does block_size 64 now run all eight requests at once? Which columns of the
     table in step 7 change, and which can no amount of memory change?
  2. Set LONG_CONTEXT to 128, then to 4096. How do the attention ratios of step 5 move, and
     from what context length on would you start to care about the block count?
"""

import os
import time

from minipaged import LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np
from minipaged.tools.workloads import make_prompts
from minipaged.memory.block_manager import blocks_for
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.engine.metrics import Metrics

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK_SIZES = (4, 8, 16, 32, 64)
SLOTS = 384                    # the KV budget of every engine, in token slots: SLOTS // block_size blocks
NUM_REQUESTS, SEED = 8, 0      # prompts of 20..60 random token ids, outputs of 3..6 tokens (seeded)
SYSTEM = ("You are a patient tutor for a first course on operating systems. Answer in two plain "
          "sentences at most, and give one example from everyday life, such as a library, a kitchen "
          "or a parking garage. Explain every technical word the first time you use it, and never "
          "assume that the student has read the textbook. If you are not sure of an answer, say so "
          "instead of guessing, and suggest a chapter of a well-known textbook or a trusted website "
          "where the student could read more about it. Keep a friendly tone and do not repeat the "
          "question. Question:")
QUESTIONS = ["Define a page.", "Why do pages have a fixed size?", "How big is a huge page?",
             "What is a page fault?"]   # they differ from their first word on


class TimedOps:
    """The model's kernel namespace, with a stopwatch on paged_attention (the CPU runs it synchronously)."""

    def __init__(self, ops) -> None:
        self.ops, self.seconds = ops, 0.0

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def paged_attention(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.ops.paged_attention(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out


def watch(engine: LLMEngine, record: dict) -> None:
    """After each scheduling decision, note every scheduled sequence's table (blocks, slots mapped)."""
    schedule = engine.scheduler.schedule

    def schedule_and_look():
        plan = schedule()
        bm = engine.block_manager
        for item in plan.scheduled:
            table = bm.tables[item.seq.seq_id]
            empty = len(table) * bm.block_size - table.num_tokens   # slots of its last block not mapped
            assert 0 <= empty <= bm.block_size - 1, empty            # only the last block is ever partly empty
            record["tables"][item.group.request_id] = (len(table), table.num_tokens)
        if plan.scheduled:
            record["widest"] = max(record["widest"], max(len(bm.block_table(s.seq)) for s in plan.scheduled))
        return plan

    engine.scheduler.schedule = schedule_and_look


# ---------------------------------------------------------------- the engines and the workload
engines, records = {}, {}
for size in BLOCK_SIZES:
    # prefix caching is on so that step 6 can use the same engines; the random prompts of
    # steps 2 to 5 never share a block, so it changes nothing there
    engines[size] = LLMEngine(MODEL, device="cpu", block_size=size, num_blocks=SLOTS // size,
                              swap_space=0.05, enable_prefix_caching=True, track_fragmentation=True)
    engines[size].model.ops = TimedOps(engines[size].model.ops)
    records[size] = {"tables": {}, "widest": 0, "step_s": 0.0, "tokens": {}}
    watch(engines[size], records[size])
first = engines[BLOCK_SIZES[0]]
vocab = first.model_config.vocab_size
prompts = make_prompts(NUM_REQUESTS, 20, 60, vocab, SEED)
lengths = [int(n) for n in np.random.default_rng(SEED + 1).integers(3, 7, size=NUM_REQUESTS)]
requests = {f"r{i}": (p, n) for i, (p, n) in enumerate(zip(prompts, lengths))}
# What each request caches at the end: prompt + output - 1 (the last sampled token is never written).
final_len = {rid: len(p) + n - 1 for rid, (p, n) in requests.items()}
print(f"1. One workload, five block sizes ({MODEL}), the same budget of {SLOTS} KV slots each")
print(f"  {NUM_REQUESTS} requests (seed {SEED}): prompt tokens {[len(p) for p, _ in requests.values()]}, "
      f"output tokens {lengths}")
print(f"  tokens each request caches at its end: {list(final_len.values())}")
for size in BLOCK_SIZES:
    bm = engines[size].block_manager
    print(f"  block_size {size:2}: {bm.num_blocks:3} blocks x {size:2} slots = {bm.num_blocks * size} slots, "
          f"{engines[size].cache.bytes_per_block:7} bytes a block, watermark {bm.watermark_blocks} block(s)")
    assert bm.num_blocks * size == SLOTS

# Warm up: load the compiled kernels (serial and threaded) outside the timings, with throwaway
# requests of the same shape but other tokens (so the prefix cache learns nothing), then reset.
for i, warm in enumerate(make_prompts(NUM_REQUESTS, 20, 60, vocab, SEED + 99)):
    first.add_request(f"warm-up {i}", warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
while first.has_unfinished_requests():
    first.step()
first.model.ops.seconds = 0.0
records[BLOCK_SIZES[0]].update(tables={}, widest=0)
first.scheduler.reset_counters()
first.metrics = Metrics()
first.kv_history.clear()

# ---------------------------------------------------------------- run them side by side
for size, engine in engines.items():
    for rid, (prompt, n) in requests.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
while any(e.has_unfinished_requests() for e in engines.values()):
    for size, engine in engines.items():   # one step each, in turn: noise lands on everyone alike
        if engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step()
            records[size]["step_s"] += time.perf_counter() - start
            done = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
            records[size]["tokens"].update(done)
            engine.block_manager.check_invariants()
stats = {size: engines[size].get_stats() for size in BLOCK_SIZES}

print("\n2. Internal fragmentation: the empty slots in each request's last block, at its end")
waste = {}
for size in BLOCK_SIZES:
    tables = records[size]["tables"]
    for rid, (num_blocks, num_tokens) in tables.items():
        assert num_tokens == final_len[rid] and num_blocks == blocks_for(final_len[rid], size)
    waste[size] = [tables[rid][0] * size - tables[rid][1] for rid in requests]
    print(f"  block_size {size:2}: empty slots {waste[size]}  total {sum(waste[size]):3} "
          f"= {sum(waste[size]) / sum(final_len.values()):5.1%} of the tokens; "
          f"step-average utilization {stats[size]['fragmentation']['utilization']:.1%}")
    assert all(0 <= w <= size - 1 for w in waste[size])   # never a whole empty block
    assert waste[size] == [-final_len[rid] % size for rid in requests]
for small, big in zip(BLOCK_SIZES, BLOCK_SIZES[1:]):
    # a block of 2b slots ends where a block of b does, or b slots later: the waste can only grow
    assert all(w_big >= w_small for w_small, w_big in zip(waste[small], waste[big]))
print("  never more than block_size - 1 per sequence, about (block_size - 1) / 2 on average. Utilization"
      "\n  is slots holding K/V over slots in held blocks, averaged over the steps "
      "(get_stats()['fragmentation'])")

print("\n3. Page tables: entries per sequence, and the widest block_tables row attention got")
entries = {}
for size in BLOCK_SIZES:
    entries[size] = [records[size]["tables"][rid][0] for rid in requests]
    widest = records[size]["widest"]
    print(f"  block_size {size:2}: entries per sequence {entries[size]}  (longest {max(entries[size]):2}); "
          f"widest block_tables row {widest:2}")
    assert widest == max(entries[size]) == blocks_for(max(final_len.values()), size)
for small, big in zip(BLOCK_SIZES, BLOCK_SIZES[1:]):
    assert all(e_big <= e_small for e_small, e_big in zip(entries[small], entries[big]))
print(f"  reading the longest context walks {max(entries[4])} blocks at block_size 4 and "
      f"{max(entries[64])} at 64: one table lookup and one jump in memory per block")

print(f"\n4. What the same {SLOTS} slots held at once")
held, need = {}, {}
for size in BLOCK_SIZES:
    s, bm = stats[size], engines[size].block_manager
    need[size] = sum(blocks_for(n, size) for n in final_len.values()) * size   # all final tables side by side
    held[size] = (s["max_concurrent_requests"], s["num_preemptions"])
    print(f"  block_size {size:2}: all {NUM_REQUESTS} final tables side by side need {need[size]:3} slots; "
          f"at most {held[size][0]} requests ran at once, {held[size][1]} preemption(s), "
          f"peak {s['kv_blocks_peak'] * size:3} slots held")
    assert s["kv_blocks_used"] == 0 and s["num_waiting"] == s["num_running"] == 0
    if need[size] <= SLOTS - bm.watermark_blocks * size:   # everyone fits from start to end: nobody waits
        assert held[size] == (NUM_REQUESTS, 0)
squeezed = [size for size in BLOCK_SIZES if held[size] != (NUM_REQUESTS, 0)]
print(f"  block sizes that had to preempt or make requests wait: {squeezed}, those whose final tables"
      f"\n  need more than {SLOTS} slots (it can still go well: short requests finish early and free blocks)")
# Which sizes squeeze follows from whether their final tables fit, not from a fixed list
# (at SLOTS = 384, 16 fits and 64 does not).
assert squeezed == [size for size in BLOCK_SIZES if need[size] > SLOTS]
same = all(records[size]["tokens"] == records[16]["tokens"] for size in BLOCK_SIZES)
if 64 in squeezed and 16 not in squeezed:
    print("  the empty tails are real memory: block_size 64 could not run at once the batch that 16 ran;")
else:
    print(f"  with {SLOTS} slots, 16 and 64 alike {'ran' if 64 not in squeezed else 'could not run'} "
          "the whole batch at once; the empty tails\n  still cost memory (compare the slots each size "
          "needed, above);")
print(f"  the greedy outputs are identical for all five block sizes: {same}")
assert same

print("\n5. Time: a step and its paged attention, per step and as a ratio to block_size 16")
print("  (measured on this machine, interleaved; your numbers will differ, and none is asserted)")
per_step = {size: (records[size]["step_s"] / stats[size]["num_steps"],
                   engines[size].model.ops.seconds / stats[size]["num_steps"]) for size in BLOCK_SIZES}
for size in BLOCK_SIZES:
    step_s, attn_s = per_step[size]
    print(f"  block_size {size:2}: {stats[size]['num_steps']:2} steps, {records[size]['step_s']:5.2f} s in all, "
          f"{step_s * 1e3:6.1f} ms a step (x{step_s / per_step[16][0]:.2f}), "
          f"attention {attn_s * 1e3:6.1f} ms a step (x{attn_s / per_step[16][1]:.2f}), "
          f"{attn_s / step_s:4.0%} of the step")
# Contexts of at most 65 tokens are a few blocks whatever the size: the matrix products of the
# MLP dominate. Longer contexts make the block count matter: time the same kernel on a decode
# batch of LONG_SEQS sequences of LONG_CONTEXT tokens each, blocks shuffled over one layer's pool.
LONG_SEQS, LONG_CONTEXT, REPEATS = 8, 1024, 15
c, ops = first.model_config, first.model.ops.ops
rng = np.random.default_rng(SEED)
query = rng.standard_normal((LONG_SEQS, c.num_attention_heads, c.head_dim), dtype=np.float32)
setups = {}
for size in BLOCK_SIZES:
    per_seq = LONG_CONTEXT // size
    pool = rng.standard_normal(kv_cache_shape(1, LONG_SEQS * per_seq, c.num_key_value_heads, size, c.head_dim),
                               dtype=np.float32)
    tables = rng.permutation(LONG_SEQS * per_seq).astype(np.int32).reshape(LONG_SEQS, per_seq)
    meta = AttentionMetadata(slot_mapping=np.full(LONG_SEQS, -1, np.int64),
                             query_start_loc=np.arange(LONG_SEQS + 1, dtype=np.int32),
                             seq_lens=np.full(LONG_SEQS, LONG_CONTEXT, np.int32), block_tables=tables,
                             max_query_len=1, max_seq_len=LONG_CONTEXT)
    setups[size] = (pool[0, 0], pool[0, 1], ops.plan_step(first.model.weights, meta, pool))   # planned once
kernel_s = {size: [] for size in BLOCK_SIZES}
for _ in range(REPEATS):
    for size, (keys, values, plan) in setups.items():   # round robin again
        start = time.perf_counter()
        ops.paged_attention(query, keys, values, plan, first.model.scale)
        kernel_s[size].append(time.perf_counter() - start)
long_x = {size: float(np.median(kernel_s[size]) / np.median(kernel_s[16])) for size in BLOCK_SIZES}
print(f"  the same kernel, {LONG_SEQS} decodes of {LONG_CONTEXT}-token contexts (median of {REPEATS}): "
      + ", ".join(f"{size}: x{long_x[size]:.2f}" for size in BLOCK_SIZES))
fewer = (f"{' and '.join(map(str, squeezed))} ran more, smaller steps: they could not hold everyone at once."
         if squeezed else "every size held everyone at once.")
print(f"  {fewer} With contexts this"
      "\n  short the weight matrices dominate a step and the block size hardly shows; over a long"
      "\n  context, attention visits every block of it, and the last line shows what each block costs.")
del setups

print(f"\n6. Prefix caching reuses whole blocks only: one system prompt, {len(QUESTIONS)} questions")
hits = {}
one = SamplingParams(temperature=0.0, max_tokens=1)
for size, engine in engines.items():
    ids = [engine.tokenize(f"{SYSTEM} {q}").token_ids for q in QUESTIONS]
    shared = next(i for i, column in enumerate(zip(*ids)) if len(set(column)) > 1)   # common prefix
    before = engine.get_stats()
    # All four arrive together: the first is scheduled first and names its full blocks at once,
    # so the three admitted after it in the same step already find them (each layer writes the
    # step's K/V before it attends, so the blocks are filled by the time they are read).
    for i, prompt in enumerate(ids):
        engine.add_request(f"q{i}", {"prompt_token_ids": prompt}, one)
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.get_stats()
    found = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    asked = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits[size] = found // (len(QUESTIONS) - 1)
    print(f"  block_size {size:2}: {shared} shared tokens; each later request found {hits[size]:3} "
          f"= {hits[size] // size:2} x {size:2} in the cache and computed {shared - hits[size]:2} again; "
          f"hit rate {found / asked:.0%}")
    assert found % size == 0 and found == (len(QUESTIONS) - 1) * (shared // size) * size
for small, big in zip(BLOCK_SIZES, BLOCK_SIZES[1:]):
    assert hits[big] <= hits[small]
assert hits[64] <= hits[16]
print("  the block that holds the end of the shared prompt also holds the start of the question,"
      "\n  so it is never shared: up to block_size - 1 shared tokens are computed again")

print("\n7. Why 16 is the usual default")
share_16 = sum(waste[16]) / sum(final_len.values())
print(f"  {'block':>5} {'empty slots':>11} {'longest table':>13} {'ran at once':>11} {'prefix reused':>13} "
      f"{f'attention x ({LONG_CONTEXT} ctx)':>22}")
for size in BLOCK_SIZES:
    print(f"  {size:5} {sum(waste[size]):11} {max(entries[size]):13} {held[size][0]:11} "
          f"{hits[size]:9}/{shared:<3} {long_x[size]:22.2f}")
print(f"""  - Small blocks (4, 8) waste almost nothing, but the page tables are long ({max(entries[4])} entries
    against {max(entries[16])} at 16) and attention stops for a table lookup every few tokens. On a GPU it
    should be worse (expected from the kernel's design, not measured: the CUDA kernels have not
    yet run on a GPU): warps take whole blocks in turn (kernels/paged_attention.cu), and a
    4-token block is likely too little work between two lookups to keep the memory bus busy.
  - Big blocks (32, 64) make short tables, but every sequence strands up to block_size - 1 slots:
    the same memory runs fewer requests at once, and a shared prompt is reused only up to the
    last whole block it fills.
  - 16 sits in between: at most 15 empty slots a sequence ({share_16:.0%} of this workload's
    short sequences, a few percent of real ones hundreds of tokens long), short tables, and
    blocks big enough for the kernels. It is vLLM's default for the same reasons.""")
assert max(waste[16]) <= 15 and 3 * max(entries[16]) <= max(entries[4])

print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
