"""Verifying draft tokens: keep the longest prefix the target model agrees with.

The target scores k drafted tokens and one position more in a single pass; this module decides,
position by position, which drafts stand. Like a CPU retiring speculatively executed
instructions: those on the predicted path commit, the first misprediction squashes the rest,
and the correct instruction (here, token) is issued in its place. The engine then rolls the
block table back past the squashed positions (BlockManager.rollback).

- Greedy rows: a draft stands while it equals the target's argmax; then the target's own token
  follows (the correction, or after k accepted drafts, the bonus). The output is the target's
  greedy output exactly.
- Sampled rows: the rejection rule of Leviathan et al. (2023) and Chen et al. (2023). Draft x_i
  drawn from q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection the token is drawn from norm(max(0, p_i - q_i)) instead, and nothing after it
  stands; if all k stand, one more token is drawn from p_k. Every emitted token is then
  distributed exactly as the target alone would draw it.
- One-hot drafts (n-gram lookup, q_i(x_i) = 1): the rule says x_i stands with probability
  p_i(x_i), and a rejection draws from p_i without x_i. ``verify_coupled`` carries it out by
  drawing the token the target itself would draw at that position, t_i from p_i, with the one
  uniform number it would use, and letting x_i stand iff t_i = x_i: P(stand) = p_i(x_i), and a
  rejected position emits t_i, distributed as p_i without x_i. It uses one uniform number per
  emitted token, as decoding without speculation does, so a seeded request gives the very
  tokens it gives without speculation, whatever the draft lengths or the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    num_accepted: int       # drafts that stand (0 .. k)
    token_ids: list[int]    # the accepted drafts, then the target's own next token: num_accepted + 1


def verify_greedy(target_token_ids, draft_token_ids) -> Verdict:
    """target_token_ids (k + 1,): the target's argmax at each position; draft_token_ids (k,)."""
    accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        accepted += 1
    return Verdict(accepted, [int(t) for t in draft_token_ids[:accepted]] + [int(target_token_ids[accepted])])


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token from probs (V,) by inverse CDF with one uniform from ``generator``."""
    cdf = np.cumsum(probs)
    token = min(int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right")), probs.shape[0] - 1)
    while probs[token] == 0.0:     # a rounding edge landed on a removed token
        token -= 1
    return token


def verify_coupled(target_probs: np.ndarray, draft_token_ids, generator: np.random.Generator) -> Verdict:
    """The rule for one-hot drafts: target_probs (k + 1, V) float64; each position's token is
    drawn as the target would draw it (one uniform), and its draft stands iff they agree."""
    k = len(draft_token_ids)
    for i in range(k):
        token = draw(target_probs[i], generator)
        if token != int(draft_token_ids[i]):
            return Verdict(i, [int(t) for t in draft_token_ids[:i]] + [token])
    return Verdict(k, [int(t) for t in draft_token_ids] + [draw(target_probs[k], generator)])


def verify_sampled(target_probs: np.ndarray, draft_token_ids, generator: np.random.Generator,
                   draft_probs: np.ndarray | None = None) -> Verdict:
    """target_probs (k + 1, V) float64: the target's distribution at each position, after the
    request's penalties, temperature and filters; draft_token_ids (k,); draft_probs (k, V) the
    draft's distributions (None: one-hot drafts, as n-gram lookup makes)."""
    k = len(draft_token_ids)
    for i in range(k):
        x = int(draft_token_ids[i])
        p = target_probs[i]                                   # (V,)
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if generator.random() * q_x < p[x]:                   # u < p(x) / q(x): the draft stands
            continue
        q = np.zeros_like(p) if draft_probs is None else draft_probs[i]
        if draft_probs is None:
            q[x] = 1.0
        residual = np.maximum(p - q, 0.0)                     # (V,) where the target wants more than drafted
        total = residual.sum()
        token = draw(residual / total, generator) if total > 0 else draw(p, generator)
        return Verdict(i, [int(t) for t in draft_token_ids[:i]] + [token])
    return Verdict(k, [int(t) for t in draft_token_ids] + [draw(target_probs[k], generator)])
