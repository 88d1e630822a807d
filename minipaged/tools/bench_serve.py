"""``python -m minipaged bench serve``: many clients against the HTTP server, as vLLM's serving
benchmark measures it.

N requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once),
at most ``--max-concurrency`` in flight, each a streaming ``/v1/completions`` call with a
seeded random token-id prompt and a fixed output length (EOS ignored), so every run does the
same work. Per request it records the time to the first token, the gaps between tokens and
the end; the report has request throughput, output tokens/s, and TTFT / TPOT / ITL at p50
and p99. The server is the one at ``--base-url``, or one it starts (``python -m minipaged
serve`` in a child process, with the engine flags given here). ``--compare-idle`` then sends
the same prompts one at a time, for the ratio of the TTFT medians (a load against an idle
server); ``--compare-offline`` runs them through ``LLMEngine`` in this process, for the ratio
of the output tokens/s. ``--repeats`` makes the whole measurement several times and reports
the median ratios.

The client side uses httpx (the serve extra); tokens are counted from the server's own
``usage`` chunk, not guessed from text.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import numpy as np

from .measure import cpu_times, percentile, steal_fraction
from .workloads import make_prompts


def engine_flags(engine_kwargs: dict) -> list[str]:
    """The command-line flags that rebuild these engine keyword arguments (for the child server)."""
    flags = []
    for key, value in engine_kwargs.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


class ChildServer:
    """``python -m minipaged serve --port 0`` with the given engine flags (and ``flags`` as they
    are); the URL it prints. Its stderr goes to ``stderr`` (a file), or nowhere."""

    def __init__(self, engine_kwargs: dict, timeout: float = 600, flags: tuple = (), stderr=None) -> None:
        cmd = [sys.executable, "-m", "minipaged", "serve", "--port", "0", *engine_flags(engine_kwargs), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr or subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + timeout
        self.base_url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if " at http" in line:
                self.base_url = line.split(" at ")[1].split()[0].removesuffix("/v1")
                break
        if self.base_url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start (run `python -m minipaged serve` to see why)")

    def stop(self) -> int:
        """Ctrl-C, then its exit status (-9: it had to be killed after a minute)."""
        self.proc.send_signal(2)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    """One streaming completion; its timings (perf_counter seconds) and token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals = []                      # when each chunk with text (or a finish) came
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"{response.status_code}: {(await response.aread()).decode()[:300]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    ttft = arrivals[0] - start if arrivals else None
    return {"start": start, "end": end, "ttft": ttft, "tokens": tokens, "prompt_len": len(prompt),
            "itl": list(np.diff(arrivals)) if len(arrivals) > 1 else [],
            "tpot": (end - arrivals[0]) / (tokens - 1) if arrivals and tokens > 1 else None}


async def run_clients(base_url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float,
                      max_concurrency: int | None, seed: int) -> tuple[list[dict], float]:
    import httpx  # noqa: PLC0415 (the serve extra)

    rng = np.random.default_rng(seed)
    gaps = (rng.exponential(1.0 / request_rate, size=len(prompts)) if math.isfinite(request_rate)
            else np.zeros(len(prompts)))
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        async def limited(prompt):
            async with limit:
                return await one_request(client, base_url, model, prompt, output_len)

        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(float(gap))     # Poisson arrivals: exponential gaps
            tasks.append(asyncio.ensure_future(limited(prompt)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(results: list[dict], elapsed: float) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    return {"requests": len(results), "failed": len(results) - len(ok), "elapsed_s": elapsed,
            "request_throughput": len(ok) / elapsed, "output_tok_s": tokens / elapsed,
            "output_tokens": tokens,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5],
            "per_request": per_request(results)}


def per_request(results: list[dict]) -> list[dict]:
    """Each request in workload order: prompt length, start (seconds after the first), TTFT, TPOT."""
    first = min((r["start"] for r in results if "start" in r), default=0.0)
    return [{"prompt_len": r.get("prompt_len"), "start_s": r["start"] - first if "start" in r else None,
             "ttft_s": r.get("ttft"), "tpot_s": r.get("tpot"), "error": r.get("error")} for r in results]


def offline_tok_s(engine_kwargs: dict, prompts: list[list[int]], output_len: int) -> float:
    """The same prompts through LLMEngine in this process (after the server has stopped)."""
    from ..engine.llm_engine import LLMEngine  # noqa: PLC0415
    from .measure import run_workload  # noqa: PLC0415
    from .workloads import BenchRequest  # noqa: PLC0415

    engine = LLMEngine(**{**engine_kwargs, "log_stats_interval": 0})
    run_workload(engine, [BenchRequest(p, 2) for p in prompts[:2]], progress=False)     # warm up
    return run_workload(engine, [BenchRequest(p, output_len) for p in prompts], progress=False)["generation_tok_s"]


def bench_serve(args, cfg: dict, engine_kwargs: dict) -> dict:
    """Run the clients against the server (started here unless --base-url); the report.

    With ``repeats`` > 1 the whole measurement (the server's run, the idle run, the offline
    run) is made that many times, alternating, and each ratio is the median of its runs: on
    a shared 2-core machine one pair can differ by 20% from the next.
    """
    repeats = cfg.get("repeats") or 1
    runs = [one_measurement(args, cfg, engine_kwargs) for _ in range(repeats)]
    report = runs[0]
    if repeats > 1:
        for key in ("output_tok_s", "offline_output_tok_s", "cpu_steal", "offline_cpu_steal",
                    *RATIOS):
            if key in report:
                report[key + "_runs"] = [r[key] for r in runs]
        for ratio in RATIOS:
            if ratio in report:
                report[ratio] = float(np.median(report[ratio + "_runs"]))
    return report


RATIOS = ("server_vs_offline", "ttft_p50_vs_idle")    # reported as medians over the repeats


def one_measurement(args, cfg: dict, engine_kwargs: dict) -> dict:
    """One server run (and its idle run, its offline run when asked)."""
    server = None
    base_url = args.base_url
    if base_url is None:
        server = ChildServer({**engine_kwargs, "log_stats_interval": 0})
        base_url = server.base_url
    base_url = base_url.rstrip("/")
    try:
        import httpx  # noqa: PLC0415

        model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        if args.base_url is None:
            from ..model.config import LlamaConfig  # noqa: PLC0415
            from ..model.fetch import resolve_model  # noqa: PLC0415

            vocab = LlamaConfig.from_dir(resolve_model(engine_kwargs["model"])).vocab_size
        else:   # another server's vocabulary is unknown here: ids below 256 exist in any byte-level BPE
            vocab = 256
        prompts = make_prompts(cfg["num_prompts"], cfg["min_prompt_len"], cfg["max_prompt_len"], vocab,
                               args.workload_seed)
        # warm-up: compile (or load) every kernel variant and touch the KV blocks the run will
        # use: a batch of up to 8 prompts, then 2 alone (a first request alone paid 0.1-0.2 s more)
        asyncio.run(run_clients(base_url, model, prompts[:8], 8, math.inf, None, 1))
        asyncio.run(run_clients(base_url, model, prompts[:2], 2, math.inf, 1, 1))
        before = cpu_times()
        results, elapsed = asyncio.run(run_clients(base_url, model, prompts, cfg["output_len"],
                                                   cfg["request_rate"], cfg["max_concurrency"],
                                                   args.workload_seed))
        steal = steal_fraction(before, cpu_times())
        idle = None
        if cfg.get("compare_idle"):   # the same prompts one at a time: each request alone on the server
            idle = summarize(*asyncio.run(run_clients(base_url, model, prompts, cfg["output_len"], math.inf, 1,
                                                      args.workload_seed)))
    finally:
        if server is not None:
            server.stop()
    report = summarize(results, elapsed)
    report["cpu_steal"] = steal        # the hypervisor's share of the CPUs during the run
    if idle is not None:
        report["idle_ttft_p50_s"] = idle["ttft_p50_s"]
        report["ttft_p50_vs_idle"] = report["ttft_p50_s"] / idle["ttft_p50_s"]
    if cfg.get("compare_offline"):
        before = cpu_times()
        offline = offline_tok_s(engine_kwargs, prompts, cfg["output_len"])
        report["offline_cpu_steal"] = steal_fraction(before, cpu_times())
        report["offline_output_tok_s"] = offline
        report["server_vs_offline"] = report["output_tok_s"] / offline
    return report
