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

from .sampling_params import SamplingParams


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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(N, V) -> (N, V) float32, computed stably (subtract the row max first)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def shaped_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row (V,) of logits -> (V,) float64 probabilities after temperature, top-k, top-p, min-p."""
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep a token if the tokens more likely than it sum to less than top_p
        keep = cumulative - probs[order] < params.top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
    if params.min_p > 0.0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


class Sampler:
    def __call__(self, logits: np.ndarray, requests: list[SampleRequest]) -> list[SampleResult]:
        """logits: (N, V) float32 on the host, row i belongs to requests[i]."""
        logprobs = log_softmax(logits)                 # (N, V) the model's own, before any ban
        logits = np.array(logits, dtype=np.float32)   # (N, V) own copy: bans write into it
        for i, req in enumerate(requests):
            if req.banned_token_ids:
                logits[i, req.banned_token_ids] = -np.inf
        greedy_tokens = logits.argmax(axis=-1)         # (N,) used by temperature-0 rows
        results = []
        for i, req in enumerate(requests):
            if req.params.greedy:
                token = int(greedy_tokens[i])
            else:
                probs = shaped_probs(logits[i], req.params)
                # inverse-CDF draw: one uniform number per token, from this request's generator
                token = int(np.searchsorted(np.cumsum(probs), req.generator.random() * probs.sum(),
                                            side="right"))
                token = min(token, probs.shape[0] - 1)
                while probs[token] == 0.0:  # a rounding edge landed on a removed token
                    token -= 1
            top = None
            if req.params.logprobs is not None:
                k = min(req.params.logprobs, logprobs.shape[1])
                best = np.argpartition(-logprobs[i], k - 1)[:k] if k else np.array([], dtype=np.int64)
                top = {int(t): float(logprobs[i, t]) for t in best[np.argsort(-logprobs[i, best])]}
                top[token] = float(logprobs[i, token])
            results.append(SampleResult(token, float(logprobs[i, token]), top))
        return results
