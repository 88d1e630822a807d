"""Executors: where the workers live, and how one step reaches all of them.

A multiprocessor's kernel decides once what runs, then tells every processor (an
inter-processor call). The driver's scheduler and block manager decide once; an executor
carries the decision to every worker (``worker.py``): the same block moves, the same flat
arrays, and for pipeline parallelism the hidden states from one stage to the next.

``UniExecutor`` (vLLM's ``uni``) keeps every worker in this process. A stage's
tensor-parallel workers run in lock step (``run_in_lock_step``): each worker's forward pass
is a generator that stops at an all-reduce with its partial sum; when all have stopped, the
executor adds the partials in rank order and hands every worker the same total. That is all
an all-reduce is; NCCL does the same across GPUs (``ray_executor.py``).

``make_executor`` picks the executor that ``ParallelConfig.distributed_executor_backend`` names.
"""

from __future__ import annotations

from ...config import CacheConfig, ParallelConfig
from ...model.config import LlamaConfig
from ...model.sharding import ShardSpec
from ...model.weights import load_weights
from ..backend import Backend
from ..cache_engine import cpu_pool_blocks, profile_gpu_num_blocks, swap_pool_blocks
from ..model_runner import ForwardInput
from .worker import Worker, WorkerError


def run_in_lock_step(runs: list):
    """Drive one stage's tensor-parallel forward passes (``Worker.run`` generators) together.

    At each all-reduce every run yields its partial sum, (T, hidden); their sum, added in
    rank order so that every run receives the very same array, is sent back to all. Returns
    the runs' results, rank by rank."""
    total = None
    while True:
        partials, results = [], []
        for run in runs:
            try:
                partials.append(run.send(total))
            except StopIteration as done:
                results.append(done.value)
        if results:
            if partials:
                raise WorkerError("tensor-parallel workers fell out of step: some finished, some wait "
                                  "at an all-reduce")
            return results
        total = partials[0]
        for partial in partials[1:]:
            total = total + partial                  # a new array: no worker's partial is changed


class UniExecutor:
    """Every worker in the driver's process, on the driver's one device."""

    def __init__(self, model_dir, model_config: LlamaConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                 backend: Backend, max_model_len: int, max_num_batched_tokens: int, *,
                 extra_models=(), extra_bytes_per_block: int = 0) -> None:
        """``extra_models``: (model, config) pairs sharing the device and the block ids (a draft
        model), with ``extra_bytes_per_block`` their frames' bytes per block id."""
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        tensors = load_weights(model_dir, backend.weight_format)       # read once; each worker keeps its slices
        self.stages = [[Worker(ShardSpec(t, tp, p, pp), model_config, tensors, cache_config, backend, max_model_len)
                        for t in range(tp)] for p in range(pp)]           # stages[pp_rank][tp_rank]
        del tensors
        self.workers = [w for stage in self.stages for w in stage]
        self.driver_worker = self.stages[0][0]
        # One device holds every worker's frames, so a block id costs all of them together
        # (the same bytes as one unsplit worker's frame): the budget is shared, not multiplied.
        per_block = self.bytes_per_block + extra_bytes_per_block
        if cache_config.num_blocks is not None:
            num_blocks = cache_config.num_blocks
        elif backend.device == "cuda":
            others = [(w.model, w.config) for w in self.workers[1:]]
            num_blocks = profile_gpu_num_blocks(
                self.driver_worker.model, self.driver_worker.config, cache_config, max_num_batched_tokens,
                max_model_len, backend.dtype, extra_models=[*others, *extra_models],
                extra_bytes_per_block=per_block - self.driver_worker.bytes_per_block,
                group_sizes=(tp,) * pp + (1,) * len(extra_models))   # a stage's ranks live at once
        else:
            num_blocks = cpu_pool_blocks(cache_config, per_block)
        num_cpu_blocks = swap_pool_blocks(cache_config, per_block)
        for worker in self.workers:
            worker.init_cache(num_blocks, num_cpu_blocks)

    @property
    def num_blocks(self) -> int:
        return self.driver_worker.cache.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.driver_worker.cache.num_cpu_blocks

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs across all workers (each holds its heads' or layers' share)."""
        return sum(w.bytes_per_block for w in self.workers)

    def move_blocks(self, swap_out, swap_in, copy) -> None:
        for worker in self.workers:
            worker.move_blocks(swap_out, swap_in, copy)

    def execute_model(self, model_input: ForwardInput):
        """One forward pass through every stage; (R, vocab) logits from the last stage's rank 0."""
        if len(self.workers) == 1:
            return self.driver_worker.execute(model_input)
        hidden = None                                # the first stage reads the token ids
        for stage in self.stages:
            hidden = run_in_lock_step([w.run(model_input, hidden) for w in stage])[0]
        return hidden

    def pool_bytes(self) -> list[int]:
        """Each worker's device pool, in bytes (stage by stage, rank by rank)."""
        return [w.pool_bytes() for w in self.workers]

    def shutdown(self) -> None:
        """Nothing to stop: the workers go with this process."""


def check_executor(parallel: ParallelConfig, device: str) -> None:
    """Refuse, before anything loads, an executor this machine cannot run."""
    if parallel.distributed_executor_backend == "ray":
        from .ray_executor import check_ray_backend  # noqa: PLC0415

        check_ray_backend(parallel, device)


def make_executor(model_dir, model_config: LlamaConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                  backend: Backend, max_model_len: int, max_num_batched_tokens: int, **kwargs):
    if parallel.distributed_executor_backend == "ray":
        from .ray_executor import RayExecutor  # noqa: PLC0415 (ray is the optional `distributed` extra)

        return RayExecutor(model_dir, model_config, cache_config, parallel, backend, max_model_len,
                           max_num_batched_tokens, **kwargs)
    return UniExecutor(model_dir, model_config, cache_config, parallel, backend, max_model_len,
                       max_num_batched_tokens, **kwargs)
