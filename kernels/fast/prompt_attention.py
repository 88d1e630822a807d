"""A prompt's attention through its block table, a tile of queries at a time (the MMU's
page-table walk again, now for a process that touches many addresses at once: each page is
fetched once per tile of queries and serves all of them).

Decodes and short prompts go to the paged kernels (``attention.py``); a sequence with many
queries over a long context (a long prompt, a big chunk) came to two BLAS products per KV head,
on its blocks gathered into a contiguous copy. With an inner dimension of head_dim (64) the
first product is short for BLAS, and the (queries, context) scores went through memory three
times (written, softmaxed, read). This kernel keeps them in a chunk-sized scratch instead, the
way FlashAttention does:

- a work item is a tile of QUERY_TILE queries and one KV head: its rows are every (query,
  head of the GQA group) pair, ``rows`` of them, padded to a multiple of the register tiles;
- the scaled queries are laid out as panels of PANEL = 2 x LANES rows, (head_dim, PANEL) each,
  like the weights of ``kernels/panel_gemm.py``; keys are read straight from their blocks;
- for each chunk of KEY_CHUNK keys: scores transposed, (keys, rows), six keys at a time, each
  key's head_dim values broadcast against two registers of rows (``_scores_6``); an online
  softmax update across rows, in registers of LANES rows because rows are contiguous (on the
  chunk that reaches the tile's own positions, each row's causal future is first overwritten
  with HIDDEN); then p x v for six rows at a time and PANEL of head_dim (``_pv_6``), the
  chunk's values first copied out of their blocks into PANEL-wide columns;
- the rows' sums are divided by their softmax totals at the end.

Spec: ``kernels/reference.py`` ``paged_attention`` (``tests/test_prompt_attention.py``).
Plain (C-contiguous) float32 pools of one shape, with head_dim a multiple of PANEL, take this
kernel (``fits``); anything else stays with BLAS.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .fast_math import fast_exp
from .simd import LANES, SIMD_CACHE, vbroadcast, vfma, vload, vmax, vstore, vzero

PANEL = 2 * LANES                     # rows of a query panel, and head_dim of a p x v tile
QUERY_TILE = 32                       # queries per work item
KEY_CHUNK = 128                       # keys per online-softmax update: (128, 96) scores, 48 KB
ROW_MULTIPLE = 6 * PANEL // math.gcd(6, PANEL)   # rows padded to tiles of 6 and panels of PANEL
HIDDEN = np.float32(-1e30)            # a causal-future score: below every real one, e^(HIDDEN - max) = 0


def fits(k_cache: np.ndarray, v_cache: np.ndarray, head_dim: int) -> bool:
    """Whether this kernel can read the pools: plain (C-contiguous) float32 arrays of one shape,
    head_dim a multiple of PANEL."""
    return (k_cache.dtype == np.float32 and v_cache.dtype == np.float32 and head_dim % PANEL == 0
            and k_cache.shape == v_cache.shape and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous)


def prompt_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                     seq_len: int, scale: float, out: np.ndarray, num_threads: int) -> None:
    """Causal attention of q (n, num_heads, head_dim), the last n positions of a context of
    seq_len, into out (n, num_heads, head_dim). Pools: (blocks, kv_heads, block_size, head_dim),
    as ``fits`` allows."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    block_stride, head_stride, token_stride = (st // 4 for st in k_cache.strides[:3])
    group = num_heads // num_kv_heads
    rows = -(-QUERY_TILE * group // ROW_MULTIPLE) * ROW_MULTIPLE
    items = -(-n // QUERY_TILE) * num_kv_heads
    _prompt_attention(np.ascontiguousarray(q), k_cache.reshape(-1), v_cache.reshape(-1), block_stride,
                      head_stride, token_stride, block_size, num_kv_heads, block_table, seq_len,
                      np.float32(scale), rows, out, max(1, min(num_threads, items)))


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _six_pairs(src, o0, o1, o2, o3, o4, o5, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5):
    """(a_i, b_i) += src[o_i] * (lo, hi) for six values of ``src``, each broadcast just before its
    two fused multiply-adds (12 sums + 2 operands + 1 broadcast: 15 of AVX2's 16 registers)."""
    x = vbroadcast(src, o0); a0, b0 = vfma(x, lo, a0), vfma(x, hi, b0)    # noqa: E702
    x = vbroadcast(src, o1); a1, b1 = vfma(x, lo, a1), vfma(x, hi, b1)    # noqa: E702
    x = vbroadcast(src, o2); a2, b2 = vfma(x, lo, a2), vfma(x, hi, b2)    # noqa: E702
    x = vbroadcast(src, o3); a3, b3 = vfma(x, lo, a3), vfma(x, hi, b3)    # noqa: E702
    x = vbroadcast(src, o4); a4, b4 = vfma(x, lo, a4), vfma(x, hi, b4)    # noqa: E702
    x = vbroadcast(src, o5); a5, b5 = vfma(x, lo, a5), vfma(x, hi, b5)    # noqa: E702
    return a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _scores_6(panels, p, head_dim, k_flat, key_at, kk, scores, rows):
    """scores[kk .. kk + 5, PANEL p .. + PANEL] = keys kk .. kk + 5 times the query panel p:
    12 registers of sums (6 keys x 2 registers of rows), one key value broadcast per FMA pair."""
    a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = a4 = b4 = a5 = b5 = vzero()
    k0, k1, k2 = key_at[kk], key_at[kk + 1], key_at[kk + 2]
    k3, k4, k5 = key_at[kk + 3], key_at[kk + 4], key_at[kk + 5]
    base = p * head_dim * PANEL
    for d in range(head_dim):
        lo = vload(panels, base + d * PANEL)
        hi = vload(panels, base + d * PANEL + LANES)
        a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5 = _six_pairs(
            k_flat, k0 + d, k1 + d, k2 + d, k3 + d, k4 + d, k5 + d, lo, hi,
            a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5)
    at = kk * rows + p * PANEL
    vstore(scores, at, a0); vstore(scores, at + LANES, b0)                                   # noqa: E702
    vstore(scores, at + rows, a1); vstore(scores, at + rows + LANES, b1)                     # noqa: E702
    vstore(scores, at + 2 * rows, a2); vstore(scores, at + 2 * rows + LANES, b2)             # noqa: E702
    vstore(scores, at + 3 * rows, a3); vstore(scores, at + 3 * rows + LANES, b3)             # noqa: E702
    vstore(scores, at + 4 * rows, a4); vstore(scores, at + 4 * rows + LANES, b4)             # noqa: E702
    vstore(scores, at + 5 * rows, a5); vstore(scores, at + 5 * rows + LANES, b5)             # noqa: E702


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _scores_1(panels, p, head_dim, k_flat, key_at, kk, scores, rows):
    """``_scores_6`` for one key (a chunk's last few)."""
    a0 = b0 = vzero()
    base = p * head_dim * PANEL
    for d in range(head_dim):
        x = vbroadcast(k_flat, key_at[kk] + d)
        a0 = vfma(x, vload(panels, base + d * PANEL), a0)
        b0 = vfma(x, vload(panels, base + d * PANEL + LANES), b0)
    vstore(scores, kk * rows + p * PANEL, a0)
    vstore(scores, kk * rows + p * PANEL + LANES, b0)


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def _pv_6(acc, r0, c, head_dim, probs, rows, values, num_keys):
    """acc[r0 .. r0 + 5, c .. c + PANEL] += probs[keys, those rows] @ values[keys, c .. c + PANEL]:
    12 registers of sums held across the chunk's keys. ``values`` is the chunk's copy, whose
    columns c .. c + PANEL start at c * KEY_CHUNK, PANEL floats a key."""
    at_c = c * KEY_CHUNK
    a0, b0 = vload(acc, r0 * head_dim + c), vload(acc, r0 * head_dim + c + LANES)
    a1, b1 = vload(acc, (r0 + 1) * head_dim + c), vload(acc, (r0 + 1) * head_dim + c + LANES)
    a2, b2 = vload(acc, (r0 + 2) * head_dim + c), vload(acc, (r0 + 2) * head_dim + c + LANES)
    a3, b3 = vload(acc, (r0 + 3) * head_dim + c), vload(acc, (r0 + 3) * head_dim + c + LANES)
    a4, b4 = vload(acc, (r0 + 4) * head_dim + c), vload(acc, (r0 + 4) * head_dim + c + LANES)
    a5, b5 = vload(acc, (r0 + 5) * head_dim + c), vload(acc, (r0 + 5) * head_dim + c + LANES)
    for kk in range(num_keys):
        lo = vload(values, at_c + kk * PANEL)
        hi = vload(values, at_c + kk * PANEL + LANES)
        at = kk * rows + r0
        a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5 = _six_pairs(
            probs, at, at + 1, at + 2, at + 3, at + 4, at + 5, lo, hi,
            a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5)
    vstore(acc, r0 * head_dim + c, a0); vstore(acc, r0 * head_dim + c + LANES, b0)                      # noqa: E702
    vstore(acc, (r0 + 1) * head_dim + c, a1); vstore(acc, (r0 + 1) * head_dim + c + LANES, b1)          # noqa: E702
    vstore(acc, (r0 + 2) * head_dim + c, a2); vstore(acc, (r0 + 2) * head_dim + c + LANES, b2)          # noqa: E702
    vstore(acc, (r0 + 3) * head_dim + c, a3); vstore(acc, (r0 + 3) * head_dim + c + LANES, b3)          # noqa: E702
    vstore(acc, (r0 + 4) * head_dim + c, a4); vstore(acc, (r0 + 4) * head_dim + c + LANES, b4)          # noqa: E702
    vstore(acc, (r0 + 5) * head_dim + c, a5); vstore(acc, (r0 + 5) * head_dim + c + LANES, b5)          # noqa: E702


@njit(fastmath=True, parallel=True, cache=SIMD_CACHE)
def _prompt_attention(q, k_flat, v_flat, block_stride, head_stride, token_stride, block_size,
                      num_kv_heads, block_table, seq_len, scale, rows, out, num_threads):
    """q (n, heads, head_dim); k_flat / v_flat: the pools' memory, element (block, head, token,
    d) at block * block_stride + head * head_stride + token * token_stride + d. Thread tid takes
    work items tid, tid + num_threads, ... (item w: query tile w // kv_heads, KV head w % kv_heads),
    which spreads the costlier late tiles evenly."""
    n, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    items = -(-n // QUERY_TILE) * num_kv_heads
    first_pos = seq_len - n                           # position of query 0
    for tid in prange(num_threads):
        panels = np.empty(rows * head_dim, np.float32)        # (rows / PANEL, head_dim, PANEL) scaled queries
        scores = np.empty(KEY_CHUNK * rows, np.float32)       # (keys, rows): scores, then p
        acc = np.empty(rows * head_dim, np.float32)           # (rows, head_dim) running sums of p * v
        row_max = np.empty(rows, np.float32)
        row_sum = np.empty(rows, np.float32)
        new_max = np.empty(rows, np.float32)
        row_pos = np.empty(rows, np.int64)                    # each row's position: keys after it are masked
        key_at = np.empty(KEY_CHUNK, np.int64)                # where each key of the chunk starts, in k_flat / v_flat
        values = np.empty(KEY_CHUNK * head_dim, np.float32)   # (head_dim / PANEL, keys, PANEL): the chunk's V
        for w in range(tid, items, num_threads):
            t0 = (w // num_kv_heads) * QUERY_TILE
            kv_head = w % num_kv_heads
            count = min(QUERY_TILE, n - t0)                   # queries in this tile
            for r in range(rows):                             # row r: query r // group, head r % group
                qi = min(r // group, count - 1)               # padding rows repeat the last query
                g = r % group
                row_pos[r] = first_pos + t0 + qi
                for d in range(head_dim):
                    panels[((r // PANEL) * head_dim + d) * PANEL + r % PANEL] = q[t0 + qi, kv_head * group + g, d] * scale
                row_max[r] = HIDDEN
                row_sum[r] = 0.0
            acc[:] = 0.0
            context = first_pos + t0 + count                  # keys [0, context): the tile's last query's
            for c0 in range(0, context, KEY_CHUNK):
                num_keys = min(KEY_CHUNK, context - c0)
                for kk in range(num_keys):
                    key = c0 + kk
                    key_at[kk] = (block_table[key // block_size] * block_stride + kv_head * head_stride
                                  + (key % block_size) * token_stride)
                for p in range(rows // PANEL):
                    kk = 0
                    while kk + 6 <= num_keys:
                        _scores_6(panels, p, head_dim, k_flat, key_at, kk, scores, rows)
                        kk += 6
                    while kk < num_keys:
                        _scores_1(panels, p, head_dim, k_flat, key_at, kk, scores, rows)
                        kk += 1
                # the online softmax, LANES rows to a register. Where the chunk reaches past the
                # first row's position, each row's causal future (keys beyond its own) is hidden
                # first: HIDDEN is below every score, and its e^(s - max) is 0
                if c0 + num_keys - 1 > row_pos[0]:
                    for r in range(rows):
                        for kk in range(max(0, row_pos[r] - c0 + 1), num_keys):
                            scores[kk * rows + r] = HIDDEN
                for v in range(0, rows, LANES):               # rows' maxima, one register at a time
                    m = vload(row_max, v)
                    for kk in range(num_keys):
                        m = vmax(m, vload(scores, kk * rows + v))
                    vstore(new_max, v, m)
                for r in range(rows):
                    correction = fast_exp(row_max[r] - new_max[r])
                    row_sum[r] *= correction
                    row_max[r] = new_max[r]
                    for d in range(head_dim):
                        acc[r * head_dim + d] *= correction
                for kk in range(num_keys):
                    for r in range(rows):
                        e = fast_exp(scores[kk * rows + r] - row_max[r])
                        scores[kk * rows + r] = e
                        row_sum[r] += e
                # the chunk's values, copied out of their blocks into PANEL-wide columns, so that
                # each pass of six rows reads its columns as one run that stays in L1
                for kk in range(num_keys):
                    for c in range(0, head_dim, PANEL):
                        at = c * KEY_CHUNK + kk * PANEL
                        vstore(values, at, vload(v_flat, key_at[kk] + c))
                        vstore(values, at + LANES, vload(v_flat, key_at[kk] + c + LANES))
                for c in range(0, head_dim, PANEL):
                    for r0 in range(0, rows, 6):
                        _pv_6(acc, r0, c, head_dim, scores, rows, values, num_keys)
            for r in range(count * group):
                inv = np.float32(1.0) / row_sum[r]
                for d in range(head_dim):
                    out[t0 + r // group, kv_head * group + r % group, d] = acc[r * head_dim + d] * inv
