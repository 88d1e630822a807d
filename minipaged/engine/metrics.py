"""Metrics: the engine's ``top``: who runs, who waits, how full the pools are, how fast it goes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np


LATENCY_WINDOW = 10_000   # TTFT / TPOT statistics cover the latest this many requests


def _percentiles(values, prefix: str) -> dict:
    if not values:
        return {f"{prefix}_mean": None, f"{prefix}_p50": None, f"{prefix}_p99": None}
    return {f"{prefix}_mean": float(np.mean(values)), f"{prefix}_p50": float(np.percentile(values, 50)),
            f"{prefix}_p99": float(np.percentile(values, 99))}


@dataclass
class Metrics:
    kv_blocks_peak: int = 0
    kv_blocks_unshared_peak: int = 0   # the peak if every sequence had its own copy of every block
    max_concurrent_requests: int = 0   # the most requests running (holding KV blocks) at once
    num_steps: int = 0
    prompt_tokens: int = 0        # prompt (and recomputed) tokens run through the model
    generation_tokens: int = 0    # tokens sampled
    start_time: float = field(default_factory=time.monotonic)
    # Per request, the most recent LATENCY_WINDOW of them: a server runs for days, and every
    # get_stats() (every /metrics scrape) takes percentiles over these.
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))  # arrival -> first token (s)
    tpots: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))  # mean time per later token (s)
    # what the last periodic log line had seen, to report rates since then
    _last_log: tuple[float, int, int] = (0.0, 0, 0)

    def record_step(self, kv_blocks_used: int, kv_blocks_mapped: int, num_prompt_tokens: int,
                    num_generated: int) -> None:
        self.num_steps += 1
        self.kv_blocks_peak = max(self.kv_blocks_peak, kv_blocks_used)
        self.kv_blocks_unshared_peak = max(self.kv_blocks_unshared_peak, kv_blocks_mapped)
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_generated

    def record_finished(self, first_token: float | None, finished: float, num_output_tokens: int) -> None:
        if first_token is not None and num_output_tokens > 1:
            self.tpots.append((finished - first_token) / (num_output_tokens - 1))

    def snapshot(self, **engine_state) -> dict:
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {
            **engine_state,
            "kv_blocks_peak": self.kv_blocks_peak,
            "kv_blocks_unshared_peak": self.kv_blocks_unshared_peak,
            "num_steps": self.num_steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "prompt_throughput": self.prompt_tokens / elapsed,       # tokens/s since the engine started
            "generation_throughput": self.generation_tokens / elapsed,
            **_percentiles(self.ttfts, "ttft"),
            **_percentiles(self.tpots, "tpot"),
        }

    def log_line(self, stats: dict) -> str:
        """vLLM-style one-line summary; rates are over the time since the previous line."""
        now = time.monotonic()
        then, prompt, generated = self._last_log or (self.start_time, 0, 0)
        then = then or self.start_time
        dt = max(now - then, 1e-9)
        self._last_log = (now, self.prompt_tokens, self.generation_tokens)
        spec = stats.get("spec_decode")
        speculation = ""
        if spec and spec["num_draft_tokens"]:
            speculation = (f", Speculative decoding: acceptance {spec['acceptance_rate']:.1%} of "
                           f"{spec['num_draft_tokens']} drafts, mean accepted length "
                           f"{spec['mean_accepted_length']:.2f}")
        return (f"Avg prompt throughput: {(self.prompt_tokens - prompt) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(self.generation_tokens - generated) / dt:.1f} tokens/s, "
                f"Running: {stats['num_running']} reqs, Swapped: {stats['num_swapped']} reqs, "
                f"Pending: {stats['num_waiting']} reqs, KV cache usage: {stats['kv_usage']:.1%}, "
                f"CPU KV cache usage: {stats['cpu_kv_usage']:.1%}, "
                f"Preemptions: {stats['num_preemptions']} (swap {stats['num_preemptions_swap']}, "
                f"recompute {stats['num_preemptions_recompute']}){speculation}")
