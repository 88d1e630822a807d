"""``python -m minipaged bench``: seeded synthetic workloads, timed end to end.

Prompts are random token ids (seeded), outputs have a fixed length with EOS
ignored, so every run does exactly the same work. Numbers are printed as a
table and optionally written as JSON for comparison across commits.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tqdm.auto import tqdm

WORKLOADS = {
    # name: (description, defaults)
    "throughput": ("N requests, prompt lengths uniform in [min, max], fixed output length",
                   dict(num_prompts=64, min_prompt_len=32, max_prompt_len=256, output_len=128)),
    "single-stream": ("one request decoding alone: time per output token",
                      dict(num_prompts=1, min_prompt_len=16, max_prompt_len=16, output_len=128)),
    "prefill": ("one long prompt, one output token: prompt processing speed",
                dict(num_prompts=1, min_prompt_len=256, max_prompt_len=256, output_len=1)),
}


def add_bench_parser(sub, add_engine_flags) -> None:
    p = sub.add_parser("bench", help="run a benchmark workload",
                       description="Seeded synthetic workloads: " + "; ".join(
                           f"{name}: {desc}" for name, (desc, _) in WORKLOADS.items()))
    p.add_argument("workload", choices=list(WORKLOADS), nargs="?", default="throughput")
    p.add_argument("--num-prompts", type=int, default=None, help="requests in the workload")
    p.add_argument("--min-prompt-len", type=int, default=None)
    p.add_argument("--max-prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None, help="tokens generated per request")
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


def run_workload(engine, prompts: list[list[int]], output_len: int, progress: bool = True) -> dict:
    """Feed all prompts at once and step until done; returns timings and token counts."""
    from .sampling_params import OutputKind, SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=OutputKind.FINAL_ONLY)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", ids, params)
    outputs = []
    with tqdm(total=len(prompts), desc="requests", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.append(out)
                bar.update(1)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs]
    tpot = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs if len(o.outputs[0].token_ids) > 1]
    prompt_tokens = sum(len(p) for p in prompts)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "requests": len(prompts), "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "elapsed_s": elapsed,
        "generation_tok_s": generated / elapsed,
        "total_tok_s": (prompt_tokens + generated) / elapsed,
        "prompt_tok_s_first_token": prompt_tokens / max(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "decode_tok_s_single": 1.0 / percentile(tpot, 50) if len(prompts) == 1 and tpot else None,
        "kv_blocks_peak": engine.get_stats()["kv_blocks_peak"],
    }


def run_peer(peer: str, model_dir: str, prompts: list[list[int]], output_len: int) -> dict:
    """Run a peer on the same prompts in a child process (its threads never meet ours)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import numba  # noqa: PLC0415

    cmd = [sys.executable, "-m", "minipaged.bench_peers", peer, "--model-dir", model_dir,
           "--output-len", str(output_len), "--threads", str(numba.get_num_threads())]
    from . import THREAD_ENV  # noqa: PLC0415

    # The peer gets the environment the user gave us, not our thread settings
    # (passive OpenMP waiting would slow torch's own pool down).
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    done = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the {peer} peer failed (is the 'peers' extra installed?):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cmd_bench(args: argparse.Namespace) -> int:
    from .cli import engine_kwargs  # noqa: PLC0415
    from .engine import LLMEngine  # noqa: PLC0415

    _, defaults = WORKLOADS[args.workload]
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    engine = LLMEngine(**engine_kwargs(args))
    prompts = make_prompts(cfg["num_prompts"], cfg["min_prompt_len"], cfg["max_prompt_len"],
                           engine.model_config.vocab_size, args.workload_seed)
    # Warm-up: compile the kernels and touch the weights before the clock starts.
    run_workload(engine, make_prompts(2, 8, 8, engine.model_config.vocab_size, 1), 2, progress=False)
    engine.metrics.kv_blocks_peak = 0
    result = run_workload(engine, prompts, cfg["output_len"])
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
