"""Tutorial 22: from the plain kernels to the fast ones, and what each trick buys.

Goal: one interface (``kernels/ops.py``'s ``KernelOps``), two CPU tiers behind it. The plain
tier (``kernels/simple.py``, tutorial 4) is one readable function per operation; the fast tier
(``kernels/fast/``) computes the same with the tricks of tutorials 14 and 19. Choosing one is a
config field, ``LLM(..., kernels="simple" | "fast")`` (``--kernels``): the model and the engine
never know which runs them. We:

1. run SmolLM2 on each tier: the same greedy tokens, and the time a token takes on each;
2. take paged attention apart, one layer of a decode batch: the plain kernel (a thread per
   query token, one head at a time, an online softmax over blocks), the fast tier's loop kernel
   (a tile of queries walks each block once for all its heads, the heads of a GQA group
   scored together), its register kernel (named vector registers, 256 keys scored before one
   softmax step), and split-K for one long decode (its context cut into a slice per thread);
3. take a linear layer apart at decode sizes: BLAS's ``x @ w.T`` (the plain tier's), the
   skinny kernel (each weight row read once for every row of x), the panels (the weight laid
   out for the registers, in 2 MB pages);
4. run a decode step layer by layer against the persistent kernel (tutorial 19);

and print what each buys, as ratios measured here (none is asserted: they depend on the machine;
docs/kernels.md records one host's).

The OS analogy: a generic driver and a tuned one behind the same driver interface (Linux's VESA
framebuffer beside a card's own driver). Start from the generic one; each optimisation in the
tuned one is a measured answer to one question.

Run it:  python tutorials/22_from_plain_to_fast_kernels.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import os
import time

from minipaged import LLM, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np
from numba import get_num_threads

from minipaged.kernels.fast.linear import linear, pack_linear
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels.layout import AttentionMetadata
from minipaged.kernels.simple import SimpleOps

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
TOKENS = 24                   # step 1: tokens generated on each tier
BATCH, CONTEXT = 16, 512      # step 2: decodes in the batch, tokens of context each
LONG = 4096                   # step 2: one long decode's context (split-K)
REPEATS = 7                   # the best of this many calls of each kernel


def best_of(fn, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` calls, after one untimed call (compiles, warms the caches)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


print(f"1. The same model on each tier ({MODEL})")
params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
prompt = "A page table maps each virtual page of a process to"
tokens, per_token = {}, {}
for kernels in ("simple", "fast"):
    # our own engines by name: the fast tier's cpu_gemm="auto" may time oneMKL in (tutorial 20)
    llm = LLM(MODEL, device="cpu", num_blocks=64, max_model_len=512, kernels=kernels, cpu_gemm="numba")
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)       # compile, fault the weights in
    start = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    per_token[kernels] = (time.perf_counter() - start) / TOKENS
    tokens[kernels] = out.token_ids
    print(f"  kernels={kernels!r:9} {type(llm.llm_engine.model.ops).__name__:9} {per_token[kernels] * 1e3:6.1f} ms a "
          f"token: {out.text[:48]!r}...")
    config = llm.llm_engine.model_config
    del llm
print(f"  the same tokens: {tokens['simple'] == tokens['fast']}; the fast tier "
      f"{per_token['simple'] / per_token['fast']:.1f}x the plain one's speed")
assert tokens["simple"] == tokens["fast"]

heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
print(f"\n2. One layer's decode attention: {BATCH} sequences of {CONTEXT} tokens "
      f"({heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, blocks of 16)")
rng = np.random.default_rng(0)


def decode_batch(contexts: list[int], block_size: int = 16):
    """q (S, H, D), a pool with every context in shuffled blocks, and the step's metadata."""
    per = [-(-n // block_size) for n in contexts]
    pool = rng.standard_normal((2, sum(per) + 1, kv_heads, block_size, head_dim)).astype(np.float32)
    order = rng.permutation(sum(per) + 1)
    tables = np.full((len(contexts), max(per)), -1, np.int32)
    start = 0
    for s, n in enumerate(per):
        tables[s, :n] = order[start:start + n]
        start += n
    meta = AttentionMetadata(np.zeros(len(contexts), np.int64), np.arange(len(contexts) + 1, dtype=np.int32),
                             np.array(contexts, np.int32), tables, 1, max(contexts))
    q = rng.standard_normal((len(contexts), heads, head_dim)).astype(np.float32)
    return q, pool[0], pool[1], meta


def attention_times(q, k, v, meta, tiers: dict) -> dict:
    outs = {name: ops.paged_attention(q, k, v, meta, head_dim ** -0.5) for name, ops in tiers.items()}
    for name, out in outs.items():
        np.testing.assert_allclose(out, outs["plain"], rtol=1e-4, atol=1e-5)   # each computes the same
    return {name: best_of(lambda ops=ops: ops.paged_attention(q, k, v, meta, head_dim ** -0.5))
            for name, ops in tiers.items()}


seconds = attention_times(*decode_batch([CONTEXT] * BATCH), {
    "plain": SimpleOps(), "loops": FastOps(FastTuning(vector_attention=False)), "registers": FastOps()})
for name, why in (("plain", "a thread a query token, one head at a time"),
                  ("loops", "a tile walks each block once; a GQA group's heads together"),
                  ("registers", "named vector registers; 256 keys scored, then one softmax step")):
    print(f"  {name:10} {seconds[name] * 1e3:7.2f} ms  {seconds['plain'] / seconds[name]:5.1f}x   {why}")
attention = seconds
long = attention_times(*decode_batch([LONG]), {
    "plain": SimpleOps(), "one thread": FastOps(FastTuning(split_min_tokens=1 << 30)), "split-K": FastOps()})
print(f"  one decode of {LONG} tokens on {get_num_threads()} threads: plain {long['plain'] * 1e3:.2f} ms, "
      f"fast on one thread {long['one thread'] * 1e3:.2f} ms, split-K (a slice a thread, then merged) "
      f"{long['split-K'] * 1e3:.2f} ms")

print(f"\n3. One linear layer at decode sizes: gate/up ({2 * config.intermediate_size} x {config.hidden_size})")
w = rng.standard_normal((2 * config.intermediate_size, config.hidden_size)).astype(np.float32)   # (out, in)
panels = pack_linear(w)                         # kernels/fast/panel_gemm.py: made once, at load
products = {}
for rows in (1, 8):
    x = rng.standard_normal((rows, config.hidden_size)).astype(np.float32)
    for name, fn in (("BLAS", lambda: x @ w.T), ("skinny", lambda: linear(x, w)),
                     ("panels", lambda: linear(x, w, panels))):
        np.testing.assert_allclose(fn(), x @ w.T, rtol=1e-4, atol=1e-3)
        products[rows, name] = best_of(fn, 50)
    print(f"  {rows} row(s): " + ", ".join(f"{name} {products[rows, name] * 1e6:6.1f} us" for name in
                                         ("BLAS", "skinny", "panels"))
          + f"  (panels {products[rows, 'BLAS'] / products[rows, 'panels']:.1f}x BLAS)")

print("\n4. A decode step: layer by layer, or every layer in one persistent kernel (tutorial 19)")
llm = LLM(MODEL, device="cpu", num_blocks=64, max_model_len=512, kernels="fast", cpu_gemm="numba")
model = llm.llm_engine.model
tiers = {on: FastOps(FastTuning(persistent_decode=on)) for on in (False, True)}   # the same prepared weights
step_time = {}
for on in (False, True, False, True):            # alternated: the second of each counts
    model.ops = tiers[on]
    start = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    step_time[on] = (time.perf_counter() - start) / TOKENS
    assert out.token_ids == tokens["fast"]
print(f"  layer by layer {step_time[False] * 1e3:.1f} ms a token, one kernel {step_time[True] * 1e3:.1f} ms "
      f"({step_time[False] / step_time[True]:.2f}x); the same tokens")

print("\n5. What each trick bought, here")
print(f"  attention, {BATCH} decodes of {CONTEXT}: tiles and GQA groups {attention['plain'] / attention['loops']:.1f}x, "
      f"then registers {attention['loops'] / attention['registers']:.1f}x")
print(f"  a long decode: split-K {long['one thread'] / long['split-K']:.1f}x over one thread")
print(f"  a linear layer, 1 row: panels {products[1, 'BLAS'] / products[1, 'panels']:.1f}x BLAS; "
      f"8 rows: {products[8, 'BLAS'] / products[8, 'panels']:.1f}x")
print(f"  a whole decode step: the persistent kernel {step_time[False] / step_time[True]:.2f}x layer by layer")
print(f"  the model end to end: the fast tier {per_token['simple'] / per_token['fast']:.1f}x the plain tier")

print("""
Exercises:
  1. Give the plain kernel one trick: in kernels/simple.py, _paged_attention, loop over the KV heads
     and let _attend score all `group` query heads of one KV head at each key it loads. Rerun
     step 2: how much of the loop kernel's lead does that close, and tests/test_simple_kernels.py
     still pass?
  2. Step 2 at CONTEXT = 64 and at 4096: where do the plain and register kernels' times meet,
     and why does the longer context favour the tiled kernels (what does each block load serve)?""")
