"""Scheduler: first-come-first-served continuous batching, the engine's process scheduler.

Every step it builds one batch: first the running sequences (one decode token
each), then, while blocks, ``max_num_seqs`` and the token budget allow, new
requests from the waiting queue in arrival order. Finished sequences free their
blocks at once, so a waiting request can join at the very next step.

If a running sequence needs a new block and none is free, the most recently
arrived running request is preempted by recomputation (its blocks are freed,
it goes back to the front of the waiting queue with its generated tokens as part
of its prompt), exactly as an OS kills the youngest process rather than letting
everyone starve. Earlier requests then proceed, so the engine never deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import AllocStatus, BlockManager
from .config import SchedulerConfig
from .sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: ``num_new_tokens`` tokens to compute."""

    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int   # the query length: a whole prompt, or 1 for a decode
    do_sample: bool       # these tokens end the known context: sample the next one
                          # (always true until chunked prefill splits a prompt over steps)
    is_prefill: bool      # prompt (or recomputed) tokens rather than one decode token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()  # arrival order (preempted ones at the front)
        self.running: list[SequenceGroup] = []         # arrival order
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add_seq_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Cancel a request wherever it is; its blocks are free when this returns."""
        for queue in (self.waiting, self.running):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    for seq in group.seqs:
                        self.block_manager.free(seq)
                    return group
        return None

    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. Running requests compute their next token (their whole prompt, if a step
        #    was interrupted before it finished), earliest arrival first.
        queue = deque(self.running)
        still_running: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            while not self.block_manager.can_append_slots(group):
                # Out of blocks: evict the latest arrival (possibly this group itself).
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                still_running.append(group)
                num_tokens = sum(s.num_uncomputed_tokens for s in group.unfinished_seqs())
                if num_tokens > budget:
                    continue  # keeps its blocks; runs next step
                for seq in group.unfinished_seqs():
                    self.block_manager.append_slots(seq)
                    out.scheduled.append(ScheduledSeq(
                        group, seq, seq.num_uncomputed_tokens, do_sample=True,
                        is_prefill=seq.num_computed_tokens < seq.num_prompt_tokens))
                budget -= num_tokens
        self.running = still_running

        # 2. Admit waiting requests in arrival order; the first that does not fit
        #    blocks the rest (strict FCFS). Nothing is admitted in a step that
        #    had to preempt: memory is tight, let the survivors run first.
        while self.waiting and not out.preempted:
            group = self.waiting[0]
            num_tokens = sum(s.num_uncomputed_tokens for s in group.unfinished_seqs())
            num_seqs = len(group.unfinished_seqs())
            if num_tokens > budget:
                break
            if self.num_running_seqs() + num_seqs > self.config.max_num_seqs:
                break
            if self.block_manager.can_allocate(group) != AllocStatus.OK:
                break  # LATER; NEVER is refused before a request is queued
            # in a queue at every moment, so an interrupt here can never orphan blocks
            self.running.append(self.waiting.popleft())
            self.block_manager.allocate(group)
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.RUNNING
                out.scheduled.append(ScheduledSeq(group, seq, seq.num_uncomputed_tokens,
                                                  do_sample=True, is_prefill=True))
            budget -= num_tokens
        return out

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Recompute-preemption: free the group's blocks; it will prefill again later."""
        for seq in group.unfinished_seqs():
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        self.waiting.appendleft(group)  # victims are taken latest-first, so FCFS order is kept
        out.preempted.append(group)
        self.num_preemptions += 1

    def free_finished(self) -> list[SequenceGroup]:
        """Release the blocks of finished sequences; drop finished groups from running."""
        finished = []
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished():
                    self.block_manager.free(seq)
            if group.is_finished():
                finished.append(group)
        if finished:
            self.running = [g for g in self.running if not g.is_finished()]
        return finished
