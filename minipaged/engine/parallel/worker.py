"""Worker: one processor of a multiprocessor, with its local memory.

The driver (LLMEngine) is the kernel: one scheduler, one block manager, one set of block
tables. Each worker is a processor with memory of its own, as in a NUMA machine: a shard of
the model (``model/sharding.py``) and a CacheEngine whose frames hold the K/V of *its* KV
heads (tensor parallelism) and *its* layers (pipeline parallelism), at the same block ids as
every other worker's. So the block manager plans once: each swap, copy-on-write copy and
free names block ids that every worker carries out on its own frames, and one step's block
tables, slot mapping and positions are read by all of them.

A worker knows nothing of sequences: it receives plain arrays (``ForwardInput``), and block
moves as (source, destination) pairs. Executors (``executor.py``, ``ray_executor.py``) decide
where workers live and how their all-reduces meet.
"""

from __future__ import annotations

import dataclasses

from ...config import CacheConfig
from ...model.config import LlamaConfig
from ...model.llama import LlamaModel
from ...model.sharding import ShardSpec, shard_config, shard_tensors
from ..backend import Backend
from ...kernels.kv_quant import KV_INT8
from ..cache_engine import CacheEngine, block_bytes
from ..model_runner import ForwardInput, ModelRunner


class WorkerError(RuntimeError):
    """A worker died, failed, or fell out of step; the engine cannot step any more."""


class Worker:
    def __init__(self, shard: ShardSpec, model_config: LlamaConfig, tensors: dict, cache_config: CacheConfig,
                 backend: Backend, max_model_len: int) -> None:
        """``model_config``, ``tensors``: the whole model's; the worker keeps its slice."""
        self.shard = shard
        self.backend = backend
        self.cache_config = cache_config
        if backend.linear_paths is None:
            raise RuntimeError("the backend's linear paths are not decided yet: settle them first "
                               "(engine/linear_calibration.py settle_linear_paths)")
        self.config = shard_config(model_config, shard)          # this worker's heads, columns, layers
        # tensors in a compact format come quantized (model/weights.py load_weights): kept so
        self.model = LlamaModel(self.config, shard_tensors(tensors, model_config, shard), backend.ops,
                                backend.dtype, max_positions=max_model_len, shard=shard)
        self.runner = ModelRunner(self.model)
        self.cache: CacheEngine | None = None                    # after init_cache
        self.bytes_per_block = block_bytes(self.config, cache_config, backend.dtype)   # one frame here

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate this worker's pool: as many frames as every other worker's (one block id each)."""
        config = dataclasses.replace(self.cache_config, num_blocks=num_blocks)
        self.cache = CacheEngine(self.config, config, self.backend.ops, self.backend.dtype,
                                 num_cpu_blocks=num_cpu_blocks)

    def move_blocks(self, swap_out, swap_in, copy) -> None:
        """Carry out the block manager's plan on this worker's frames (CacheEngine.move)."""
        self.cache.move(swap_out, swap_in, copy)

    def _pool_views(self):
        cache = self.cache
        quant = cache.layer_quant if cache.kv_format else None
        bounds = cache.layer_bounds if cache.key_bounds is not None else None
        return quant, bounds

    def execute(self, model_input: ForwardInput):
        """One step of a worker that holds the whole model: (R, vocab) logits."""
        quant, bounds = self._pool_views()
        logits = self.runner.execute(model_input, self.cache.kv_cache, quant, bounds)
        self.cache.scales_pending = False           # calculate_kv_scales: set once, by the first step
        return logits

    def run(self, model_input: ForwardInput, hidden=None):
        """One step of a shard, as a generator that stops at each all-reduce (``LlamaModel.run``).
        ``hidden``: (T, hidden) the previous stage's output; None on the first stage."""
        quant, bounds = self._pool_views()
        out = yield from self.runner.run(model_input, hidden, self.cache.kv_cache, quant, bounds)
        self.cache.scales_pending = False
        return out

    def pool_bytes(self) -> int:
        """Bytes of this worker's device pool: what its block ids index (K/V, int8's scales, the
        sparse key bounds; not fp8's few per-layer scales)."""
        cache = self.cache
        arrays = [cache.kv_cache, cache.kv_scales if cache.kv_format == KV_INT8 else None, cache.key_bounds]
        return sum(int(a.nbytes) for a in arrays if a is not None)
