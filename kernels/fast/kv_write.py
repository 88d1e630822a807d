"""The fast tier's KV writes and block copies: a step's keys and values into their slots, and the
block moves of copy-on-write and swapping.

The OS idea is the page store and the DMA engine: ``write_kv`` stores each token's K and V at
its slot (block * block_size + offset, the physical address the block table gives), quantized
on write for an int8 / fp8 cache; ``swap_blocks`` and ``copy_blocks`` move whole frames.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numba import njit, prange

from ..kv_quant import K_SCALE_CONSTANT, KV_FLOAT, KV_INT8, V_SCALE_CONSTANT, float_to_fp8
from ..layout import BlockBounds, KVQuant
from .compile import two_ways
from .tuning import DEFAULT_TUNING, FastTuning

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



@partial(two_ways, fastmath=False)
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
             bounds: BlockBounds | None = None, tuning: FastTuning = DEFAULT_TUNING) -> None:
    """Scatter k, v (T, num_kv_heads, head_dim) into the caches at ``slot_mapping`` (T,), whose
    slots are distinct (-1 aside: tokens not written), as the block tables make them: from
    ``tuning.write_kv_parallel_min_tokens`` tokens the threads write at once;
    with ``quant``, as int8 or fp8 bytes (and int8's per-token scales); with ``bounds``,
    keeping each block's key min / max (block-sparse attention's page metadata)."""
    if bounds is not None:
        _update_key_bounds(k, slot_mapping, k_cache.shape[2], bounds.key_min, bounds.key_max)
    kernel = _write_kv(slot_mapping.shape[0], tuning.write_kv_parallel_min_tokens)
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

