"""Sequence and SequenceGroup: the processes and the jobs of the engine.

A *request* is a SequenceGroup (a job). Each of its sequences (a process) owns a
block table in the block manager, the way each process owns a page table.
Parallel samples and beams are several sequences of one group.

This is the process descriptor (an OS's task struct), read by both the memory
manager (memory/) and the scheduler (scheduler/); it lives at the top of the
package, below both, so that neither has to import the other's room.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for type hints; keeps this module free of numpy/model imports
    from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"          # not yet admitted (or preempted by recomputation)
    RUNNING = "running"          # holds device blocks, scheduled every step
    SWAPPED = "swapped"          # preempted by swapping: its blocks wait in the CPU pool
    FINISHED_STOPPED = "stop"    # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"   # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"   # cancelled by the user

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclass
class Sequence:
    """One stream of tokens: the prompt followed by what has been generated."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are already in the cache. The scheduler computes the
    # rest: the whole prompt at admission, then one token per decode step.
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if asked
    output_text: str = ""
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # incremental detokenizer state (see detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    # speculative decoding: tokens guessed for the next step, not yet verified, so not output
    # (engine/spec_decode.py proposes them; the scheduler takes them, placing what fits)
    draft_token_ids: list[int] = field(default_factory=list)
    # with a draft model: positions whose K/V are in the draft model's pool (its own page
    # fill; the blocks are the ones this sequence's table maps, in the draft's pool)
    draft_num_computed_tokens: int = 0
    # structured outputs: this sequence's place in its request's grammar (engine/structured_output.py
    # Grammar), advanced by each token it keeps; None when the request asked for no constraint
    grammar: Any = None
    # prefix caching: mixed into the name of its first block, so only requests with the same
    # salt share cached blocks (one tenant cannot time another's prefix); None: no salt
    cache_salt: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def reset_for_recompute(self) -> None:
        """Forget the cache: everything (prompt and output) must be computed again."""
        self.num_computed_tokens = 0
        self.draft_num_computed_tokens = 0
        self.status = SequenceStatus.WAITING


@dataclass
class SequenceGroup:
    """One request: its sequences share the prompt and the sampling parameters."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: "SamplingParams"
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = -1      # FCFS order, set by the scheduler when the request is added
    # A beam search's state (engine/beam_search.py: BeamState), None for sampling. The
    # scheduler only asks whether it is set: the beams themselves
    # are chosen by the engine, above them.
    beam: Any = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # prompt tokens found in the prefix cache when it was first admitted (None until then)
    num_cached_tokens: int | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    def num_seqs_reserved(self) -> int:
        """Sequences this request may run at once: a beam search grows to beam_width."""
        live = len(self.unfinished_seqs())
        # a beam search runs with n = beam_width (engine/input_processor.py)
        return max(live, self.sampling_params.n) if self.beam is not None and live else live

    def set_status(self, status: SequenceStatus) -> None:
        for seq in self.unfinished_seqs():
            seq.status = status

    def num_uncomputed_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self.unfinished_seqs())

    def in_prompt_phase(self) -> bool:
        """No sample has generated anything yet: all still hold exactly the prompt."""
        return all(s.num_output_tokens == 0 for s in self.unfinished_seqs())

    def is_prefilling(self) -> bool:
        """Its prompt (or, after recomputation, prompt + output) is not all in the cache yet."""
        return any(s.num_uncomputed_tokens > 1 or s.num_computed_tokens == 0
                   for s in self.unfinished_seqs())
