"""Measuring a trace: feed the requests to an engine at their arrival steps, step until
all are done, and time it: throughput, TTFT, TPOT and inter-token latency percentiles,
beside the engine's own counters (peak KV blocks, preemptions, prefix-cache hits).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
from tqdm.auto import tqdm

from ..engine.beam_search import BeamSearchParams
from ..kernels.fast.linear_paths import KIND_NAMES, STEP_KINDS
from ..sampling_params import OutputKind, SamplingParams
from .workloads import BenchRequest


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def cpu_times() -> tuple[int, int] | None:
    """(stolen, total) clock ticks of all CPUs since boot, from Linux's /proc/stat; None elsewhere.

    "Steal" is time the hypervisor gave this virtual machine's CPUs to another guest: on a
    shared 2-core machine it is what makes one run 20% slower than the next.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two ``cpu_times()`` readings (None if unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def run_workload(engine, requests: list[BenchRequest], progress: bool = True) -> dict:
    """Feed the requests (each at its arrival step), step until done; timings and token counts."""
    pending = sorted(enumerate(requests), key=lambda r: r[1].arrival_step)
    last_token_time: dict[str, float] = {}
    gaps: list[float] = []            # inter-token latencies of measured requests (s per token)
    outputs = []
    step = 0
    running_peak = 0                  # most requests holding KV blocks at once
    start = time.perf_counter()
    with tqdm(total=len(requests), desc="requests", disable=not progress) as bar:
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][1].arrival_step <= step:
                i, req = pending.pop(0)
                if req.beam_width:
                    engine.add_beam_request(f"bench-{i}", req.prompt, BeamSearchParams(
                        beam_width=req.beam_width, max_tokens=req.output_len, ignore_eos=True))
                    continue
                engine.add_request(f"bench-{i}", req.prompt, SamplingParams(
                    n=req.n, temperature=1.0 if req.n > 1 else 0.0, seed=i, max_tokens=req.output_len,
                    ignore_eos=True, detokenize=False, output_kind=OutputKind.DELTA))
            outs = engine.step()
            running_peak = max(running_peak, len(engine.scheduler.running))
            for out in outs:
                now = time.perf_counter()
                rid = out.request_id
                new = len(out.outputs[0].token_ids)
                if rid in last_token_time and new and requests[int(rid.split("-")[1])].measured:
                    gaps.extend([(now - last_token_time[rid]) / new] * new)
                last_token_time[rid] = now
                if out.finished:
                    outputs.append(out)
                    bar.update(1)
            step += 1
    elapsed = time.perf_counter() - start
    measured = [o for o in outputs if requests[int(o.request_id.split("-")[1])].measured]
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in measured]
    lengths = {o.request_id: requests[int(o.request_id.split("-")[1])].output_len for o in measured}
    tpot = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (lengths[o.request_id] - 1)
            for o in measured if lengths[o.request_id] > 1]
    prompt_tokens = sum(len(r.prompt) for r in requests)
    generated = sum(r.output_len * max(r.n, r.beam_width) for r in requests)  # beams: tokens per beam
    stats = engine.get_stats()
    return {
        "requests": len(requests), "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "elapsed_s": elapsed,
        "generation_tok_s": generated / elapsed,
        "total_tok_s": (prompt_tokens + generated) / elapsed,
        "prompt_tok_s_first_token": prompt_tokens / max(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "decode_tok_s_single": 1.0 / percentile(tpot, 50) if len(requests) == 1 and tpot else None,
        "kv_blocks_peak": stats["kv_blocks_peak"],
        "max_running_requests": running_peak,
        "kv_blocks_unshared_peak": stats["kv_blocks_unshared_peak"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "num_preemptions": stats["num_preemptions"],
        "num_preemptions_swap": stats["num_preemptions_swap"],
        "num_preemptions_recompute": stats["num_preemptions_recompute"],
        "blocks_swapped_out": stats["blocks_swapped_out"],
        "linear_paths": paths_taken(engine),
        "kernels": engine.backend.kernels,          # the tier that ran (kernels/ops.py)
        "weight_format": engine.backend.weight_format,   # how the weights are stored (docs/weights.md)
        "weight_mb": engine.model.nbytes / 1e6 if engine.model is not None else None,
        **weight_scope(engine),
        **resident_memory(),
    }


def weight_scope(engine) -> dict:
    """Under tensor or pipeline parallelism ``weight_mb`` is the first worker's shard: say so
    (with Ray's workers, no model lives here and there is no figure)."""
    tp = engine.parallel_config.tensor_parallel_size
    pp = engine.parallel_config.pipeline_parallel_size
    split = tp * pp > 1 and engine.model is not None
    return {"weight_mb_of": f"rank 0 of {tp * pp} workers (tp {tp} x pp {pp})"} if split else {}


def resident_memory() -> dict:
    """This process's resident memory now and at its peak, MB (Linux's VmRSS, VmHWM), or nothing."""
    try:
        lines = open("/proc/self/status").read().splitlines()
    except OSError:
        return {}
    found = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in lines if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_mb": found.get("VmRSS"), "peak_rss_mb": found.get("VmHWM")}


def steps_by_path(model) -> Counter:
    """The fast tier's count of the steps each (kind, engine) took (``FastState``); empty on a
    tier that keeps none (the plain tier, the GPU's): a live counter, which a caller may clear."""
    state = model.weights.tier_state
    counter = getattr(state, "steps_by_path", None)
    return counter if counter is not None else Counter()


def paths_taken(engine) -> str | None:
    """The engine of the linear layers (kernels/linear_paths.py) each kind of step took, and how
    many steps: "single-stream decode numba x 1, batched decode numba x 95"; None where the model
    is not in this process, or not on the CPU."""
    model = engine.model
    if model is None or engine.backend.device != "cpu":
        return None
    if engine.backend.kernels == "simple":
        return "BLAS (the plain tier)"
    order = {kind: i for i, kind in enumerate(STEP_KINDS)}
    taken = sorted(steps_by_path(model).items(), key=lambda item: order[item[0][0]])
    return ", ".join(f"{KIND_NAMES[kind]} {path} x {n}" for (kind, path), n in taken) or "no steps"
