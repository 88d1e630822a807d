"""Metrics: the engine's ``top``: who runs, who waits, how full the KV pool is, how fast it goes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Metrics:
    kv_blocks_peak: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0        # prompt (and recomputed) tokens run through the model
    generation_tokens: int = 0    # tokens sampled
    start_time: float = field(default_factory=time.monotonic)
    ttfts: list[float] = field(default_factory=list)  # seconds from arrival to first token, per request

    def record_step(self, kv_blocks_used: int, num_prompt_tokens: int, num_generated: int) -> None:
        self.num_steps += 1
        self.kv_blocks_peak = max(self.kv_blocks_peak, kv_blocks_used)
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_generated

    def snapshot(self, *, num_running: int, num_waiting: int, kv_blocks_used: int,
                 kv_blocks_total: int, num_preemptions: int) -> dict:
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {
            "num_running": num_running,
            "num_waiting": num_waiting,
            "kv_blocks_used": kv_blocks_used,
            "kv_blocks_total": kv_blocks_total,
            "kv_blocks_peak": self.kv_blocks_peak,
            "kv_usage": kv_blocks_used / kv_blocks_total,
            "num_preemptions": num_preemptions,
            "num_steps": self.num_steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "prompt_throughput": self.prompt_tokens / elapsed,       # tokens/s since the engine started
            "generation_throughput": self.generation_tokens / elapsed,
            "mean_ttft": sum(self.ttfts) / len(self.ttfts) if self.ttfts else None,
        }
