"""SamplingParams: how one request wants its tokens chosen and when to stop (vLLM's names)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class OutputKind(enum.Enum):
    """What each ``LLMEngine.step()`` reports for a request (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything generated so far
    DELTA = "delta"            # only what this step added
    FINAL_ONLY = "final_only"  # nothing until the request finishes


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM does)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``.

    Sample 0 uses the request's seed itself; sample i >= 1 uses the first 64-bit
    word of numpy's SeedSequence([seed, i]). So sample i of an n-sample request
    draws exactly what an n=1 request seeded with ``derive_seed(seed, i)`` draws.
    """
    if index == 0:
        return seed
    import numpy as np  # noqa: PLC0415 (keeps this module importable without numpy)

    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0])


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                        # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0          # 0 (or below 1e-5) means greedy
    top_p: float = 1.0                # keep the smallest set of tokens whose probability >= top_p
    top_k: int = -1                   # keep the k most likely tokens; -1 (or 0) keeps all
    min_p: float = 0.0                # drop tokens less likely than min_p * the top probability
    seed: int | None = None           # per-request seed: same seed, same tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0               # EOS and stops are ignored before this many tokens
    logprobs: int | None = None       # return this many top log-probabilities per token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise ValueError(f"invalid SamplingParams: {message}")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be a positive integer, got {self.n!r}")
        if not self.temperature >= 0.0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            bad(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or s == "" for s in stops):
            bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", list(stops))
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or any(not isinstance(t, int) or t < 0 for t in ids):
            bad(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", list(ids))
        if self.stop and not self.detokenize:
            bad("stop strings need detokenize=True (they are matched in the text)")
        if not isinstance(self.output_kind, OutputKind):
            bad(f"output_kind must be an OutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows float32; the limit of
        # sampling as temperature -> 0 is the argmax anyway.
        return self.temperature < GREEDY_BELOW
