"""``python -m minipaged bench roofline``: the machine's own limits, and every step against them.

The analogy is the machine's data sheet beside a profiler (``bounds.py``): first measure
what the hardware can do at all (a large square matrix product for the arithmetic peak, a
streaming sum over more memory than the last-level cache for the read bandwidth),
then time real engine steps and set each one against its bound (the machine is probed
again at the end, and the bounds use the better reading of each limit),

    bound = max(bytes the step must read / bandwidth, FLOPs it must do / peak),

where the bytes are every weight once (the LM head included), the K and V of every
context token, and the logits written; the FLOPs are the matrix products and the
attention. That bound lets attention's K/V reading hide under the products' arithmetic;
the **serial bound** beside it does not: the products' own bound, then attention's (one
after the other, as on a machine whose every core runs either a product or attention at a
time). A step at ratio 1.0 runs at the roofline; the breakdown says where the rest goes:
matrix products (the layers' and the LM head's), attention, the other kernels (norms,
rotary, SwiGLU, KV writes, gathers and adds), and the Python around the model (scheduler,
model-input building, sampler, output processing).

Decode is measured at batch sizes B with a context of about ``context_len`` tokens:
the largest batch is prefilled once, then measured, and requests are aborted down to
each smaller batch in turn (each batch's real mean context is reported and used).
Prefill is one prompt of each length in ``prefill_lens``, alone in its step.

``workload_floor`` applies the same bound to a whole workload (``bench throughput``,
``single-stream``, ``prefill`` report it): the least time this machine allows it, and so the
largest speed-up over a peer that any engine could show here.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from .bounds import (_set_bounds, bound, compute_seconds, integer_params, integer_peak,  # noqa: F401
                     last_level_cache_bytes, matmul_peak, read_bandwidth, serial_bound,
                     step_cost, stored_weight_bytes, workload_floor)   # (re-exported: bench, tests)
from .measure import steps_by_path
from .workloads import make_prompts

# --------------------------------------------------------------------------- timing the parts

# A decode step's layers and LM head run as one persistent kernel (kernels/persistent_decode.py):
# their products, attention and small kernels share one call, timed as "persistent" (0 in other
# steps). So each such row is timed a second time layer by layer, kernel by kernel, for the split.
CATEGORY = {"linear": "matmuls", "paged_attention": "attention", "plan_step": "attention",
            "rms_norm": "other_kernels", "rotary": "other_kernels", "silu_and_mul": "other_kernels",
            "write_kv": "other_kernels", "decode_step": "persistent"}
PARTS = ("matmuls", "lm_head", "attention", "other_kernels", "persistent", "sampler", "python")


class TimedOps:
    """The model's tier of kernels with a stopwatch on every call (CPU kernels are
    synchronous, so a call's wall time is its cost). The LM head's product is counted
    apart from the layers' products. ``layer_by_layer``: the tier's whole-step call
    (``decode_step``) declines, so the same step runs kernel by kernel."""

    def __init__(self, ops, lm_head) -> None:
        self._ops = ops
        self._lm_head = lm_head
        self.xp = ops.xp
        self.name = ops.name
        self.layer_by_layer = False
        self.seconds: dict[str, float] = defaultdict(float)

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn
        if name == "decode_step" and self.layer_by_layer:
            return lambda *args, **kwargs: None

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            label = "lm_head" if name == "linear" and args[1] is self._lm_head else CATEGORY.get(name, "other_kernels")
            if name == "decode_step" and result is None:   # declined: the layers run kernel by kernel
                label = "other_kernels"
            self.seconds[label] += time.perf_counter() - start
            return result
        return timed


class StepProfiler:
    """Wraps one engine's model runner, model ops and sampler to split each step's time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        model = engine.runner.model
        self.ops = TimedOps(model.ops, model.weights.lm_head)
        self.forward_seconds = 0.0
        self.sampler_seconds = 0.0
        runner_execute, sampler = engine.runner.execute, engine.sampler

        def execute(*args, **kwargs):
            start = time.perf_counter()
            out = runner_execute(*args, **kwargs)
            self.forward_seconds += time.perf_counter() - start
            return out

        def sample(*args, **kwargs):
            start = time.perf_counter()
            out = sampler(*args, **kwargs)
            self.sampler_seconds += time.perf_counter() - start
            return out

        sample.prompt_logprobs = sampler.prompt_logprobs
        model.ops = self.ops
        engine.runner.execute = execute
        engine.sampler = sample
        self._restore = (model, runner_execute, sampler, self.ops._ops)

    def reset(self) -> None:
        self.ops.seconds.clear()
        self.forward_seconds = self.sampler_seconds = 0.0

    def close(self) -> None:
        model, runner_execute, sampler, ops = self._restore
        model.ops = ops
        self.engine.runner.execute = runner_execute
        self.engine.sampler = sampler

    def breakdown(self, total: float, steps: int) -> dict:
        """Seconds per step: each kernel category, the forward's remainder, and the Python."""
        parts = {k: v / steps for k, v in self.ops.seconds.items()}
        kernels = sum(self.ops.seconds.values())
        parts["other_kernels"] = parts.get("other_kernels", 0.0) + (self.forward_seconds - kernels) / steps
        parts["sampler"] = self.sampler_seconds / steps
        parts["python"] = (total - self.forward_seconds - self.sampler_seconds) / steps
        for key in PARTS:
            parts.setdefault(key, 0.0)
        return parts


# --------------------------------------------------------------------------- the measurements


def _paths_since(engine: LLMEngine, before: dict) -> str:
    """The engine ("numba" or "mkl", kernels/linear_paths.py) of the linear layers of the steps
    run since ``before`` (a copy of the model's ``steps_by_path``): both, joined, if they differ."""
    now = steps_by_path(engine.runner.model)
    return "+".join(sorted({path for (kind, path), n in now.items() if n > before.get((kind, path), 0)}))


def _timed_steps(engine: LLMEngine, profiler: StepProfiler, steps: int) -> float:
    """Seconds that ``steps`` engine steps take, the profiler counting from zero."""
    profiler.reset()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - start


def _layer_by_layer(engine: LLMEngine, profiler: StepProfiler, steps: int, machine: dict) -> dict:
    """A warm-up step and ``steps`` timed steps more with the persistent kernel off (the
    model's layers one kernel at a time, the same floats): their step time, its split into the
    kernels' parts, and their own cost and bound (their contexts are longer by then)."""
    profiler.ops.layer_by_layer = True
    try:
        engine.step()                                  # warm-up: the layer path's kernels
        contexts = [g.seqs[0].num_computed_tokens + 1 for g in engine.scheduler.running]
        total = _timed_steps(engine, profiler, steps)
    finally:
        profiler.ops.layer_by_layer = False
    return _decode_row(engine, machine, contexts, total, steps, profiler.breakdown(total, steps))


def _decode_row(engine: LLMEngine, machine: dict, contexts: list[int], total: float, steps: int,
                breakdown: dict) -> dict:
    """A row of ``steps`` decode steps that took ``total`` seconds, whose sequences held
    ``contexts`` tokens at the first of them: mean context, step time, cost, bound and ratio."""
    mean_ctx = [c + (steps - 1) / 2 for c in contexts]
    cost = step_cost(engine, [1] * len(mean_ctx), mean_ctx, len(mean_ctx))
    row = {"mean_context": float(np.mean(mean_ctx)), "step_s": total / steps, "breakdown_s": breakdown, **cost}
    _set_bounds(row, machine)
    return row


def measure_decode(engine: LLMEngine, machine: dict, batch_sizes: list[int], context_len: int,
                   steps: int, progress=print) -> list[dict]:
    """Prefill max(batch_sizes) requests of ``context_len`` tokens, then time decode steps at
    each batch size, largest first, aborting requests down to the next size. A row whose steps
    ran as the persistent kernel is timed again layer by layer (``layer_by_layer``: a warm-up
    and ``steps`` steps more; their step time, bound, ratio and split into matmuls, attention, ...)."""
    batch_sizes = sorted(set(batch_sizes), reverse=True)
    vocab = engine.model_config.vocab_size
    prompts = make_prompts(batch_sizes[0], context_len, context_len, vocab, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - context_len,
                            ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"roofline-{i}", prompt, params)
    start = time.perf_counter()
    while engine.scheduler.waiting or any(g.seqs[0].num_output_tokens == 0 for g in engine.scheduler.running):
        engine.step()
    progress(f"prefilled {len(prompts)} x {context_len} tokens in {time.perf_counter() - start:.1f} s")
    profiler = StepProfiler(engine)
    rows = []
    try:
        for batch in batch_sizes:
            for group in list(engine.scheduler.running)[batch:]:
                engine.abort_request(group.request_id)
            engine.step()                                  # warm-up at this size
            running = list(engine.scheduler.running)
            contexts = [g.seqs[0].num_computed_tokens + 1 for g in running]   # after this step's token
            before = dict(steps_by_path(engine.runner.model))
            total = _timed_steps(engine, profiler, steps)
            path = _paths_since(engine, before)
            breakdown = profiler.breakdown(total, steps)
            if breakdown["persistent"] > 0:  # the same kind of steps layer by layer: where the time goes
                layers = _layer_by_layer(engine, profiler, steps, machine)
            if engine.scheduler.num_preemptions:
                raise ValueError(f"the KV pool ({engine.block_manager.num_blocks} blocks) cannot hold "
                                 f"{batch_sizes[0]} sequences of {context_len}+ tokens, so requests were "
                                 "preempted during the decode rows; raise --num-blocks / --kv-cache-space "
                                 "or leave both unset")
            if len(engine.scheduler.running) != len(running):
                raise RuntimeError("a decode request finished while it was being timed; "
                                   "give the engine a longer max_model_len")
            row = {"batch": len(running), "linear_path": path,
                   **_decode_row(engine, machine, contexts, total, steps, breakdown)}
            parts = row["breakdown_s"]   # a persistent step's products are timed with its layers
            row["matmul_gflop_s"] = row["matmul_flops"] / (parts["matmuls"] + parts["lm_head"]
                                                           + parts["persistent"]) / 1e9
            if parts["persistent"] > 0:
                row["layer_by_layer"] = layers
            rows.append(row)
            progress(f"decode B={row['batch']}: {row['step_s'] * 1e3:.1f} ms a step, bound "
                     f"{row['bound_s'] * 1e3:.1f} ms, {row['ratio']:.2f}x")
    finally:
        profiler.close()
        sched = engine.scheduler
        for group in [*sched.running, *sched.waiting, *sched.swapped]:   # none left for the prefill rows
            engine.abort_request(group.request_id)
    return sorted(rows, key=lambda r: r["batch"])


def measure_prefill(engine: LLMEngine, machine: dict, prefill_lens: list[int], repeats: int,
                    progress=print) -> list[dict]:
    """Time the step that prefills one prompt of each length, alone (best of ``repeats``)."""
    vocab = engine.model_config.vocab_size
    rows = []
    profiler = StepProfiler(engine)
    try:
        for length in prefill_lens:
            best = None
            for r in range(repeats + 1):                 # the first run warms up
                prompt = make_prompts(1, length, length, vocab, seed=100 + r)[0]
                engine.add_request(f"prefill-{length}-{r}", prompt,
                                   SamplingParams(temperature=0.0, max_tokens=1, detokenize=False))
                profiler.reset()
                before = dict(steps_by_path(engine.runner.model))
                start = time.perf_counter()
                engine.step()
                total = time.perf_counter() - start
                path = _paths_since(engine, before)
                parts = profiler.breakdown(total, 1)          # this step's alone
                while engine.has_unfinished_requests():
                    engine.step()
                if r and (best is None or total < best[0]):
                    best = (total, parts, path)
            cost = step_cost(engine, [length], [length], 1)
            row = {"prompt_len": length, "linear_path": best[2], "step_s": best[0], "breakdown_s": best[1], **cost}
            _set_bounds(row, machine)
            row["gflop_s"] = cost["flops"] / best[0] / 1e9
            row["fraction_of_peak"] = cost["flops"] / best[0] / machine["matmul_peak"]
            rows.append(row)
            progress(f"prefill {length}: {best[0] * 1e3:.0f} ms, {row['gflop_s']:.0f} GFLOP/s "
                     f"({100 * row['fraction_of_peak']:.0f}% of the matmul peak)")
    finally:
        profiler.close()
    return rows


def parse_sizes(text: str, flag: str, allow_empty: bool = False) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; anything but positive integers is refused, naming the flag."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not all(p.isascii() and p.isdecimal() and int(p) > 0 for p in parts) or not (parts or allow_empty):
        raise ValueError(f"{flag} takes positive integers separated by commas (e.g. 1,2,4), got {text!r}")
    return [int(p) for p in parts]


def check_roofline_args(cfg: dict) -> None:
    """Refuse bad sizes before anything is measured or loaded."""
    parse_sizes(cfg["batch_sizes"], "--batch-sizes")
    parse_sizes(cfg["prefill_lens"], "--prefill-lens", allow_empty=True)
    for key in ("context_len", "steps", "prefill_repeats"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ValueError(f"--{key.replace('_', '-')} must be a positive integer, got {cfg[key]!r}")


def run_roofline(engine_kwargs: dict, cfg: dict, progress=print) -> dict:
    """The whole ``bench roofline``: machine limits, decode rows, prefill rows."""
    check_roofline_args(cfg)
    batch_sizes = parse_sizes(cfg["batch_sizes"], "--batch-sizes")
    prefill_lens = parse_sizes(cfg["prefill_lens"], "--prefill-lens", allow_empty=True)
    if engine_kwargs.get("device") == "cuda":
        raise ValueError("bench roofline measures the CPU backend (numpy's matmul peak, the CPU's read "
                         "bandwidth, synchronous kernels); run it with --device cpu")
    # the decode requests live through every batch size's warm-up and timed steps
    decode_len = cfg["context_len"] + len(set(batch_sizes)) * (2 * cfg["steps"] + 2) + 16
    longest = max([decode_len, *[n + 1 for n in prefill_lens]])
    given = engine_kwargs.get("max_model_len")
    if given is not None and given < longest:
        raise ValueError(f"--max-model-len {given} is too short for this roofline run: it needs "
                         f"{longest} tokens (context {cfg['context_len']} plus every timed decode step, "
                         f"and the longest prefill); raise it or leave it unset")
    machine = {"matmul_peak": matmul_peak(), "read_bandwidth": read_bandwidth(), "integer_peak": integer_peak(),
               "last_level_cache_bytes": last_level_cache_bytes()}
    progress(f"machine: matmul peak {machine['matmul_peak'] / 1e9:.0f} GFLOP/s, read bandwidth "
             f"{machine['read_bandwidth'] / 1e9:.1f} GB/s, integer peak {machine['integer_peak'] / 1e9:.0f} GOP/s")
    kwargs = dict(engine_kwargs, device="cpu")
    kwargs["max_model_len"] = kwargs.get("max_model_len") or longest
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, max(batch_sizes))
    # a large step budget prefills many of the decode rows' prompts at once
    kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 0, longest,
                                           kwargs["max_num_seqs"], 4096)
    if kwargs.get("num_blocks") is None and kwargs.get("kv_cache_space") is None:
        block = kwargs.get("block_size") or 16
        kwargs["num_blocks"] = max(batch_sizes) * (-(-longest // block) + 1) + 8
    engine = LLMEngine(**kwargs)
    decode = measure_decode(engine, machine, batch_sizes, cfg["context_len"], cfg["steps"], progress)
    prefill = measure_prefill(engine, machine, prefill_lens, cfg["prefill_repeats"], progress)
    # A machine shared with other guests reads faster or slower from minute to minute: probed
    # again at the end, the bounds take the better reading of each, so no step is set against
    # a slow spell (the progress lines above used the first probe).
    end = {"matmul_peak": matmul_peak(), "read_bandwidth": read_bandwidth(), "integer_peak": integer_peak()}
    progress(f"machine at the end: matmul peak {end['matmul_peak'] / 1e9:.0f} GFLOP/s, read bandwidth "
             f"{end['read_bandwidth'] / 1e9:.1f} GB/s")
    machine["probes"] = [{k: machine[k] for k in end}, end]
    for key in end:
        machine[key] = max(probe[key] for probe in machine["probes"])
    for row in decode + prefill:
        for timed in filter(None, (row, row.get("layer_by_layer"))):   # a row, and its steps layer by layer
            _set_bounds(timed, machine)
        if "fraction_of_peak" in row:
            row["fraction_of_peak"] = row["flops"] / row["step_s"] / machine["matmul_peak"]
    return {"machine": machine, "kernels": engine.backend.kernels, "linear_paths": engine.backend.linear_paths.as_dict(),
            "decode": decode,
            "prefill": prefill}
