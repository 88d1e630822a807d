"""NumPy specs of every kernel: the slowest, plainest statement of what each must compute.

They are the test oracle for the Numba CPU kernels (``kernels/cpu.py``) and
for the CUDA kernels (``kernels/*.cu``, through the CPU harness and on a GPU). Each spec loops in the most obvious way and
never shares code with the kernel it checks.
"""

from __future__ import annotations

import numpy as np


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """Scatter new keys/values into their slots (in place).

    k_cache, v_cache: (num_blocks, num_kv_heads, block_size, head_dim)
    k, v:             (T, num_kv_heads, head_dim)
    slot_mapping:     (T,) slot = block * block_size + offset; -1 means "do not write"
    """
    block_size = k_cache.shape[2]
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), block_size)
        k_cache[block, :, offset, :] = k[t]
        v_cache[block, :, offset, :] = v[t]


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
                    query_start_loc: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention of a flattened batch of query tokens through block tables.

    q:               (T, num_heads, head_dim)
    k_cache/v_cache: (num_blocks, num_kv_heads, block_size, head_dim)
    block_tables:    (S, max_blocks) int
    seq_lens:        (S,) context length of each sequence (new tokens included)
    query_start_loc: (S+1,) sequence s owns query rows [qsl[s], qsl[s+1])
    returns          (T, num_heads, head_dim) float32

    Query head h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).
    """
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[1]
    out = np.zeros(q.shape, dtype=np.float32)
    for s in range(len(seq_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        keys = gather_context(k_cache, block_tables[s], seq_len)    # (seq_len, Hkv, D)
        values = gather_context(v_cache, block_tables[s], seq_len)  # (seq_len, Hkv, D)
        for i, t in enumerate(range(start, end)):
            pos = seq_len - (end - start) + i       # this query's own position
            for h in range(num_heads):
                kv = h // group
                scores = keys[: pos + 1, kv, :] @ q[t, h].astype(np.float32) * scale  # (pos+1,)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[t, h] = weights @ values[: pos + 1, kv, :]
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
