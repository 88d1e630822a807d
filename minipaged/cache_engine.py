"""CacheEngine: owns the physical memory, the KV pool, as RAM chips own the frames.

The block manager only deals in block *numbers*; this class holds the one array
those numbers index (layout in ``kernels/layout.py``) and sizes it.
"""

from __future__ import annotations

from .kernels.layout import kv_bytes_per_block, kv_cache_shape
from .config import CacheConfig

DEFAULT_CPU_KV_SPACE_GIB = 4.0  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
GIB = 1 << 30


class CacheEngine:
    def __init__(self, model_config, cache_config: CacheConfig, xp, dtype) -> None:
        c = model_config
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
        # (layers, 2, num_blocks, kv_heads, block_size, head_dim); zeros are mapped
        # lazily by the OS, so an unused pool costs address space, not RAM.
        shape = kv_cache_shape(c.num_hidden_layers, self.num_blocks, c.num_key_value_heads,
                               cache_config.block_size, c.head_dim)
        try:
            self.kv_cache = xp.zeros(shape, dtype=dtype)
        except MemoryError:
            raise ValueError(f"could not allocate a KV pool of {self.num_blocks} blocks "
                             f"({self.total_bytes / GIB:.1f} GiB); lower kv_cache_space or "
                             "num_blocks") from None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block
