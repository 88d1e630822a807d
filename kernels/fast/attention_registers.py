"""The fast tier's register attention kernel: a float32 pool's decode attention with named vector
registers (``simd.py``).


A float32 cache is read by the kernel below, which names its vector registers (kernels/simd.py)
instead of leaving the head_dim loops to LLVM: a key's dot products with the HEADS queries
of its group are HEADS registers of sums, added across lanes once per key, and p x v keeps
the HEADS rows' accumulators for 4 x LANES of head_dim in registers across a whole block,
where the loop above loads and stores them for every key. It asks for the next block's K a
key's row per key while it scores, and for the next block's V likewise while it multiplies. At 64
decodes of 264 tokens, all 30 layers: 30-32 ms a step against 37-40 (2-core AMD EPYC, Zen 3,
docs/benchmarks.md). Quantized caches, head_dim that is not a multiple of LANES, and pools it
cannot address as a flat window (head_dim strided, negative strides, K and V laid out
differently) use the loop kernel (``attention_loop.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..layout import BlockBounds
from .attention_loop import _ALL_BLOCKS, _any_chosen, _choose_blocks, _finish_item, _softmax_step, _work_item
from .compile import specialize, two_ways
from .simd import LANES, SIMD_CACHE, prefetch, vbroadcast, vfma, vload, vmul, vsplat, vstore, vsum, vzero
from .tuning import DEFAULT_TUNING, QUERY_TILE, SCORE_CHUNK

HEADS_TOGETHER = 1       # query heads of a GQA group scored together (1 to 3): set in each copy

_NO_BOUNDS = np.zeros((1, 1, 1), np.float32)   # dense attention: no page metadata


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
                            base = block * block_stride + kv_head * head_stride   # the head's tile
                            # what to ask for while the tile's keys are multiplied, a key's row with
                            # each key: the next block's tile of V, or at the chunk's end the next
                            # chunk's first tile of K (a tile's 64 lines asked for at once filled the
                            # core's queue of misses and stalled its multiply-adds: 1.06-1.23x
                            # slower at 4-8 decodes from memory, docs/weights.md)
                            ahead_pool, ahead_at = v_flat, -1
                            if qi == 0 and v_ahead != 0:
                                ahead_at = base + v_ahead
                            elif qi == 0 and j + 1 == c1 and c1 < last_block:
                                ahead_pool, ahead_at = k_flat, block_tables[s, c1] * block_stride + kv_head * head_stride
                            if ahead_at >= 0 and quads_end == 0:       # no quad loop to spread it over
                                for line in range(0, block_size * token_stride, 16):
                                    prefetch(ahead_pool, 4 * (ahead_at + line))
                            for g0 in range(0, group, heads):
                                h = kv_head * group + g0
                                r0 = rq + h
                                if sparse and not _any_chosen(chosen, r0, heads, j):
                                    continue
                                q0 = r0 * head_dim
                                q1, q2 = q0 + head_dim, q0 + 2 * head_dim
                                p0_at = h * span + o0            # the heads' p for block j
                                p1_at, p2_at = p0_at + span, p0_at + 2 * span
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
                                        if ahead_at >= 0 and g0 == 0 and c == 0:      # key o's row ahead
                                            for line in range(0, head_dim, 16):
                                                prefetch(ahead_pool, 4 * (ahead_at + o * token_stride + line))
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
_vector_attention = {heads: two_ways(specialize(_vector_attention_body, HEADS_TOGETHER=heads), SIMD_CACHE) for heads in (1, 2, 3)}


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


def vector_attention_call(q, k_cache, v_cache, plan, scale, part_acc, part_max, part_sum, out,
                          bounds: BlockBounds | None = None,
                          threshold: int = DEFAULT_TUNING.attention_parallel_min_work) -> bool:
    """Run the register kernel when it can read this cache; False when it cannot. ``threshold``: the
    work from which its threaded copy runs (``FastTuning.attention_parallel_min_work``)."""
    head_dim = q.shape[2]
    if head_dim % LANES or k_cache.strides != v_cache.strides:
        return False
    k_flat, v_flat = _flat_window(k_cache), _flat_window(v_cache)
    if k_flat is None or v_flat is None:
        return False
    block_stride, head_stride, token_stride, _ = (st // 4 for st in k_cache.strides)
    kernel = _vector_attention[vector_heads(q.shape[1] // k_cache.shape[1])](plan.work_estimate, threshold)
    meta = plan.meta
    key_min, key_max, keep = _bounds_args(bounds)
    kernel(q, k_flat, v_flat, block_stride, head_stride, token_stride, k_cache.shape[2], k_cache.shape[1],
           meta.block_tables, meta.seq_lens, meta.query_start_loc, np.float32(scale), plan.items,
           plan.num_threads, key_min, key_max, keep, part_acc, part_max, part_sum, out)
    return True

