"""Tutorial 19: one kernel per step, or a decode step without forks and joins.

Goal: make the one-sequence decode step (a chat, ``bench single-stream``) run at the speed
of memory. That step reads every weight once, 538 MB for SmolLM2, and does almost no
arithmetic, so the memory bus should never rest. Run kernel by kernel (``kernels/fast/``),
the step is ~120 matrix products and ~200 small kernels (norms, rotary, the KV write,
attention, SiLU), each its own parallel region: Python calls it, the thread pool wakes, the
work is split evenly, the threads join. Between two products the bus idles. The persistent
kernel (``kernels/fast/persistent_decode.py``) runs every layer in one parallel region instead:

- the step is a fixed list of **phases**: a product's phase has many tasks (a run of its
  weight's panels each; the LM head's is the last phase); a norm, rotary with the KV write,
  SiLU, the residual adds are phases of one task a token; attention has one task per work item;
- a thread **claims** a phase's next task by adding one to a counter, atomically
  (``kernels/fast/atomics.py``: the futex word of the analogy), runs it, and counts it done; each
  thread has a contiguous range of each phase's tasks, with a counter of its own, and takes
  the others' tasks only when its own are done (work stealing), so that it reads its share
  of a weight front to back;
- a thread with nothing left to claim **polls** the phase's done counter until the phase is
  complete, and meanwhile asks the memory for the next weight it will multiply, so that the
  bus streams weights while the other thread runs attention or a norm.

The same kernel takes every decode step the panels multiply (up to ``FastTuning.panel_max_rows`` =
128 tokens, rows padded to a multiple of 4 (1, and 2 of quantized weights, as they are), none of
them a long prompt's); here we follow a single sequence. We:

1. claim tasks on two threads, each from its own range first, and check every task was run
   exactly once;
2. run a real single-sequence step both ways and compare the logits and the K/V written: the
   same floats, bit for bit, since every task calls the very kernels the layer-by-layer path
   calls, in the same order;
3. run the kernel with more iterations than threads (some run one after another): it still
   completes, because no thread ever waits for another to *start*, only for claimed work;
4. time a short generation both ways (a ratio, not asserted: it depends on the machine).

The OS analogy: a busy-polling driver (Linux's NAPI, DPDK's poll-mode drivers). At high
packet rates an interrupt per packet costs more than the packet, so the driver keeps its
cores and polls a ring for work instead of sleeping and being woken each time. Here the
"interrupts" are the thread pool's wake-ups and joins, ~300 of them a step.

Run it:  python tutorials/19_one_kernel_per_step.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Set TASK_BYTES in kernels/fast/layer_stack.py to 16 KB, then to 4 MB (each edit
     compiles afresh: Numba's cache folder is named after every kernel source), and
     rerun step 4. Which costs more: claiming many small tasks, or the two threads finishing
     a product at different times?
  2. Set AHEAD_BYTES to 0, so that a polling thread only polls. How much slower is the step?
     Which phases does the other thread spend its time in?
  3. Why may a task never wait for another task of the same phase? Sketch a phase where it
     would, and the iterations of step 3 that would then never finish.
  4. In ``_product``, start every iteration's claims at range 0 instead of its own, so that
     the threads take alternate tasks as from one shared counter, and time a step of eight
     sequences both ways. Why does the panels' read-ahead care which thread ran the task
     before?
"""

import os
import time

from minipaged import LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np
from numba import get_num_threads, njit, prange

from minipaged.kernels.fast import attention, layer_stack, ops as fast_ops, persistent_decode
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import FastTuning

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
TASKS = 100_000           # step 1: tasks of one phase
TOKENS = 32               # step 4: tokens generated each way


@njit(parallel=True)
def claim_all(ctr, runs, owner):
    """Iteration ``it`` claims the phase's tasks, its own range first (``_claim``), until none
    is left anywhere; runs[i] counts how many times task i was run and owner[i] says which
    iteration ran it (owned writes: exactly one thread writes each)."""
    iterations = ctr.shape[1] // persistent_decode.LINE - 1          # one range each
    for it in prange(iterations):
        task, r = persistent_decode._claim(ctr, 0, runs.shape[0], it)
        while task < runs.shape[0]:
            runs[task] += 1
            owner[task] = it
            persistent_decode._done(ctr, 0)            # fetch_add on the phase's done counter
            task, r = persistent_decode._claim(ctr, 0, runs.shape[0], r)


threads = get_num_threads()
print(f"1. Claiming one phase's tasks ({threads} threads, a range of tasks each)")
ctr = np.zeros((2, (threads + 1) * persistent_decode.LINE), np.int64)   # done, a claim counter a range;
#                                                                    the last row: the step's failure mark
runs = np.zeros(TASKS, np.int64)
owner = np.full(TASKS, -1, np.int64)
claim_all(ctr, runs, owner)
print(f"  {TASKS:,} tasks: each run {runs.min()}..{runs.max()} time(s); the done counter reads {ctr[0, 0]:,}")
for it in range(threads):
    lo, hi = it * TASKS // threads, (it + 1) * TASKS // threads
    mine = owner == it
    print(f"  iteration {it} ran {mine.sum():,} tasks, {mine[lo:hi].sum():,} of them from its own range "
          f"[{lo:,}, {hi:,})")
assert runs.min() == runs.max() == 1 and ctr[0, 0] == TASKS and owner.min() >= 0

print(f"\n2. One step of one sequence, layer by layer and as one kernel ({MODEL})")
# our own kernels by name: with oneMKL installed, cpu_gemm="auto" times both engines on this
# machine and may give some kinds of step to oneMKL (tutorial 20); the persistent kernel is ours
engine = LLMEngine(MODEL, device="cpu", num_blocks=64, max_model_len=512, log_stats_interval=0, cpu_gemm="numba",
                   kernels="fast")
model, c = engine.runner.model, engine.model_config
stack = model.weights.tier_state.persistent   # the layers as the kernel reads them: views of the panels
# the fast tier with its persistent kernel on and off (a FastTuning switch, kernels/fast/tuning.py):
# the prepared weights serve both, so the model can be handed either
tier = {on: FastOps(FastTuning(persistent_decode=on)) for on in (False, True)}
print(f"  {c.num_hidden_layers} layers, {persistent_decode.PHASES_PER_LAYER} phases each "
      f"(one more for layer 0's first norm, one for the LM head): "
      f"{2 + persistent_decode.PHASES_PER_LAYER * c.num_hidden_layers} phases in one parallel region")
per = stack.per_task
print(f"  a product task is a run of {per[0]} panels of qkv, {per[2]} of gate/up ({c.hidden_size} inputs), "
      f"{per[3]} of down ({c.intermediate_size}): at most {layer_stack.TASK_BYTES >> 10} KB of weights, "
      f"as many tasks as a multiple of the threads")
engine.add_request("chat", "The operating system keeps a page table for every process, so that",
                   SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
engine.step()                         # the prompt, and its first token
caught = {}
execute = engine.runner.execute


def catch(model_input, kv_cache, *rest):   # the next step's inputs, as the runner gets them
    caught["step"] = (model_input, kv_cache)
    return execute(model_input, kv_cache, *rest)


engine.runner.execute = catch
engine.step()
engine.runner.execute = execute
step, kv = caught["step"]
meta = engine.runner._device_meta(step.meta)
print(f"  the step: {step.input_ids.shape[0]} token at position {int(step.positions[0])}, its K/V to slot "
      f"{int(meta.slot_mapping[0])}")
logits, pools = {}, {}
for on in (False, True):
    model.ops = tier[on]
    pool = kv.copy()                  # each way writes this token's K/V into its own copy
    logits[on] = model.forward(step.input_ids, step.positions, pool, meta, step.logits_indices)
    pools[on] = pool
same_logits = np.array_equal(logits[True], logits[False])
same_kv = np.array_equal(pools[True], pools[False])
print(f"  the same logits, bit for bit: {same_logits}; the same K/V written: {same_kv}")
assert same_logits and same_kv

print("\n3. More iterations than threads")
plan = attention.plan_attention(meta)
hidden = model.embed[step.input_ids]
args = (plan, model.scale, c.rms_norm_eps, model.rope.cos, model.rope.sin, c.num_attention_heads)
_, expected = fast_ops.decode_layers(stack, hidden, step.positions, kv.copy(), *args, with_head=True)   # (1, vocab)
more = get_num_threads() + 1
_, got = fast_ops.decode_layers(stack, hidden, step.positions, kv.copy(), *args, with_head=True, num_threads=more)
print(f"  {more} iterations on {get_num_threads()} threads: one thread runs two of them, one after the "
      f"other; the second finds every phase done and passes through. The same logits: "
      f"{np.array_equal(got, expected)}")
assert np.array_equal(got, expected) and np.array_equal(got, logits[True])

print(f"\n4. A short generation both ways ({TOKENS} tokens, alternated, the best of 3 each)")
best = {False: float("inf"), True: float("inf")}
tokens = {}
for _ in range(3):
    for on in (False, True):
        model.ops = tier[on]
        engine.add_request(f"timed-{on}", "A thread that finds the lock taken can sleep or spin;",
                           SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
        engine.step()                 # the prompt (short: through the kernel too, when it is on)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[on] = out.outputs[0].token_ids
        best[on] = min(best[on], (time.perf_counter() - start) / (TOKENS - 1))
model.ops = tier[True]
print(f"  layer by layer: {best[False] * 1e3:.1f} ms a token; one kernel: {best[True] * 1e3:.1f} ms "
      f"({best[False] / best[True]:.2f}x); the same tokens: {tokens[True] == tokens[False]}")
assert tokens[True] == tokens[False]
print("  docs/benchmarks.md records the measured step against the machine's bandwidth bound "
      "(python -m minipaged bench single-stream, bench roofline)")

print("\nDone: one parallel region a step; threads claim tasks and poll counters instead of "
      "being forked and joined, and the polling thread keeps the memory busy.")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
