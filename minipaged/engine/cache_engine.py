"""CacheEngine: owns the physical memory (the KV pool) and the swap space, and moves blocks.

The block manager only deals in block *numbers*; this class holds the arrays
those numbers index (layout in ``kernels/layout.py``), sizes them, and carries
out the block manager's swap plans with the kernels' block-copy op, the way a
DMA engine carries out the transfers an OS programs.
"""

from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..kernels.layout import kv_bytes_per_block, kv_cache_shape

DEFAULT_CPU_KV_SPACE_GIB = 4.0  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
GIB = 1 << 30


class CacheEngine:
    def __init__(self, model_config, cache_config: CacheConfig, ops, dtype,
                 gpu_num_blocks: int | None = None) -> None:
        c = model_config
        xp = ops.xp
        self.ops = ops
        self.block_size = cache_config.block_size
        self.bytes_per_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads,
                                                  cache_config.block_size, c.head_dim,
                                                  xp.dtype(dtype).itemsize)
        if cache_config.num_blocks is not None:
            self.num_blocks = cache_config.num_blocks
        elif gpu_num_blocks is not None:      # measured by profile_gpu_num_blocks
            self.num_blocks = gpu_num_blocks
        else:
            space = cache_config.kv_cache_space or DEFAULT_CPU_KV_SPACE_GIB
            self.num_blocks = int(space * GIB) // self.bytes_per_block
            if self.num_blocks < 1:
                raise ValueError(f"kv_cache_space={space} GiB holds no block of "
                                 f"{self.bytes_per_block} bytes; give it more space")
        self.num_cpu_blocks = int(cache_config.swap_space * GIB) // self.bytes_per_block

        def shape(num_blocks: int) -> tuple[int, ...]:
            return kv_cache_shape(c.num_hidden_layers, num_blocks, c.num_key_value_heads,
                                  cache_config.block_size, c.head_dim)

        # Zeros are mapped lazily by the OS, so an unused block costs address space, not RAM.
        try:
            self.kv_cache = xp.zeros(shape(self.num_blocks), dtype=dtype)   # the device pool
            # the swap space is host memory whatever the device; on a GPU it is pinned and
            # mapped, so the block-copy kernel reads and writes it directly over PCIe
            self.cpu_cache = (np.zeros(shape(self.num_cpu_blocks), dtype=dtype)
                              if xp is np or self.num_cpu_blocks == 0
                              else _pinned(shape(self.num_cpu_blocks), dtype))
        except MemoryError:
            raise ValueError(f"could not allocate a KV pool of {self.num_blocks} blocks "
                             f"({self.total_bytes / GIB:.1f} GiB) and a swap space of "
                             f"{self.num_cpu_blocks} blocks; lower kv_cache_space, num_blocks "
                             "or swap_space") from None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (device block, CPU block) pairs into the swap space."""
        self.ops.swap_blocks(self.kv_cache, self.cpu_cache, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (CPU block, device block) pairs back into the device pool."""
        self.ops.swap_blocks(self.cpu_cache, self.kv_cache, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate (shared block, private block) pairs inside the device pool."""
        self.ops.copy_blocks(self.kv_cache, mapping)


def _pinned(shape, dtype):
    from numba import cuda  # noqa: PLC0415 (GPU only)

    array = cuda.mapped_array(shape, dtype=dtype)
    array[...] = 0
    return array


def profile_gpu_num_blocks(model, model_config, cache_config: CacheConfig, max_num_batched_tokens: int,
                           max_model_len: int, dtype) -> int:
    """Size the GPU KV pool as vLLM does: run one forward pass at the largest batch the
    budgets allow, measure the peak memory (weights + activations), and give the KV cache
    what remains of ``gpu_memory_utilization`` of the device's memory."""
    import cupy  # noqa: PLC0415

    from ..kernels.layout import AttentionMetadata  # noqa: PLC0415

    c = model_config
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()          # count only what the weights and this pass hold
    bytes_per_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, cache_config.block_size,
                                         c.head_dim, np.dtype(dtype).itemsize)
    lengths = []                                           # sequences filling the token budget
    left = max_num_batched_tokens
    while left > 0:
        lengths.append(min(left, max_model_len))
        left -= lengths[-1]
    size = cache_config.block_size
    blocks = [-(-n // size) for n in lengths]
    scratch = cupy.zeros(kv_cache_shape(c.num_hidden_layers, sum(blocks), c.num_key_value_heads, size,
                                        c.head_dim), dtype=dtype)
    tables = np.full((len(lengths), max(blocks)), -1, np.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = np.arange(first, first + n)
        first += n
    slots = np.concatenate([tables[i, np.arange(n) // size] * size + np.arange(n) % size
                            for i, n in enumerate(lengths)]).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    meta = AttentionMetadata(cupy.asarray(slots), cupy.asarray(qsl), cupy.asarray(np.array(lengths, np.int32)),
                             cupy.asarray(tables), max(lengths), max(lengths))
    positions = np.concatenate([np.arange(n) for n in lengths])
    model.forward(cupy.zeros(len(positions), np.int64), cupy.asarray(positions), scratch, meta,
                  cupy.asarray(qsl[1:] - 1))
    cupy.cuda.Device().synchronize()
    peak = pool.total_bytes() - scratch.nbytes            # weights + the activations' high-water mark
    del scratch
    pool.free_all_blocks()
    _, total = cupy.cuda.runtime.memGetInfo()
    budget = cache_config.gpu_memory_utilization * total - peak
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"no GPU memory left for the KV cache: weights and activations take "
                         f"{peak / GIB:.1f} GiB of {total / GIB:.1f} GiB at gpu_memory_utilization="
                         f"{cache_config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens")
    return num_blocks
