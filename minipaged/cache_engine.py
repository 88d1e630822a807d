"""CacheEngine: owns the physical memory (the KV pool) and the swap space, and moves blocks.

The block manager only deals in block *numbers*; this class holds the arrays
those numbers index (layout in ``kernels/layout.py``), sizes them, and carries
out the block manager's swap plans with the kernels' block-copy op, the way a
DMA engine carries out the transfers an OS programs.
"""

from __future__ import annotations

import numpy as np

from .config import CacheConfig
from .kernels.layout import kv_bytes_per_block, kv_cache_shape

DEFAULT_CPU_KV_SPACE_GIB = 4.0  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
GIB = 1 << 30


class CacheEngine:
    def __init__(self, model_config, cache_config: CacheConfig, ops, dtype) -> None:
        c = model_config
        xp = ops.xp
        self.ops = ops
        self.block_size = cache_config.block_size
        self.bytes_per_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads,
                                                  cache_config.block_size, c.head_dim,
                                                  xp.dtype(dtype).itemsize)
        if cache_config.num_blocks is not None:
            self.num_blocks = cache_config.num_blocks
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
            # the swap space is host memory whatever the device: numpy, not xp
            self.cpu_cache = np.zeros(shape(self.num_cpu_blocks), dtype=dtype)
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
