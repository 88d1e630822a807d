"""The plain kernel tier: one readable function for each call of ``KernelOps`` (kernels/ops.py).

The OS idea is the plain, portable reference driver an OS keeps beside the tuned one (Linux's
generic VESA framebuffer beside a graphics card's own driver): it drives the same interface,
runs on any machine, and is short enough to read in one sitting, at some cost in speed. This
is the tier a learner reads first (tutorial 04) and the one to change first. Each operation is
one Numba or NumPy function whose loops say what they compute, checked against the NumPy specs
of kernels/reference.py by tests/test_simple_kernels.py; the tuned tier computes the same.

Words met below:

- a *slot* is ``block * B + offset``: where one token's K and V live in the pool (kernels/layout.py);
- a *block table* row lists one sequence's physical blocks in logical order, -1 padded;
- *GQA* (grouped-query attention): ``group = H // KVH`` query heads share each KV head, so
  query head h reads KV head ``h // group``;
- a *compressed* cache (kernels/kv_quant.py) holds one byte per value: int8 codes with a
  float32 scale per (token, KV head), or fp8 bytes with one scale per layer; they are widened
  back to floats as attention reads them;
- *online softmax*: the softmax of a query's scores computed in one pass over its keys, with a
  running max and a running sum, rescaling what was summed so far whenever the max grows;
- *block-sparse decode* (Quest): a decoding head reads only the ``keep`` blocks whose keys could
  score highest, judged from each block's element-wise key min and max (its *key bounds*).

Shapes: T tokens of the step, H query heads, KVH KV heads, D head_dim, N blocks in the pool,
B block size, S sequences, L layers.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kv_quant import KV_FLOAT, KV_INT8, K_SCALE_CONSTANT, V_SCALE_CONSTANT, float_to_fp8, fp8_widen_scale, widen
from .weight_formats import product
from .layout import AttentionMetadata, BlockBounds, KVQuant
from .ops import ModelWeights, Rope, check_block_ids, check_slots, first_read_positions, window_first_read

# --------------------------------------------------------------------------- small per-token math


@njit(parallel=True, cache=True)
def _rms_norm(x, weight, eps):
    """x (T, hidden) / rms(x) * weight (hidden,): each token's row divided by its root mean square."""
    out = np.empty(x.shape, np.float32)                # (T, hidden)
    hidden = x.shape[1]
    for t in prange(x.shape[0]):
        total = 0.0                                    # sum of squares, in float64
        for i in range(hidden):
            total += x[t, i] * x[t, i]
        inv_rms = 1.0 / np.sqrt(total / hidden + eps)
        for i in range(hidden):
            out[t, i] = x[t, i] * inv_rms * weight[i]
    return out


@njit(parallel=True, cache=True)
def _rotary(x, positions, cos, sin):
    """Rotate-half RoPE of x (T, heads, D): dimension i and i + D/2 form a pair, turned by the
    angle whose cos and sin are cos[pos, i], sin[pos, i] (pos: the token's position)."""
    out = np.empty(x.shape, np.float32)                # (T, heads, D)
    half = x.shape[2] // 2
    for t in prange(x.shape[0]):
        pos = positions[t]
        for h in range(x.shape[1]):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = a * cos[pos, i] - b * sin[pos, i]
                out[t, h, i + half] = b * cos[pos, i] + a * sin[pos, i]
    return out


@njit(parallel=True, cache=True)
def _silu_and_mul(gate_up):
    """gate_up (T, 2 * ffn) = [gate | up] -> silu(gate) * up (T, ffn); silu(g) = g / (1 + e^-g)."""
    ffn = gate_up.shape[1] // 2
    out = np.empty((gate_up.shape[0], ffn), np.float32)   # (T, ffn)
    for t in prange(gate_up.shape[0]):
        for i in range(ffn):
            g = np.float64(gate_up[t, i])
            out[t, i] = g / (1.0 + np.exp(-g)) * gate_up[t, ffn + i]
    return out


# --------------------------------------------------------------------------- writing K and V


@njit(cache=True)
def _store(x, row, fmt, scales, block, head, offset):
    """One token's values of one head, x (D,), into its cache row (D,): copied (a float cache),
    as int8 codes round(x / scale) with scale = max|x| / 127 kept in scales[block, head, offset]
    (an all-zero head: scale 0, codes 0), or as the fp8 bytes of x / the layer's scales[0, 0, 0]."""
    if fmt == KV_FLOAT:
        for d in range(x.shape[0]):
            row[d] = x[d]
    elif fmt == KV_INT8:
        top = np.float32(0.0)
        for d in range(x.shape[0]):
            top = max(top, abs(x[d]))
        scale = top / np.float32(127.0)
        scales[block, head, offset] = scale
        for d in range(x.shape[0]):
            code = min(max(np.rint(x[d] / scale), -127.0), 127.0) if scale > 0 else 0.0
            row[d] = np.int8(code)
    else:
        for d in range(x.shape[0]):
            row[d] = float_to_fp8(np.float32(x[d] / scales[0, 0, 0]), fmt)


@njit(cache=True)
def _write_kv(k_cache, v_cache, k, v, slot_mapping, fmt, k_scale, v_scale):
    """Token t's k[t], v[t] (KVH, D) into slot slot_mapping[t] of the pools (N, KVH, B, D)."""
    block_size = k_cache.shape[2]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:                                   # -1: this token is not written
            continue
        block, offset = slot // block_size, slot % block_size
        for h in range(k.shape[1]):
            _store(k[t, h], k_cache[block, h, offset], fmt, k_scale, block, h, offset)
            _store(v[t, h], v_cache[block, h, offset], fmt, v_scale, block, h, offset)


@njit(cache=True)
def _update_key_bounds(k, slot_mapping, block_size, key_min, key_max):
    """Each written key k[t] (KVH, D) widens its block's box, key_min and key_max (N, KVH, D).
    A block's first slot (offset 0) starts the box afresh: a freed block's old keys are forgotten."""
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        block, offset = slot // block_size, slot % block_size
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                key = k[t, h, d]
                if offset == 0:
                    key_min[block, h, d] = key
                    key_max[block, h, d] = key
                else:
                    key_min[block, h, d] = min(key_min[block, h, d], key)
                    key_max[block, h, d] = max(key_max[block, h, d], key)


# --------------------------------------------------------------------------- paged attention


@njit(cache=True)
def _choose_blocks(q_head, key_min, key_max, table, kv_head, num_blocks, keep):
    """(num_blocks,) bool: the blocks of table (max_blocks,) a decoding head q_head (D,) keeps,
    judged from key_min, key_max (N, KVH, D). A block's upper bound is the most any key inside
    its box could score, sum_d max(q_d * min_d, q_d * max_d); the first and the last block always
    stay, then the keep - 2 others with the highest bounds (ties: the earlier block)."""
    chosen = np.zeros(num_blocks, np.bool_)            # (num_blocks,)
    chosen[0] = True
    chosen[num_blocks - 1] = True
    bound = np.empty(num_blocks - 2, np.float32)       # (num_blocks - 2,) the middle blocks' bounds
    for j in range(1, num_blocks - 1):
        block = table[j]
        total = np.float32(0.0)
        for d in range(q_head.shape[0]):
            low, high = q_head[d] * key_min[block, kv_head, d], q_head[d] * key_max[block, kv_head, d]
            total += max(low, high)
        bound[j - 1] = total
    order = np.argsort(-bound, kind="mergesort")       # highest first; a stable sort keeps ties in order
    for i in range(keep - 2):
        chosen[1 + order[i]] = True
    return chosen


@njit(cache=True)
def _attend(q_head, k_cache, v_cache, table, kv_head, first, pos, chosen, fmt, k_scale, v_scale, out):
    """One query head, q_head (D,) already times the softmax scale, over the keys at positions
    first .. pos of its sequence (first > 0: a sliding window), block by block through its block
    table (max_blocks,), skipping the blocks ``chosen`` (blocks,) leaves out: an online softmax
    whose result goes to out (D,)."""
    block_size, head_dim = k_cache.shape[2], k_cache.shape[3]
    # widen(value, fmt) reads a stored value as a float32: a float as it is, an int8 code as a
    # number, an fp8 byte as its value / fp8_widen_scale(fmt) (2^8 for e4m3), which the fp8
    # layer scales below put back. The scale multiplies the score or the weight of each key.
    int8 = fmt == KV_INT8                              # int8: a scale per (token, KV head)
    fp8 = fmt != KV_FLOAT and not int8                 # fp8: one scale per layer
    k_layer = k_scale[0, 0, 0] * fp8_widen_scale(fmt) if fp8 else np.float32(1.0)
    v_layer = v_scale[0, 0, 0] * fp8_widen_scale(fmt) if fp8 else np.float32(1.0)
    scores = np.empty(block_size, np.float32)          # (B,) one block's scores
    acc = np.zeros(head_dim, np.float32)               # (D,) running sum of weight * value
    run_max = np.float32(-np.inf)                      # the highest score so far
    run_sum = np.float32(0.0)                          # the sum of e^(score - run_max) so far
    for j in range(first // block_size, pos // block_size + 1):   # the blocks that hold first .. pos
        if not chosen[j]:
            continue
        block = table[j]
        start = max(first - j * block_size, 0)         # the window: the first block is cut at first
        valid = min(block_size, pos + 1 - j * block_size)     # causal: the last block is cut at pos
        block_max = np.float32(-np.inf)
        for o in range(start, valid):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q_head[d] * widen(k_cache[block, kv_head, o, d], fmt)
            scores[o] = dot * (k_scale[block, kv_head, o] if int8 else k_layer)
            block_max = max(block_max, scores[o])
        new_max = max(run_max, block_max)
        correction = np.exp(run_max - new_max)         # what the old terms shrink by (0 at first)
        run_sum *= correction
        for d in range(head_dim):
            acc[d] *= correction
        for o in range(start, valid):
            weight = np.exp(scores[o] - new_max)
            run_sum += weight
            weight *= v_scale[block, kv_head, o] if int8 else v_layer
            for d in range(head_dim):
                acc[d] += weight * widen(v_cache[block, kv_head, o, d], fmt)
        run_max = new_max
    for d in range(head_dim):
        out[d] = acc[d] / run_sum


@njit(parallel=True, cache=True)
def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                     fmt, k_scale, v_scale, key_min, key_max, keep, window):
    """Causal attention of q (T, H, D) through the block tables (S, max_blocks): (T, H, D).
    Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1] - 1 (S + 1,), the
    last tokens of its seq_lens[s] (S,); each token runs on its own thread. With keep > 0, a
    sequence of one query (a decode) whose context spans more than keep blocks is block-sparse.
    With window > 0 the token at pos reads only pos - window + 1 .. pos."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size = k_cache.shape[2]
    group = num_heads // k_cache.shape[1]              # query heads per KV head (GQA)
    out = np.empty(q.shape, np.float32)                # (T, H, D)
    for t in prange(q.shape[0]):
        s = np.searchsorted(query_start_loc, t, side="right") - 1   # the sequence t belongs to
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        pos = seq_lens[s] - q_len + (t - query_start_loc[s])        # t's position: it sees 0 .. pos
        first = max(pos - window + 1, 0) if window > 0 else 0       # ... or a window's last ones
        num_blocks = pos // block_size + 1
        sparse = keep > 0 and q_len == 1 and num_blocks > keep
        q_head = np.empty(head_dim, np.float32)        # (D,) one head's query, times scale
        for h in range(num_heads):
            kv_head = h // group
            for d in range(head_dim):
                q_head[d] = q[t, h, d] * scale
            if sparse:
                chosen = _choose_blocks(q_head, key_min, key_max, block_tables[s], kv_head, num_blocks, keep)
            else:
                chosen = np.ones(num_blocks, np.bool_)         # (num_blocks,) dense: every block
            _attend(q_head, k_cache, v_cache, block_tables[s], kv_head, first, pos, chosen,
                    fmt, k_scale, v_scale, out[t, h])
    return out


# --------------------------------------------------------------------------- the tier


def _format(quant: KVQuant | None) -> tuple:
    """(format, K scales, V scales) for the kernels; a float cache has no scales: (1, 1, 1) ones."""
    if quant is None:
        return KV_FLOAT, np.ones((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32)
    return quant.fmt, quant.k_scale, quant.v_scale


class SimpleOps:
    """The plain tier of ``KernelOps``: NumPy arrays, one function per call, no copies of weights."""

    name = "simple"
    xp = np

    # ---------------------------------------------------------------- weights, once per model
    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """The weights as they are (float32 arrays of the checkpoint's layout): ``linear`` reads
        (out, in) rows directly, so this tier makes no copies."""
        return weights

    def weight_bytes(self, weights: ModelWeights) -> int:
        """Bytes of every array the weights hold, each once."""
        return sum(int(a.nbytes) for a in weights.arrays())

    # ---------------------------------------------------------------- one step
    def plan_step(self, weights: ModelWeights, meta: AttentionMetadata, kv_cache) -> AttentionMetadata:
        """No planning: the step's plan is its AttentionMetadata. Its block ids and slots are checked
        against the pool (L, 2, N, KVH, B, D) first, so that a bad one stops the step before any
        layer writes (write_kv and paged_attention check them again when called on their own)."""
        if kv_cache is not None:
            num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[4]
            check_block_ids(meta.block_tables, meta.seq_lens, block_size, num_blocks, self.name,
                            first_read_positions(weights, meta))
            check_slots(meta.slot_mapping, num_blocks * block_size, self.name)
        return meta

    def decode_step(self, weights, hidden, positions, kv_cache, plan, rope: Rope, scale: float,
                    eps: float, num_heads: int, with_head: bool, layer_quant=None, layer_bounds=None) -> None:
        """None: the plain tier declines, and the model goes layer by layer."""
        return None

    def linear(self, x: np.ndarray, w, plan=None) -> np.ndarray:
        """x (T, in) @ w.T -> (T, out), w (out, in): one matrix product by BLAS. A weight in a
        compact format (``kernels/weight_formats.py``) is widened to float32 first, every call:
        its spec, and the bytes it is stored in stay compact ("q4_1_a8" rounds x first)."""
        return product(x, w)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """x (T, hidden) / rms(x) * weight (hidden,) -> (T, hidden)."""
        return _rms_norm(x, weight, eps)

    def rotary(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate-half RoPE of x (T, heads, D) at positions (T,); cos, sin (max_positions, D // 2)."""
        return _rotary(x, positions, cos, sin)

    def silu_and_mul(self, gate_up: np.ndarray) -> np.ndarray:
        """gate_up (T, 2 * ffn) -> silu(gate) * up (T, ffn)."""
        return _silu_and_mul(gate_up)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, quant: KVQuant | None = None,
                 bounds: BlockBounds | None = None) -> None:
        """k, v (T, KVH, D) into k_cache, v_cache (N, KVH, B, D) at slot_mapping (T,); with ``quant``
        as int8 / fp8 bytes (int8's scales too), with ``bounds`` each block's key min / max.
        A slot outside the pool is an IndexError, raised before anything is written."""
        num_blocks, _, block_size, _ = k_cache.shape
        check_slots(slot_mapping, num_blocks * block_size, self.name)
        if bounds is not None:
            _update_key_bounds(k, slot_mapping, block_size, bounds.key_min, bounds.key_max)
        fmt, k_scale, v_scale = _format(quant)
        _write_kv(k_cache, v_cache, k, v, slot_mapping, fmt, k_scale, v_scale)

    def calibrate_kv_scales(self, k: np.ndarray, v: np.ndarray, quant: KVQuant) -> None:
        """fp8's layer scales from this step's k, v (T, KVH, D): max|k| / K_SCALE_CONSTANT and
        max|v| / V_SCALE_CONSTANT (vLLM's calculate_kv_scales), 1.0 where all are 0."""
        for x, scale, constant in ((k, quant.k_scale, K_SCALE_CONSTANT), (v, quant.v_scale, V_SCALE_CONSTANT)):
            top = float(np.abs(x).max()) if x.size else 0.0
            scale[...] = np.float32(top / constant) if top > 0 else np.float32(1.0)

    def paged_attention(self, q, k_cache, v_cache, plan: AttentionMetadata, scale: float,
                        quant: KVQuant | None = None, bounds: BlockBounds | None = None,
                        window: int = 0) -> np.ndarray:
        """Causal attention of q (T, H, D) over each sequence's context in k_cache, v_cache
        (N, KVH, B, D) through its block table: float32 (T, H, D). ``plan`` is the step's
        AttentionMetadata; ``bounds`` turns on block-sparse decode (keep ``bounds.keep`` blocks);
        ``window`` > 0: a sliding window (the token at p reads p - window + 1 .. p).
        A block id outside the pool is an IndexError, raised before anything is read."""
        meta = plan
        num_blocks, _, block_size, _ = k_cache.shape
        if bounds is not None and window:
            raise ValueError("the simple kernels: block-sparse decode attention with a sliding window "
                             "is not supported")
        check_block_ids(meta.block_tables, meta.seq_lens, block_size, num_blocks, self.name,
                        window_first_read(meta, window))
        fmt, k_scale, v_scale = _format(quant)
        if bounds is None:                             # dense: no key bounds to read
            no_bounds = np.zeros((1, 1, 1), np.float32)
            key_min, key_max, keep = no_bounds, no_bounds, 0
        else:
            key_min, key_max, keep = bounds.key_min, bounds.key_max, int(bounds.keep)
        return _paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                np.float32(scale), fmt, k_scale, v_scale, key_min, key_max, keep, int(window))

    # ---------------------------------------------------------------- the pool (DMA)
    def swap_blocks(self, src: np.ndarray, dst: np.ndarray, block_mapping) -> None:
        """Blocks block_mapping[:, 0] of src to block_mapping[:, 1] of dst, every layer, K and V:
        pools (L, 2, N, ...), the K/V blocks or int8's scales; block_mapping (n, 2)."""
        for src_block, dst_block in np.asarray(block_mapping, np.int64).reshape(-1, 2):
            dst[:, :, dst_block] = src[:, :, src_block]

    def copy_blocks(self, kv_cache: np.ndarray, block_mapping) -> None:
        """Copy-on-write inside one pool (L, 2, N, ...): a swap whose source and destination are the same."""
        self.swap_blocks(kv_cache, kv_cache, block_mapping)
