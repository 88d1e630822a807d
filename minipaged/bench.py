"""``python -m minipaged bench``: seeded synthetic workloads, timed end to end.

Prompts are random token ids (seeded), outputs have a fixed length with EOS
ignored, so every run does exactly the same work. Numbers are printed as a
table and optionally written as JSON for comparison across commits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from .fragmentation import summarize
from .metrics import Metrics

WORKLOADS = {
    # name: (description, defaults)
    "throughput": ("N requests, prompt lengths uniform in [min, max], fixed output length",
                   dict(num_prompts=64, min_prompt_len=32, max_prompt_len=256, output_len=128)),
    "single-stream": ("one request decoding alone: time per output token",
                      dict(num_prompts=1, min_prompt_len=16, max_prompt_len=16, output_len=128)),
    "prefill": ("one long prompt, one output token: prompt processing speed",
                dict(num_prompts=1, min_prompt_len=256, max_prompt_len=256, output_len=1)),
    "long-prompts": ("N short requests decoding while LONG_PROMPTS long prompts arrive one by one "
                     "(every ARRIVAL_GAP steps), with chunked prefill off and on (a CHUNK_BUDGET-token "
                     "budget): the stall decodes suffer (TTFT, TPOT, inter-token latency)",
                     dict(num_prompts=16, min_prompt_len=32, max_prompt_len=32, output_len=96,
                          long_prompts=4, long_prompt_len=1024, arrival_gap=8, chunk_budget=256)),
    "parallel-sampling": ("N prompts, each sampled n=4 times (temperature 1, seeded): the samples "
                          "share the prompt's blocks", dict(num_prompts=16, min_prompt_len=128,
                                                            max_prompt_len=256, output_len=64)),
    "beam": ("N prompts, beam search of width 4: beams share their common prefix",
             dict(num_prompts=8, min_prompt_len=128, max_prompt_len=256, output_len=32)),
    "shared-prefix": ("N requests behind one shared system prompt of PREFIX_LEN tokens, run with "
                      "prefix caching off and on", dict(num_prompts=32, min_prompt_len=16, max_prompt_len=64,
                                                        output_len=32, prefix_len=512)),
    "memory": ("one trace (prompts and outputs of uniform random lengths) under one fixed KV budget, "
               "with the paged allocator and the contiguous baseline (reserving max_model_len, then "
               "prompt + max_tokens): utilization, fragmentation, concurrency, throughput",
               dict(num_prompts=64, min_prompt_len=32, max_prompt_len=256, output_len=256, min_output_len=32,
                    num_blocks=512, max_model_len=1024)),
}

# Engine settings a workload fixes unless the command line sets them.
WORKLOAD_ENGINE = {"memory": ("num_blocks", "max_model_len")}


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]      # token ids
    output_len: int
    arrival_step: int = 0  # engine steps after the start at which the request arrives
    measured: bool = True  # counts in the latency figures (the long intruders do not)
    n: int = 1             # parallel samples
    beam_width: int = 0    # > 0: a beam search instead of sampling


def make_requests(workload: str, cfg: dict, vocab: int, seed: int) -> list[BenchRequest]:
    requests = [BenchRequest(p, cfg["output_len"]) for p in
                make_prompts(cfg["num_prompts"], cfg["min_prompt_len"], cfg["max_prompt_len"], vocab, seed)]
    if workload == "parallel-sampling":
        requests = [dataclasses.replace(r, n=4) for r in requests]
    if workload == "beam":
        requests = [dataclasses.replace(r, beam_width=4) for r in requests]
    if workload == "shared-prefix":
        prefix = make_prompts(1, cfg["prefix_len"], cfg["prefix_len"], vocab, seed + 2)[0]
        requests = [dataclasses.replace(r, prompt=prefix + r.prompt) for r in requests]
    if workload == "memory":  # outputs of varied length: what a reservation cannot foresee
        rng = np.random.default_rng(seed + 3)
        lengths = rng.integers(cfg["min_output_len"], cfg["output_len"] + 1, size=len(requests))
        requests = [dataclasses.replace(r, output_len=int(n)) for r, n in zip(requests, lengths)]
    if workload == "long-prompts":
        longs = make_prompts(cfg["long_prompts"], cfg["long_prompt_len"], cfg["long_prompt_len"], vocab, seed + 1)
        requests += [BenchRequest(p, 8, arrival_step=(i + 1) * cfg["arrival_gap"], measured=False)
                     for i, p in enumerate(longs)]
    return requests


def add_bench_parser(sub, add_engine_flags) -> None:
    p = sub.add_parser("bench", help="run a benchmark workload",
                       description="Seeded synthetic workloads: " + "; ".join(
                           f"{name}: {desc}" for name, (desc, _) in WORKLOADS.items()))
    p.add_argument("workload", choices=list(WORKLOADS), nargs="?", default="throughput")
    p.add_argument("--num-prompts", type=int, default=None, help="requests in the workload")
    p.add_argument("--min-prompt-len", type=int, default=None, help="shortest prompt, in tokens")
    p.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt, in tokens")
    p.add_argument("--output-len", type=int, default=None, help="tokens generated per request")
    p.add_argument("--long-prompts", type=int, default=None, help="long-prompts: how many long prompts")
    p.add_argument("--long-prompt-len", type=int, default=None, help="long-prompts: their length")
    p.add_argument("--arrival-gap", type=int, default=None, help="long-prompts: steps between arrivals")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: system prompt length")
    p.add_argument("--chunk-budget", type=int, default=None,
                   help="long-prompts: token budget of the chunked-prefill run")
    p.add_argument("--min-output-len", type=int, default=None, help="memory: shortest output")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="memory: draw KV usage and its breakdown over time for each allocator "
                        "(needs matplotlib: pip install -e '.[plot]')")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the prompt lengths and ids")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--peer", choices=["hf"], default=None,
                   help="also run the same prompts through Hugging Face transformers generate "
                        "(padded batch, float32) in a subprocess and print the ratio; needs the "
                        "'peers' extra (torch, transformers)")
    add_engine_flags(p)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_workload(engine, requests: list[BenchRequest], progress: bool = True) -> dict:
    """Feed the requests (each at its arrival step), step until done; timings and token counts."""
    from .beam_search import BeamSearchParams  # noqa: PLC0415
    from .sampling_params import OutputKind, SamplingParams  # noqa: PLC0415

    pending = sorted(enumerate(requests), key=lambda r: r[1].arrival_step)
    last_token_time: dict[str, float] = {}
    gaps: list[float] = []            # inter-token latencies of measured requests (s per token)
    outputs = []
    step = 0
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
            for out in engine.step():
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
        "kv_blocks_unshared_peak": stats["kv_blocks_unshared_peak"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "num_preemptions": stats["num_preemptions"],
        "num_preemptions_swap": stats["num_preemptions_swap"],
        "num_preemptions_recompute": stats["num_preemptions_recompute"],
        "blocks_swapped_out": stats["blocks_swapped_out"],
    }


def run_peer(peer: str, model_dir: str, prompts: list[list[int]], output_len: int,
             device: str = "cpu", dtype: str = "float32") -> dict:
    """Run a peer on the same prompts in a child process (its threads never meet ours)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import numba  # noqa: PLC0415

    cmd = [sys.executable, "-m", "minipaged.bench_peers", peer, "--model-dir", model_dir,
           "--output-len", str(output_len), "--threads", str(numba.get_num_threads()),
           "--device", device, "--dtype", dtype]
    from . import THREAD_ENV  # noqa: PLC0415

    # The peer gets the environment the user gave us, not our thread settings
    # (passive OpenMP waiting would slow torch's own pool down).
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    done = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the {peer} peer failed (is the 'peers' extra installed?):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_table(workload: str, cfg: dict, results: dict[str, dict]) -> None:
    """Several runs of one trace, side by side."""
    labels = list(results)
    keys = list(results[labels[0]])
    width = max(len(k) for k in keys)
    print(f"\n{workload}: {cfg}")
    print(f"  {'':<{width}}  " + "  ".join(f"{label:>12}" for label in labels))
    for key in keys:
        cells = [results[label][key] for label in labels]
        shown = [f"{c:12.4g}" if isinstance(c, float) else f"{str(c):>12}" for c in cells]
        print(f"  {key:<{width}}  " + "  ".join(shown))


def _memory_figures(engine, result: dict) -> dict:
    """The memory workload's headline numbers, from the engine's per-step slot accounting."""
    summary = summarize(engine.kv_history)
    return {"utilization": summary["utilization"], "max_concurrent_requests": summary["max_concurrent_requests"],
            "throughput_tok_s": result["generation_tok_s"],
            "reserved_fraction": summary["reserved_fraction_of_allocated"],
            "internal_fraction": summary["internal_fraction_of_allocated"],
            "external_fraction_of_pool": summary["external_fraction_of_pool"]}


def plot_memory(histories: dict, path: str) -> None:
    """KV pool over time, one panel per allocator: used / reserved / internal / external / free."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    fig, axes = plt.subplots(len(histories), 1, figsize=(9, 2.6 * len(histories)), sharey=True, squeeze=False)
    colors = {"used": "#2a7", "reserved": "#9cf", "internal": "#f96", "external": "#c33", "free": "#eee"}
    for ax, (label, history) in zip(axes[:, 0], histories.items()):
        pool = [h.allocated + h.free for h in history]
        layers = {"used": [h.used for h in history], "reserved": [h.reserved for h in history],
                  "internal": [h.internal for h in history], "external": [h.external for h in history],
                  "free": [h.free - h.external for h in history]}
        ax.stackplot(range(len(history)), *[[v / p for v, p in zip(vals, pool)] for vals in layers.values()],
                     labels=list(layers), colors=[colors[k] for k in layers])
        summary = summarize(history)
        ax.set_title(f"{label}: utilization {summary['utilization']:.0%}, "
                     f"at most {summary['max_concurrent_requests']} requests at once", fontsize=10)
        ax.set_xlim(0, max(len(history) - 1, 1))
        ax.set_ylabel("share of KV pool")
    axes[0, 0].legend(loc="upper right", fontsize=8, ncol=5)
    axes[-1, 0].set_xlabel("engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PEER_WORKLOADS = ("throughput", "single-stream", "prefill")   # one padded batch, greedy, fits a peer


def check_bench_args(args: argparse.Namespace, defaults: dict) -> None:
    """Refuse flags this workload would silently ignore, before any model is loaded."""
    for name, (_, other) in WORKLOADS.items():
        for key in other:
            engine_flag = key in WORKLOAD_ENGINE.get(name, ())   # an engine flag, valid everywhere
            if not engine_flag and key not in defaults and getattr(args, key, None) is not None:
                users = [w for w, (_, d) in WORKLOADS.items() if key in d]
                raise ValueError(f"--{key.replace('_', '-')} does not apply to the {args.workload} workload "
                                 f"(it applies to: {', '.join(users)})")
    if args.plot and args.workload != "memory":
        raise ValueError("--plot draws the memory workload's KV pool; use it with `bench memory`")
    if args.peer and args.workload not in PEER_WORKLOADS:
        raise ValueError(f"--peer runs one padded greedy batch, which fits only the "
                         f"{', '.join(PEER_WORKLOADS)} workloads, not {args.workload}")
    if args.workload == "memory" and args.enable_prefix_caching:
        raise ValueError("the memory workload compares paging with the contiguous baseline, which "
                         "has no prefix caching; run it without --enable-prefix-caching")


def cmd_bench(args: argparse.Namespace) -> int:
    from .cli import engine_kwargs  # noqa: PLC0415
    from .engine import LLMEngine  # noqa: PLC0415

    _, defaults = WORKLOADS[args.workload]
    check_bench_args(args, defaults)
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    base = engine_kwargs(args)
    for key in WORKLOAD_ENGINE.get(args.workload, ()):
        if base[key] is None:
            base[key] = cfg[key]
    runs = {"": base}
    if args.workload == "shared-prefix":  # the same trace with the page cache off, then on
        runs = {f"caching {'on' if on else 'off'}": {**base, "enable_prefix_caching": on} for on in (False, True)}
    if args.workload == "long-prompts":  # the same arrivals without and with chunked prefill
        chunk = base["max_num_batched_tokens"] or cfg["chunk_budget"]
        runs = {"chunked off": {**base, "enable_chunked_prefill": False, "max_num_batched_tokens": None},
                "chunked on": {**base, "enable_chunked_prefill": True, "max_num_batched_tokens": chunk,
                               "max_num_seqs": min(base["max_num_seqs"], chunk)}}
    if args.workload == "memory":  # the same trace and budget, paging against reservation
        runs = {"paged": {**base, "kv_allocator": "paged", "track_fragmentation": True},
                "contiguous": {**base, "kv_allocator": "contiguous", "contiguous_reserve": "max_model_len",
                               "track_fragmentation": True},
                "contiguous_max_tokens": {**base, "kv_allocator": "contiguous", "contiguous_reserve": "max_tokens",
                                          "track_fragmentation": True}}
    histories = {}
    results = {}
    for label, kwargs in runs.items():
        engine = LLMEngine(**kwargs)
        vocab = engine.model_config.vocab_size
        requests = make_requests(args.workload, cfg, vocab, args.workload_seed)
        # Warm-up: compile the kernels and touch the weights; then start the counters afresh.
        run_workload(engine, [BenchRequest(p, 2) for p in make_prompts(2, 40, 40, vocab, 1)], progress=False)
        engine.metrics = Metrics()
        engine.scheduler.reset_counters()
        if engine.block_manager.cache is not None:
            engine.block_manager.cache.queries = engine.block_manager.cache.hits = 0
        engine.kv_history = []
        results[label] = run_workload(engine, requests)
        if args.workload == "memory":
            results[label] = {**_memory_figures(engine, results[label]), **results[label]}
            histories[label] = engine.kv_history
    if args.plot:
        plot_memory(histories, args.plot)
    if len(results) > 1:
        # one section per configuration: "paged" / "contiguous" (memory), "caching on" / "caching off"
        report = {"workload": args.workload, "config": cfg, "engine": engine_kwargs(args), **results}
        _print_table(args.workload, cfg, results)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    result = results[""]
    prompts = [r.prompt for r in requests]
    report = {"workload": args.workload, "config": cfg, "engine": engine_kwargs(args), "result": result}
    if args.peer:
        peer = run_peer(args.peer, str(engine.model_dir), prompts, cfg["output_len"])
        report["peer"] = peer
        result = {**result, f"{args.peer}_generation_tok_s": peer["generation_tok_s"],
                  f"speedup_vs_{args.peer}": result["generation_tok_s"] / peer["generation_tok_s"]}
    width = max(len(k) for k in result)
    print(f"\n{args.workload}: {cfg}")
    for key, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"  {key:<{width}}  {shown}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
