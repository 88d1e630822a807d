"""Tutorial 14: the roofline, or where a decode step's time goes.

Goal: tutorial 1 argued that decode is limited by memory and prefill by arithmetic.
Here we measure it, with the instrument behind ``python -m minipaged bench roofline``
(minipaged/tools/roofline.py). First the machine's own limits: how many FLOP/s a large
matrix product reaches (the arithmetic peak) and how many bytes/s a streaming read of
more memory than the last-level cache reaches (the read bandwidth); their quotient is
the ridge point. Then the cost of one step, counted from the model's shapes: the bytes
it must read (every weight once, the K and V of every context token) and the FLOPs it
must do, and so its bound, the time it could not beat even on a perfect engine:

    bound = max(bytes / bandwidth, FLOPs / peak)

Then real engine steps, timed against that bound and split into matrix products, the
LM head, attention, the other kernels, the sampler and the Python around the model (a decode
step runs its layers as one persistent kernel, tutorial 19: one column of its own; the same steps
timed again layer by layer, kernel by kernel, give the split).
Last, what the measurement taught while the CPU path was made fast: a BLAS product of a
few rows costs far more than reading the weight once (OpenBLAS packs the whole weight
into its own layout first, at every call), so the fast tier's ``linear`` (``kernels/fast/linear.py``) sends small
products to Numba kernels that stream each weight once for all of their rows:
``_skinny_linear`` (up to SKINNY_MAX_ROWS = 64 rows) reads the checkpoint's rows, dot product
by dot product, and the panel kernel (up to PANEL_MAX_ROWS = 128 rows: every decode batch
up to 128; ``kernels/fast/panel_gemm.py``, on ``kernels/fast/simd.py``'s registers) reads a copy of
each weight laid out once, at load, for the product, which is what the engine multiplies
by (every weight's panels in one region of 2 MB pages, ``kernels/fast/huge_pages.py``, so that the
TLB covers them); that packing once, instead of at every call, is also what a
vendor's library offers (oneMKL's packed GEMM, ``kernels/fast/packed_gemm.py``; with it installed,
``cpu_gemm="auto"`` times both engines on the machine and gives each kind of step the faster,
tutorial 20); and two thread pools on the same cores must spin only briefly while they wait,
then sleep. The steps here run our own kernels, asked for by name (``cpu_gemm="numba"``).

The OS analogy: the machine's data sheet beside a profiler. ``perf`` and ``top`` tell
you where each tick went; the data sheet tells you what the hardware could have done
with it. Only the two together say whether a program is slow or the machine is simply
busy moving bytes: a step at ratio 1.0 runs at the roofline, and every tick above it is
overhead somebody can remove.

Every timing depends on the machine and on what else it runs, so timings are printed,
as ratios where they are compared, and never asserted. What is asserted is arithmetic:
the costs counted from the model's shapes, which side of the ridge each step falls on,
that the bound is the larger of its two terms, that each step's breakdown adds up to its
time, and that ``linear`` computes what ``x @ w.T`` computes (weights are stored as the
checkpoint has them, (out, in)).

Run it:  python tutorials/14_the_roofline.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Build the engine with fast_tuning=FastTuning(panel_max_rows=0, skinny_max_rows=0)
     (kernels/fast/tuning.py: every batch goes to BLAS;
     with only PANEL_MAX_ROWS at 0, up to 64 rows go to _skinny_linear), then both to 256, and
     rerun  python -m minipaged bench roofline --batch-sizes 1,2,4,8,16,32,64 --prefill-lens 256
     How do the matmuls and lm_head columns move? Is BLAS's gemm the faster for the
     256-token prefill? Does step 4's micro-benchmark, on one weight that stays in
     cache, predict the whole step? Why not?
  2. With step 2's numbers, find the batch size at which a decode step at context 128 turns
     compute-bound on this machine: solve B x (FLOPs per sequence) = ridge x (weight bytes +
     B x KV bytes per sequence). Is there always an answer, as the context grows? Then run
     bench roofline at that batch size: what ratio does the engine reach there?
  3. With oneMKL installed, run  python -m minipaged bench roofline --batch-sizes 1,2,8,16,32,64
     --cpu-gemm numba  and again with --cpu-gemm mkl. From which batch size does the packed GEMM
     win? Give the engine FastTuning(packed_min_rows=1) and measure B=1 and B=2 again: why can
     packing not help a product that only streams the weight once?
  4. Step 4 prints this CPU's register shape (LANES, REGISTERS, TILE_ROWS). Set TILE_ROWS in
     kernels/fast/panel_gemm.py to 4, so that rows pass over a panel in tiles of 4 with 8 registers
     of sums each, and rerun  python -m minipaged bench roofline --batch-sizes 4,8,16,32,64
     --prefill-lens ""  What do the wider tiles (8 rows with AVX-512, 6 with AVX2) buy, and at
     which batch sizes? On an AVX2 CPU, run it also with MINIPAGED_SIMD_LANES=16 (AVX-512's
     shapes: 16 sums of 16 lanes asked of 16 ymm registers): what does a tile that asks for more
     registers than there are cost? (Look for vmovups to the stack in the kernel's inspect_asm().)
  5. The same bound holds for a whole workload: run  python -m minipaged bench throughput
     --num-prompts 8 --output-len 32  and read floor_s, floor_bound and of_floor (the
     workload's FLOPs at the peak, or its bytes at the bandwidth, against the run's time). Then
     --num-prompts 1: why does the bound change side? With the peers extra installed, add
     --peer hf: max_speedup_vs_hf is the most any engine could beat the peer by on this machine.
"""

import math
import os
import time

from minipaged import LLMEngine  # before numpy: it sets up numpy's thread pools
import numpy as np
import numba
from minipaged.kernels.fast import thread_pools
from minipaged.kernels.fast import huge_pages
from minipaged.kernels.fast.linear import linear, pack_linear
from minipaged.kernels.fast.tuning import DEFAULT_TUNING as TUNING
from minipaged.kernels.fast.packed_gemm import load_packed_gemm
from minipaged.kernels.fast.panel_gemm import PANEL, TILE_ROWS, PanelWeight
from minipaged.kernels.fast.simd import LANES, REGISTERS
from minipaged.tools import roofline

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
CONTEXT = 128                 # tokens of context of the decode steps
DECODE_BATCHES = (1, 2, 4)    # batch sizes measured in step 3 (all through the panels)
DECODE_STEPS = 4              # decode steps timed at each batch size
PREFILL_LEN = 256             # the prompt of the prefill measured in step 3
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)   # rows of the products of step 4 (256: past PANEL_MAX_ROWS)
REPEATS = 100                 # step 4: the best of this many calls of each product
PARTS = roofline.PARTS         # matmuls, lm_head, attention, other_kernels, persistent, sampler, python


def linear_path(rows: int, packed=None) -> str:
    """Which product the fast tier's linear (kernels/fast/linear.py) runs for this many float32 rows,
    given w's second copy."""
    if isinstance(packed, PanelWeight) and rows <= TUNING.panel_max_rows:
        return "panels"
    if packed is not None and not isinstance(packed, PanelWeight) and rows >= TUNING.packed_min_rows:
        return "oneMKL packed"
    return "skinny kernel" if rows <= TUNING.skinny_max_rows else "BLAS gemm"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


print("1. The machine's limits (its data sheet, measured)")
llc = roofline.last_level_cache_bytes()
probe = max(4 * llc, 1 << 30)         # what read_bandwidth streams by default
peak = roofline.matmul_peak()
bandwidth = roofline.read_bandwidth()
machine = {"matmul_peak": peak, "read_bandwidth": bandwidth}
ridge = peak / bandwidth
print(f"  arithmetic peak: a 2048 x 2048 float32 matrix product through numpy's BLAS runs at "
      f"{peak / 1e9:.0f} GFLOP/s")
print(f"  read bandwidth: a streaming sum over {fmt_bytes(probe)} (4x the {llc >> 20} MiB last-level "
      f"cache, so it comes from DRAM) reads {bandwidth / 1e9:.1f} GB/s")
print(f"  ridge point: {peak / 1e9:.0f} GFLOP/s / {bandwidth / 1e9:.1f} GB/s = {ridge:.1f} FLOP/byte")
print("  a step doing fewer FLOPs per byte it reads waits for memory (bandwidth-bound); more, and it "
      "waits for the arithmetic units (compute-bound)")
assert peak > 0 and bandwidth > 0 and probe >= 4 * llc

print(f"\n2. One step's bytes and FLOPs, counted from the model's shapes ({MODEL})")
engine = LLMEngine(MODEL, device="cpu", kernels="fast", num_blocks=128, max_model_len=512, max_num_seqs=8,
                   max_num_batched_tokens=2048, swap_space=0, cpu_gemm="numba")   # our kernels, by name
c = engine.model_config
steps = {"decode B=1": roofline.step_cost(engine, [1], [CONTEXT], 1),
         "decode B=8": roofline.step_cost(engine, [1] * 8, [CONTEXT] * 8, 8),
         f"prefill {PREFILL_LEN}": roofline.step_cost(engine, [PREFILL_LEN], [PREFILL_LEN], 1)}
model = engine.runner.model
# every matrix is stored (out, in), as the checkpoint has it; .size does not care which way.
# Tied, the LM head is the embedding matrix itself (the config says so; the fast tier wraps the same
# array, model.lm_head.weight is model.embed): counted once.
matrices = sum(int(a.size) for layer in model.layers for a in (layer.qkv, layer.o, layer.gate_up, layer.down))
matrices += int(model.lm_head.size)
assert model.lm_head.shape == (c.vocab_size, c.hidden_size)                   # (out, in)
tied = bool(c.tie_word_embeddings)
kv_token = engine.cache.bytes_per_block // engine.cache.block_size     # K and V, every layer
print(f"  every weight once: {matrices:,} float32 parameters in the layers' matrices and the LM head "
      f"= {fmt_bytes(4 * matrices)}; K and V of one token: {kv_token:,} bytes")
print(f"  the LM head is {'tied: the embedding matrix itself, read once per step' if tied else 'its own matrix'} "
      f"({model.lm_head.shape[0]:,} x {model.lm_head.shape[1]}); the embedding lookup reads only the rows of "
      "the step's tokens")
print(f"  {'step':14} {'reads':>9} {'of it KV':>9} {'GFLOP':>7} {'FLOP/byte':>10} {'bytes/bw ms':>12} "
      f"{'FLOPs/peak ms':>14}  side of the ridge")
intensity = {}
for name, cost in steps.items():
    intensity[name] = cost["flops"] / cost["bytes"]
    memory_s, compute_s = cost["bytes"] / bandwidth, cost["flops"] / peak
    side = "bandwidth-bound" if intensity[name] < ridge else "compute-bound"
    print(f"  {name:14} {fmt_bytes(cost['bytes']):>9} {fmt_bytes(cost['kv_bytes']):>9} "
          f"{cost['flops'] / 1e9:7.2f} {intensity[name]:10.2f} {memory_s * 1e3:12.1f} {compute_s * 1e3:14.1f}  "
          f"{side} (ridge {ridge:.1f})")
    assert cost["weight_bytes"] == 4 * matrices
    assert roofline.bound(cost, machine) == max(memory_s, compute_s)
one, eight, prefill = (intensity[name] for name in steps)
print(f"  decode does 2 FLOPs (a multiply and an add) for each 4-byte weight it reads, about 0.5 "
      f"FLOP/byte: {one:.2f} for one sequence, with its attention and its KV")
print(f"  8 sequences share the weights but each reads its own KV: {eight:.2f} FLOP/byte, "
      f"{eight / one:.1f}x, not 8x")
print(f"  a {PREFILL_LEN}-token prompt puts {PREFILL_LEN} rows through every weight: {prefill:.0f} FLOP/byte, "
      f"{prefill / ridge:.0f}x the ridge")
assert 0.45 < one < 0.55               # 2 FLOPs / 4 bytes, give or take attention and the KV
assert 6 * one < eight < 8 * one       # the KV bytes grow with the batch, the weights do not
assert one < eight < prefill and one < ridge < prefill   # decode waits for memory, prefill for arithmetic
# (where 8 sequences fall, against a ridge measured on a shared host, is printed above, not asserted)

print(f"\n3. Real steps against their bound (decode at context ~{CONTEXT}, a {PREFILL_LEN}-token prefill)")
decode = roofline.measure_decode(engine, machine, list(DECODE_BATCHES), context_len=CONTEXT,
                                 steps=DECODE_STEPS, progress=lambda line: print("  measured: " + line))
prefills = roofline.measure_prefill(engine, machine, [PREFILL_LEN], repeats=1,
                                    progress=lambda line: print("  measured: " + line))
print(f"  {'step':>7} {'ctx':>4} {'step ms':>8} {'bound ms':>9} {'ratio':>6} {'serial':>7}  "
      + " ".join(f"{p:>13}" for p in PARTS) + "   (ms per step)")
for row in decode + prefills:
    name = f"B={row['batch']}" if "batch" in row else f"T={row['prompt_len']}"
    ctx = f"{row['mean_context']:4.0f}" if "batch" in row else "    "
    print(f"  {name:>7} {ctx} {row['step_s'] * 1e3:8.1f} {row['bound_s'] * 1e3:9.1f} {row['ratio']:6.2f} "
          f"{row['serial_bound_s'] * 1e3:7.1f}  " + " ".join(f"{row['breakdown_s'][p] * 1e3:13.2f}" for p in PARTS))
    parts = row["breakdown_s"]
    assert set(parts) == set(PARTS)
    assert math.isclose(sum(parts.values()), row["step_s"], rel_tol=1e-9)   # every tick accounted for
    assert row["bound_s"] == max(row["bytes"] / bandwidth, row["flops"] / peak)
    assert math.isclose(row["ratio"], row["step_s"] / row["bound_s"])
    # the serial bound: the products' own bound, then attention's (its K/V, or its FLOPs) after it
    products = max((row["bytes"] - row["kv_bytes"]) / bandwidth, row["matmul_flops"] / peak)
    attention = max(row["kv_bytes"] / bandwidth, row["attention_flops"] / peak)
    assert math.isclose(row["serial_bound_s"], products + attention)
    if "layer_by_layer" in row:             # the same steps again, one kernel at a time
        layers = row["layer_by_layer"]
        print(f"  {'layers':>7} {'':4} {layers['step_s'] * 1e3:8.1f} {'':9} {layers['ratio']:6.2f} {'':>7}  "
              + " ".join(f"{layers['breakdown_s'][p] * 1e3:13.2f}" for p in PARTS))
        assert math.isclose(sum(layers["breakdown_s"].values()), layers["step_s"], rel_tol=1e-9)
        assert layers["breakdown_s"]["persistent"] == 0 and layers["breakdown_s"]["matmuls"] > 0
assert [row["batch"] for row in decode] == list(DECODE_BATCHES)
assert all(row["bound_s"] == row["bytes"] / bandwidth for row in decode)           # memory's side
assert prefills[0]["bound_s"] == prefills[0]["flops"] / peak                       # arithmetic's side
print("  ratio = step / bound: 1.00 would be the roofline")
print("  serial: the bound if attention's K/V reading cannot hide under the products' arithmetic (the "
      "products' bound plus attention's, one after the other): on a machine of few cores, where each core "
      "runs one or the other, that is what a compute-bound step of many sequences can reach at best "
      "(docs/benchmarks.md)")
print("  the breakdown adds up to the step: matmuls (the layers' products), the LM head's product, "
      "attention, the other kernels (norms, rotary, SwiGLU, KV writes), the sampler, and the Python "
      "around the model (scheduler, inputs, outputs)")
print("  the layers and LM head of a decode step run as one persistent kernel (tutorial 19, "
      "kernels/fast/persistent_decode.py): their products, attention and small kernels are one call, the "
      "persistent column; the 'layers' line times the same steps again layer by layer, kernel by kernel, "
      "which splits them (and shows what the one kernel saves)")


def weights_time(row) -> float:
    """Seconds of a step spent where the weights are read: the products and the LM head (in a
    persistent step the whole kernel, its attention and small kernels included)."""
    parts = row["breakdown_s"]
    return parts["matmuls"] + parts["persistent"] + parts["lm_head"]


b1 = decode[0]
assert b1["breakdown_s"]["persistent"] > 0 and b1["breakdown_s"]["matmuls"] == 0
share = weights_time(b1) / b1["step_s"]
print(f"  at B=1 that kernel takes {share:.0%} of the step and streams the weights at "
      f"{b1['weight_bytes'] / weights_time(b1) / 1e9:.1f} GB/s "
      f"(the probe read {bandwidth / 1e9:.1f} GB/s): decode is reading weights")
for row in decode[1:]:
    mm = weights_time(row) / weights_time(b1)
    print(f"  B={row['batch']}: {row['bound_s'] / b1['bound_s']:.2f}x the bound of B=1, its matrix products "
          f"{mm:.2f}x the time of B=1's layers and LM head (linear: "
          f"{linear_path(row['batch'], model.layers[0].gate_up.numba)}, step 4)")
print(f"  the prefill reaches {100 * prefills[0]['fraction_of_peak']:.0f}% of the matmul peak: "
      f"{prefills[0]['gflop_s']:.0f} GFLOP/s")

print("\n4. Skinny matrices: a few rows through one weight")
w = model.layers[0].gate_up.weight          # (2 x ffn, hidden), (out, in): the FFN's fused gate and up projections
assert w.shape == (2 * c.intermediate_size, c.hidden_size)
panels = pack_linear(w)                 # kernels/fast/panel_gemm.py: (panels, hidden, PANEL), made once
assert panels.data.shape == (-(-w.shape[0] // PANEL), w.shape[1], PANEL) and PANEL == 2 * LANES
rng = np.random.default_rng(0)
xs = {m: rng.standard_normal((m, w.shape[1]), dtype=np.float32) for m in ROWS}   # (M, hidden)
for m, x in xs.items():
    np.testing.assert_allclose(linear(x, w), x @ w.T, rtol=1e-4, atol=1e-4)          # the same product
    np.testing.assert_allclose(linear(x, w, panels), x @ w.T, rtol=1e-4, atol=1e-4)  # and again
HOWS = ("BLAS", "skinny", "panels")
best = {(m, how): math.inf for m in ROWS for how in HOWS}
for _ in range(REPEATS):                    # interleaved: a busy moment slows every case alike
    for m, x in xs.items():
        for how, fn in zip(HOWS, (lambda: x @ w.T, lambda: linear(x, w), lambda: linear(x, w, panels))):
            start = time.perf_counter()
            fn()
            best[m, how] = min(best[m, how], time.perf_counter() - start)
base = best[1, "BLAS"]
print(f"  the weight: {w.shape[0]} x {w.shape[1]} {w.dtype} ({fmt_bytes(w.nbytes)}), "
      f"the best of {REPEATS} calls, as a ratio to one row through x @ w.T ({base * 1e3:.3f} ms)")
print(f"  {'rows':>4} {'x @ w.T':>8} {'skinny':>7} {'panels':>7}  linear's path with the panels "
      f"(PANEL_MAX_ROWS = {TUNING.panel_max_rows})")
for m in ROWS:
    print(f"  {m:4} {best[m, 'BLAS'] / base:7.2f}x {best[m, 'skinny'] / base:6.2f}x {best[m, 'panels'] / base:6.2f}x  "
          f"{linear_path(m, panels)}")
print("  one row through x @ w.T is a matrix-vector product (gemv): it streams the weight once, as it "
      "lies. From two rows on it is a matrix-matrix product (gemm): OpenBLAS first packs the weight into "
      "its own tiled layout, which pays off for many rows, not for a few")
print("  the skinny kernel (_skinny_linear, linear without a second copy) reads each weight row once for all "
      "the rows: 4 x 4 dot products at a time, each summed in a register whose 16 lanes must then be added up")
print(f"  this CPU's registers hold {LANES} float32s and there are {REGISTERS} of them (kernels/fast/simd.py), so the "
      f"panels (linear with the weight's .numba copy) hold {PANEL} output features' weights for each k side by side: "
      f"for a tile of {TILE_ROWS} rows the kernel keeps {2 * TILE_ROWS} registers of whole output rows, "
      f"two loads and {2 * TILE_ROWS} fused multiply-adds per k, and never adds lanes up")
small = [m for m in ROWS if m <= TUNING.skinny_max_rows]
wins = [m for m in small if best[m, "panels"] < best[m, "skinny"]]
print(f"  here, in cache, the panels beat the skinny kernel at {len(wins)} of {len(small)} row counts "
      f"({best[8, 'panels'] / base:.1f}x against {best[8, 'skinny'] / base:.1f}x for 8 rows, "
      f"{best[32, 'panels'] / base:.1f}x against {best[32, 'skinny'] / base:.1f}x for 32, "
      f"{best[32, 'BLAS'] / base:.1f}x through BLAS)")
print(f"  so linear runs the panels for 1..{TUNING.panel_max_rows} rows, and BLAS's gemm for more (prefill), "
      "which reuses each row of x across the whole weight in its caches; past that many rows, x itself "
      "no longer stays in the core's L2 cache beside a panel")
fits = w.nbytes < llc
where = ("fits in the {} MiB last-level cache: after the first call it is read from cache" if fits else
         "does not fit in the {} MiB last-level cache, yet part of it stays there from call to call")
print(f"  but this {fmt_bytes(w.nbytes)} weight {where.format(llc >> 20)} "
      f"({w.nbytes / base / 1e9:.0f} GB/s for one row here, against {bandwidth / 1e9:.1f} GB/s from DRAM)")
spills = b1["weight_bytes"] > llc
print(f"  a whole decode step reads {fmt_bytes(b1['weight_bytes'])} of weights, "
      f"{'more' if spills else 'less'} than the {llc >> 20} MiB that cache holds, so in a real step "
      f"{'every row after the first finds only part of the weights still in cache' if spills else 'the other weights and the KV cache compete for it'}: "
      "that is why bench roofline times whole steps (step 3), and why PANEL_MAX_ROWS was chosen from them")
print("  docs/benchmarks.md records whole steps' products (2-core AMD EPYC, AVX-512, one sitting): the "
      "skinny kernel took 43-44 ms for 8 rows, 59-60 for 16, 111-121 for 64; the panels 26-27, 42, 96 "
      "(the weights streamed near the memory's speed up to 8 rows, then the multiply-adds near their peak); "
      "on an AVX2 EPYC (Zen 3) the AVX-512 shapes spilled their sums (241 ms at 64 rows), the AVX2 ones 105")
# The model packed every weight's panels back to back into one region of huge pages
# (kernels/fast/linear.py pack_linears, kernels/fast/huge_pages.py): the TLB, the page table's cache, covers 2 MB an
# entry there instead of 4 KB.
# our engine's copies: each linear weight of the fast tier (a FastLinear) holds its panels as .numba
copies = [w.numba for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
copies += [model.lm_head.numba]
# (grouped by kind, every layer's qkv side by side, then every o, ...: the persistent decode kernel
# reads each kind as one (layers, bytes) array, kernels/fast/layer_stack.py)
region = sorted((p.data for p in copies if isinstance(p, PanelWeight)), key=lambda a: a.ctypes.data)
if region:
    first, last = region[0].ctypes.data, region[-1].ctypes.data + region[-1].nbytes
    assert all(a.ctypes.data + a.nbytes <= b.ctypes.data for a, b in zip(region, region[1:]))   # one region, no overlap
    span = last - first
    assert span < sum(a.nbytes for a in region) + len(region) * huge_pages.ALIGN   # back to back: no gaps but alignment
    print(f"  every panel lies in one region of {fmt_bytes(span)}: {-(-span // 4096):,} pages of 4 KB, or "
          f"{-(-span // huge_pages.HUGE_PAGE):,} of 2 MB, for a TLB of a few thousand entries; a decode step "
          "streams it all, and with 4 KB pages each 4 KB of it waits for a walk of the page table")
    mapping = huge_pages.mapping_of(region[0])
    if mapping is not None:
        print(f"  Linux was {'asked' if mapping['advised'] else 'not asked'} for huge pages on it "
              f"(madvise MADV_HUGEPAGE), and backs {mapping['huge_bytes'] / max(1, mapping['bytes']):.0%} of it "
              "with 2 MB pages now (/proc/self/smaps); one-sequence steps ran 2-5% faster so (docs/benchmarks.md)")

print("\n5. Packing once: the CPU maker's own GEMM (oneMKL)")
gemm = load_packed_gemm("auto", numba.get_num_threads())   # kernels/fast/packed_gemm.py: None without the mkl wheel
if gemm is None:
    print("  oneMKL is not installed here (pip install 'minipaged[mkl]', Linux x86-64): linear multiplies by "
          "the panels and BLAS")
else:
    packed = gemm.pack(w)                   # once: MKL's own tiled layout of the weight
    print(f"  cblas_sgemm_pack copied the {fmt_bytes(w.nbytes)} weight into MKL's layout once "
          f"({fmt_bytes(packed.nbytes)} of address space: its tiles are padded); every product after "
          "that skips the copy OpenBLAS makes at each call")
    timed = {}
    for m in (8, 16, 32, 64):
        np.testing.assert_allclose(packed.apply(xs[m]), xs[m] @ w.T, rtol=1e-4, atol=1e-4)  # the same product
        timed[m] = [math.inf, math.inf]
        for _ in range(REPEATS // 4):
            for i, fn in enumerate((lambda: linear(xs[m], w, panels), lambda: packed.apply(xs[m]))):
                start = time.perf_counter()
                fn()
                timed[m][i] = min(timed[m][i], time.perf_counter() - start)
    print(f"  {'rows':>4} {'panels':>7} {'packed':>7}  (as ratios to one row through x @ w.T)")
    for m, (ours, theirs) in timed.items():
        print(f"  {m:4} {ours / base:6.2f}x {theirs / base:6.2f}x")
    print(f"  with cpu_gemm='mkl' the engine packs every weight of {c.num_hidden_layers} layers and the LM head "
          f"at load (each weight's .mkl copy); linear uses the packed copy from PACKED_MIN_ROWS = "
          f"{TUNING.packed_min_rows} rows. One weight in cache does not say which engine wins a whole step: "
          "cpu_gemm='auto' times whole steps of each kind through both, once per machine (tutorial 20)")

print("\n6. Two thread pools on the same cores")
libraries = thread_pools.openblas_libraries()
wanted = int(os.environ.get("OPENBLAS_THREAD_TIMEOUT", thread_pools.THREAD_TIMEOUT))
for info in libraries:
    timeout = thread_pools.thread_timeout(info["filepath"])
    print(f"  OpenBLAS {info.get('version')} ({os.path.basename(info['filepath'])}), "
          f"{info.get('num_threads')} threads: thread_timeout = {timeout}")
    assert timeout in (None, wanted)        # None: this OpenBLAS cannot report it
if not libraries:
    print("  numpy here does not use OpenBLAS: nothing to settle")
print(f"  minipaged sets OPENBLAS_THREAD_TIMEOUT={thread_pools.THREAD_TIMEOUT} (OpenBLAS's threads spin "
      "2**16 cycles, about 25 us, then sleep; OpenBLAS's default is 2**28)")
assert "GOMP_SPINCOUNT" in os.environ and "KMP_BLOCKTIME" in os.environ   # boot.py's, or the user's own
print(f"  and, for Numba's OpenMP pool, GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']} (GNU libgomp's threads "
      f"spin that many rounds, about 30-100 us at 3000, then sleep) and KMP_BLOCKTIME={os.environ['KMP_BLOCKTIME']} "
      "(LLVM's libomp, where Numba uses it, sleeps at once)")
try:
    layer_name = numba.threading_layer()
except ValueError:                          # no parallel kernel has run yet
    layer_name = "not started"
print(f"  Numba's threading layer in this process: {layer_name} ({numba.config.NUMBA_NUM_THREADS} threads)")
print("  why: numpy's BLAS and our Numba kernels each keep a pool of threads on the same cores, and a "
      "pool that busy-waits after its work steals the cores the other needs next, like two processes "
      "spinning on one CPU (a 0.5 ms matmul once took 9 ms after a parallel kernel whose threads spun "
      "for their default time)")
print("  sleeping at once is no better: waking a sleeping pool costs ~70 us, more than many decode kernels "
      "take. So each pool spins briefly, then sleeps")
if gemm is not None:
    print("  oneMKL (step 5) adds no third pool: it was told to run on GNU OpenMP (MKL_Set_Threading_Layer), "
          "the libgomp threads Numba's kernels use")

print("\n7. The full table")
print("  python -m minipaged bench roofline    decode at B = 1, 2, 4, 8, 16, 32, 64 and prefills of "
      "256 and 2048 tokens, against the same bound, with the same breakdown (--out keeps it as JSON)")
print("  docs/benchmarks.md records the figures measured on the reference machine")

print("\nDone: decode reads every weight for a few FLOPs and waits for memory; prefill waits for "
      "arithmetic; the breakdown says where the rest of each step goes.")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
