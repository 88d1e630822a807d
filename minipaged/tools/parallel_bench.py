"""``python -m minipaged bench parallel``: what splitting the model costs, per step, side by side.

Engines identical but for their workers, one at a time, each after a warm-up:

- ``one worker``: the whole model in this process (the baseline);
- ``uni pp2``: two pipeline stages in this process (the layers split, nothing else);
- ``uni tp3``: three tensor-parallel ranks in this process, all-reducing by summing (when
  the model's head counts divide by 3, as SmolLM2's do);
- ``ray pp2``: two stages as two Ray actor processes, hidden states as Ray objects.

Each runs two tasks, greedy: **single** (one request decoding alone: the step is as small
as it gets, so the fixed cost per step shows) and **batch** (the throughput trace's first
NUM_PROMPTS requests at once). Reported: seconds per step, the ratio to one worker, and
whether the tokens equal one worker's, and the driver's share of the step (scheduling,
sampling: everything outside the executor's forward pass). For Ray, where the forward pass
went: the workers' compute (on a GPU, with the step's upload to the device), their copies of
the step's arrays out of Ray's read-only buffers ("unpack"), and the rest (Ray's calls, the
object store, the stages waiting on each other), beside a no-op round trip of one step's
hidden states through both stages. Without Ray installed, the Ray run is skipped and says so.

On one machine with few cores no split can be faster: every worker still computes its share
on the same cores, one stage after another. This measures the price of the machinery that
lets a model span devices (docs/distributed.md has the numbers and the rerun line).
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from ..engine.backend import release_device_memory
from ..engine.llm_engine import LLMEngine
from ..model.config import LlamaConfig
from ..model.fetch import resolve_model
from ..sampling_params import OutputKind, SamplingParams
from .workloads import make_requests


def run_task(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    executor = engine.executor
    forward = executor.execute_model
    inside = [0.0]                 # seconds in the executor's forward passes

    def timed(model_input):
        started = time.perf_counter()
        try:
            return forward(model_input)
        finally:
            inside[0] += time.perf_counter() - started

    executor.execute_model = timed
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=OutputKind.FINAL_ONLY)
    for i, ids in enumerate(prompts):
        engine.add_request(f"par-{i}", {"prompt_token_ids": ids}, params)
    tokens, steps = {}, 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - started
    del executor.execute_model     # the class's method again
    return {"steps": steps, "seconds": seconds, "forward_seconds": inside[0],
            "tokens": [tokens[f"par-{i}"] for i in range(len(prompts))]}


def variants(config: LlamaConfig) -> dict[str, dict]:
    out = {"one worker": {}, "uni pp2": dict(pipeline_parallel_size=2)}
    if all(n % 3 == 0 for n in (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)):
        out["uni tp3"] = dict(tensor_parallel_size=3)
    if importlib.util.find_spec("ray") is not None:
        out["ray pp2"] = dict(pipeline_parallel_size=2, distributed_executor_backend="ray")
    return out


def run_parallel_bench(engine_kwargs: dict, cfg: dict) -> dict:
    base = {k: v for k, v in engine_kwargs.items()
            if k not in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")}
    config = LlamaConfig.from_dir(resolve_model(base["model"]))
    trace = [r.prompt for r in make_requests("throughput", cfg, config.vocab_size, cfg.get("workload_seed", 0))]
    tasks = {"single": (trace[:1], cfg["output_len"]), "batch": (trace, cfg["output_len"])}
    rows, reference, ray_split = [], {}, None
    for name, split in variants(config).items():
        release_device_memory()
        engine = LLMEngine(**{**base, **split})
        run_task(engine, [trace[0][:16]], 4)                             # warm-up: compile, touch weights
        executor = engine.executor
        for task, (prompts, max_tokens) in tasks.items():
            if name.startswith("ray"):
                executor.worker_timings()                                 # start from zero
            result = run_task(engine, prompts, max_tokens)
            if name == "one worker":
                reference[task] = result
            one = reference[task]
            row = {"task": task, "variant": name, "steps": result["steps"],
                   "ms_per_step": 1e3 * result["seconds"] / result["steps"],
                   "vs_one_worker": (result["seconds"] / result["steps"]) / (one["seconds"] / one["steps"]),
                   "driver_ms": 1e3 * (result["seconds"] - result["forward_seconds"]) / result["steps"],
                   "forward_ms": 1e3 * result["forward_seconds"] / result["steps"],
                   "same_tokens": result["tokens"] == one["tokens"]}
            if name.startswith("ray"):
                timings = executor.worker_timings()
                per_step = lambda key: 1e3 * sum(t[key] for t in timings) / result["steps"]   # noqa: E731
                hidden = np.zeros((len(prompts), config.hidden_size), np.float32)   # a decode step's hidden states
                trips = [executor.round_trip(hidden) for _ in range(20)]
                row.update(compute_ms=per_step("compute"), unpack_ms=per_step("unpack"),
                           round_trip_ms=1e3 * float(np.median(trips)))
                row["ray_ms"] = row["forward_ms"] - row["compute_ms"] - row["unpack_ms"]
                ray_split = split
            rows.append(row)
        engine.shutdown()
        del engine, executor
    skipped = None if ray_split else "Ray is not installed (pip install 'minipaged[distributed]')"
    return {"variants": variants(config), "ray": ray_split, "ray_skipped": skipped, "rows": rows}


def print_parallel_bench(report: dict) -> None:
    print("\nparallel workers against one (seconds per engine step)")
    print(f"{'task':>7} {'variant':>11} {'steps':>6} {'ms/step':>8} {'vs one':>7} {'driver':>7} {'forward':>8} "
          f"{'same':>5}   where a Ray forward pass goes")
    for r in report["rows"]:
        where = ""
        if "compute_ms" in r:
            where = (f"workers compute {r['compute_ms']:.1f} ms, unpack {r['unpack_ms']:.2f} ms, Ray "
                     f"{r['ray_ms']:.1f} ms (a no-op round trip: {r['round_trip_ms']:.1f} ms)")
        print(f"{r['task']:>7} {r['variant']:>11} {r['steps']:>6} {r['ms_per_step']:>8.1f} "
              f"{r['vs_one_worker']:>6.2f}x {r['driver_ms']:>7.1f} {r['forward_ms']:>8.1f} "
              f"{str(r['same_tokens']):>5}   {where}")
    if report.get("ray_skipped"):
        print(f"  ray pp2 skipped: {report['ray_skipped']}")
