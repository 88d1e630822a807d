"""NumPy specs of every kernel: the slowest, plainest statement of what each must compute.

They are the test oracle for the plain tier (``kernels/simple.py``), the fast tier (``kernels/fast/``) and
for the CUDA kernels (``kernels/*.cu``, through the CPU harness and on a GPU). Each spec loops in the most obvious way and
never shares code with the kernel it checks.
"""

from __future__ import annotations

import numpy as np


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray, quant=None) -> None:
    """Scatter new keys/values into their slots (in place).

    k_cache, v_cache: (num_blocks, num_kv_heads, block_size, head_dim)
    k, v:             (T, num_kv_heads, head_dim)
    slot_mapping:     (T,) slot = block * block_size + offset, distinct; -1 means "do not write"
    quant:            a layout.KVQuant for a compressed cache: the values are stored as
                      ``quantize_kv`` says, and int8's scales go to quant.k_scale / v_scale
    """
    block_size = k_cache.shape[2]
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), block_size)
        if quant is None:
            k_cache[block, :, offset, :] = k[t]
            v_cache[block, :, offset, :] = v[t]
            continue
        for x, cache, scales in ((k[t], k_cache, quant.k_scale), (v[t], v_cache, quant.v_scale)):
            codes, token_scales = quantize_kv(x, quant.fmt, scales)
            cache[block, :, offset, :] = codes
            if token_scales is not None:
                scales[block, :, offset] = token_scales


KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = 1, 2, 3      # kv_quant's format numbers


def _fp8_dtype(fmt: int):
    import ml_dtypes  # noqa: PLC0415 (the float8 reference conversions; a test dependency)

    return {KV_FP8_E4M3: ml_dtypes.float8_e4m3fn, KV_FP8_E5M2: ml_dtypes.float8_e5m2}[fmt]


def quantize_kv(x: np.ndarray, fmt: int, layer_scale: np.ndarray):
    """One token's K or V (num_kv_heads, head_dim) -> (codes, per-head scales or None).

    int8: scale = max|x| / 127 per head, code = round(x / scale) (0 where the head is all 0).
    fp8:  code = the fp8 byte nearest x / layer scale (ties to even), saturated at the
          format's largest finite value (448 for e4m3, 57344 for e5m2).
    """
    x = x.astype(np.float32)
    if fmt == KV_INT8:
        scales = (np.abs(x).max(axis=-1) / np.float32(127.0)).astype(np.float32)     # (heads,)
        safe = np.where(scales > 0, scales, np.float32(1.0))
        codes = np.where(scales[:, None] > 0, np.clip(np.rint(x / safe[:, None]), -127, 127), 0).astype(np.int8)
        return codes, scales
    dtype = _fp8_dtype(fmt)
    largest = float(np.finfo(dtype).max)
    scaled = np.clip(x / np.float32(layer_scale.reshape(-1)[0]), -largest, largest)
    return scaled.astype(dtype).view(np.uint8), None


def calibrate_kv_scales(k: np.ndarray, v: np.ndarray, quant) -> None:
    """fp8's calculate_kv_scales (vLLM's): the layer scale is max|x| over the step's K (V)
    divided by 200 (100 for V), 1.0 if they are all 0."""
    for x, scale, constant in ((k, quant.k_scale, 200.0), (v, quant.v_scale, 100.0)):
        top = float(np.abs(x.astype(np.float64)).max()) if x.size else 0.0
        scale[...] = np.float32(top / constant) if top > 0 else np.float32(1.0)


def dequantize_kv(codes: np.ndarray, fmt: int, scales: np.ndarray) -> np.ndarray:
    """A whole compressed cache back to float32: codes (num_blocks, heads, block_size, head_dim);
    scales: int8 (num_blocks, heads, block_size), fp8 (1, 1, 1)."""
    if fmt == KV_INT8:
        return codes.astype(np.float32) * scales[..., None]
    return codes.view(_fp8_dtype(fmt)).astype(np.float32) * scales.reshape(-1)[0]


def swap_blocks(src: np.ndarray, dst: np.ndarray, block_mapping: np.ndarray) -> None:
    """Copy whole blocks, every layer, keys and values (in place on ``dst``).

    src, dst:      (num_layers, 2, num_blocks_{src,dst}, num_kv_heads, block_size, head_dim)
    block_mapping: (n, 2) rows of (source block, destination block)
    Swapping out is device -> CPU pool, swapping in CPU pool -> device; copy-on-write
    is the same operation with src and dst the same pool.
    """
    for src_block, dst_block in block_mapping:
        dst[:, :, dst_block] = src[:, :, src_block]


def gather_context(cache: np.ndarray, block_table: np.ndarray, seq_len: int) -> np.ndarray:
    """Read one sequence's first ``seq_len`` K (or V) vectors through its block table.

    cache: (num_blocks, num_kv_heads, block_size, head_dim) -> (seq_len, num_kv_heads, head_dim)
    """
    block_size = cache.shape[2]
    rows = []
    for pos in range(seq_len):
        block = block_table[pos // block_size]
        rows.append(cache[block, :, pos % block_size, :])
    return np.stack(rows).astype(np.float32)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, seq_lens: np.ndarray,
                    query_start_loc: np.ndarray, scale: float, window: int = 0) -> np.ndarray:
    """Causal attention of a flattened batch of query tokens through block tables.

    q:               (T, num_heads, head_dim)
    k_cache/v_cache: (num_blocks, num_kv_heads, block_size, head_dim)
    block_tables:    (S, max_blocks) int
    seq_lens:        (S,) context length of each sequence (new tokens included)
    query_start_loc: (S+1,) sequence s owns query rows [qsl[s], qsl[s+1])
    window:          0, or a sliding window: the query at position p reads p - window + 1 .. p
                     (transformers' mask), and table entries of blocks before that are never read
    returns          (T, num_heads, head_dim) float32

    Query head h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).
    """
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[1]
    block_size = k_cache.shape[2]
    out = np.zeros(q.shape, dtype=np.float32)
    for s in range(len(seq_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        for i, t in enumerate(range(start, end)):
            pos = seq_len - (end - start) + i       # this query's own position
            first = max(pos - window + 1, 0) if window else 0
            seen = range(first, pos + 1)            # the positions it reads
            keys = np.stack([k_cache[block_tables[s][p // block_size], :, p % block_size] for p in seen])
            values = np.stack([v_cache[block_tables[s][p // block_size], :, p % block_size] for p in seen])
            keys, values = keys.astype(np.float32), values.astype(np.float32)   # (len(seen), Hkv, D)
            for h in range(num_heads):
                kv = h // group
                scores = keys[:, kv, :] @ q[t, h].astype(np.float32) * scale  # (len(seen),)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[t, h] = weights @ values[:, kv, :]
    return out


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A linear layer without bias: x (T, in), w (out, in) as checkpoints store it ->
    x @ w.T, (T, out), summed in float64."""
    out = np.zeros((x.shape[0], w.shape[0]), dtype=np.float64)   # (T, out)
    for i in range(x.shape[1]):
        out += np.outer(x[:, i].astype(np.float64), w[:, i].astype(np.float64))
    return out.astype(x.dtype)


def stream_sum(data: np.ndarray) -> float:
    """The sum of data (n,), in float64: what the bandwidth probe must return."""
    return float(np.sum(data, dtype=np.float64))


def logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) of each row of x (N, V), in float64 -> (N,)."""
    x64 = x.astype(np.float64)
    top = x64.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(x64 - top).sum(axis=-1, keepdims=True)))[:, 0]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: (T, hidden), weight: (hidden,) -> (T, hidden): x / rms(x) * weight."""
    x32 = x.astype(np.float32)
    inv_rms = 1.0 / np.sqrt((x32 * x32).mean(axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms * weight).astype(x.dtype)


def rotary(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (the Hugging Face Llama convention).

    x: (T, heads, head_dim); positions: (T,); cos, sin: (max_positions, head_dim // 2)
    Dimension i is paired with dimension i + head_dim/2 and rotated by angle pos * freq_i.
    """
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]   # (T, 1, half)
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU's middle: gate_up (T, 2*ffn) = [gate | up] -> silu(gate) * up, (T, ffn)."""
    ffn = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :ffn].astype(np.float64), gate_up[:, ffn:].astype(np.float64)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(gate_up.dtype)


EXP_MIN, EXP_MAX = -87.0, 88.0   # the range where e^x is a normal float32


def exp(x: np.ndarray) -> np.ndarray:
    """e^x (any shape), in float64, of x clamped to [EXP_MIN, EXP_MAX]; 0 below EXP_MIN."""
    x64 = np.asarray(x, dtype=np.float64)
    return np.where(x64 < EXP_MIN, 0.0, np.exp(np.minimum(x64, EXP_MAX)))


def key_bounds(k_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quest's page metadata of whole blocks: the element-wise min and max of each block's keys.

    k_cache: (num_blocks, num_kv_heads, block_size, head_dim) -> two (num_blocks, num_kv_heads, head_dim)
    (the kernels keep them over the slots written so far; for full blocks the two agree)
    """
    k = k_cache.astype(np.float32)
    return k.min(axis=2), k.max(axis=2)


def select_blocks(q_head: np.ndarray, key_min: np.ndarray, key_max: np.ndarray, num_blocks: int,
                  keep: int) -> np.ndarray:
    """The blocks one query head attends to under a budget of ``keep`` blocks (Quest).

    q_head: (head_dim,); key_min, key_max: (num_blocks, head_dim) of its KV head, the context's
    blocks in logical order. A block's score is the most any of its keys could score,
    sum_i max(q_i * min_i, q_i * max_i); the first and the last (partly filled) block are always
    kept, then the highest scores (ties: the earlier block). Returns sorted logical block indices.
    """
    if keep >= num_blocks:
        return np.arange(num_blocks)
    bound = np.maximum(q_head * key_min[:num_blocks], q_head * key_max[:num_blocks]).sum(axis=1)   # (num_blocks,)
    middle = np.arange(1, num_blocks - 1)
    order = middle[np.argsort(-bound[middle], kind="stable")][: keep - 2]
    return np.sort(np.concatenate([[0], order, [num_blocks - 1]]))


def sparse_decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            key_min: np.ndarray, key_max: np.ndarray, block_tables: np.ndarray,
                            seq_lens: np.ndarray, scale: float, budget: int) -> np.ndarray:
    """Block-sparse decode attention (one query per sequence): each head attends only to the
    blocks ``select_blocks`` keeps within ``budget`` tokens (budget // block_size blocks).

    q: (S, num_heads, head_dim); key_min, key_max: (num_blocks, num_kv_heads, head_dim) physical
    returns (S, num_heads, head_dim) float32; equal to dense attention when the budget covers
    the whole context.
    """
    num_heads, block_size = q.shape[1], k_cache.shape[2]
    group = num_heads // k_cache.shape[1]
    keep = budget // block_size
    out = np.zeros(q.shape, dtype=np.float32)
    for s in range(len(seq_lens)):
        seq_len = int(seq_lens[s])
        n = -(-seq_len // block_size)
        table = block_tables[s, :n]
        keys = gather_context(k_cache, block_tables[s], seq_len)       # (seq_len, Hkv, D)
        values = gather_context(v_cache, block_tables[s], seq_len)
        for h in range(num_heads):
            kv = h // group
            qh = q[s, h].astype(np.float32) * scale
            chosen = select_blocks(qh, key_min[table, kv], key_max[table, kv], n, keep)
            positions = np.concatenate([np.arange(b * block_size, min((b + 1) * block_size, seq_len))
                                        for b in chosen])
            scores = keys[positions, kv, :] @ qh
            weights = np.exp(scores - scores.max())
            out[s, h] = (weights / weights.sum()) @ values[positions, kv, :]
    return out
