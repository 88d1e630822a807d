"""Sampler: turns each row of logits into the next token, as its request asked.

Greedy rows (temperature 0) take the argmax. Random rows are shaped in this
order: temperature, top-k, top-p, min-p, then one draw from the request's own
random generator, so a request with a seed gets the same tokens whatever else
shares its batch. Log-probabilities are those of the model itself (the
log-softmax of the raw logits), which is what ``cumulative_logprob`` sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """One row of the logits and what to do with it."""

    params: SamplingParams
    generator: np.random.Generator
    banned_token_ids: list[int]  # e.g. EOS before min_tokens is reached


@dataclass
class SampleResult:
    token_id: int
    logprob: float                      # model log-probability of token_id
    top_logprobs: dict[int, float] | None  # if params.logprobs: the sampled token and the top k


def log_softmax(logits, xp=np):
    """(N, V) -> (N, V), computed stably (subtract the row max first); numpy or cupy arrays."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))


def shaped_probs(logits, params: SamplingParams, xp=np):
    """One row (V,) of logits -> (V,) float64 probabilities after temperature, top-k, top-p, min-p."""
    x = logits.astype(xp.float64) / params.temperature
    if 0 < params.top_k < x.shape[0]:
        kth = xp.partition(x, -params.top_k)[-params.top_k]
        x = xp.where(x >= kth, x, -xp.inf)
    probs = xp.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = xp.argsort(-probs, kind="stable")
        cumulative = xp.cumsum(probs[order])
        # keep a token if the tokens more likely than it sum to less than top_p
        keep = cumulative - probs[order] < params.top_p
        mask = xp.zeros(probs.shape, dtype=bool)
        mask[order[keep]] = True
        probs = xp.where(mask, probs, 0.0)
    if params.min_p > 0.0:
        probs = xp.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def to_host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


class Sampler:
    """Samples where the logits are (numpy on the CPU, cupy on a GPU); only token ids and
    their log-probabilities (a few numbers a row) come back to the host."""

    def __init__(self, xp=np) -> None:
        self.xp = xp

    def __call__(self, logits, requests: list[SampleRequest]) -> list[SampleResult]:
        """logits: (N, V), row i belongs to requests[i]."""
        xp = self.xp
        logits = logits.astype(xp.float32)             # (N, V) own copy: bans write into it
        logprobs = log_softmax(logits, xp)             # (N, V) the model's own, before any ban
        for i, req in enumerate(requests):
            if req.banned_token_ids:
                logits[i, req.banned_token_ids] = -xp.inf
        greedy_tokens = to_host(logits.argmax(axis=-1))  # (N,) used by temperature-0 rows
        tokens = []
        for i, req in enumerate(requests):
            if req.params.greedy:
                tokens.append(int(greedy_tokens[i]))
                continue
            probs = shaped_probs(logits[i], req.params, xp)
            cdf = xp.cumsum(probs)
            # inverse-CDF draw: one uniform number from this request's own generator (on the
            # host, so a seed gives the same tokens on every device)
            u = req.generator.random()
            token = min(int(xp.searchsorted(cdf, u * cdf[-1], side="right")), probs.shape[0] - 1)
            while float(probs[token]) == 0.0:  # a rounding edge landed on a removed token
                token -= 1
            tokens.append(token)
        rows = xp.arange(len(requests))
        token_logprobs = to_host(logprobs[rows, xp.asarray(tokens, dtype=xp.int64)])  # (N,)
        results = []
        for i, req in enumerate(requests):
            top = None
            if req.params.logprobs is not None:
                row = logprobs[i]
                k = min(req.params.logprobs, row.shape[0])
                best = to_host(xp.argpartition(-row, k - 1)[:k]) if k else np.array([], dtype=np.int64)
                values = to_host(row[xp.asarray(best)]) if k else np.array([])
                top = {int(t): float(v) for t, v in sorted(zip(best, values), key=lambda tv: -tv[1])}
                top[tokens[i]] = float(token_logprobs[i])
            results.append(SampleResult(tokens[i], float(token_logprobs[i]), top))
        return results
