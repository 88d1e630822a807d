"""CacheEngine: owns the physical memory (the KV pool) and the swap space, and moves blocks.

The block manager only deals in block *numbers*; this class holds the arrays
those numbers index (layout in ``kernels/layout.py``), sizes them, and carries
out the block manager's swap plans with the kernels' block-copy op, the way a
DMA engine carries out the transfers an OS programs.

With ``kv_cache_dtype`` int8 or fp8 the pool holds one byte per value (``kernels/kv_quant.py``)
and a scales array beside it; int8's scales are per block, so every swap and copy moves
them with the same block mapping as the bytes.
"""

from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..kernels.kv_quant import KV_FLOAT, KV_INT8, STORAGE_DTYPE, kv_format, scale_bytes_per_token_head
from ..kernels.layout import (BlockBounds, KVQuant, key_bounds_shape, kv_bytes_per_block, kv_cache_shape,
                              kv_scales_shape)

DEFAULT_CPU_KV_SPACE_GIB = 4.0  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
GIB = 1 << 30


class CacheEngine:
    def __init__(self, model_config, cache_config: CacheConfig, ops, dtype,
                 gpu_num_blocks: int | None = None, extra_bytes_per_block: int = 0,
                 num_cpu_blocks: int | None = None) -> None:
        """``extra_bytes_per_block``: what another pool indexed by the same block ids (a draft
        model's) takes per block out of the same space; ``num_cpu_blocks``: that pool's swap
        blocks, to match (default: as many as swap_space holds)."""
        c = model_config
        xp = ops.xp
        self.ops = ops
        self.block_size = cache_config.block_size
        self.kv_format = kv_format(cache_config.kv_cache_dtype)
        storage = dtype if self.kv_format == KV_FLOAT else STORAGE_DTYPE[self.kv_format]
        self.storage_dtype = np.dtype(storage)
        self.bytes_per_block = block_bytes(model_config, cache_config, dtype)
        if cache_config.num_blocks is not None:
            self.num_blocks = cache_config.num_blocks
        elif gpu_num_blocks is not None:      # measured by profile_gpu_num_blocks
            self.num_blocks = gpu_num_blocks
        else:
            self.num_blocks = cpu_pool_blocks(cache_config, self.bytes_per_block + extra_bytes_per_block)
        self.num_cpu_blocks = (swap_pool_blocks(cache_config, self.bytes_per_block + extra_bytes_per_block)
                               if num_cpu_blocks is None else num_cpu_blocks)

        def shape(num_blocks: int) -> tuple[int, ...]:
            return kv_cache_shape(c.num_hidden_layers, num_blocks, c.num_key_value_heads,
                                  cache_config.block_size, c.head_dim)

        def scales_shape(num_blocks: int) -> tuple[int, ...]:
            return kv_scales_shape(c.num_hidden_layers, num_blocks, c.num_key_value_heads,
                                   cache_config.block_size, per_token=self.kv_format == KV_INT8)

        # Zeros are mapped lazily by the OS, so an unused block costs address space, not RAM.
        try:
            self.kv_cache = xp.zeros(shape(self.num_blocks), dtype=storage)   # the device pool
            # the swap space is host memory whatever the device; on a GPU it is pinned and
            # mapped, so the block-copy kernel reads and writes it directly over PCIe
            def host(shape_, dtype_):   # the swap space's arrays: pinned and mapped on a GPU
                return np.zeros(shape_, dtype_) if xp is np or self.num_cpu_blocks == 0 else _pinned(shape_, dtype_)

            self.cpu_cache = host(shape(self.num_cpu_blocks), storage)
            # int8: a scale per (token, head) in every block, swapped with it; fp8: per layer,
            # 1.0 as vLLM's default (K and V of every layer)
            self.kv_scales = self.cpu_scales = None
            if self.kv_format == KV_INT8:
                self.kv_scales = xp.zeros(scales_shape(self.num_blocks), dtype=np.float32)
                self.cpu_scales = host(scales_shape(self.num_cpu_blocks), np.float32)
            elif self.kv_format != KV_FLOAT:
                self.kv_scales = xp.ones(scales_shape(0), dtype=np.float32)
            # block-sparse attention: each block's key [min | max] per layer, moved with the block
            self.sparse_keep = (cache_config.sparse_attention_budget // self.block_size
                                if cache_config.sparse_attention_budget else 0)
            self.key_bounds = self.cpu_bounds = None
            if self.sparse_keep:
                self.key_bounds = xp.zeros(key_bounds_shape(c.num_hidden_layers, self.num_blocks,
                                                            c.num_key_value_heads, c.head_dim), dtype=np.float32)
                self.cpu_bounds = host(key_bounds_shape(c.num_hidden_layers, self.num_cpu_blocks,
                                                        c.num_key_value_heads, c.head_dim), np.float32)
            # fp8 with calculate_kv_scales: the first step sets the layer scales (vLLM's rule)
            self.scales_pending = cache_config.calculate_kv_scales and self.kv_format not in (KV_FLOAT, KV_INT8)
        except MemoryError:
            raise ValueError(f"could not allocate a KV pool of {self.num_blocks} blocks "
                             f"({self.total_bytes / GIB:.1f} GiB) and a swap space of "
                             f"{self.num_cpu_blocks} blocks; lower kv_cache_space, num_blocks "
                             "or swap_space") from None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def layer_quant(self, layer: int) -> KVQuant | None:
        """What the kernels need to read and write layer ``layer``'s compressed blocks."""
        if self.kv_format == KV_FLOAT:
            return None
        return KVQuant(self.kv_format, self.kv_scales[layer, 0], self.kv_scales[layer, 1],
                       calibrate=self.scales_pending)

    def layer_bounds(self, layer: int) -> BlockBounds | None:
        """Layer ``layer``'s page metadata for block-sparse decode attention, if it is on."""
        if self.key_bounds is None:
            return None
        return BlockBounds(self.key_bounds[layer, 0], self.key_bounds[layer, 1], self.sparse_keep)

    def set_sparse_budget(self, tokens: int) -> None:
        """Change the decode budget (tokens; 0: dense) of a cache built with one, which keeps
        the page metadata whatever the budget (``bench sparse`` compares budgets on one engine)."""
        if self.key_bounds is None:
            raise ValueError("this cache keeps no page metadata: build the engine with sparse_attention_budget")
        if tokens and tokens < 2 * self.block_size:
            raise ValueError(f"a sparse budget must be 0 (dense) or >= {2 * self.block_size} tokens, got {tokens}")
        self.sparse_keep = tokens // self.block_size

    def _per_block(self) -> list[tuple]:
        """(device array, swap-space array) of everything indexed by block id: the K/V bytes,
        int8's scales, the sparse key bounds. A block moves with all of them."""
        pairs = [(self.kv_cache, self.cpu_cache)]
        if self.kv_format == KV_INT8:
            pairs.append((self.kv_scales, self.cpu_scales))
        if self.key_bounds is not None:
            pairs.append((self.key_bounds, self.cpu_bounds))
        return pairs

    def move(self, swap_out, swap_in, copy) -> None:
        """Carry out one step's plan: swap-outs first (they free device blocks that this step's
        swap-ins may reuse), then swap-ins, then copy-on-write copies."""
        if swap_out:
            self.swap_out(swap_out)
        if swap_in:
            self.swap_in(swap_in)
        if copy:
            self.copy(copy)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (device block, CPU block) pairs into the swap space (bytes and their scales)."""
        for device, host in self._per_block():
            self.ops.swap_blocks(device, host, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (CPU block, device block) pairs back into the device pool."""
        for device, host in self._per_block():
            self.ops.swap_blocks(host, device, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate (shared block, private block) pairs inside the device pool."""
        for device, _ in self._per_block():
            self.ops.copy_blocks(device, mapping)


def block_bytes(model_config, cache_config: CacheConfig, dtype) -> int:
    """Bytes one physical block takes in the pool: its K/V in the storage type, and whatever it
    carries beside them (int8's scales, block-sparse attention's key bounds)."""
    fmt = kv_format(cache_config.kv_cache_dtype)
    storage = np.dtype(dtype if fmt == KV_FLOAT else STORAGE_DTYPE[fmt])
    return kv_bytes_per_block(model_config.num_hidden_layers, model_config.num_key_value_heads,
                              cache_config.block_size, model_config.head_dim, storage.itemsize,
                              scale_bytes_per_token_head(fmt),
                              key_bounds=cache_config.sparse_attention_budget is not None)


def cpu_pool_blocks(cache_config: CacheConfig, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` (every pool a block id names, summed) in ``kv_cache_space``."""
    space = cache_config.kv_cache_space or DEFAULT_CPU_KV_SPACE_GIB
    num_blocks = int(space * GIB) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_space={space} GiB holds no block of {bytes_per_block} bytes; give it more space")
    return num_blocks


def swap_pool_blocks(cache_config: CacheConfig, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` in the swap space (``swap_space`` GiB of host memory)."""
    return int(cache_config.swap_space * GIB) // bytes_per_block


def _pinned(shape, dtype):
    from numba import cuda  # noqa: PLC0415 (GPU only)

    # Numba has no bfloat16: a bf16 pool's swap space is mapped as its uint16 bits (a view of a
    # mapped array would lose its device pointer); swap_blocks copies 16-bit words either way
    bits = np.dtype(np.uint16) if np.dtype(dtype).name == "bfloat16" else np.dtype(dtype)
    array = cuda.mapped_array(shape, dtype=bits)
    array[...] = 0
    return array


def kv_cache_blocks(*, total: int, free: int, utilization: float, activations: int,
                    bytes_per_block: int) -> int:
    """How many KV blocks a new engine may have, from what the device really has free.

    total, free:  the device's memory and what is free now (``cudaMemGetInfo``), after
                  this engine loaded its weights and CuPy's pool returned its cached blocks
    activations:  the peak of this engine's profiling pass (needed again at every step)

    vLLM's rule: an engine may use ``utilization`` of the device's memory. Everything in
    use now counts against that share: this engine's weights and CUDA context, and any
    other engine or process on the device. So a second engine in one process gets only
    what the first left, never a negative budget from counting a cache as in use.
    """
    in_use = total - free
    return max(int((utilization * total - in_use - activations) // bytes_per_block), 0)


def profile_gpu_num_blocks(model, model_config, cache_config: CacheConfig, max_num_batched_tokens: int,
                           max_model_len: int, dtype, extra_models=(), extra_bytes_per_block: int = 0,
                           group_sizes: tuple[int, ...] | None = None) -> int:
    """Size the GPU KV pool as vLLM does: run one forward pass at the largest batch the
    budgets allow, measure its peak memory, and give the KV cache what remains of
    ``gpu_memory_utilization`` of the device's memory (``kv_cache_blocks``).

    ``extra_models``: (model, config) pairs that run on the same steps (a draft model, the
    other shards of a split model), each measured the same way; ``extra_bytes_per_block``:
    what their pools take per block id besides this one's. ``group_sizes``: the nets, in
    order, come in groups that are alive at once (a stage's tensor-parallel ranks, in lock
    step), whose peaks add; the peak is the largest group's. Default: each net alone."""
    import cupy  # noqa: PLC0415

    from ..kernels.layout import AttentionMetadata  # noqa: PLC0415

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()          # cached blocks of dropped arrays are not ours to count
    bytes_per_block = block_bytes(model_config, cache_config, dtype) + extra_bytes_per_block
    lengths = []                                           # sequences filling the token budget
    left = max_num_batched_tokens
    while left > 0:
        lengths.append(min(left, max_model_len))
        left -= lengths[-1]
    size = cache_config.block_size
    blocks = [-(-n // size) for n in lengths]
    tables = np.full((len(lengths), max(blocks)), -1, np.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = np.arange(first, first + n)
        first += n
    slots = np.concatenate([tables[i, np.arange(n) // size] * size + np.arange(n) % size
                            for i, n in enumerate(lengths)]).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])
    peaks = []                  # each net's own high-water mark, in order
    xp_dtype = np.dtype(dtype)
    nets = [(model, model_config), *extra_models]
    for net, c in nets:
        scratch = cupy.zeros(kv_cache_shape(c.num_hidden_layers, sum(blocks), c.num_key_value_heads, size,
                                            c.head_dim), dtype=dtype)
        meta = AttentionMetadata(cupy.asarray(slots), cupy.asarray(qsl), cupy.asarray(np.array(lengths, np.int32)),
                                 cupy.asarray(tables), max(lengths), max(lengths))
        ids, pos, last = cupy.zeros(len(positions), np.int64), cupy.asarray(positions), cupy.asarray(qsl[1:] - 1)
        alive = pool.used_bytes()       # everything in use before the pass (ours, and any other engine's)
        # a later pipeline stage starts from hidden states; a tensor-parallel shard's all-reduces
        # are answered with its own partial (the shapes, not the sums, set the memory)
        inputs = ids if net.shard.is_first_stage else cupy.zeros((len(positions), c.hidden_size), xp_dtype)
        run = net.run(inputs, pos, scratch, meta, last)
        try:
            partial = next(run)
            while True:
                partial = run.send(partial)
        except StopIteration:
            pass
        cupy.cuda.Device().synchronize()
        peaks.append(pool.total_bytes() - alive)    # the pool keeps the pass's high-water mark
        del scratch, meta, ids, pos, last, inputs, run
        pool.free_all_blocks()
    sizes, first, activations = group_sizes or (1,) * len(nets), 0, 0
    for size in sizes:
        activations = max(activations, sum(peaks[first:first + size]))
        first += size
    free, total = cupy.cuda.runtime.memGetInfo()
    utilization = cache_config.gpu_memory_utilization
    num_blocks = kv_cache_blocks(total=total, free=free, utilization=utilization, activations=activations,
                                 bytes_per_block=bytes_per_block)
    if num_blocks < 1:
        weights = model.nbytes + sum(net.nbytes for net, _ in extra_models)
        raise ValueError(f"no GPU memory left for the KV cache: {(total - free) / GIB:.1f} GiB of the device's "
                         f"{total / GIB:.1f} GiB is in use (this engine's weights: {weights / GIB:.1f} GiB) "
                         f"and a step's activations need {activations / GIB:.1f} GiB, beyond "
                         f"gpu_memory_utilization={utilization}; raise it, lower max_num_batched_tokens, or "
                         "drop other engines first (minipaged.engine.backend.release_device_memory)")
    return num_blocks
