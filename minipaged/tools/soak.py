"""``python -m minipaged.tools.soak``: the server under a bounded soak with faults (a burn-in test,
as hardware is burned in before it goes into service), as an operator tries it first.

It starts ``python -m minipaged serve`` (with the flags after ``--``) on a free loopback port,
then sends ``--requests`` requests, at most ``--concurrency`` in flight, through the official
``openai`` client: completions and chat, streamed or not, n = 1..3, logprobs, stop strings,
prompts from a few tokens to near the context limit. Mixed in, from a seeded generator:

- streams dropped part-way (``--drop-fraction``): the client hangs up;
- bad requests of many kinds (``--bad-fraction``), each of which must get a 4xx in OpenAI's
  error shape;
- one body of ``--oversized-mb`` MB, sent halfway through, beside the traffic;
- a prompt of exactly max_model_len tokens (it must be refused: no room for one token);
- ``--greedy-checks`` greedy requests sent once to the idle server before the soak and again
  during it: under load the text must be the same.

Every stream's choices are counted: each must finish exactly once. At the end the report has
the requests by outcome, the time to first token, the gaps between streamed chunks (ITL) and
the request latency at p50 / p90 / p99, the server's RSS (after warm-up, at its peak, at the
end), the KV blocks still held once the server is idle (must be 0), and the problems found.
The exit status is 1 if there were any. The soak is bounded twice: in requests, and by
``--max-seconds`` (requests not yet sent then are skipped; those in flight are cancelled).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from .bench_serve import ChildServer
from .measure import percentile

# Bad requests: (endpoint, body or raw bytes, what it is). Each must be answered 4xx.
BAD_REQUESTS = [
    ("completions", {"prompt": "hi", "max_tokens": -1}, "negative max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, "negative temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p of 0"),
    ("completions", {"prompt": "hi", "n": 0}, "n of 0"),
    ("completions", {"prompt": "hi", "logprobs": 10_000}, "too many logprobs"),
    ("completions", {"prompt": [10_000_000]}, "a token id outside the vocabulary"),
    ("completions", {"prompt": ""}, "an empty prompt"),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, "an unknown model"),
    ("completions", {"prompt": "hi", "stop": [1, 2]}, "stop of the wrong type"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options without stream"),
    ("completions", {"prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias on a negative id"),
    ("completions", b'{"prompt": "hi", "max_tokens": ', "truncated JSON"),
    ("completions", b"\xff\xfe not json", "bytes that are not JSON"),
    ("chat/completions", {"messages": []}, "no messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "an unknown role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
     "top_logprobs without logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000_000},
     "max_tokens past the context"),
    ("chat/completions", {"messages": "hi"}, "messages that are not a list"),
]
WORDS = ("the cat sat on a mat while seven small birds sang about paging memory and blocks of keys "
         "values tables frames processes kernels schedulers queues prefixes caches").split()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.results: list[dict] = []           # one per request: kind, status, timings
        self.problems: list[str] = []
        self.rss_peak = 0

    # ------------------------------------------------------------------ the server
    def start_server(self) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minipaged-soak-", suffix=".log", delete=False)
        try:
            self.server = ChildServer({}, timeout=900, flags=("--served-model-name", "soak", *self.args.serve_args),
                                      stderr=self.log)
        except RuntimeError:
            raise RuntimeError(f"the server did not start: {Path(self.log.name).read_text()[-2000:]}") from None
        self.proc, self.base = self.server.proc, self.server.base_url

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    async def watch_rss(self) -> None:
        while True:
            self.rss_peak = max(self.rss_peak, self.rss_mb())
            await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ the traffic
    def prompt_words(self, tokens: int) -> str:
        """About ``tokens`` tokens of words (the server's tokenizer says how many a word takes)."""
        words = max(int(tokens / self.tokens_per_word), 1)
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def good_request(self) -> dict:
        r = self.rng
        length = r.choice([8, 32, 128, 512]) if r.random() > self.args.long_fraction else \
            int(self.max_model_len * r.uniform(0.6, 0.8))
        body = {"max_tokens": r.choice([4, 16, 48, 96]), "n": r.choice([1, 1, 2, 3]),
                "temperature": r.choice([0.0, 0.7, 1.0]), "seed": r.randrange(1000)}
        if r.random() < 0.2:
            body["stop"] = [r.choice(WORDS)]
        chat = r.random() < 0.5
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt_words(length)}]
            if r.random() < 0.2:
                body.update(logprobs=True, top_logprobs=2)
        else:
            body["prompt"] = self.prompt_words(length)
            if r.random() < 0.2:
                body["logprobs"] = 2
        body["stream"] = r.random() < 0.6
        return {"chat": chat, "body": body, "drop": body["stream"] and r.random() < self.args.drop_fraction}

    async def send(self, http, request: dict) -> dict:
        """One request through the openai client; what happened and when."""
        import openai  # noqa: PLC0415 (the dev extra: the official client is the point)

        body, chat = request["body"], request["chat"]
        client = self.client
        create = client.chat.completions.create if chat else client.completions.create
        start = time.perf_counter()
        result = {"kind": ("chat" if chat else "completion") + ("-stream" if body["stream"] else ""),
                  "n": body["n"], "start": start}
        try:
            if not body["stream"]:
                answer = await create(model="soak", **body)
                result.update(status=200, end=time.perf_counter(), text=[c.message.content if chat else c.text
                                                                         for c in answer.choices])
                return result
            finishes, arrivals, texts = {}, [], {}
            stream = await create(model="soak", **body)
            async for chunk in stream:
                arrivals.append(time.perf_counter())
                for c in chunk.choices:
                    piece = (c.delta.content if chat else c.text) or ""
                    texts[c.index] = texts.get(c.index, "") + piece
                    if c.finish_reason is not None:
                        finishes[c.index] = finishes.get(c.index, 0) + 1
                if request["drop"] and len(arrivals) >= 3:
                    await stream.close()                 # the client hangs up part-way
                    result.update(status="dropped", end=time.perf_counter())
                    return result
            if sorted(finishes) != list(range(body["n"])) or any(v != 1 for v in finishes.values()):
                self.problems.append(f"a stream of n={body['n']} finished its choices {finishes} times "
                                     "(each must finish exactly once)")
            result.update(status=200, end=time.perf_counter(), ttft=arrivals[0] - start if arrivals else None,
                          itl=[b - a for a, b in zip(arrivals, arrivals[1:])],
                          text=[texts.get(i, "") for i in range(body["n"])])
        except openai.APIStatusError as err:
            result.update(status=err.status_code, end=time.perf_counter(), error=str(err)[:200])
        except openai.APIConnectionError as err:
            result.update(status="connection", end=time.perf_counter(), error=str(err)[:200])
        return result

    async def send_bad(self, http, endpoint: str, body, what: str) -> dict:
        start = time.perf_counter()
        if isinstance(body, dict):
            body = {"model": "soak", **body}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await http.post(f"{self.base}/v1/{endpoint}", content=content, headers={"content-type": "application/json"})
        ok = 400 <= r.status_code < 500
        try:
            ok = ok and "message" in r.json()["error"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self.problems.append(f"{what}: answered {r.status_code} {r.text[:200]!r}, not a 4xx OpenAI error")
        return {"kind": "bad", "what": what, "status": r.status_code, "start": start, "end": time.perf_counter()}

    async def oversized(self, http) -> dict:
        body = json.dumps({"model": "soak", "prompt": "word " * int(self.args.oversized_mb * 2 ** 20 / 5),
                           "max_tokens": 1}).encode()
        start = time.perf_counter()
        r = await http.post(f"{self.base}/v1/completions", content=body, headers={"content-type": "application/json"})
        took = time.perf_counter() - start
        if r.status_code not in (400, 413):
            self.problems.append(f"the {self.args.oversized_mb:g} MB body was answered {r.status_code}, not 400/413")
        return {"kind": "oversized", "status": r.status_code, "start": start, "end": start + took}

    async def full_context(self, http) -> dict:
        start = time.perf_counter()
        r = await http.post(f"{self.base}/v1/completions", json={"model": "soak", "prompt": [7] * self.max_model_len})
        if r.status_code != 400:
            self.problems.append(f"a prompt of max_model_len tokens was answered {r.status_code}, not 400")
        return {"kind": "full-context", "status": r.status_code, "start": start, "end": time.perf_counter()}

    # ------------------------------------------------------------------ the run
    async def run(self) -> dict:
        import httpx  # noqa: PLC0415
        import openai  # noqa: PLC0415

        args = self.args
        self.client = openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="soak", max_retries=0, timeout=600)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                     limits=httpx.Limits(max_connections=args.concurrency + 8)) as http:
            self.max_model_len = (await http.get(f"{self.base}/v1/models")).json()["data"][0]["max_model_len"]
            sample = " ".join(WORDS * 4)
            counted = (await http.post(f"{self.base}/tokenize", json={"prompt": sample})).json()["count"]
            self.tokens_per_word = counted / len(WORDS * 4)
            greedy = [{"chat": i % 2 == 1, "drop": False,
                       "body": {"max_tokens": 24, "n": 1, "temperature": 0.0, "stream": i % 3 == 0,
                                **({"messages": [{"role": "user", "content": self.prompt_words(20 + i)}]}
                                   if i % 2 else {"prompt": self.prompt_words(20 + i)})}}
                      for i in range(args.greedy_checks)]
            alone = [await self.send(http, g) for g in greedy]
            rss_start = self.rss_mb()
            watcher = asyncio.ensure_future(self.watch_rss())
            plan: list = [("good", self.good_request()) if self.rng.random() >= args.bad_fraction
                          else ("bad", self.rng.choice(BAD_REQUESTS)) for _ in range(args.requests)]
            for i, g in enumerate(greedy):
                plan.insert(self.rng.randrange(len(plan) + 1), ("greedy", (i, g)))
            plan.insert(len(plan) // 2, ("oversized", None))
            plan.insert(len(plan) // 3, ("full-context", None))
            limit = asyncio.Semaphore(args.concurrency)
            deadline = time.monotonic() + args.max_seconds
            again: dict[int, dict] = {}
            skipped = 0

            async def one(kind, item):
                nonlocal skipped
                async with limit:
                    if time.monotonic() > deadline:
                        skipped += 1
                        return
                    if kind == "good":
                        self.results.append(await self.send(http, item))
                    elif kind == "greedy":
                        again[item[0]] = await self.send(http, item[1])
                        self.results.append(again[item[0]])
                    elif kind == "bad":
                        self.results.append(await self.send_bad(http, *item))
                    elif kind == "oversized":
                        self.results.append(await self.oversized(http))
                    else:
                        self.results.append(await self.full_context(http))

            started = time.perf_counter()
            tasks = [asyncio.ensure_future(one(kind, item)) for kind, item in plan]
            done, pending = await asyncio.wait(tasks, timeout=args.max_seconds + 60)
            for task in pending:
                task.cancel()
            elapsed = time.perf_counter() - started
            for i, first in enumerate(alone):
                if i in again and again[i].get("status") == 200 and again[i]["text"] != first.get("text"):
                    self.problems.append(f"greedy request {i} gave another text under load")
            blocks = await self.blocks_when_idle(http)
            watcher.cancel()
        return self.report(elapsed, rss_start, blocks, skipped + len(pending),
                           sum(1 for i in again if again[i].get("status") == 200))

    async def blocks_when_idle(self, http) -> int:
        """KV blocks held once nothing runs (aborts land within a step or two)."""
        deadline = time.monotonic() + 30
        while True:
            stats = (await http.get(f"{self.base}/stats")).json()
            idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_swapped"] == 0
            if (idle and stats["kv_blocks_used"] == 0) or time.monotonic() > deadline:
                return stats["kv_blocks_used"]
            await asyncio.sleep(0.1)

    def report(self, elapsed: float, rss_start: float, blocks: int, skipped: int, greedy_compared: int) -> dict:
        statuses: dict[str, int] = {}
        for r in self.results:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        served = [r for r in self.results if r["status"] == 200]
        ttft = [r["ttft"] for r in served if r.get("ttft") is not None]
        itl = [gap for r in served for gap in r.get("itl", [])]
        latency = [r["end"] - r["start"] for r in served]
        server_errors = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
        if server_errors:
            self.problems.append(f"{server_errors} answers were 5xx")
        if blocks:
            self.problems.append(f"{blocks} KV blocks still held with nothing running")
        log = Path(self.log.name).read_text()
        if "Traceback" in log:
            self.problems.append("the server logged a traceback: " + log[log.index("Traceback"):][:500])

        def pcts(values):
            return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

        oversized = next((r for r in self.results if r["kind"] == "oversized"), None)
        return {"requests": len(self.results), "skipped": skipped, "seconds": elapsed, "statuses": statuses,
                "bad_requests": sum(1 for r in self.results if r["kind"] == "bad"),
                "dropped_streams": statuses.get("dropped", 0), "greedy_compared": greedy_compared,
                "oversized_seconds": None if oversized is None else oversized["end"] - oversized["start"],
                "ttft_s": pcts(ttft), "itl_s": pcts(itl), "latency_s": pcts(latency),
                "rss_mb": {"start": rss_start, "peak": self.rss_peak, "end": self.rss_mb()},
                "kv_blocks_held_after": blocks, "problems": self.problems}

    def stop_server(self) -> int:
        return self.server.stop()


def print_report(report: dict) -> None:
    def ms(d):
        return " / ".join("-" if v is None else f"{v * 1e3:.0f}" for v in d.values())

    print(f"requests {report['requests']} in {report['seconds']:.0f} s (skipped {report['skipped']}); "
          f"by status {report['statuses']}; bad {report['bad_requests']}, dropped {report['dropped_streams']}, "
          f"greedy compared {report['greedy_compared']}")
    print(f"TTFT p50/p90/p99 ms: {ms(report['ttft_s'])};  ITL: {ms(report['itl_s'])};  "
          f"latency: {ms(report['latency_s'])}")
    rss = report["rss_mb"]
    print(f"RSS MB: start {rss['start']:.0f}, peak {rss['peak']:.0f}, end {rss['end']:.0f};  oversized body answered in "
          f"{report['oversized_seconds'] or 0:.2f} s;  KV blocks held after: {report['kv_blocks_held_after']}")
    print("problems: " + ("none" if not report["problems"] else "\n  " + "\n  ".join(report["problems"])))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m minipaged.tools.soak", description=__doc__.split("\n\n")[0],
                                epilog="Flags after -- go to `python -m minipaged serve` (the model, the engine).")
    p.add_argument("--requests", type=int, default=600, help="requests to send (default 600)")
    p.add_argument("--concurrency", type=int, default=24, help="most in flight (default 24)")
    p.add_argument("--max-seconds", type=float, default=1800, help="stop sending after this long (default 1800)")
    p.add_argument("--drop-fraction", type=float, default=0.15, help="streams the client drops part-way")
    p.add_argument("--bad-fraction", type=float, default=0.1, help="requests that are bad on purpose")
    p.add_argument("--long-fraction", type=float, default=0.03,
                   help="prompts of 60-80%% of max_model_len (the rest: 8 to 512 words)")
    p.add_argument("--oversized-mb", type=float, default=50.0, help="the one oversized body, in MB")
    p.add_argument("--greedy-checks", type=int, default=8, help="greedy requests compared alone and under load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report here")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "max_seconds", "oversized_mb"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("drop_fraction", "bad_fraction", "long_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be between 0 and 1, got {getattr(args, name)}")
    if args.greedy_checks < 0:
        p.error(f"--greedy-checks must be >= 0, got {args.greedy_checks}")
    args.serve_args = serve_args
    soak = Soak(args)
    soak.start_server()
    try:
        report = asyncio.run(soak.run())
    finally:
        code = soak.stop_server()
    if code != 0:
        report["problems"].append(f"the server exited {code} on SIGINT, not 0")
    report["serve_args"] = shlex.join(serve_args)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
