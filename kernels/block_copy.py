"""Block copies on the GPU as Numba CUDA kernels: the DMA engine of copy-on-write and swapping.

spec: kernels/reference.py swap_blocks. Caches: (num_layers, 2, num_blocks, kv_heads, block_size,
head_dim). One CUDA thread block per (block pair, layer, K/V); its threads copy the contiguous
``kv_heads * block_size * head_dim`` chunk. The kernels take any CUDA array (CuPy arrays
through ``__cuda_array_interface__``) and, for swapping, host arrays in pinned memory that the
GPU addresses directly (mapped with ``cuda.mapped_array``), so a swap is one kernel either way.
Under ``NUMBA_ENABLE_CUDASIM=1`` they run on the CPU simulator, which is how CI tests them.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

THREADS = 256


@cuda.jit
def _copy_blocks_kernel(src, dst, mapping):
    """grid = (num_pairs, num_layers * 2): block (p, lk) copies pair p of layer lk // 2, K or V."""
    pair = cuda.blockIdx.x
    layer = cuda.blockIdx.y // 2
    kv = cuda.blockIdx.y % 2
    s = mapping[pair, 0]
    d = mapping[pair, 1]
    heads, size, dim = src.shape[3], src.shape[4], src.shape[5]
    chunk = heads * size * dim
    i = cuda.threadIdx.x
    while i < chunk:
        h = i // (size * dim)
        o = (i // dim) % size
        e = i % dim
        dst[layer, kv, d, h, o, e] = src[layer, kv, s, h, o, e]
        i += cuda.blockDim.x


@cuda.jit
def _copy_block_metadata_kernel(src, dst, mapping):
    """The same for what a block carries beside its K/V, one axis fewer: int8's scales
    (num_layers, 2, num_blocks, kv_heads, block_size) and block-sparse attention's key bounds
    (num_layers, 2, num_blocks, kv_heads, head_dim)."""
    pair = cuda.blockIdx.x
    layer = cuda.blockIdx.y // 2
    kv = cuda.blockIdx.y % 2
    s = mapping[pair, 0]
    d = mapping[pair, 1]
    heads, width = src.shape[3], src.shape[4]
    i = cuda.threadIdx.x
    while i < heads * width:
        dst[layer, kv, d, i // width, i % width] = src[layer, kv, s, i // width, i % width]
        i += cuda.blockDim.x


@cuda.jit
def _fill_kernel(array, value):
    """The GPU check's preflight probe: one line, to learn whether Numba can launch at all."""
    i = cuda.grid(1)
    if i < array.size:
        array[i] = value


def probe_mapped_launch(n: int = 64) -> bool:
    """Launch a one-line kernel on a mapped (pinned, device-addressable) host array, as
    swapping does, and check it wrote every element."""
    mapped = cuda.mapped_array(n, dtype=np.float32)   # (n,) host memory the GPU reads and writes
    mapped[:] = 0
    _fill_kernel[1, n](mapped, 3.0)
    cuda.synchronize()
    return bool((np.asarray(mapped) == 3.0).all())


def swap_blocks(src, dst, block_mapping) -> None:
    """Copy blocks ``block_mapping[:, 0]`` of ``src`` to ``block_mapping[:, 1]`` of ``dst``.

    src, dst: (num_layers, 2, num_blocks, kv_heads, block_size, head_dim) device or pinned arrays,
              or a block's metadata with one axis fewer (int8 scales, sparse key bounds)
    block_mapping: (n, 2) int64 (host); it is copied to the device for the launch.
    """
    mapping = np.ascontiguousarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    if len(mapping) == 0:
        return
    grid = (len(mapping), src.shape[0] * 2)
    kernel = _copy_blocks_kernel if src.ndim == 6 else _copy_block_metadata_kernel
    kernel[grid, THREADS](_device(src), _device(dst), cuda.to_device(mapping))


def copy_blocks(kv_cache, block_mapping) -> None:
    """Copy-on-write inside one pool (destinations are fresh blocks, never sources)."""
    swap_blocks(kv_cache, kv_cache, block_mapping)


def _device(array):
    """A Numba view of a CuPy (or mapped host) array, zero copy; plain host arrays pass through
    (the simulator takes them as they are)."""
    if hasattr(array, "__cuda_array_interface__"):
        return cuda.as_cuda_array(array)
    return array
