"""The fast tier's paged attention: how a step's attention is planned, and which kernel takes what.

The OS idea is the I/O scheduler: one plan a step (``plan_attention``) sorts the work once for
every layer. Prompts and long chunks go to the prompt kernel (``prompt_attention.py``) or two
BLAS products per KV head; decodes and short chunks become work items for the register kernel
(``attention_registers.py``) or the loop kernel (``attention_loop.py``); a few long decodes are cut
into split-K slices, one per thread, and merged.
"""

from __future__ import annotations

from functools import partial
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads, prange

from ..kv_quant import KV_FLOAT, KV_INT8, dequantize
from ..layout import AttentionMetadata, BlockBounds, KVQuant
from . import prompt_attention
from .attention_loop import _merge_partials, _paged_attention, heads_together
from .attention_registers import _bounds_args, vector_attention_call
from .compile import two_ways
from .elementwise import vector_max
from .fast_math import fast_exp
from .simd import SIMD_CACHE
from .tuning import DEFAULT_TUNING, QUERY_TILE, FastTuning

_NO_SCALES = np.ones((1, 1, 1), np.float32)    # a float cache: no scales
_WHOLE_CONTEXT = (1 << 62) - 1                 # an item's end token past any context: all of it


def attention_work_items(query_start_loc: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """List the (sequence, first query row) tiles of the given sequences: (W, 2) int64."""
    starts = query_start_loc[seqs].astype(np.int64)                   # (n,)
    q_lens = query_start_loc[seqs + 1].astype(np.int64) - starts       # (n,)
    if len(q_lens) and 1 <= q_lens.min() and q_lens.max() <= QUERY_TILE:   # a tile each (decodes)
        return np.stack((seqs.astype(np.int64), starts), axis=1)
    tiles = -(-q_lens // QUERY_TILE)                                  # (n,) ceil
    work = np.empty((int(tiles.sum()), 2), dtype=np.int64)
    work[:, 0] = np.repeat(seqs, tiles)
    first_tile = np.repeat(np.cumsum(tiles) - tiles, tiles)
    work[:, 1] = np.repeat(starts, tiles) + (np.arange(len(work)) - first_tile) * QUERY_TILE
    return work



def split_work(tiles: np.ndarray, meta: AttentionMetadata, num_threads: int,
               split_min_tokens: int = DEFAULT_TUNING.split_min_tokens,
               first_read: np.ndarray | None = None, block_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's items (W, 5) [sequence, first query row, first token, end token, partial slot]
    and the split tiles to merge (M, 4) [sequence, first query row, first slot, slices].
    ``first_read`` (S,): with sliding windows, the first position any layer reads: the slices
    share out only the context from there. A slice reads the blocks its token edges fall in
    (edge // ``block_size``), so a tile splits only where each slice spans a block or more."""
    items, merges, slot = [], [], 0
    whole = _WHOLE_CONTEXT
    split = 0 < len(tiles) < num_threads
    for s, t0 in tiles.tolist():
        seq_len = int(meta.seq_lens[s])
        first = int(first_read[s]) if first_read is not None else 0
        if split and seq_len - first >= max(split_min_tokens, block_size) * num_threads:
            # token edges; the last is past every block, so the slices cover the whole context
            edges = [first + (seq_len - first) * p // num_threads for p in range(num_threads)] + [whole]
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
    tuning: FastTuning = DEFAULT_TUNING   # the thresholds every layer's call reads


def plan_attention(meta: AttentionMetadata, gemm=None, tuning: FastTuning = DEFAULT_TUNING,
                   first_read: np.ndarray | None = None, persistent: bool = False,
                   block_size: int = 1) -> AttentionPlan:
    """How one batch's attention splits: prompts and big chunks to the prompt path (the prompt
    kernel on a float32 cache, else BLAS, through ``gemm``, oneMKL, when given), decodes and
    short chunks to the paged kernels' work items. ``first_read`` (S,): sliding windows' first
    position read (``kernels/ops.py`` ``first_read_positions``), where split-K slices begin.
    ``persistent``: the persistent decode kernel will run the step, if it has no prompt: long
    contexts split from ``tuning.persistent_split_min_tokens`` a thread, else ``split_min_tokens``
    (and at least a block of the pool's ``block_size`` a slice)."""
    qsl = meta.query_start_loc
    q_lens = np.diff(qsl)                                              # (S,)
    long_runs = q_lens >= tuning.prompt_min_queries
    prompt_seqs = np.flatnonzero(long_runs)
    small = np.flatnonzero(~long_runs)
    work = attention_work_items(qsl, small)
    # work estimate for the Numba part: query tokens x longest context x 8 heads-ish
    estimate = int(q_lens[small].sum()) * int(meta.seq_lens[small].max()) * 8 if len(small) else 0
    threads = get_num_threads()
    awake = persistent and len(prompt_seqs) == 0       # the threads already run: a slice is a phase
    split_min = tuning.persistent_split_min_tokens if awake else tuning.split_min_tokens
    items, merges = split_work(work, meta, threads, split_min, first_read, block_size)
    return AttentionPlan(meta, prompt_seqs, work, estimate, threads, items, merges, gemm, tuning)



@partial(two_ways, cache=SIMD_CACHE)   # vector_max: registers
def _causal_softmax(scores, row_first, row_pos, scale, sums):
    """In place, row by row: exp(scale * (s - max)) over the keys the row may see (keys
    row_first[r]..row_pos[r]: 0 unless a sliding window), 0 for the others; sums[r] gets the
    row's total. One pass for what numpy needs five for (scale, mask, max, exp, sum), with the
    vectorised exp."""
    for r in prange(scores.shape[0]):
        row = scores[r]
        first, visible = row_first[r], row_pos[r] + 1
        for j in range(first):
            row[j] = row[first]          # out of the window: a score that cannot raise the max
        top = vector_max(row, visible) * scale
        total = np.float32(0.0)
        for j in range(first, visible):
            e = fast_exp(row[j] * scale - top)
            row[j] = e
            total += e
        for j in range(first):
            row[j] = 0.0
        for j in range(visible, row.shape[0]):
            row[j] = 0.0
        sums[r] = total


def _blas_attention(q, k_cache, v_cache, block_table, seq_len, scale, out, quant=None, gemm=None,
                    tuning: FastTuning = DEFAULT_TUNING, window: int = 0) -> None:
    """Attention of one sequence's many queries with two matrix products per KV head.

    q, out: (n, num_heads, head_dim), the last n positions of a context of seq_len.
    The context's blocks are gathered into contiguous (seq_len, head_dim) tiles
    first: the same page-table walk as the kernel, then BLAS does the arithmetic
    (vLLM's prefills likewise leave the paged kernel for a dense one). ``gemm``: oneMKL
    (``kernels/packed_gemm.py``) for the two products, else numpy's BLAS. On MKL they run
    on the OpenMP pool the softmax uses; numpy's OpenBLAS pool then slows that pass (a
    2048-token prompt, one layer: softmax 10 ms after MKL's products, 11-23 after OpenBLAS's).
    ``window`` > 0: a sliding window; only the blocks from the first one it reads are gathered
    (those before may be freed: -1 in the table), and each tile of queries multiplies only the
    keys its window spans.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    base = (max(seq_len - n - window + 1, 0) // block_size) * block_size if window else 0   # first key gathered
    blocks = block_table[base // block_size: -(-seq_len // block_size)]
    # (kv_heads, seq_len - base, head_dim): blocks in logical order, heads first
    keys = k_cache[blocks].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :seq_len - base]
    values = v_cache[blocks].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :seq_len - base]
    if quant is not None:   # widened as they are gathered: this copy is made for floats too
        keys = dequantize(keys, quant.fmt, _gathered_scales(quant.k_scale, quant.fmt, blocks, seq_len - base))
        values = dequantize(values, quant.fmt, _gathered_scales(quant.v_scale, quant.fmt, blocks, seq_len - base))
    tile = tuning.blas_query_tile
    for start in range(0, n, tile):
        stop = min(start + tile, n)
        first_pos = seq_len - n + start
        last_pos = seq_len - n + stop - 1
        lo = max(first_pos - window + 1, base) - base if window else 0   # the tile's first key (gathered index)
        hi = last_pos + 1 - base                                          # ... and its end
        # (rows,) position of each (query, head-in-group) row, and its window's first, both
        # counted from key lo; keys beyond a row's position are never seen
        row_pos = np.repeat(np.arange(first_pos, last_pos + 1) - base - lo, group)
        row_first = (np.maximum(row_pos - window + 1, 0) if window else np.zeros_like(row_pos))
        total = np.empty(len(row_pos), np.float32)                         # (rows,) softmax sums
        for h in range(num_kv_heads):
            qh = q[start:stop, h * group:(h + 1) * group].reshape(-1, head_dim)  # (rows, head_dim)
            if gemm is None:
                scores = qh @ keys[h, lo:hi].T                             # (rows, keys)
            else:
                scores = gemm.sgemm(qh, keys[h, lo:hi], trans_b=True)
            _causal_softmax(scores.size, tuning.softmax_parallel_min_elements)(
                scores, row_first, row_pos, np.float32(scale), total)
            seen = values[h, lo:hi]                                        # (keys, head_dim)
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


_NO_BOUNDS = np.zeros((1, 1, 1), np.float32)   # dense attention: no page metadata
_NO_PARTS = (np.empty((0, 1, 1), np.float32), np.empty((0, 1), np.float32), np.empty((0, 1), np.float32))


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    plan: AttentionPlan | AttentionMetadata, scale: float,
                    quant: KVQuant | None = None, bounds: BlockBounds | None = None, window: int = 0) -> np.ndarray:
    """Causal attention of q (T, num_heads, head_dim) through block tables -> (T, num_heads, head_dim).

    Sequences with many queries (prompts, prompt chunks) use two BLAS products;
    decodes and short chunks use the Numba kernel, which streams each block once.
    ``plan`` comes from ``plan_attention(meta)`` (a bare ``meta`` is planned here).
    ``quant`` describes a compressed cache (int8 / fp8 bytes and their scales); ``bounds``
    turns on block-sparse decode attention (prefills and chunks stay dense). ``window`` > 0: a
    sliding window, read by the BLAS path and the loop kernel (the prompt and register kernels
    have no window).
    """
    if isinstance(plan, AttentionMetadata):
        plan = plan_attention(plan)
    meta, tuning = plan.meta, plan.tuning
    if bounds is not None and len(meta.seq_lens) and bounds.keep * k_cache.shape[2] >= int(meta.seq_lens.max()):
        bounds = None        # the budget covers every context: dense attention, by the dense kernel
    out = np.empty(q.shape, dtype=np.float32)
    qsl = meta.query_start_loc
    if bounds is not None and window:
        raise ValueError("the fast kernels: block-sparse decode attention with a sliding window is not supported")
    prompt_kernel = (len(plan.prompt_seqs) and tuning.prompt_kernel and quant is None and plan.gemm is None
                     and not window and prompt_attention.fits(k_cache, v_cache, q.shape[2]))
    for s in plan.prompt_seqs:
        a, b = qsl[s], qsl[s + 1]
        if prompt_kernel:
            prompt_attention.prompt_attention(q[a:b], k_cache, v_cache, meta.block_tables[s],
                                              int(meta.seq_lens[s]), scale, out[a:b], get_num_threads())
        else:
            _blas_attention(q[a:b], k_cache, v_cache, meta.block_tables[s], int(meta.seq_lens[s]),
                            scale, out[a:b], quant, plan.gemm, tuning, window)
    if len(plan.work):
        slots = int(plan.merges[:, 3].sum()) if len(plan.merges) else 0
        if slots:                    # split-K slices: their partial sums, for _merge_partials
            rows = QUERY_TILE * q.shape[1]
            part_acc = np.empty((slots, rows, q.shape[2]), np.float32)      # (slots, rows, head_dim)
            part_max = np.empty((slots, rows), np.float32)                  # (slots, rows)
            part_sum = np.empty((slots, rows), np.float32)                  # (slots, rows)
        else:                        # whole tiles only: the kernels never touch these
            part_acc, part_max, part_sum = _NO_PARTS
        if quant is not None or window or not tuning.vector_attention or not vector_attention_call(
                q, k_cache, v_cache, plan, scale, part_acc, part_max, part_sum, out, bounds,
                tuning.attention_parallel_min_work):
            fmt, k_scale, v_scale = ((KV_FLOAT, _NO_SCALES, _NO_SCALES) if quant is None
                                     else (quant.fmt, quant.k_scale, quant.v_scale))
            kernel = _paged_attention[fmt, heads_together(q.shape[1] // k_cache.shape[1])](plan.work_estimate,
                                                                                      tuning.attention_parallel_min_work)
            key_min, key_max, keep = _bounds_args(bounds)
            kernel(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, qsl,
                   np.float32(scale), plan.items, plan.num_threads, k_scale, v_scale, key_min, key_max, keep,
                   int(window), part_acc, part_max, part_sum, out)
        if slots:
            _merge_partials(part_acc, part_max, part_sum, plan.merges, qsl, q.shape[1], out)
    return out
