"""RayExecutor: every worker a Ray actor, a process of its own (vLLM's ``ray`` backend).

A multiprocessor's kernel reaches its processors through inter-processor calls; here the
driver reaches its workers through Ray. Each worker (``worker.py``) lives in an actor that
Ray places on a CPU slot, or on a GPU of its own, on this machine or on any machine of the
cluster. One step is, for pipeline stages s = 0, 1, ...::

    hidden = stage[s].execute.remote(step, hidden)     # an ObjectRef, handed to the next stage

so hidden states go from stage to stage through Ray's object store, never back through the
driver, and only the last stage's logits come home. Block moves are sent ahead without
waiting (an actor runs one caller's calls in order) and checked with the next step.

Tensor parallelism across GPUs all-reduces through NCCL (``cupy.cuda.nccl``): each stage's
ranks share a communicator, and the all-reduces of ``LlamaModel.run`` become
``ncclAllReduce`` calls. Ray's own collective library would do the same over NCCL, but on CPUs
its only backend (gloo) needs torch, so tensor parallelism over Ray on CPU workers is
refused; ``uni`` splits by heads on a CPU.

Ray starts here with ``ray.init()`` (a local cluster) unless the program started it, or
``RAY_ADDRESS`` names a running cluster (``ray start --head``, then ``ray start
--address=...`` on every other machine). The model directory must exist at the same path on
every machine. A worker that dies makes the next step raise ``WorkerError``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import time
import weakref

import numpy as np

from ...config import CacheConfig, ConfigError, ParallelConfig
from ...kernels.layout import AttentionMetadata
from ...kernels.fast.linear_paths import LinearPaths
from ...kernels.fast.tuning import DEFAULT_TUNING
from ...model.config import LlamaConfig
from ...model.sharding import ShardSpec
from ...model.weights import gguf_path_of, load_weights
from ..backend import Backend, select_backend
from ..cache_engine import cpu_pool_blocks, profile_gpu_num_blocks, swap_pool_blocks
from ..model_runner import ForwardInput
from .worker import Worker, WorkerError

PLACEMENT_TIMEOUT_S = 120.0     # how long the cluster may take to find room for every worker
LOAD_TIMEOUT_S = 1800.0         # how long the workers may take to load their shards
STEP_TIMEOUT_S = 600.0          # how long one step may take before a worker counts as lost
POLL_S = 0.5                    # how often a wait looks for a worker that failed early
# Ray, if minipaged started it (no ray.init() of the program's own), and how many executors
# use it: the last one to go stops it.
_RAY = {"started_here": False, "executors": 0}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def check_ray_backend(parallel: ParallelConfig, device: str) -> None:
    """Refuse, before anything loads, what the ray executor cannot do here."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'minipaged[distributed]'")
    tp = parallel.tensor_parallel_size
    if tp > 1 and device != "cuda":
        raise ConfigError(
            f"tensor_parallel_size={tp} over Ray needs GPUs: its all-reduce goes through NCCL, and Ray's "
            "collective library has no CPU backend without torch (gloo). On CPUs use "
            "distributed_executor_backend='uni' for tensor parallelism, or pipeline_parallel_size with 'ray'")


def worker_resources(gpu: bool) -> tuple[dict, dict]:
    """(one placement bundle, the actor's options): the bundle must hold all the actor asks for."""
    if gpu:
        return {"CPU": 1, "GPU": 1}, {"num_cpus": 1, "num_gpus": 1}
    return {"CPU": 1}, {"num_cpus": 1, "num_gpus": 0}


def _first_line(text: str) -> str:
    lines = [line.strip() for line in _ANSI.sub("", str(text)).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _writable(array):
    """Ray hands arrays over read-only, straight from its object store; kernels write."""
    return None if array is None else np.array(array)


class NcclGroup:
    """One stage's tensor-parallel ranks, all-reducing over NCCL (one GPU each)."""

    def __init__(self, unique_id, size: int, rank: int) -> None:
        from cupy.cuda import nccl  # noqa: PLC0415 (GPU only)

        self.nccl = nccl
        self.comm = nccl.NcclCommunicator(size, unique_id, rank)

    def all_reduce(self, x):
        import cupy  # noqa: PLC0415

        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        name = np.dtype(x.dtype).name
        if name == "bfloat16" and not hasattr(self.nccl, "NCCL_BFLOAT16"):
            raise RuntimeError("this CuPy's NCCL has no bfloat16: run tensor parallelism with dtype='float16'")
        kind = (self.nccl.NCCL_BFLOAT16 if name == "bfloat16" else
                self.nccl.NCCL_FLOAT16 if name == "float16" else self.nccl.NCCL_FLOAT32)
        self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, kind, self.nccl.NCCL_SUM,
                            cupy.cuda.get_current_stream().ptr)
        return out


class WorkerActor:
    """What runs inside one Ray actor: a Worker, and its end of the NCCL group."""

    def __init__(self, shard: ShardSpec, model_dir: str, model_config: LlamaConfig, cache_config: CacheConfig,
                 device: str, dtype: str, max_model_len: int, max_num_batched_tokens: int,
                 cpu_gemm: str = "auto", linear_paths: LinearPaths | None = None,
                 kernels: str = "fast", tuning=None, weight_format: str = "float32") -> None:
        self.max_model_len, self.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        self.group: NcclGroup | None = None
        self.seconds = {"unpack": 0.0, "compute": 0.0}   # where this worker's step time went
        # A failure here is kept and raised by pid(): Ray reports a task's own exception (a
        # bad checkpoint, say) to the driver, but a failed constructor only as "the actor died".
        self.load_error: Exception | None = None
        try:
            # the driver's choices, its weight format included (bfloat16 is asked for as a dtype)
            self.backend = select_backend(device, "bfloat16" if weight_format == "bfloat16" else dtype, cpu_gemm,
                                          linear_paths, kernels, tuning or DEFAULT_TUNING,
                                          quantization=None if weight_format in ("float32", "bfloat16") else weight_format)
            self.worker = Worker(shard, model_config, load_weights(model_dir, weight_format), cache_config,
                                 self.backend, max_model_len)
        except Exception as err:  # noqa: BLE001 (handed to the driver as it is)
            self.load_error = err

    def pid(self) -> int:
        """This worker's process id, once it has loaded its shard (or its loading error)."""
        if self.load_error is not None:
            raise self.load_error
        return os.getpid()

    def available_blocks(self) -> tuple[int, int]:
        """(device blocks, swap blocks) this worker's own memory holds."""
        w, config = self.worker, self.worker.cache_config
        if config.num_blocks is not None:
            blocks = config.num_blocks
        elif self.backend.device == "cuda":
            blocks = profile_gpu_num_blocks(w.model, w.config, config, self.max_num_batched_tokens,
                                            self.max_model_len, self.backend.dtype)
        else:
            blocks = cpu_pool_blocks(config, w.bytes_per_block)
        return blocks, swap_pool_blocks(config, w.bytes_per_block)

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_blocks, num_cpu_blocks)

    @staticmethod
    def nccl_unique_id():
        from cupy.cuda import nccl  # noqa: PLC0415

        return nccl.get_unique_id()

    def join_group(self, unique_id, size: int, rank: int) -> None:
        self.group = NcclGroup(unique_id, size, rank)

    def move_blocks(self, swap_out, swap_in, copy) -> None:
        self.worker.move_blocks(swap_out, swap_in, copy)

    def execute(self, step: ForwardInput, hidden):
        """This worker's part of one step: hidden states for the next stage, or logits (host arrays)."""
        started = time.perf_counter()
        m = step.meta
        step = ForwardInput(_writable(step.input_ids), _writable(step.positions), AttentionMetadata(
            _writable(m.slot_mapping), _writable(m.query_start_loc), _writable(m.seq_lens),
            _writable(m.block_tables), m.max_query_len, m.max_seq_len), _writable(step.logits_indices))
        run = self.worker.run(step, _writable(hidden))
        computing = time.perf_counter()
        try:
            partial = next(run)
            while True:                      # each stop is an all-reduce over the stage's GPUs
                partial = run.send(self.group.all_reduce(partial))
        except StopIteration as done:
            out = done.value
        self.seconds["unpack"] += computing - started
        self.seconds["compute"] += time.perf_counter() - computing
        if out is None or self.worker.shard.tp_rank != 0:   # rank 0 speaks for its stage
            return None
        return out if isinstance(out, np.ndarray) else out.get()

    def pool_bytes(self) -> int:
        return self.worker.pool_bytes()

    def timings(self) -> dict:
        """Seconds spent unpacking steps and computing them since the last call (bench parallel)."""
        seconds, self.seconds = self.seconds, {"unpack": 0.0, "compute": 0.0}
        return seconds

    @staticmethod
    def echo(x):
        return x

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block


class RayExecutor:
    """Workers as Ray actors: stage after stage, hidden states as Ray objects."""

    def __init__(self, model_dir, model_config: LlamaConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                 backend: Backend, max_model_len: int, max_num_batched_tokens: int, *,
                 extra_models=(), extra_bytes_per_block: int = 0) -> None:
        """A draft model (``extra_models``) stays in the driver with a pool of its own, as many
        blocks as the workers' (its bytes are not in their budgets)."""
        check_ray_backend(parallel, backend.device)
        if backend.weight_format in ("gguf", "gguf_a8"):   # found (or fetched) once here, not by every actor at once
            gguf_path_of(model_dir)
        import ray  # noqa: PLC0415 (the optional `distributed` extra)
        from ray.util.placement_group import placement_group  # noqa: PLC0415
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        gpu = backend.device == "cuda"
        self.ray = ray
        self.xp = backend.xp                 # the driver samples on its own device
        self._dead: str | None = None        # why this executor cannot step any more
        self._pending: list = []             # block moves sent ahead, checked with the next step
        if not ray.is_initialized():
            _start_ray(ray, os.environ.get("RAY_ADDRESS"))
        _RAY["executors"] += 1
        # One bundle per worker, reserved together, so a cluster too small fails here, clearly,
        # instead of leaving an actor pending for ever.
        bundle, options = worker_resources(gpu)
        kind, world = ("GPU" if gpu else "CPU"), tp * pp
        total = ray.cluster_resources().get(kind, 0)
        self.actors: list = []               # filled below; stopped when this executor goes
        if total < world:                    # it can never fit: say so now
            _stop_workers(ray, [], None)
            raise ConfigError(f"the Ray cluster cannot place {world} workers of 1 {kind} each: it has {total:g} "
                              f"{kind}s in all; start Ray with more (ray.init(num_cpus=...), or more machines), "
                              "or lower tensor_parallel_size / pipeline_parallel_size")
        self.placement = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        self._finalizer = weakref.finalize(self, _stop_workers, ray, self.actors, self.placement)
        try:
            ray.get(self.placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources().get(kind, 0)
            self.shutdown()
            raise ConfigError(f"the Ray cluster found no room for {world} workers of 1 {kind} each in "
                              f"{PLACEMENT_TIMEOUT_S:g} s: it has {total:g} {kind}s, {free:g} of them free (others, "
                              "another engine's workers say, hold the rest); free them, or lower "
                              "tensor_parallel_size / pipeline_parallel_size") from None
        actor = ray.remote(WorkerActor)
        self.stages = []                     # stages[pp_rank][tp_rank]: actor handles
        for p in range(pp):
            stage = []
            for t in range(tp):
                strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=p * tp + t)
                stage.append(actor.options(**options, scheduling_strategy=strategy, max_concurrency=1).remote(
                    ShardSpec(t, tp, p, pp), str(model_dir), model_config, cache_config, backend.device,
                    np.dtype(backend.dtype).name, max_model_len,
                    max_num_batched_tokens, backend.cpu_gemm, backend.linear_paths,
                    "fast" if backend.kernels == "cuda" else backend.kernels,
                    getattr(backend.ops, "tuning", None), backend.weight_format))
            self.stages.append(stage)
        self.actors.extend(a for stage in self.stages for a in stage)
        try:                                 # a bad model or budget: its own error, as with uni
            self.pids = self._get([a.pid.remote() for a in self.actors], LOAD_TIMEOUT_S, loading=True)
            if tp > 1:                       # one NCCL communicator per stage
                for stage in self.stages:
                    uid = self._get(stage[0].nccl_unique_id.remote(), loading=True)
                    self._get([a.join_group.remote(uid, tp, t) for t, a in enumerate(stage)], loading=True)
            sizes = self._get([a.available_blocks.remote() for a in self.actors], LOAD_TIMEOUT_S, loading=True)
            self.num_blocks = min(s[0] for s in sizes)                     # every pool: the same ids
            self.num_cpu_blocks = min(s[1] for s in sizes)
            self._get([a.init_cache.remote(self.num_blocks, self.num_cpu_blocks) for a in self.actors],
                      loading=True)
            self.bytes_per_block = sum(self._get([a.bytes_per_block.remote() for a in self.actors]))
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs, timeout: float = STEP_TIMEOUT_S, loading: bool = False):
        """ray.get, with a dead or failing worker turned into one clear WorkerError (while
        loading, a worker's ValueError, such as a bad checkpoint or budget, is raised as it is).

        Waits in short polls, so a worker that fails early is reported at once, even while
        its peers are stuck (in an all-reduce the dead one never joins)."""
        ray = self.ray
        if self._dead:
            raise WorkerError(self._dead)
        many = isinstance(refs, list)
        waiting = list(refs) if many else [refs]
        deadline = time.monotonic() + timeout
        try:
            while True:
                ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S, fetch_local=False)
                if len(ready) == len(waiting):
                    return ray.get(refs)
                ray.get(ready)               # raises now if one of them failed
                if time.monotonic() > deadline:
                    self._dead = f"a Ray worker gave no answer in {timeout:g} s"
                    break
        except ray.exceptions.RayTaskError as err:
            cause = err.cause
            if loading and isinstance(cause, ValueError):
                raise cause from None
            self._dead = f"a Ray worker failed: {type(cause).__name__}: {_first_line(cause)}"
        except ray.exceptions.RayActorError as err:
            self._dead = f"a Ray worker died ({type(err).__name__}: {_first_line(err)})"
        except ray.exceptions.RayError as err:      # lost objects, a dead node, a full object store
            self._dead = f"Ray failed ({type(err).__name__}: {_first_line(err)})"
        self._dead += "; this engine cannot step any more: delete it and build a new one"
        self._finalizer()                    # stop the others now (one may wait in an all-reduce)
        raise WorkerError(self._dead)

    def _submit(self, fn):
        """Send work to the actors; a failure to even send it is a WorkerError too."""
        if self._dead:
            raise WorkerError(self._dead)
        try:
            return fn()
        except self.ray.exceptions.RayError as err:
            self._dead = (f"Ray failed ({type(err).__name__}: {_first_line(err)}); this engine cannot step "
                          "any more: delete it and build a new one")
            self._finalizer()
            raise WorkerError(self._dead) from None

    def move_blocks(self, swap_out, swap_in, copy) -> None:
        self._pending += self._submit(lambda: [a.move_blocks.remote(swap_out, swap_in, copy) for a in self.actors])

    def execute_model(self, model_input: ForwardInput):
        """One step through every stage; (R, vocab) logits from the last stage's rank 0."""
        pending, self._pending = self._pending, []

        def send():
            step = self.ray.put(model_input)          # stored once, read by every worker
            hidden, others = None, []
            for stage in self.stages:
                refs = [a.execute.remote(step, hidden) for a in stage]
                hidden, others = refs[0], others + refs[1:]   # rank 0's output feeds the next stage
            return [*pending, *others, hidden]

        results = self._get(self._submit(send))
        return self.xp.array(results[-1])     # a copy: the sampler may write into its logits

    def pool_bytes(self) -> list[int]:
        return self._get(self._submit(lambda: [a.pool_bytes.remote() for a in self.actors]))

    def worker_timings(self) -> list[dict]:
        """Each worker's unpack and compute seconds since the last call."""
        return self._get(self._submit(lambda: [a.timings.remote() for a in self.actors]))

    def round_trip(self, array) -> float:
        """Seconds for ``array`` to go through every stage and back doing nothing: Ray's own cost."""
        started = time.perf_counter()

        def send():
            ref = self.ray.put(array)
            for stage in self.stages:
                ref = stage[0].echo.remote(ref)
            return ref

        self._get(self._submit(send))
        return time.perf_counter() - started

    def shutdown(self) -> None:
        """Kill every worker actor and free their reservation (and stop Ray, if minipaged started
        it and no other executor uses it). Also run when the executor is collected, and at exit."""
        self._dead = self._dead or "this engine was shut down"
        self._finalizer()


def _start_ray(ray, address: str | None) -> None:
    """ray.init, local or at ``address``; a cluster that is not there is a one-line ConfigError,
    at once (Ray itself would retry a dead address for minutes)."""
    if address and address != "auto" and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()
        except (OSError, ValueError):
            raise ConfigError(f"no Ray cluster answers at RAY_ADDRESS={address!r}; start one there "
                              "(ray start --head) or unset RAY_ADDRESS to start a local one") from None
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as err:
        raise ConfigError(f"could not reach a Ray cluster (RAY_ADDRESS={address!r}): {_first_line(err)}; start "
                          "one (ray start --head) or unset RAY_ADDRESS to start a local one") from None
    _RAY["started_here"] = True


def _stop_workers(ray, actors: list, placement) -> None:
    """The executor's finalizer (run once): it holds the actors, never the executor or the engine."""
    _RAY["executors"] -= 1
    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor)
        if placement is not None:
            ray.util.remove_placement_group(placement)
        if _RAY["started_here"] and _RAY["executors"] == 0:
            ray.shutdown()
            _RAY["started_here"] = False
    actors.clear()
