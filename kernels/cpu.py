"""CPU kernels compiled by Numba: the same contract as the CUDA kernels, for a laptop.

Each public function has a NumPy spec of the same name in ``kernels/reference.py``
and is tested against it. Work is split over CPU threads with ``prange``; inside
a thread most loops are left for LLVM to vectorise (fastmath lets it reorder the
float sums), while decode attention on a float32 pool names its vector registers
(``kernels/simd.py``), as the panel products do.

The module is used as an "ops" namespace by the model: ``ops.rms_norm(...)``,
``ops.paged_attention(...)``; ``kernels/cuda.py`` (``CudaOps``) offers the same names.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import partial

import numpy as np
from numba import get_num_threads, njit, prange

from .kv_quant import (K_SCALE_CONSTANT, KV_FLOAT, KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8, V_SCALE_CONSTANT,
                       dequantize, float_to_fp8, fp8_widen_scale, widen)
from .fast_math import fast_exp
from .layout import AttentionMetadata, BlockBounds, KVQuant
from . import persistent_decode, prompt_attention
from .huge_pages import Arena
from .panel_gemm import PanelWeight, pack as pack_panels, panel_shape
from .simd import (LANES, SIMD_CACHE, prefetch, vbroadcast, vfma, vload, vmax, vmax_lanes, vmul, vsplat, vstore,
                   vsum, vzero)

xp = np  # the array module this backend computes with

# Waking a pool of threads costs tens of microseconds (an empty parallel kernel: ~70 us
# once its threads sleep, ~2 us while they still spin; 2-core Xeon), more than a decode
# step's elementwise work; below this many elements a kernel runs on the calling thread.
PARALLEL_MIN_ELEMENTS = 1 << 16
# Decode attention's work estimate (query tokens x context x 8) above which it is worth
# waking the pool: serial attention costs ~27 ns a unit, so from ~5,000 units half the work
# saves more than the wake-up. At 16 sequences of 284 tokens (36,352 units), serial: 29.6 ms
# a step; threaded: 15 ms.
ATTENTION_PARALLEL_MIN_WORK = 1 << 13
# Kernels with a few flops per element (rms_norm, rotary) stream their data faster on one
# thread than the pool wakes up after a BLAS product: inside a 256-token prefill, rms_norm
# took 0.27 ms a call threaded against 0.07 serial, and rotary 0.14 against 0.08; at 2048
# tokens serial still won (0.88 vs 1.13 ms). Those two go threaded only from this size.
LIGHT_PARALLEL_MIN_ELEMENTS = 1 << 21
# SiLU·up follows the gate/up product, whose threads still spin, and costs ~2 ns a value on one
# thread: from 8,192 values of gate/up (3 rows of SmolLM2) the pool is the cheaper. 8 rows:
# 9.8 against 26.7 us; 16 rows: 12.6 against 46.9 (Zen 3 EPYC); 1 row stays serial (2.7 against 4.0).
SILU_PARALLEL_MIN_ELEMENTS = 1 << 13


def two_ways(fn, min_work: str = "PARALLEL_MIN_ELEMENTS", cache: bool = True, fastmath: bool = True,
             error_model: str = "python"):
    """Compile ``fn`` twice: serial (prange acts as range) and across threads (each cached on disk
    when ``cache``), picked by a work size against the module threshold named ``min_work``
    (``.serial`` and ``.parallel`` name each: a kernel that runs inside another's threads calls
    the serial one).
    ``fastmath=False`` keeps IEEE arithmetic (write_kv's int8 scales must round as the spec's).
    ``error_model="numpy"``: a float division gives inf or nan for a zero divisor, as NumPy's,
    instead of testing it first to raise Python's ZeroDivisionError, a test that keeps LLVM
    from vectorising a loop that divides.

    The serial copy gets its own name: Numba's on-disk cache is keyed by the
    function's qualified name and signature, not by the ``parallel`` flag, so
    two compilations of one function would overwrite each other's cache entry.
    """
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                              fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    serial = njit(fastmath=fastmath, cache=cache, error_model=error_model)(twin)
    parallel = njit(fastmath=fastmath, cache=cache, parallel=True, error_model=error_model)(fn)
    def pick(work):
        return parallel if work >= globals()[min_work] else serial   # the threshold named
    pick.serial, pick.parallel = serial, parallel
    return pick

# --------------------------------------------------------------------------- prefetch


@njit(inline="always", cache=True)
def _prefetch_block(cache, block):
    """Prefetch every cache line of ``cache[block]`` (all of its KV heads)."""
    size = cache.strides[0]
    start = block * size
    for offset in range(0, size, 64):
        prefetch(cache, start + offset)


# A thread walks a sequence's K/V blocks once for a tile of up to QUERY_TILE
# query tokens (times the GQA group), so each block it loads serves them all.
QUERY_TILE = 16


@njit(fastmath=True, cache=True)
def _exp_into(x, out):
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])


def exp(x: np.ndarray) -> np.ndarray:
    """e^x elementwise with ``fast_exp``, for a float32 array (the kernel, callable from Python)."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(flat)
    _exp_into(flat, out)
    return out.reshape(np.shape(x))


# --------------------------------------------------------------------------- KV writes

_NO_SCALES = np.ones((1, 1, 1), np.float32)    # a float cache: no scales

@njit(cache=True)
def _quantize_vector(x, out, fmt, scales, block, head, offset):
    """One token's head_dim values of one head into bytes: int8 with its own scale
    (max|x| / 127, written to scales[block, head, offset]), or fp8 over the layer's scale."""
    if fmt == KV_INT8:
        top = np.float32(0.0)
        for d in range(x.shape[0]):
            top = max(top, abs(x[d]))
        scale = top / np.float32(127.0)
        scales[block, head, offset] = scale
        for d in range(x.shape[0]):   # clamped: a scale that underflows could round past 127
            out[d] = np.int8(min(max(np.rint(x[d] / scale), -127.0), 127.0)) if scale > 0 else np.int8(0)
    else:
        layer_scale = scales[0, 0, 0]
        for d in range(x.shape[0]):
            out[d] = float_to_fp8(np.float32(x[d] / layer_scale), fmt)


# Tokens from which write_kv splits its copies over the threads (each token's slots are its
# own). 64 decodes, 30 layers, scattered blocks: 22 against 12 us a layer; a 2048-token prompt:
# 405 against 195 us (2-core AMD EPYC, Zen 3). 16 tokens: a tie.
WRITE_KV_PARALLEL_MIN_TOKENS = 32


@partial(two_ways, min_work="WRITE_KV_PARALLEL_MIN_TOKENS", fastmath=False)
def _write_kv(k_cache, v_cache, k, v, slot_mapping, fmt, k_scale, v_scale):
    block_size = k_cache.shape[2]
    for t in prange(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        block = slot // block_size
        offset = slot % block_size
        if fmt == KV_FLOAT:                          # a plain copy of the token's K/V rows
            # element by element: a slice assignment (k_cache[block, :, offset, :] = k[t]) builds
            # array views for every token (64 tokens: 15 us a call against 11, in cache)
            for h in range(k.shape[1]):
                for d in range(k.shape[2]):
                    k_cache[block, h, offset, d] = k[t, h, d]
                    v_cache[block, h, offset, d] = v[t, h, d]
            continue
        for h in range(k.shape[1]):
            _quantize_vector(k[t, h], k_cache[block, h, offset], fmt, k_scale, block, h, offset)
            _quantize_vector(v[t, h], v_cache[block, h, offset], fmt, v_scale, block, h, offset)


def calibrate_kv_scales(k: np.ndarray, v: np.ndarray, quant: KVQuant) -> None:
    """fp8's calculate_kv_scales: the layer's scales from this step's k, v (T, kv_heads, head_dim):
    max|k| / K_SCALE_CONSTANT and max|v| / V_SCALE_CONSTANT (1.0 where all are 0)."""
    for x, scale, constant in ((k, quant.k_scale, K_SCALE_CONSTANT), (v, quant.v_scale, V_SCALE_CONSTANT)):
        top = float(np.abs(x).max()) if x.size else 0.0
        scale[...] = np.float32(top / constant) if top > 0 else np.float32(1.0)


@njit(cache=True)
def _update_key_bounds(k, slot_mapping, block_size, key_min, key_max):
    """Each written key widens its block's [min, max]; a block's first slot starts them
    afresh (a freed block's old bounds are forgotten)."""
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        block = slot // block_size
        if slot % block_size == 0:
            key_min[block] = k[t]
            key_max[block] = k[t]
        else:
            for h in range(k.shape[1]):
                for d in range(k.shape[2]):
                    key_min[block, h, d] = min(key_min[block, h, d], k[t, h, d])
                    key_max[block, h, d] = max(key_max[block, h, d], k[t, h, d])


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray, quant: KVQuant | None = None,
             bounds: BlockBounds | None = None) -> None:
    """Scatter k, v (T, num_kv_heads, head_dim) into the caches at ``slot_mapping`` (T,), whose
    slots are distinct (-1 aside: tokens not written), as the block tables make them: from
    WRITE_KV_PARALLEL_MIN_TOKENS tokens the threads write at once;
    with ``quant``, as int8 or fp8 bytes (and int8's per-token scales); with ``bounds``,
    keeping each block's key min / max (block-sparse attention's page metadata)."""
    if bounds is not None:
        _update_key_bounds(k, slot_mapping, k_cache.shape[2], bounds.key_min, bounds.key_max)
    kernel = _write_kv(slot_mapping.shape[0])
    if quant is None:
        kernel(k_cache, v_cache, k, v, slot_mapping, KV_FLOAT, _NO_SCALES, _NO_SCALES)
    else:
        kernel(k_cache, v_cache, k, v, slot_mapping, quant.fmt, quant.k_scale, quant.v_scale)


# --------------------------------------------------------------------------- block copies (DMA)

@njit(cache=True)
def _swap_blocks(src, dst, block_mapping):
    for i in range(block_mapping.shape[0]):
        s, d = block_mapping[i, 0], block_mapping[i, 1]
        for layer in range(src.shape[0]):
            for kv in range(2):
                dst[layer, kv, d] = src[layer, kv, s]


def swap_blocks(src: np.ndarray, dst: np.ndarray, block_mapping: np.ndarray) -> None:
    """Copy blocks ``block_mapping[:, 0]`` of ``src`` to ``block_mapping[:, 1]`` of ``dst``, all layers.

    src, dst: (num_layers, 2, num_blocks, ...): the K/V pools, or int8's per-block scales
    block_mapping: (n, 2)
    """
    if len(block_mapping):
        _swap_blocks(src, dst, np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2))


def copy_blocks(kv_cache: np.ndarray, block_mapping: np.ndarray) -> None:
    """Copy-on-write: duplicate blocks inside one pool (destinations are fresh blocks)."""
    swap_blocks(kv_cache, kv_cache, block_mapping)


# --------------------------------------------------------------------------- paged attention

@njit(cache=True)
def _choose_blocks(qs, key_min, key_max, table, num_blocks, keep, num_heads, group):
    """(rows, num_blocks) bool: the blocks each query row (a head) keeps. A block's score is the
    most any of its keys could give, sum_d max(q_d * min_d, q_d * max_d); the first and last
    blocks always stay, then the keep - 2 highest of the others (ties: the earlier block)."""
    rows, head_dim = qs.shape
    chosen = np.zeros((rows, num_blocks), np.bool_)
    bound = np.empty(num_blocks - 2, np.float32)
    for r in range(rows):
        kv_head = (r % num_heads) // group
        for j in range(1, num_blocks - 1):
            block = table[j]
            total = np.float32(0.0)
            for d in range(head_dim):
                total += max(qs[r, d] * key_min[block, kv_head, d], qs[r, d] * key_max[block, kv_head, d])
            bound[j - 1] = -total
        order = np.argsort(bound, kind="mergesort")          # stable: ties keep block order
        chosen[r, 0] = True
        chosen[r, num_blocks - 1] = True
        for i in range(keep - 2):
            chosen[r, 1 + order[i]] = True
    return chosen


@njit(inline="always", cache=True)
def _work_item(work, w, tile, block_size, query_start_loc, seq_lens):
    """Work item w (tiles of ``tile`` queries: the caller's QUERY_TILE, so that one value sizes
    its scratch and its tiles), unpacked: its sequence s, query rows [t0, t1), the blocks it reads
    [first_block, end_block) (a split-K slice's), its partial slot (-1: a whole tile), and the
    positions of its first and last query."""
    s, t0 = work[w, 0], work[w, 1]
    first_block, end_block, slot = work[w, 2] // block_size, work[w, 3] // block_size, work[w, 4]
    seq_start, seq_end = query_start_loc[s], query_start_loc[s + 1]
    t1 = min(t0 + tile, seq_end)
    first_pos = seq_lens[s] - (seq_end - seq_start) + (t0 - seq_start)
    last_pos = first_pos + (t1 - t0) - 1
    return s, t0, t1, first_block, end_block, slot, first_pos, last_pos


@njit(inline="always", cache=True)
def _any_chosen(chosen, r0, heads, j):
    """Whether any of rows r0 .. r0 + heads - 1 keeps block j (block-sparse decode)."""
    for g in range(heads):
        if chosen[r0 + g, j]:
            return True
    return False


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _row_max(row, n):
    """max(row[:n]) (-inf for n = 0), row a 1-D float32 array: four registers of running
    maxima (``vmax``), 4 x LANES values a step, then the last few one by one. LLVM does not
    vectorise a loop of ``max`` itself: one chain of scalar compares ran at ~1 ns a value,
    eight scalar chains at ~0.16 (a 256-value row on a Zen 3 core); four registers of eight
    at ~0.03 (docs/benchmarks.md)."""
    top = np.float32(-np.inf)
    j = 0
    if n >= 4 * LANES:
        m0, m1 = vload(row, 0), vload(row, LANES)
        m2, m3 = vload(row, 2 * LANES), vload(row, 3 * LANES)
        j = 4 * LANES
        while j + 4 * LANES <= n:
            m0, m1 = vmax(m0, vload(row, j)), vmax(m1, vload(row, j + LANES))
            m2, m3 = vmax(m2, vload(row, j + 2 * LANES)), vmax(m3, vload(row, j + 3 * LANES))
            j += 4 * LANES
        top = vmax_lanes(vmax(vmax(m0, m1), vmax(m2, m3)))
    while j < n:
        top = max(top, row[j])
        j += 1
    return top


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _softmax_step(row, n, row_max, row_sum, r):
    """One online softmax step for row r over n keys (a block, or a chunk of blocks): row[:n]
    holds their scores (-inf where the row does not read a key) and gets their e^(s - new max);
    row_max[r] and row_sum[r] are brought up to date. Returns the factor the row's running sum
    of p * v must be scaled by (1 when none of the keys is read)."""
    new_max = max(row_max[r], _row_max(row, n))
    if not new_max > np.float32(-1e30):      # -inf: nothing read yet (no test against inf,
        # which fastmath may fold away): p = 0 for every key
        for o in range(n):
            row[o] = 0.0
        return np.float32(1.0)
    correction = fast_exp(row_max[r] - new_max)
    total = row_sum[r] * correction
    for o in range(n):                       # the exps, vectorised
        row[o] = fast_exp(row[o] - new_max)
    for o in range(n):
        total += row[o]
    row_sum[r] = total
    row_max[r] = new_max
    return correction


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _softmax_block(row, valid, row_max, row_sum, r, skip):
    """The loop kernel's step for one block (``_softmax_step`` over its ``valid`` keys).
    ``skip`` (block-sparse: this head does not read the block): p = 0 and the factor 1, the
    row's statistics untouched."""
    if skip:
        for o in range(valid):
            row[o] = 0.0
        return np.float32(1.0)
    return _softmax_step(row, valid, row_max, row_sum, r)


@njit(fastmath=True, inline="always", cache=True)
def _finish_item(acc, row_max, row_sum, rows, t0, slot, layer_v, part_acc, part_max, part_sum, out):
    """An item's rows out: a slice's unnormalised sums, max and total into its partial slot (for
    _merge_partials), or a whole tile's acc / row_sum into out (rows: query-major, then head)."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    if slot >= 0:
        for r in range(rows):
            part_max[slot, r] = row_max[r]
            part_sum[slot, r] = row_sum[r]
            for d in range(head_dim):
                part_acc[slot, r, d] = acc[r, d] * layer_v
        return
    for r in range(rows):
        inv = layer_v / row_sum[r]
        for d in range(head_dim):
            out[t0 + r // num_heads, r % num_heads, d] = acc[r, d] * inv


def _paged_attention_body(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           scale, work, num_threads, k_scale, v_scale, key_min, key_max, keep,
                           part_acc, part_max, part_sum, out):
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # A compressed cache (kv_quant): values are widened to float32 as they are read (``widen``
    # is compiled for the cache's element type); int8 scales each token's score and value by
    # its own scale, fp8's layer scales fold into the queries and the output. KV_FORMAT is
    # a constant of each compiled copy (``_specialize``), so every branch on it folds away.
    per_token = KV_FORMAT == KV_INT8
    fp8 = KV_FORMAT != KV_FLOAT and not per_token
    layer_k = k_scale[0, 0, 0] * fp8_widen_scale(KV_FORMAT) if fp8 else np.float32(1.0)
    layer_v = v_scale[0, 0, 0] * fp8_widen_scale(KV_FORMAT) if fp8 else np.float32(1.0)
    # Thread `tid` takes work items tid, tid + n, tid + 2n, ...: late tiles of a
    # prompt cost more than early ones, and striding spreads them evenly.
    # An item is (sequence, first query row, first token, end token, partial slot): a whole
    # tile writes its output; a slice of a long context (split-K, partial slot >= 0) reads the
    # blocks from first // block_size to end // block_size (consecutive slices share none)
    # and writes its unnormalised sum, max and total for _merge_partials.
    for tid in prange(num_threads):
        for w in range(tid, work.shape[0], num_threads):
            s, t0, t1, first_block, end_block, slot, first_pos, last_pos = _work_item(
                work, w, QUERY_TILE, block_size, query_start_loc, seq_lens)
            # One item covers every head of its queries, so it reads each block's
            # contiguous [head 0 | head 1 | ...] chunk once, front to back.
            rows = (t1 - t0) * num_heads                 # row r = query r // num_heads, head r % num_heads
            qs = np.empty((rows, head_dim), np.float32)  # scaled queries
            acc = np.zeros((rows, head_dim), np.float32)  # running sum of p * v
            row_max = np.full(rows, -np.inf, np.float32)  # running max score (online softmax)
            row_sum = np.zeros(rows, np.float32)          # running sum of p
            scores = np.empty((4, block_size), np.float32)   # a block's scores, then its p, per head
            for r in range(rows):
                for d in range(head_dim):
                    qs[r, d] = q[t0 + r // num_heads, r % num_heads, d] * (scale * layer_k)
            num_ctx_blocks = last_pos // block_size + 1
            # Block-sparse decode (Quest): a decoding head attends only to the `keep` blocks
            # whose keys could score highest, always the first and the last.
            sparse = keep > 0 and query_start_loc[s + 1] - query_start_loc[s] == 1 and num_ctx_blocks > keep
            chosen = _choose_blocks(qs, key_min, key_max, block_tables[s], num_ctx_blocks, keep,
                                    num_heads, group) if sparse else _ALL_BLOCKS
            # GQA: the `group` query heads of a KV head read the same keys and values, so
            # HEADS of them (HEADS_TOGETHER, a constant of each compiled copy) go together:
            # each K or V value loaded once feeds HEADS multiply-adds, kept in scalars.
            heads = HEADS_TOGETHER
            last_block = min(end_block, num_ctx_blocks)
            for j in range(first_block, last_block):
                block = block_tables[s, j]
                # The next block's K and V load while this one is scored, when the next block is
                # elsewhere in the pool: the CPU's own prefetcher follows consecutive blocks, and
                # asking for them anyway made the kernel up to 1.8x slower on an AMD EPYC.
                next_block = block_tables[s, j + 1] if j + 1 < last_block else block + 1
                if not sparse and next_block != block + 1:
                    _prefetch_block(k_cache, next_block)
                    _prefetch_block(v_cache, next_block)
                for qi in range(t1 - t0):
                    # causal: this query sees positions <= its own
                    valid = min(block_size, first_pos + qi - j * block_size + 1)
                    if valid <= 0:
                        continue
                    for kv_head in range(num_kv_heads):
                        for g0 in range(0, group, heads):
                            r0 = qi * num_heads + kv_head * group + g0   # rows r0 .. r0 + heads - 1
                            if sparse and not _any_chosen(chosen, r0, heads, j):
                                continue                 # no head of the group keeps block j
                            for o in range(valid):               # the block's scores, key by key
                                a0 = a1 = a2 = a3 = np.float32(0.0)
                                for d in range(head_dim):
                                    key = widen(k_cache[block, kv_head, o, d], KV_FORMAT)
                                    a0 += qs[r0, d] * key
                                    if heads > 1:
                                        a1 += qs[r0 + 1, d] * key
                                    if heads > 2:
                                        a2 += qs[r0 + 2, d] * key
                                    if heads > 3:
                                        a3 += qs[r0 + 3, d] * key
                                if per_token:
                                    key_scale = k_scale[block, kv_head, o]
                                    a0, a1, a2, a3 = a0 * key_scale, a1 * key_scale, a2 * key_scale, a3 * key_scale
                                scores[0, o] = a0
                                if heads > 1:
                                    scores[1, o] = a1
                                if heads > 2:
                                    scores[2, o] = a2
                                if heads > 3:
                                    scores[3, o] = a3
                            for g in range(heads):               # each head's online softmax
                                r = r0 + g
                                skip = sparse and not chosen[r, j]   # this head skips the block
                                correction = _softmax_block(scores[g], valid, row_max, row_sum, r, skip)
                                if not skip:
                                    for d in range(head_dim):
                                        acc[r, d] *= correction
                            for o in range(valid):               # p * v, each value loaded once
                                p0 = scores[0, o]
                                p1 = scores[1, o] if heads > 1 else np.float32(0.0)
                                p2 = scores[2, o] if heads > 2 else np.float32(0.0)
                                p3 = scores[3, o] if heads > 3 else np.float32(0.0)
                                if per_token:
                                    value_scale = v_scale[block, kv_head, o]
                                    p0, p1, p2, p3 = p0 * value_scale, p1 * value_scale, p2 * value_scale, p3 * value_scale
                                for d in range(head_dim):
                                    value = widen(v_cache[block, kv_head, o, d], KV_FORMAT)
                                    acc[r0, d] += p0 * value
                                    if heads > 1:
                                        acc[r0 + 1, d] += p1 * value
                                    if heads > 2:
                                        acc[r0 + 2, d] += p2 * value
                                    if heads > 3:
                                        acc[r0 + 3, d] += p3 * value
            _finish_item(acc, row_max, row_sum, rows, t0, slot, layer_v, part_acc, part_max, part_sum, out)


KV_FORMAT = KV_FLOAT     # what the copies below replace; read by the kernel body only
HEADS_TOGETHER = 1       # query heads of a GQA group scored together (1 to 4): set in each copy
_ALL_BLOCKS = np.ones((1, 1), np.bool_)   # dense attention: no selection


def _specialize(fn, **constants):
    """A copy of ``fn`` that sees these module constants (KV_FORMAT, HEADS_TOGETHER) with the
    given values, under its own name (Numba caches by name), so every branch on them folds
    away. The copy reads a snapshot of this module's globals taken here: monkeypatching a
    constant the kernel body reads (QUERY_TILE, say) later does not reach it."""
    suffix = "_".join(str(v) for v in constants.values())
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **constants}, f"{fn.__name__}_{suffix}",
                              fn.__defaults__, fn.__closure__)
    copy.__qualname__ = f"{fn.__qualname__}_{suffix}"
    return copy


def heads_together(group: int) -> int:
    """How many query heads of a GQA group the decode kernel scores together: the largest
    divisor of the group up to 4 (SmolLM2's 3; 4 of Llama-3's 4; 2 of a group of 6)."""
    return max(n for n in (1, 2, 3, 4) if group % n == 0)


# serial and threaded compilations for each storage format (float, int8, fp8 e4m3, fp8 e5m2)
# and each number of heads scored together, compiled on first use
_paged_attention = {(fmt, heads): two_ways(_specialize(_paged_attention_body, KV_FORMAT=fmt, HEADS_TOGETHER=heads),
                                           "ATTENTION_PARALLEL_MIN_WORK", SIMD_CACHE)
                    for fmt in (KV_FLOAT, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2) for heads in (1, 2, 3, 4)}


# --------------------------------------------------------------------------- paged attention in registers

# A float32 cache is read by the kernel below, which names its vector registers (kernels/simd.py)
# instead of leaving the head_dim loops to LLVM: a key's dot products with the HEADS queries
# of its group are HEADS registers of sums, added across lanes once per key, and p x v keeps
# the HEADS rows' accumulators for 4 x LANES of head_dim in registers across a whole block,
# where the loop above loads and stores them for every key. It asks for the next block's K a
# few lines per key while it scores, and for the next block's V while it multiplies. At 64
# decodes of 264 tokens, all 30 layers: 30-32 ms a step against 37-40 (2-core AMD EPYC, Zen 3,
# docs/benchmarks.md). Quantized caches, head_dim that is not a multiple of LANES, and pools it
# cannot address as a flat window (head_dim strided, negative strides, K and V laid out
# differently) use the loop above.
VECTOR_ATTENTION = True

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


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _three_fmas(heads, p0, p1, p2, value, a, b, c):
    """p_g * value + sum_g for the group's first ``heads`` (1 to 3) heads; the others unchanged."""
    a = vfma(p0, value, a)
    if heads > 1:
        b = vfma(p1, value, b)
    if heads > 2:
        c = vfma(p2, value, c)
    return a, b, c


@njit(inline="always", cache=SIMD_CACHE)
def _mask_unread(scores, at, span, heads, valid, chosen, r0, j):
    """Block-sparse decode: the scores of block j's ``valid`` keys become -inf (p = 0) for each
    of rows r0 .. r0 + heads - 1 that does not read the block (their scores at at + g * span)."""
    for g in range(heads):
        if not chosen[r0 + g, j]:
            for o in range(valid):
                scores[at + g * span + o] = -np.inf


def _vector_attention_body(q, k_flat, v_flat, block_stride, head_stride, token_stride, block_size,
                           num_kv_heads, block_tables, seq_lens, query_start_loc, scale, work,
                           num_threads, key_min, key_max, keep, part_acc, part_max, part_sum, out):
    """``_paged_attention_body`` for a float32 cache, in registers. k_flat / v_flat: the pools'
    memory as flat float32 windows, element (block, head, token, d) at block * block_stride +
    head * head_stride + token * token_stride + d. The work items, and block-sparse decode's
    choice of blocks (``keep`` > 0), are the same. A work item walks its context a chunk of
    SCORE_CHUNK keys at a time, in the textbook's three steps: (1) the chunk's scores, (2) one
    online softmax step over the whole chunk, (3) p x v. Steps 1 and 3 each go block by block,
    a block's KV heads in turn, so that each reads the block's K (then V) as one run of memory;
    step 1 asks for the next block's K, step 3 for the next block's V, so that memory streams
    through both."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    heads = HEADS_TOGETHER                      # 1 to 3: a constant of each compiled copy
    quad = 4 * LANES                            # head_dim a register quad covers
    quads_end = quad * (head_dim // quad)
    chunk_blocks = max(1, SCORE_CHUNK // block_size)
    span = chunk_blocks * block_size            # keys a chunk holds
    for tid in prange(num_threads):
        # a thread's scratch, flat (rows x head_dim): scaled queries, running sums of p * v
        queries = np.empty((QUERY_TILE * num_heads, head_dim), np.float32)   # (rows, head_dim)
        qs = queries.reshape(-1)                                            # the same, flat
        sums = np.empty((QUERY_TILE * num_heads, head_dim), np.float32)      # (rows, head_dim) of p * v
        acc = sums.reshape(-1)                                              # the same, flat
        row_max = np.empty(QUERY_TILE * num_heads, np.float32)
        row_sum = np.empty(QUERY_TILE * num_heads, np.float32)
        scores = np.empty(num_heads * span, np.float32)   # (num_heads, span): a query's scores, then p
        for w in range(tid, work.shape[0], num_threads):
            s, t0, t1, first_block, end_block, slot, first_pos, last_pos = _work_item(
                work, w, QUERY_TILE, block_size, query_start_loc, seq_lens)
            rows = (t1 - t0) * num_heads                 # row r = query r // num_heads, head r % num_heads
            for r in range(rows):
                row_max[r] = -np.inf
                row_sum[r] = 0.0
                for d in range(head_dim):
                    qs[r * head_dim + d] = q[t0 + r // num_heads, r % num_heads, d] * scale
                    acc[r * head_dim + d] = 0.0
            num_ctx_blocks = last_pos // block_size + 1
            # Block-sparse decode (Quest): as in the loop kernel, a decoding head reads only the
            # `keep` blocks whose keys could score highest, always the first and the last.
            sparse = keep > 0 and query_start_loc[s + 1] - query_start_loc[s] == 1 and num_ctx_blocks > keep
            chosen = _choose_blocks(queries[:rows], key_min, key_max, block_tables[s], num_ctx_blocks,
                                    keep, num_heads, group) if sparse else _ALL_BLOCKS
            last_block = min(end_block, num_ctx_blocks)
            for c0 in range(first_block, last_block, chunk_blocks):
                c1 = min(c0 + chunk_blocks, last_block)
                for qi in range(t1 - t0):
                    # the chunk's keys this query reads: a prefix of the chunk (causal)
                    n_keys = min(c1 * block_size, first_pos + qi + 1) - c0 * block_size
                    if n_keys <= 0:
                        continue
                    rq = qi * num_heads                  # the query's first row
                    # 1. the chunk's scores, block by block; a block's KV heads in turn (its K is
                    #    one run of memory), each key against the group's heads
                    for j in range(c0, c1):
                        o0 = (j - c0) * block_size       # block j's first key in the chunk
                        valid = min(block_size, n_keys - o0)
                        if valid <= 0:
                            break
                        block = block_tables[s, j]
                        ahead = 0                        # no next block, or no telling which
                        if j + 1 < last_block and not sparse:
                            ahead = (block_tables[s, j + 1] - block) * block_stride
                        for kv_head in range(num_kv_heads):
                            base = block * block_stride + kv_head * head_stride     # the head's tile
                            for g0 in range(0, group, heads):
                                h = kv_head * group + g0         # heads h .. h + heads - 1
                                r0 = rq + h                      # their rows
                                at = h * span + o0               # where their scores go
                                if sparse and not _any_chosen(chosen, r0, heads, j):
                                    _mask_unread(scores, at, span, heads, valid, chosen, r0, j)
                                    continue                     # no head of the group reads block j
                                q0 = r0 * head_dim               # where row r0's queries start
                                q1, q2 = q0 + head_dim, q0 + 2 * head_dim
                                for o in range(valid):
                                    key_at = base + o * token_stride
                                    if ahead != 0 and qi == 0 and g0 == 0:   # the next K, a line at a time
                                        for line in range(0, head_dim, 16):
                                            prefetch(k_flat, 4 * (key_at + ahead + line))
                                    if j + 1 == c1 and qi == 0 and g0 == 0:  # the chunk's first V, for step 3
                                        first_v = key_at + (block_tables[s, c0] - block) * block_stride
                                        for line in range(0, head_dim, 16):
                                            prefetch(v_flat, 4 * (first_v + line))
                                    a0 = a1 = a2 = vzero()
                                    for c in range(0, head_dim, LANES):
                                        key = vload(k_flat, key_at + c)
                                        a0 = vfma(vload(qs, q0 + c), key, a0)
                                        if heads > 1:
                                            a1 = vfma(vload(qs, q1 + c), key, a1)
                                        if heads > 2:
                                            a2 = vfma(vload(qs, q2 + c), key, a2)
                                    scores[at + o] = vsum(a0)
                                    if heads > 1:
                                        scores[at + span + o] = vsum(a1)
                                    if heads > 2:
                                        scores[at + 2 * span + o] = vsum(a2)
                                if sparse:                       # the group's heads that skip it
                                    _mask_unread(scores, at, span, heads, valid, chosen, r0, j)
                    # 2. each row's online softmax step over the whole chunk; its sums rescaled
                    for h in range(num_heads):
                        correction = _softmax_step(scores[h * span:], n_keys, row_max, row_sum, rq + h)
                        if correction != np.float32(1.0):
                            factor = vsplat(correction)
                            for c in range(0, head_dim, LANES):
                                at = (rq + h) * head_dim + c
                                vstore(acc, at, vmul(vload(acc, at), factor))
                    # 3. p * v, block by block; a block's KV heads in turn (its V is one run of
                    #    memory), 4 registers of head_dim for each of the group's heads
                    for j in range(c0, c1):
                        o0 = (j - c0) * block_size
                        valid = min(block_size, n_keys - o0)
                        if valid <= 0:
                            break
                        block = block_tables[s, j]
                        v_ahead = 0                      # the next block's V, or the next chunk's first K
                        if j + 1 < c1 and not sparse:
                            v_ahead = (block_tables[s, j + 1] - block) * block_stride
                        for kv_head in range(num_kv_heads):
                            tile = kv_head * head_stride         # the head's tile in a block
                            if qi == 0 and v_ahead != 0:
                                for line in range(0, block_size * token_stride, 16):
                                    prefetch(v_flat, 4 * (block * block_stride + tile + v_ahead + line))
                            elif qi == 0 and j + 1 == c1 and c1 < last_block:
                                for line in range(0, block_size * token_stride, 16):
                                    prefetch(k_flat, 4 * (block_tables[s, c1] * block_stride + tile + line))
                            for g0 in range(0, group, heads):
                                h = kv_head * group + g0
                                r0 = rq + h
                                if sparse and not _any_chosen(chosen, r0, heads, j):
                                    continue
                                q0 = r0 * head_dim
                                q1, q2 = q0 + head_dim, q0 + 2 * head_dim
                                p0_at = h * span + o0            # the heads' p for block j
                                p1_at, p2_at = p0_at + span, p0_at + 2 * span
                                base = block * block_stride + kv_head * head_stride
                                for c in range(0, quads_end, quad):
                                    e0 = vload(acc, q0 + c)
                                    e1 = vload(acc, q0 + c + LANES)
                                    e2 = vload(acc, q0 + c + 2 * LANES)
                                    e3 = vload(acc, q0 + c + 3 * LANES)
                                    f0 = f1 = f2 = f3 = h0 = h1 = h2 = h3 = vzero()
                                    if heads > 1:
                                        f0 = vload(acc, q1 + c)
                                        f1 = vload(acc, q1 + c + LANES)
                                        f2 = vload(acc, q1 + c + 2 * LANES)
                                        f3 = vload(acc, q1 + c + 3 * LANES)
                                    if heads > 2:
                                        h0 = vload(acc, q2 + c)
                                        h1 = vload(acc, q2 + c + LANES)
                                        h2 = vload(acc, q2 + c + 2 * LANES)
                                        h3 = vload(acc, q2 + c + 3 * LANES)
                                    for o in range(valid):
                                        # the heads' p first, then one value register at a time:
                                        # 12 sums + 3 p + 1 value = AVX2's 16 registers, none spilled
                                        at = base + o * token_stride + c
                                        p0 = vbroadcast(scores, p0_at + o)
                                        p1 = vbroadcast(scores, p1_at + o) if heads > 1 else p0
                                        p2 = vbroadcast(scores, p2_at + o) if heads > 2 else p0
                                        value = vload(v_flat, at)
                                        e0, f0, h0 = _three_fmas(heads, p0, p1, p2, value, e0, f0, h0)
                                        value = vload(v_flat, at + LANES)
                                        e1, f1, h1 = _three_fmas(heads, p0, p1, p2, value, e1, f1, h1)
                                        value = vload(v_flat, at + 2 * LANES)
                                        e2, f2, h2 = _three_fmas(heads, p0, p1, p2, value, e2, f2, h2)
                                        value = vload(v_flat, at + 3 * LANES)
                                        e3, f3, h3 = _three_fmas(heads, p0, p1, p2, value, e3, f3, h3)
                                    vstore(acc, q0 + c, e0); vstore(acc, q0 + c + LANES, e1)                 # noqa: E702
                                    vstore(acc, q0 + c + 2 * LANES, e2); vstore(acc, q0 + c + 3 * LANES, e3)  # noqa: E702
                                    if heads > 1:
                                        vstore(acc, q1 + c, f0); vstore(acc, q1 + c + LANES, f1)                 # noqa: E702
                                        vstore(acc, q1 + c + 2 * LANES, f2); vstore(acc, q1 + c + 3 * LANES, f3)  # noqa: E702
                                    if heads > 2:
                                        vstore(acc, q2 + c, h0); vstore(acc, q2 + c + LANES, h1)                 # noqa: E702
                                        vstore(acc, q2 + c + 2 * LANES, h2); vstore(acc, q2 + c + 3 * LANES, h3)  # noqa: E702
                                for c in range(quads_end, head_dim, LANES):   # what is left, a register at a time
                                    e0 = vload(acc, q0 + c)
                                    f0 = vload(acc, q1 + c) if heads > 1 else vzero()
                                    h0 = vload(acc, q2 + c) if heads > 2 else vzero()
                                    for o in range(valid):
                                        v0 = vload(v_flat, base + o * token_stride + c)
                                        e0 = vfma(vbroadcast(scores, p0_at + o), v0, e0)
                                        if heads > 1:
                                            f0 = vfma(vbroadcast(scores, p1_at + o), v0, f0)
                                        if heads > 2:
                                            h0 = vfma(vbroadcast(scores, p2_at + o), v0, h0)
                                    vstore(acc, q0 + c, e0)
                                    if heads > 1:
                                        vstore(acc, q1 + c, f0)
                                    if heads > 2:
                                        vstore(acc, q2 + c, h0)
            _finish_item(sums, row_max, row_sum, rows, t0, slot, np.float32(1.0), part_acc, part_max, part_sum, out)


def vector_heads(group: int) -> int:
    """Query heads of a GQA group the register kernel scores together: the largest divisor of the
    group up to 3 (its registers hold three heads' sums beside a block's values)."""
    return max(n for n in (1, 2, 3) if group % n == 0)


# serial and threaded compilations for 1, 2 or 3 heads scored together, compiled on first use
_vector_attention = {heads: two_ways(_specialize(_vector_attention_body, HEADS_TOGETHER=heads),
                                     "ATTENTION_PARALLEL_MIN_WORK", SIMD_CACHE) for heads in (1, 2, 3)}


def _flat_window(pool: np.ndarray) -> np.ndarray | None:
    """The float32 memory a pool view spans, as a flat array over the same bytes (None when its
    rows of head_dim are not contiguous, or a stride is negative): element i of the window is
    the float32 i elements past the pool's first one."""
    if pool.dtype != np.float32:
        return None
    if pool.flags.c_contiguous:          # every engine pool: a plain view (as_strided costs ~10 us)
        return pool.reshape(-1)
    strides = pool.strides
    if strides[-1] != 4 or any(st < 0 or st % 4 for st in strides):
        return None
    span = 1 + sum((n - 1) * st // 4 for n, st in zip(pool.shape, strides)) if pool.size else 0
    return np.lib.stride_tricks.as_strided(pool, shape=(span,), strides=(4,))


def _bounds_args(bounds: BlockBounds | None) -> tuple:
    """(key_min, key_max, keep) for the kernels: placeholders and 0 (dense) without bounds."""
    return (_NO_BOUNDS, _NO_BOUNDS, 0) if bounds is None else (bounds.key_min, bounds.key_max, bounds.keep)


def _vector_attention_call(q, k_cache, v_cache, plan, scale, part_acc, part_max, part_sum, out,
                           bounds: BlockBounds | None = None) -> bool:
    """Run the register kernel when it can read this cache; False when it cannot."""
    head_dim = q.shape[2]
    if not VECTOR_ATTENTION or head_dim % LANES or k_cache.strides != v_cache.strides:
        return False
    k_flat, v_flat = _flat_window(k_cache), _flat_window(v_cache)
    if k_flat is None or v_flat is None:
        return False
    block_stride, head_stride, token_stride, _ = (st // 4 for st in k_cache.strides)
    kernel = _vector_attention[vector_heads(q.shape[1] // k_cache.shape[1])](plan.work_estimate)
    meta = plan.meta
    key_min, key_max, keep = _bounds_args(bounds)
    kernel(q, k_flat, v_flat, block_stride, head_stride, token_stride, k_cache.shape[2], k_cache.shape[1],
           meta.block_tables, meta.seq_lens, meta.query_start_loc, np.float32(scale), plan.items,
           plan.num_threads, key_min, key_max, keep, part_acc, part_max, part_sum, out)
    return True


# Queries per sequence from which attention takes the prompt path: the prompt kernel, or BLAS.
BLAS_MIN_QUERIES = 32
# Long prompts and big chunks on a float32 cache take ``kernels/prompt_attention.py`` (scores
# in a chunk-sized scratch, products in registers) instead of the two BLAS products below,
# unless oneMKL's products were chosen (``gemm``); quantized caches keep the BLAS path. One
# layer's attention of a whole prompt, 2-core Zen 3 EPYC: see docs/kernels.md.
PROMPT_KERNEL = True
# Query rows per BLAS tile, bounding the (rows, context) score matrix. A tile's scores are
# written by the first product, rewritten by the softmax and read by the second: 128 queries
# (x 3 heads of a GQA group x 2048 keys: 3 MB) against 256 (6 MB) cut one layer's attention on
# a 2-core AMD EPYC (1 MiB of L2 a core) from 3.5 to 2.2 ms at 256 tokens, 7.7 to 5.3 at 512,
# 21 to 16.4 at 1024 and 61-68 to 45-57 at 2048; the smaller tiles also compute less of the
# masked causal future. (2-core Xeon, MKL: 40.8-46.9 ms at 256 against 42.3-50.1 at 128.)
BLAS_QUERY_TILE = 128
# Score elements from which the softmax pass is threaded. One layer's attention of a 256-token
# prompt (three (768, 256) tiles) took 1.57 ms threaded, 1.88 serial; 2048 tokens: 42 / 55 ms.
SOFTMAX_PARALLEL_MIN_ELEMENTS = 1 << 16


def attention_work_items(query_start_loc: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """List the (sequence, first query row) tiles of the given sequences: (W, 2) int64."""
    starts = query_start_loc[seqs].astype(np.int64)                   # (n,)
    q_lens = query_start_loc[seqs + 1].astype(np.int64) - starts       # (n,)
    tiles = -(-q_lens // QUERY_TILE)                                  # (n,) ceil
    work = np.empty((int(tiles.sum()), 2), dtype=np.int64)
    work[:, 0] = np.repeat(seqs, tiles)
    first_tile = np.repeat(np.cumsum(tiles) - tiles, tiles)
    work[:, 1] = np.repeat(starts, tiles) + (np.arange(len(work)) - first_tile) * QUERY_TILE
    return work


@partial(two_ways, min_work="SOFTMAX_PARALLEL_MIN_ELEMENTS", cache=SIMD_CACHE)   # _row_max: registers
def _causal_softmax(scores, row_pos, scale, sums):
    """In place, row by row: exp(scale * (s - max)) over the keys the row may see (keys
    0..row_pos[r]), 0 for the causal future; sums[r] gets the row's total. One pass for
    what numpy needs five for (scale, mask, max, exp, sum), with the vectorised exp."""
    for r in prange(scores.shape[0]):
        row = scores[r]
        visible = row_pos[r] + 1
        top = _row_max(row, visible) * scale
        total = np.float32(0.0)
        for j in range(visible):
            e = fast_exp(row[j] * scale - top)
            row[j] = e
            total += e
        for j in range(visible, row.shape[0]):
            row[j] = 0.0
        sums[r] = total


def _blas_attention(q, k_cache, v_cache, block_table, seq_len, scale, out, quant=None, gemm=None) -> None:
    """Attention of one sequence's many queries with two matrix products per KV head.

    q, out: (n, num_heads, head_dim), the last n positions of a context of seq_len.
    The context's blocks are gathered into contiguous (seq_len, head_dim) tiles
    first: the same page-table walk as the kernel, then BLAS does the arithmetic
    (vLLM's prefills likewise leave the paged kernel for a dense one). ``gemm``: oneMKL
    (``kernels/packed_gemm.py``) for the two products, else numpy's BLAS. On MKL they run
    on the OpenMP pool the softmax uses; numpy's OpenBLAS pool then slows that pass (a
    2048-token prompt, one layer: softmax 10 ms after MKL's products, 11-23 after OpenBLAS's).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    blocks = block_table[: -(-seq_len // block_size)]
    # (kv_heads, seq_len, head_dim): blocks in logical order, heads first
    keys = k_cache[blocks].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
    values = v_cache[blocks].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
    if quant is not None:   # widened as they are gathered: this copy is made for floats too
        keys = dequantize(keys, quant.fmt, _gathered_scales(quant.k_scale, quant.fmt, blocks, seq_len))
        values = dequantize(values, quant.fmt, _gathered_scales(quant.v_scale, quant.fmt, blocks, seq_len))
    for start in range(0, n, BLAS_QUERY_TILE):
        stop = min(start + BLAS_QUERY_TILE, n)
        first_pos = seq_len - n + start
        last_pos = seq_len - n + stop - 1
        # (rows,) position of each (query, head-in-group) row; keys beyond last_pos are never seen
        row_pos = np.repeat(np.arange(first_pos, last_pos + 1), group)
        total = np.empty(len(row_pos), np.float32)                         # (rows,) softmax sums
        for h in range(num_kv_heads):
            qh = q[start:stop, h * group:(h + 1) * group].reshape(-1, head_dim)  # (rows, head_dim)
            if gemm is None:
                scores = qh @ keys[h, : last_pos + 1].T                    # (rows, keys)
            else:
                scores = gemm.sgemm(qh, keys[h, : last_pos + 1], trans_b=True)
            _causal_softmax(scores.size)(scores, row_pos, np.float32(scale), total)
            seen = values[h, : last_pos + 1]                               # (keys, head_dim)
            weighted = scores @ seen if gemm is None else gemm.sgemm(scores, seen)   # (rows, head_dim)
            # normalise the (rows, head_dim) result, not the (rows, keys) weights
            out[start:stop, h * group:(h + 1) * group] = (
                weighted / total[:, None]).reshape(stop - start, group, head_dim)


def _gathered_scales(scales: np.ndarray, fmt: int, blocks: np.ndarray, seq_len: int) -> np.ndarray:
    """int8: the (kv_heads, seq_len, 1) scales of a gathered context; fp8: the layer's (1, 1, 1)."""
    if fmt != KV_INT8:
        return scales.reshape(1, 1, 1)
    heads = scales.shape[1]
    return scales[blocks].transpose(1, 0, 2).reshape(heads, -1)[:, :seq_len, None]


# Split-K: when the Numba kernel has fewer tiles than threads (a few long decodes), a tile
# whose context has at least this many tokens per thread is cut into one slice per thread,
# the way the GPU kernel splits long contexts into partitions, and the slices are merged.
SPLIT_MIN_TOKENS = 256


@njit(cache=True)
def _merge_partials(part_acc, part_max, part_sum, merges, query_start_loc, num_heads, out):
    """Combine the slices of each split tile: sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M)."""
    for i in range(merges.shape[0]):
        s, t0, first, count = merges[i, 0], merges[i, 1], merges[i, 2], merges[i, 3]
        t1 = min(t0 + QUERY_TILE, query_start_loc[s + 1])
        for r in range((t1 - t0) * num_heads):
            top = -np.inf
            for p in range(first, first + count):
                top = max(top, part_max[p, r])
            total = np.float32(0.0)
            for p in range(first, first + count):
                if part_sum[p, r] > 0:
                    total += part_sum[p, r] * fast_exp(part_max[p, r] - top)
            for d in range(part_acc.shape[2]):
                value = np.float32(0.0)
                for p in range(first, first + count):
                    if part_sum[p, r] > 0:
                        value += part_acc[p, r, d] * fast_exp(part_max[p, r] - top)
                out[t0 + r // num_heads, r % num_heads, d] = value / total


def split_work(tiles: np.ndarray, meta: AttentionMetadata, num_threads: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's items (W, 5) [sequence, first query row, first token, end token, partial slot]
    and the split tiles to merge (M, 4) [sequence, first query row, first slot, slices]."""
    items, merges, slot = [], [], 0
    whole = np.iinfo(np.int64).max // 2
    split = 0 < len(tiles) < num_threads
    for s, t0 in tiles.tolist():
        seq_len = int(meta.seq_lens[s])
        if split and seq_len >= SPLIT_MIN_TOKENS * num_threads:
            # token edges; the last is past every block, so the slices cover the whole context
            edges = np.linspace(0, seq_len, num_threads + 1).astype(np.int64)
            edges[-1] = whole
            merges.append((s, t0, slot, num_threads))
            for p in range(num_threads):
                items.append((s, t0, int(edges[p]), int(edges[p + 1]), slot))
                slot += 1
        else:
            items.append((s, t0, 0, whole, -1))
    return (np.array(items, np.int64).reshape(-1, 5), np.array(merges, np.int64).reshape(-1, 4))


@dataclass(frozen=True)
class AttentionPlan:
    """How one batch's attention is split, decided once per step and reused by every layer."""

    meta: AttentionMetadata
    prompt_seqs: np.ndarray   # (n,) sequences with long query runs: the prompt kernel, or BLAS
    work: np.ndarray        # (W, 2) (sequence, first query row) tiles for the Numba kernel
    work_estimate: int      # picks the serial or the threaded compilation
    num_threads: int
    items: np.ndarray       # (W', 5) the kernel's items: tiles, or slices of long ones (split-K)
    merges: np.ndarray      # (M, 4) split tiles: sequence, first query row, first slot, slices
    gemm: object = None     # kernels.packed_gemm.PackedGemm for the prompts' products, or None (numpy)


def plan_attention(meta: AttentionMetadata, gemm=None) -> AttentionPlan:
    """How one batch's attention splits: prompts and big chunks to the prompt path (the prompt
    kernel on a float32 cache, else BLAS, through ``gemm``, oneMKL, when given), decodes and
    short chunks to the paged kernels' work items."""
    qsl = meta.query_start_loc
    q_lens = np.diff(qsl)                                              # (S,)
    long_runs = q_lens >= BLAS_MIN_QUERIES
    prompt_seqs = np.flatnonzero(long_runs)
    small = np.flatnonzero(~long_runs)
    work = attention_work_items(qsl, small)
    # work estimate for the Numba part: query tokens x longest context x 8 heads-ish
    estimate = int(q_lens[small].sum()) * int(meta.seq_lens[small].max()) * 8 if len(small) else 0
    threads = get_num_threads()
    items, merges = split_work(work, meta, threads)
    return AttentionPlan(meta, prompt_seqs, work, estimate, threads, items, merges, gemm)


_NO_BOUNDS = np.zeros((1, 1, 1), np.float32)   # dense attention: no page metadata
_NO_PARTS = (np.empty((0, 1, 1), np.float32), np.empty((0, 1), np.float32), np.empty((0, 1), np.float32))


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    plan: AttentionPlan | AttentionMetadata, scale: float,
                    quant: KVQuant | None = None, bounds: BlockBounds | None = None) -> np.ndarray:
    """Causal attention of q (T, num_heads, head_dim) through block tables -> (T, num_heads, head_dim).

    Sequences with many queries (prompts, prompt chunks) use two BLAS products;
    decodes and short chunks use the Numba kernel, which streams each block once.
    ``plan`` comes from ``plan_attention(meta)`` (a bare ``meta`` is planned here).
    ``quant`` describes a compressed cache (int8 / fp8 bytes and their scales); ``bounds``
    turns on block-sparse decode attention (prefills and chunks stay dense).
    """
    if isinstance(plan, AttentionMetadata):
        plan = plan_attention(plan)
    meta = plan.meta
    if bounds is not None and len(meta.seq_lens) and bounds.keep * k_cache.shape[2] >= int(meta.seq_lens.max()):
        bounds = None        # the budget covers every context: dense attention, by the dense kernel
    out = np.empty(q.shape, dtype=np.float32)
    qsl = meta.query_start_loc
    prompt_kernel = (len(plan.prompt_seqs) and PROMPT_KERNEL and quant is None and plan.gemm is None
                     and prompt_attention.fits(k_cache, v_cache, q.shape[2]))
    for s in plan.prompt_seqs:
        a, b = qsl[s], qsl[s + 1]
        if prompt_kernel:
            prompt_attention.prompt_attention(q[a:b], k_cache, v_cache, meta.block_tables[s],
                                              int(meta.seq_lens[s]), scale, out[a:b], get_num_threads())
        else:
            _blas_attention(q[a:b], k_cache, v_cache, meta.block_tables[s], int(meta.seq_lens[s]),
                            scale, out[a:b], quant, plan.gemm)
    if len(plan.work):
        slots = int(plan.merges[:, 3].sum()) if len(plan.merges) else 0
        if slots:                    # split-K slices: their partial sums, for _merge_partials
            rows = QUERY_TILE * q.shape[1]
            part_acc = np.empty((slots, rows, q.shape[2]), np.float32)      # (slots, rows, head_dim)
            part_max = np.empty((slots, rows), np.float32)                  # (slots, rows)
            part_sum = np.empty((slots, rows), np.float32)                  # (slots, rows)
        else:                        # whole tiles only: the kernels never touch these
            part_acc, part_max, part_sum = _NO_PARTS
        if quant is not None or not _vector_attention_call(
                q, k_cache, v_cache, plan, scale, part_acc, part_max, part_sum, out, bounds):
            fmt, k_scale, v_scale = ((KV_FLOAT, _NO_SCALES, _NO_SCALES) if quant is None
                                     else (quant.fmt, quant.k_scale, quant.v_scale))
            kernel = _paged_attention[fmt, heads_together(q.shape[1] // k_cache.shape[1])](plan.work_estimate)
            key_min, key_max, keep = _bounds_args(bounds)
            kernel(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, qsl,
                   np.float32(scale), plan.items, plan.num_threads, k_scale, v_scale, key_min, key_max, keep,
                   part_acc, part_max, part_sum, out)
        if slots:
            _merge_partials(part_acc, part_max, part_sum, plan.merges, qsl, q.shape[1], out)
    return out


# --------------------------------------------------------------------------- matrix products

# A BLAS matrix-matrix product of a few rows costs far more than reading the weight once:
# OpenBLAS packs the whole weight into its own layout first, and its kernels are tiled for
# many rows. Over one decode step of SmolLM2 (538 MB of weights, 2-core Xeon, OpenBLAS
# 0.3.31), every product together took 23 ms for 1 row (a gemv: the weights streamed at
# the memory's speed) but 55-68 ms for 2 to 16 rows and 72-77 ms for 32. ``_skinny_linear``
# reads each weight row once for all rows: 20 ms for 1 row, 23 for 2, 32 for 8, 43 for 16,
# 66 for 32, 102 for 64 (BLAS: 105). Above this many rows (prefill) BLAS's gemm is the
# better engine.
SKINNY_MAX_ROWS = 64
# Products of up to this many rows multiply the weight's panels (``kernels/panel_gemm.py``), when
# the model made them: decode steps of up to 128 sequences, and the small prefills of a chat
# turn. On a 2-core Zen 3 EPYC (AVX2), one layer's four weights and the LM head, the two
# engines alternated in one process: 72 rows 28.7 ms against BLAS's 37.7, 112 rows 41-44
# against 48, 128 rows 48-49 against 52-54; at 144 rows BLAS won (58 against 64): the rows of x
# (331 KB at in = 576) no longer stay in L2 beside the panel. Longer prefills stay with BLAS.
PANEL_MAX_ROWS = 128
# With a packed weight, MKL takes products from this many rows. Below, reading the weight
# bounds the product and ours is as fast or faster: whole decode steps (`bench roofline`,
# 2-core Xeon, AVX-512) took 30.5 ms at B = 2 ours, 35.2 MKL; 48 both at B = 8; then MKL
# won: 69 -> 64 ms at 16, 108 -> 89 at 32, 187 -> 140 at 64.
PACKED_MIN_ROWS = 8


# Below this many rows of x, _skinny_linear takes one weight row at a time (a dot product per
# row of x) instead of its 4 x 4 tiles: on a 2-core AMD EPYC a whole step's products (538 MB)
# took 17-22 ms that way at 1-3 rows against 22-35 ms in tiles, 22-27 against 26-32 at 4; they
# tie at 5, and from 6 rows the tiles win (31-38 ms against 37-47).
SKINNY_TILE_MIN_ROWS = 5


@njit(fastmath=True, inline="always", cache=True)
def _dot(a, b):
    """sum(a * b) of two (k,) views: indexed from 0, so LLVM vectorises it with no wraparound."""
    total = np.float32(0.0)
    for k in range(a.shape[0]):
        total += a[k] * b[k]
    return total


@njit(fastmath=True, parallel=True, cache=True)
def _skinny_linear(x, w, out, chunks):
    rows, k_dim = x.shape
    n_dim = w.shape[0]
    step = -(-n_dim // chunks)
    step += (-step) % 4                           # whole groups of 4 output features per chunk
    for c in prange(chunks):                      # each thread: a run of output features
        n, stop = c * step, min(n_dim, (c + 1) * step)
        if rows < SKINNY_TILE_MIN_ROWS:           # a few rows: one weight row, one dot per row of x
            for f in range(n, stop):
                weight_row = w[f]                 # (in,) read once from memory, then from L1
                for m in range(rows):
                    out[m, f] = _dot(weight_row, x[m])
            continue
        # A tile of 4 weight rows (output features n..n+3) x 4 rows of x: 16 dot products
        # kept in registers (fastmath lets LLVM vectorise each sum over k). Each weight row
        # comes from memory once and then serves every row of x from the L1/L2 cache; each
        # loaded value serves 4 multiply-adds. w must be C-contiguous (the model's are):
        # another layout still gives the right answer, but walks memory with a stride.
        while n + 4 <= stop:
            m = 0
            while m + 4 <= rows:
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
                for k in range(k_dim):
                    wa, wb, wc, wd = w[n, k], w[n + 1, k], w[n + 2, k], w[n + 3, k]
                    x0, x1, x2, x3 = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
                    a0 += x0 * wa; a1 += x1 * wa; a2 += x2 * wa; a3 += x3 * wa   # noqa: E702
                    b0 += x0 * wb; b1 += x1 * wb; b2 += x2 * wb; b3 += x3 * wb   # noqa: E702
                    c0 += x0 * wc; c1 += x1 * wc; c2 += x2 * wc; c3 += x3 * wc   # noqa: E702
                    d0 += x0 * wd; d1 += x1 * wd; d2 += x2 * wd; d3 += x3 * wd   # noqa: E702
                out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
                out[m, n + 1], out[m + 1, n + 1], out[m + 2, n + 1], out[m + 3, n + 1] = b0, b1, b2, b3
                out[m, n + 2], out[m + 1, n + 2], out[m + 2, n + 2], out[m + 3, n + 2] = c0, c1, c2, c3
                out[m, n + 3], out[m + 1, n + 3], out[m + 2, n + 3], out[m + 3, n + 3] = d0, d1, d2, d3
                m += 4
            while m < rows:                       # the last rows of x, one at a time
                a0 = b0 = c0 = d0 = np.float32(0.0)
                for k in range(k_dim):
                    xk = x[m, k]
                    a0 += xk * w[n, k]
                    b0 += xk * w[n + 1, k]
                    c0 += xk * w[n + 2, k]
                    d0 += xk * w[n + 3, k]
                out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = a0, b0, c0, d0
                m += 1
            n += 4
        while n < stop:                           # the last output features, one at a time
            for m in range(rows):
                a0 = np.float32(0.0)
                for k in range(k_dim):
                    a0 += x[m, k] * w[n, k]
                out[m, n] = a0
            n += 1


def pack_linear(w: np.ndarray, into: np.ndarray | None = None) -> PanelWeight | None:
    """The copy of a linear weight w (out, in) that decode steps multiply by: its panels
    (``kernels/panel_gemm.py``), made once when the model loads, in ``into`` when given (an
    array of ``panel_shape``); None for a weight that is not float32 (the panels are float32
    only)."""
    return pack_panels(w, into) if w.ndim == 2 and w.dtype == np.float32 else None


def pack_linears(weights: list[np.ndarray]) -> list[PanelWeight | None]:
    """``pack_linear`` for every linear weight of a model, their panels back to back in one
    region of huge pages (``kernels/huge_pages.py``): a decode step streams them all, and 2 MB
    pages spare it a TLB miss every 4 KB."""
    shapes = [panel_shape(*w.shape) if w.ndim == 2 and w.dtype == np.float32 else None for w in weights]
    if not any(shapes):
        return [None] * len(weights)                 # nothing float32: no region
    arena = Arena(sum(Arena.footprint(shape) for shape in shapes if shape is not None))
    return [pack_linear(w, arena.take(shape)) if shape is not None else None for w, shape in zip(weights, shapes)]


def linear(x: np.ndarray, w: np.ndarray, packed=None) -> np.ndarray:
    """A linear layer: x (T, in) times w (out, in), the checkpoint's layout -> (T, out).

    ``packed`` is w's second copy, made once by the model:
    - w's panels (``pack_linear``, ``kernels/panel_gemm.py``): every float32 product of up to
      PANEL_MAX_ROWS rows (every decode step of up to 128 sequences) multiplies them;
    - oneMKL's packed layout (``kernels/packed_gemm.py``): every float32 product from
      PACKED_MIN_ROWS rows up is MKL's.
    Otherwise, up to SKINNY_MAX_ROWS rows of float32 go to ``_skinny_linear``, which streams
    each weight row once for all of them; more rows (prefill) go to numpy's BLAS gemm, which
    reads w transposed in place.
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {x.shape} and w {w.shape} do not fit: x must be (T, in) "
                         f"and w (out, in) with the same in")
    rows = x.shape[0]
    if packed is not None and (packed.out_features, packed.in_features) != w.shape:
        raise ValueError(f"linear: the packed copy is ({packed.out_features}, {packed.in_features}), "
                         f"not w's {w.shape}")
    if isinstance(packed, PanelWeight):
        if 1 <= rows <= PANEL_MAX_ROWS and x.dtype == np.float32:
            return packed.apply(x, get_num_threads())
    elif packed is not None and rows >= PACKED_MIN_ROWS and x.dtype == np.float32:
        return packed.apply(x)
    if 1 <= rows <= SKINNY_MAX_ROWS and x.dtype == np.float32 and w.dtype == np.float32:
        x = np.ascontiguousarray(x)
        out = np.empty((rows, w.shape[0]), dtype=np.float32)          # (T, out)
        _skinny_linear(x, w, out, 4 * get_num_threads())
        return out
    return x @ w.T


# --------------------------------------------------------------------------- streaming read

@njit(fastmath=True, parallel=True, cache=True)
def _stream_sum(data, partial):
    chunk = -(-data.shape[0] // partial.shape[0])
    for t in prange(partial.shape[0]):
        # A view of the chunk, indexed from 0: Numba proves i >= 0 and drops the negative-index
        # wraparound that ``range(start, stop)`` over ``data`` itself would keep, which stopped
        # LLVM vectorising the sum on an AMD EPYC (3.5 GB/s a thread against 25).
        part = data[t * chunk: min((t + 1) * chunk, data.shape[0])]
        total = np.float32(0.0)
        for i in range(part.shape[0]):
            total += part[i]
        partial[t] = total


def stream_sum(data: np.ndarray) -> float:
    """Sum of data (n,) float32, read once by every thread's share: the read-bandwidth probe
    of ``bench roofline`` (what the machine can stream, with the threads the kernels use)."""
    partial = np.zeros(get_num_threads() * 16, dtype=np.float32)   # (chunks,)
    _stream_sum(data, partial)
    return float(partial.astype(np.float64).sum())


# --------------------------------------------------------------------------- sampling

@partial(two_ways, cache=SIMD_CACHE)   # _row_max: registers of this machine's width
def _logsumexp_rows(x, out):
    for r in prange(x.shape[0]):
        row = x[r]
        top = _row_max(row, row.shape[0])
        total = np.float32(0.0)
        for j in range(row.shape[0]):
            total += fast_exp(row[j] - top)
        out[r] = top + np.log(total)


def logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) of each row of x (N, V) float32 -> (N,): the log-softmax's normaliser,
    so a sampled token's log-probability is x[row, token] - logsumexp(x)[row] without the
    (N, V) log-softmax (a max and one vectorised exp pass a row, threads over rows)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape[0], np.float32)
    if x.shape[0] and x.shape[1]:
        _logsumexp_rows(x.size)(x, out)
    return out


# --------------------------------------------------------------------------- fused elementwise

@partial(two_ways, min_work="LIGHT_PARALLEL_MIN_ELEMENTS")
def _rms_norm(x, weight, eps, out):
    hidden = x.shape[1]
    for t in prange(x.shape[0]):
        total = np.float32(0.0)
        for i in range(hidden):
            total += x[t, i] * x[t, i]
        inv_rms = np.float32(1.0) / np.sqrt(total / hidden + eps)
        for i in range(hidden):
            out[t, i] = x[t, i] * inv_rms * weight[i]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, hidden) / rms(x) * weight (hidden,) -> (T, hidden)."""
    out = np.empty_like(x)
    _rms_norm(x.size)(x, weight, np.float32(eps), out)
    return out


# IEEE arithmetic (no fastmath): with it LLVM may fuse a * cos - b * sin into a multiply-add
# or not, and did so differently in the threaded copy loaded from Numba's disk cache than in the
# one compiled afresh (numba#10617), so the layer path's floats differed from the persistent
# kernel's on a second run. The loop is a rotation: exact arithmetic costs it nothing measurable.
@partial(two_ways, min_work="LIGHT_PARALLEL_MIN_ELEMENTS", fastmath=False)
def _rotary_inplace(x, positions, cos, sin):
    half = x.shape[2] // 2
    for t in prange(x.shape[0]):
        pos = positions[t]
        for h in range(x.shape[1]):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                x[t, h, i] = a * cos[pos, i] - b * sin[pos, i]
                x[t, h, i + half] = b * cos[pos, i] + a * sin[pos, i]


def rotary(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (T, heads, head_dim) at positions (T,); returns a new array."""
    out = np.ascontiguousarray(x)
    if out is x:
        out = x.copy()
    _rotary_inplace(out.size)(out, positions, cos, sin)
    return out


@partial(two_ways, min_work="SILU_PARALLEL_MIN_ELEMENTS", fastmath=False, error_model="numpy")
def _silu_and_mul(gate_up, out):
    # Two passes over a row: e^-g first, into out, then g / (1 + e^-g) * up. In one loop LLVM
    # left the serial copy's exp unvectorised: 4 ns a value against 1.5 (16 rows of SmolLM2's
    # 1536: 100 against 38 us; 30 layers of it were 3 ms of a 50 ms step at B = 16). The
    # division vectorises only without Python's zero test (error_model="numpy"): with it, the
    # second pass ran one value at a time, 0.9 of the 1.5 ns a value on a Zen 3 core.
    # IEEE arithmetic (fastmath=False): LLVM cannot prove out and gate_up apart, so each loop
    # checks their addresses at run time and takes a vector or a scalar copy of itself; with
    # fastmath the two copies rounded differently (1 ulp), so a step's floats hung on where
    # np.empty put out (the serial copy, on a Zen 3 EPYC: 65 of 67 placements after gate_up).
    # Strict, both copies compute the same floats: 2.6 against 2.0 us for a row of 1536.
    ffn = out.shape[1]
    for t in prange(gate_up.shape[0]):
        for i in range(ffn):
            out[t, i] = fast_exp(-gate_up[t, i])
        for i in range(ffn):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + out[t, i]) * gate_up[t, ffn + i]


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up (T, 2*ffn) = [gate | up] -> silu(gate) * up, (T, ffn)."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    _silu_and_mul(gate_up.size)(gate_up, out)
    return out


# --------------------------------------------------------------------------- a decode step, persistent

# A decode step (up to PANEL_MAX_ROWS tokens, no prompt long enough for the prompt path) runs
# every layer in one parallel region whose threads claim tasks and poll counters instead of
# forking and joining ~300 times (kernels/persistent_decode.py); False: layer by layer, kernel by
# kernel, as every other step.
PERSISTENT_DECODE = True


def _never_raising(kernel, cache: bool = True):
    """A copy of a serial kernel compiled with NumPy's error model: a float division by zero
    gives inf or nan instead of raising ZeroDivisionError (the same arithmetic otherwise). In
    the persistent kernel a task that raised would leave its thread's iteration without
    counting the task done, and the other threads would poll for it for ever."""
    fn = kernel.py_func
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_never_raising", fn.__defaults__,
                              fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_never_raising"
    return njit(fastmath=kernel.targetoptions.get("fastmath", False), cache=cache, error_model="numpy")(twin)


# its kernels, bound to this module's (rotary and the float KV write never divide; SiLU already
# uses NumPy's error model): one copy for each number of heads scored together
_PERSISTENT = {heads: persistent_decode.compile_kernel(
    heads, ATTENTION=_never_raising(_vector_attention[heads].serial, SIMD_CACHE),
    RMS_NORM=_never_raising(_rms_norm.serial), ROTARY=_rotary_inplace.serial, WRITE_KV=_write_kv.serial,
    SILU_AND_MUL=_silu_and_mul.serial, MERGE=_never_raising(_merge_partials)) for heads in (1, 2, 3)}


def persistent_layers(layers, packed, final_norm=None, lm_head=None):
    """The model's layers (and its final norm and LM head's panels, where it holds them) as the
    persistent decode kernel reads them (made once, no weight copied), or None where it cannot
    (no float32 panels)."""
    return persistent_decode.stack(layers, packed, final_norm, lm_head)


def decode_layers(stack, hidden: np.ndarray, positions: np.ndarray, kv_cache: np.ndarray, plan: AttentionPlan,
                  scale: float, eps: float, cos: np.ndarray, sin: np.ndarray, num_heads: int,
                  with_head: bool = False, num_threads: int | None = None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A decode step (up to PANEL_MAX_ROWS tokens, decodes or short prompt chunks) through every
    layer in one persistent kernel (``kernels/persistent_decode.py``): hidden (T, h) -> ((T, h) the
    last layer's output, and with ``with_head`` the (T, vocab) logits after the final norm and
    the LM head, else None), the same floats as the layer-by-layer path; None when the step is
    not one it can run (more tokens, a prompt, a compressed or unusual pool, PERSISTENT_DECODE or
    VECTOR_ATTENTION off): then the model goes layer by layer. ``num_threads``: the region's
    iterations (default: Numba's thread count)."""
    if not (PERSISTENT_DECODE and VECTOR_ATTENTION
            and persistent_decode.usable(stack, positions.shape[0], plan, kv_cache, PANEL_MAX_ROWS)):
        return None
    kernel = _PERSISTENT[vector_heads(num_heads // kv_cache.shape[3])]
    return persistent_decode.run(kernel, stack, hidden, positions, kv_cache, plan, scale, eps, cos, sin, num_heads,
                                 QUERY_TILE, get_num_threads() if num_threads is None else num_threads, with_head)
