"""The fast tier's tuning: every switch and threshold in one place, and the constants its kernels
are compiled with.

The OS idea is a kernel's tunables (``/proc/sys``): one table of numbers the policy code reads,
measured on real machines, never scattered through the mechanism. ``FastTuning`` is a frozen
config: ``FastOps(FastTuning(vector_attention=False))`` turns the register kernel off for one
engine; nothing assigns a module variable. The constants below it (``QUERY_TILE``, ``SCORE_CHUNK``,
``SKINNY_TILE_MIN_ROWS``) are compiled into the kernels' machine code: they are not switches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class FastTuning:
    """The fast tier's run-time choices. Each figure below was measured on a 2-core cloud host."""

    # -- which kernels run ------------------------------------------------------------------------
    # A float32 pool's decode attention by the register kernel (attention_registers.py), which
    # names its vector registers: at 64 decodes of 264 tokens, all 30 layers, 30-32 ms a step
    # against the loop kernel's 37-40 (2-core AMD EPYC, Zen 3, docs/benchmarks.md). False: the loop
    # kernel (attention_loop.py) for every cache, as it already is for int8 / fp8.
    vector_attention: bool = True
    # Long prompts and big chunks on a float32 cache take ``prompt_attention.py`` (scores in a
    # chunk-sized scratch, products in registers) instead of two BLAS products per KV head,
    # unless oneMKL's products were chosen (``gemm``); quantized caches keep the BLAS path. One
    # layer's attention of a whole prompt, 2-core Zen 3 EPYC: see docs/kernels.md.
    prompt_kernel: bool = True
    # A decode step (up to panel_max_rows tokens, no prompt long enough for the prompt path) runs
    # every layer in one parallel region whose threads claim tasks and poll counters instead of
    # forking and joining ~300 times (persistent_decode.py); False: layer by layer, kernel by
    # kernel, as every other step.
    persistent_decode: bool = True

    # -- where attention splits ---------------------------------------------------------------------
    # Queries per sequence from which attention takes the prompt path: the prompt kernel, or BLAS.
    prompt_min_queries: int = 32
    # Query rows per BLAS tile, bounding the (rows, context) score matrix. A tile's scores are
    # written by the first product, rewritten by the softmax and read by the second: 128 queries
    # (x 3 heads of a GQA group x 2048 keys: 3 MB) against 256 (6 MB) cut one layer's attention on
    # a 2-core AMD EPYC (1 MiB of L2 a core) from 3.5 to 2.2 ms at 256 tokens, 7.7 to 5.3 at 512,
    # 21 to 16.4 at 1024 and 61-68 to 45-57 at 2048; the smaller tiles also compute less of the
    # masked causal future. (2-core Xeon, MKL: 40.8-46.9 ms at 256 against 42.3-50.1 at 128.)
    blas_query_tile: int = 128
    # Split-K: when the Numba kernel has fewer tiles than threads (a few long decodes), a tile
    # whose context has at least this many tokens per thread is cut into one slice per thread,
    # the way the GPU kernel splits long contexts into partitions, and the slices are merged.
    split_min_tokens: int = 256
    # The same, for a step the persistent decode kernel runs (``persistent_decode.py``): its threads
    # are already in the region, so a slice costs one more phase, not a wake-up; the layer-by-layer
    # path runs a small decode's slices one after another on one thread (``attention_parallel_min_work``),
    # where they only add a merge. One decode, gguf, the engine's steps alternated in one process
    # (2-core AMD EPYC, Zen 5; the memory's speed moved between sittings): ~300 tokens 3.40 ms a step
    # at 256 against 3.19 at 64, then ~316 3.86 against 3.71 (int8 4.35 / 4.11); ~120 (no split) 3.17
    # and 3.08. Layer by layer at 64: 6.45 against 6.68 ms (~200 tokens), float32 17.2 / 17.5 (~400).
    persistent_split_min_tokens: int = 64

    # -- which engine multiplies a linear layer -------------------------------------------------------
    # A BLAS matrix-matrix product of a few rows costs far more than reading the weight once:
    # OpenBLAS packs the whole weight into its own layout first, and its kernels are tiled for
    # many rows. Over one decode step of SmolLM2 (538 MB of weights, 2-core Xeon, OpenBLAS
    # 0.3.31), every product together took 23 ms for 1 row (a gemv: the weights streamed at
    # the memory's speed) but 55-68 ms for 2 to 16 rows and 72-77 ms for 32. ``_skinny_linear``
    # reads each weight row once for all rows: 20 ms for 1 row, 23 for 2, 32 for 8, 43 for 16,
    # 66 for 32, 102 for 64 (BLAS: 105). Above this many rows (prefill) BLAS's gemm is the
    # better engine.
    skinny_max_rows: int = 64
    # Products of up to this many rows multiply the weight's panels (``panel_gemm.py``), when
    # the model made them: decode steps of up to 128 sequences, and the small prefills of a chat
    # turn. On a 2-core Zen 3 EPYC (AVX2), one layer's four weights and the LM head, the two
    # engines alternated in one process: 72 rows 28.7 ms against BLAS's 37.7, 112 rows 41-44
    # against 48, 128 rows 48-49 against 52-54; at 144 rows BLAS won (58 against 64): the rows of x
    # (331 KB at in = 576) no longer stay in L2 beside the panel. Longer prefills stay with BLAS.
    panel_max_rows: int = 128
    # With a packed weight, MKL takes products from this many rows. Below, reading the weight
    # bounds the product and ours is as fast or faster: whole decode steps (`bench roofline`,
    # 2-core Xeon, AVX-512) took 30.5 ms at B = 2 ours, 35.2 MKL; 48 both at B = 8; then MKL
    # won: 69 -> 64 ms at 16, 108 -> 89 at 32, 187 -> 140 at 64.
    packed_min_rows: int = 8
    # The smallest weight oneMKL packs (packed_gemm.py MIN_PACKED_ELEMENTS): its packed copy takes ~8 MB
    # down and LM head); a smaller one stays ours, where packing bought nothing measurable.
    min_packed_elements: int = 1 << 18

    # -- when a kernel wakes the thread pool ----------------------------------------------------------
    # Waking a pool of threads costs tens of microseconds (an empty parallel kernel: ~70 us
    # once its threads sleep, ~2 us while they still spin; 2-core Xeon), more than a decode
    # step's elementwise work; below this many elements a kernel runs on the calling thread.
    parallel_min_elements: int = 1 << 16
    # Decode attention's work estimate (query tokens x context x 8) above which it is worth
    # waking the pool: serial attention costs ~27 ns a unit, so from ~5,000 units half the work
    # saves more than the wake-up. At 16 sequences of 284 tokens (36,352 units), serial: 29.6 ms
    # a step; threaded: 15 ms.
    attention_parallel_min_work: int = 1 << 13
    # Kernels with a few flops per element (rms_norm, rotary) stream their data faster on one
    # thread than the pool wakes up after a BLAS product: inside a 256-token prefill, rms_norm
    # took 0.27 ms a call threaded against 0.07 serial, and rotary 0.14 against 0.08; at 2048
    # tokens serial still won (0.88 vs 1.13 ms). Those two go threaded only from this size.
    light_parallel_min_elements: int = 1 << 21
    # SiLU·up follows the gate/up product, whose threads still spin, and costs ~2 ns a value on one
    # thread: from 8,192 values of gate/up (3 rows of SmolLM2) the pool is the cheaper. 8 rows:
    # 9.8 against 26.7 us; 16 rows: 12.6 against 46.9 (Zen 3 EPYC); 1 row stays serial (2.7 against 4.0).
    silu_parallel_min_elements: int = 1 << 13
    # Tokens from which write_kv splits its copies over the threads (each token's slots are its
    # own). 64 decodes, 30 layers, scattered blocks: 22 against 12 us a layer; a 2048-token prompt:
    # 405 against 195 us (2-core AMD EPYC, Zen 3). 16 tokens: a tie.
    write_kv_parallel_min_tokens: int = 32
    # Score elements from which the softmax pass is threaded. One layer's attention of a 256-token
    # prompt (three (768, 256) tiles) took 1.57 ms threaded, 1.88 serial; 2048 tokens: 42 / 55 ms.
    softmax_parallel_min_elements: int = 1 << 16

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ValueError(f"FastTuning.{f.name} must be True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"FastTuning.{f.name} must be an integer >= 0, got {value!r}")
        if self.blas_query_tile < 1 or self.panel_max_rows < 1:
            raise ValueError("FastTuning.blas_query_tile and panel_max_rows must be at least 1")


DEFAULT_TUNING = FastTuning()

# -- compiled into the kernels (constants, not switches) -----------------------------------------------

# A thread walks a sequence's K/V blocks once for a tile of up to QUERY_TILE
# query tokens (times the GQA group), so each block it loads serves them all.
QUERY_TILE = 16


# How far ahead of its own reads a quantized weight's single-row loop asks for lines (``prefetch``),
# in bytes of the panel stream (``quant_panels.dense_row``, ``quant_blocks.block_row``). One row
# widens every weight before its multiply-add, and the CPU's own prefetcher then fell behind: the
# 30 layers' single-row products streamed from memory, two threads (2-core AMD EPYC, Zen 5),
# took int8 3.50 ms without asking against 2.58 at 4096 bytes ahead (2.68 at 2048, 2.55 at 8192),
# q4_1 1.62 against 1.48, bfloat16 5.10 against 4.79.
ROW_AHEAD = 4096


# Up to this many rows (a decode step of 2-8 sequences; 3-8 padded to 4 or 8) multiply a quantized
# weight's codes in registers, two or four rows at a time, as one row does; more widen each run of a
# panel into a page on the stack for the float32 tiles (``quant_panels.quant_rows``). The
# products of one layer at 4 rows in the caches, before and after (2-core AMD EPYC, Zen 5): q4_1
# 0.109 against 0.073 ms, int8 0.099 against 0.067; 30 layers streamed, q4_1 3.28 against 2.37,
# int8 3.36 against 2.71. At 8 rows, registers (twice four rows) against the page: q4_1 0.157
# against 0.149 ms, int8 0.146 against 0.130 (compiled for AVX2, two runs: q4_1 0.317 against
# 0.282, then 0.291 against 0.310, registers the slower; int8 0.299 against 0.246).
REGISTER_ROWS = 8


# Keys the register kernel scores before one softmax step over them all (rounded down to whole
# blocks, at least one). Block by block, the running max, the rescaling of the p x v sums and
# the softmax's short loops (16 values, where LLVM's unrolled vector loops want more and left
# them to their scalar remainder) came back every 16 keys; a chunk pays them once per 256. One
# thread, one sequence of 4,096 keys, all in L1: 31-34 ns a key and KV head before, 19-21 after;
# 16 sequences of 5 queries (speculative decoding's verification), 30 layers: 30-34 ms against
# 26-27; tiles of 16 queries: 44-45 against 36-38. Plain decodes read their K/V from memory,
# which bounds both: the same time (2-core AMD EPYC, Zen 3). Scratch: num_heads x span floats
# (span: the chunk's keys, 256 at block sizes that divide it, one block where blocks are larger).
SCORE_CHUNK = 256


# Below this many rows of x, _skinny_linear takes one weight row at a time (a dot product per
# row of x) instead of its 4 x 4 tiles: on a 2-core AMD EPYC a whole step's products (538 MB)
# took 17-22 ms that way at 1-3 rows against 22-35 ms in tiles, 22-27 against 26-32 at 4; they
# tie at 5, and from 6 rows the tiles win (31-38 ms against 37-47).
SKINNY_TILE_MIN_ROWS = 5
