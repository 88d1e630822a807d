"""Beam search: keep the ``beam_width`` most likely continuations, forking and pruning them.

A beam is a sequence; beams of one request share every block of their common
prefix. Each step, every running beam proposes its ``2 * beam_width`` most
likely next tokens; the best ``beam_width`` proposals that do not end the text
become the new beams (a beam with two survivors forks: fork() of a process,
blocks shared, copy-on-write at the next divergent write), a beam with none is
pruned and frees what only it held, at once. A proposal that ends with EOS is
set aside as a finished hypothesis. After ``max_tokens`` steps the finished
hypotheses and the running beams are ranked by ``cum_logprob / length **
length_penalty`` (vLLM's rule: the length counts the prompt, not a final EOS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling_params import as_flag, as_float, as_int, shown, wrong_type
from ..sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # The same type rules as SamplingParams: bools are not numbers, numpy scalars
        # become Python ones, the flag must be a bool.
        def bad(message: str) -> None:
            raise ValueError(f"invalid BeamSearchParams: {message}")

        for name in ("beam_width", "max_tokens"):
            value = as_int(getattr(self, name))
            if value is None:
                bad(wrong_type(name, getattr(self, name), "an integer"))
            object.__setattr__(self, name, value)
        if self.beam_width < 1:
            bad(f"beam_width must be a positive integer, got {shown(self.beam_width)}")
        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {shown(self.max_tokens)}")
        ignore_eos = as_flag(self.ignore_eos)
        if ignore_eos is None:
            bad(wrong_type("ignore_eos", self.ignore_eos, "True or False"))
        object.__setattr__(self, "ignore_eos", ignore_eos)
        length_penalty = as_float(self.length_penalty)
        if length_penalty is None:
            bad(wrong_type("length_penalty", self.length_penalty, "a finite number"))
        object.__setattr__(self, "length_penalty", length_penalty)


@dataclass
class BeamSearchSequence:
    """One ranked result, in vLLM's shape: ``tokens`` and ``text`` include the prompt."""

    tokens: list[int]
    text: str
    cum_logprob: float          # sum of the model's log-probabilities of the generated tokens
    finish_reason: str          # "stop" (ended with EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


@dataclass
class Hypothesis:
    """A finished beam: it needs no KV blocks any more, only its tokens and score."""

    tokens: list[int]           # prompt + generated
    cum_logprob: float
    ended_with_eos: bool


@dataclass
class BeamState:
    """Per-request beam bookkeeping kept beside its SequenceGroup."""

    params: BeamSearchParams
    eos_token_id: int | None
    finished: list[Hypothesis] = field(default_factory=list)


def beam_score(num_tokens: int, cum_logprob: float, ended_with_eos: bool, length_penalty: float) -> float:
    length = num_tokens - 1 if ended_with_eos else num_tokens
    return cum_logprob / (length ** length_penalty)


@dataclass(frozen=True)
class Proposal:
    parent: int        # index of the beam it extends
    token: int
    logprob: float     # of this token
    cum_logprob: float


def propose(cum_logprobs: list[float], logprobs: np.ndarray, state: BeamState
            ) -> tuple[list[Proposal], list[Proposal]]:
    """Choose the next beams from each beam's log-probabilities.

    cum_logprobs: (B,) of the running beams; logprobs: (B, vocab) of their next token.
    Returns (the new running beams, best first; proposals that ended with EOS).
    """
    width = state.params.beam_width
    k = min(2 * width, logprobs.shape[1])
    candidates, ended = [], []
    for parent, row in enumerate(logprobs):
        top = np.argpartition(-row, k - 1)[:k]
        top = top[np.lexsort((top, -row[top]))]          # most likely first, ties by token id
        for token in top:
            proposal = Proposal(parent, int(token), float(row[token]), cum_logprobs[parent] + float(row[token]))
            if token == state.eos_token_id and not state.params.ignore_eos:
                ended.append(proposal)
            else:
                candidates.append(proposal)
    # all candidates have the same length, so ranking by score is ranking by cum_logprob
    candidates.sort(key=lambda p: -p.cum_logprob)
    return candidates[:width], ended


def best_sequences(state: BeamState, running: list[Hypothesis], decode) -> list[BeamSearchSequence]:
    """Rank finished hypotheses and running beams together; keep the best beam_width."""
    p = state.params
    pool = state.finished + running
    pool.sort(key=lambda h: -beam_score(len(h.tokens), h.cum_logprob, h.ended_with_eos, p.length_penalty))
    return [BeamSearchSequence(h.tokens, decode(h.tokens), h.cum_logprob,
                               "stop" if h.ended_with_eos else "length") for h in pool[:p.beam_width]]


def advance_beams(group: SequenceGroup, beams: list[Sequence], logprobs: np.ndarray, block_manager,
                  new_seq_id, max_model_len: int) -> None:
    """Replace the group's beams by the best proposals: fork survivors, prune the rest.

    beams: the group's running beams, in rank order; logprobs (len(beams), vocab): each
    beam's next-token log-probabilities; new_seq_id() names a forked child.
    """
    state = group.beam
    running, ended = propose([b.cumulative_logprob for b in beams], logprobs, state)
    for p in ended:
        state.finished.append(Hypothesis(beams[p.parent].token_ids + [p.token], p.cum_logprob, True))
    children: dict[int, list] = {}
    for p in running:
        children.setdefault(p.parent, []).append(p)
    new_beams: dict[int, Sequence] = {}          # proposal rank -> its sequence
    for index, parent in enumerate(beams):
        proposals = children.get(index, [])
        if not proposals:
            block_manager.free(parent)           # pruned: what only it held is free at once
            continue
        for p in proposals[1:]:                  # extra survivors fork before the parent moves on
            child = Sequence(new_seq_id(), list(parent.prompt_token_ids),
                             list(parent.output_token_ids), status=parent.status,
                             num_computed_tokens=parent.num_computed_tokens,
                             cumulative_logprob=parent.cumulative_logprob, cache_salt=parent.cache_salt)
            block_manager.fork(parent, child)
            child.append_token(p.token, p.logprob)
            new_beams[running.index(p)] = child
        parent.append_token(proposals[0].token, proposals[0].logprob)
        new_beams[running.index(proposals[0])] = parent
    group.seqs = [new_beams[rank] for rank in sorted(new_beams)]   # best first
    done = (group.seqs[0].num_output_tokens >= state.params.max_tokens
            or group.seqs[0].num_tokens >= max_model_len)
    if done:
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_LENGTH
