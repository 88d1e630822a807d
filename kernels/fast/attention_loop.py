"""The fast tier's loop attention kernel, and the pieces the register kernel shares with it.

The OS idea is the page-table walker: each work item (a tile of up to QUERY_TILE queries of one
sequence, or a split-K slice of a long context) walks its sequence's block table, reads each
block once for every query and head of the tile, and keeps an online softmax. This kernel reads
any cache: float, int8, fp8 (widened as they are read), block-sparse decode (Quest). A float32
pool is read by ``attention_registers.py`` where it can.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..kv_quant import KV_FLOAT, KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8, fp8_widen_scale, widen
from .compile import specialize, two_ways
from .elementwise import vector_max
from .fast_math import fast_exp
from .simd import SIMD_CACHE, prefetch
from .tuning import QUERY_TILE


@njit(inline="always", cache=True)
def _prefetch_block(cache, block):
    """Prefetch every cache line of ``cache[block]`` (all of its KV heads)."""
    size = cache.strides[0]
    start = block * size
    for offset in range(0, size, 64):
        prefetch(cache, start + offset)


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
def _softmax_step(row, n, row_max, row_sum, r):
    """One online softmax step for row r over n keys (a block, or a chunk of blocks): row[:n]
    holds their scores (-inf where the row does not read a key) and gets their e^(s - new max);
    row_max[r] and row_sum[r] are brought up to date. Returns the factor the row's running sum
    of p * v must be scaled by (1 when none of the keys is read)."""
    new_max = max(row_max[r], vector_max(row, n))
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
            row = out[t0 + r // num_heads, r % num_heads]          # (head_dim,): the sum, then / total
            row[:] = np.float32(0.0)
            for p in range(first, first + count):                  # each slice's weight once, not once a d
                if part_sum[p, r] > 0:
                    weight = fast_exp(part_max[p, r] - top)
                    for d in range(part_acc.shape[2]):
                        row[d] += part_acc[p, r, d] * weight
            for d in range(part_acc.shape[2]):
                row[d] = row[d] / total



def _paged_attention_body(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           scale, work, num_threads, k_scale, v_scale, key_min, key_max, keep, window,
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
            if window > 0:   # a sliding window: no query of the tile reads a block before this one
                first_block = max(first_block, max(first_pos - window + 1, 0) // block_size)
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
                    # a sliding window: nor those before position pos - window + 1
                    start = max(first_pos + qi - window + 1 - j * block_size, 0) if window > 0 else 0
                    if valid <= 0 or start >= valid:
                        continue
                    for kv_head in range(num_kv_heads):
                        for g0 in range(0, group, heads):
                            r0 = qi * num_heads + kv_head * group + g0   # rows r0 .. r0 + heads - 1
                            if sparse and not _any_chosen(chosen, r0, heads, j):
                                continue                 # no head of the group keeps block j
                            for o in range(start, valid):        # the block's scores, key by key
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
                            for o in range(start):               # before the window: p = 0
                                for g in range(heads):
                                    scores[g, o] = -np.inf
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


def heads_together(group: int) -> int:
    """How many query heads of a GQA group the decode kernel scores together: the largest
    divisor of the group up to 4 (SmolLM2's 3; 4 of Llama-3's 4; 2 of a group of 6)."""
    return max(n for n in (1, 2, 3, 4) if group % n == 0)


# serial and threaded compilations for each storage format (float, int8, fp8 e4m3, fp8 e5m2)
# and each number of heads scored together, compiled on first use
_paged_attention = {(fmt, heads): two_ways(specialize(_paged_attention_body, KV_FORMAT=fmt, HEADS_TOGETHER=heads), SIMD_CACHE)
                    for fmt in (KV_FLOAT, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2) for heads in (1, 2, 3, 4)}
