"""Scheduler: first-come-first-served continuous batching, the engine's process scheduler.

Three queues, all kept in arrival order: ``waiting`` (not admitted, or preempted
by recomputation), ``running`` (holding device blocks) and ``swapped`` (their
blocks paged out to the CPU pool). Every step builds one batch within two
budgets, ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens:

1. running requests, earliest first, each get their next token; if one needs a
   new block and none is free, the most recent arrival is preempted (swapped out
   or dropped for recomputation) until the earlier ones fit, as an OS pages out
   or kills its youngest process rather than let everyone starve;
2. with chunked prefill, running requests still reading their prompt get the
   next chunk from what is left of the token budget;
3. swapped requests come back, earliest first, before anything new;
4. new requests are admitted in arrival order while blocks and budgets allow;
   the first that does not fit blocks the rest (strict FCFS);
5. with speculative decoding, the decodes' draft tokens get slots from what is
   left, earliest request first: drafts are optional work, so they never cost
   anyone a block, a prefill chunk or an admission.

Nothing comes back or is admitted in a step that had to preempt: memory is
tight, so the survivors run first.

Demand paging (``preemption_mode="partial"``): the victim gives up only the blocks the
step lacks, its tail first, and keeps the rest resident; it waits in the swapped queue,
suspended, until its missing blocks are swapped back in, before anything new is admitted.
If the request at the head of that queue cannot come back because later suspended ones
hold the blocks it needs, those are paged out whole (or, without swap space, recomputed):
nobody waits on a request that is itself waiting. A prefix that suspended requests share,
which none of them can page out alone, goes by recomputing the latest of them.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from ..memory.block_manager import AllocStatus, BlockManager
from ..config import SchedulerConfig
from ..sequence import Sequence, SequenceGroup, SequenceStatus

# preemption_mode="auto": a request holding at most this many tokens is recomputed
# rather than swapped. Recomputing 64 tokens is one small prefill that rides along
# with the batch (about what a decode step of 64 sequences costs in matrix work),
# while swapping holds CPU memory and copies every block out and back in.
AUTO_RECOMPUTE_MAX_TOKENS = 64


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: ``num_new_tokens`` tokens to compute."""

    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int   # the query length: a prompt (or a chunk of it), or 1 for a decode
    do_sample: bool       # these tokens reach the end of the known context: sample the next one
    is_prefill: bool      # prompt (or recomputed) tokens rather than one decode token
    # Samples of the same prompt that share this sequence's blocks and computation:
    # they mirror its progress and each draw their own token from its logits.
    followers: list[Sequence] = field(default_factory=list)
    # Speculative decoding: draft tokens computed after the newest one (num_new_tokens =
    # 1 + len(draft_token_ids)), their slots mapped ahead; the model verifies them this step.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # copy-on-write (src, dst)
    num_steps: int = 1    # > 1: a decode-only batch run for several steps (slots reserved ahead)

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
        self.waiting: list[SequenceGroup] = []   # arrival order (preempted ones go back in place)
        self.running: list[SequenceGroup] = []   # arrival order
        self.swapped: list[SequenceGroup] = []   # arrival order
        self._arrivals = itertools.count()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.num_preemptions_swap = 0
        self.num_preemptions_partial = 0      # swaps that paged out only what a step lacked
        self.num_preemptions_recompute = 0
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    # ------------------------------------------------------------------ queues
    def add_seq_group(self, group: SequenceGroup) -> None:
        group.arrival_index = next(self._arrivals)
        self.waiting.append(group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Cancel a request wherever it is; its device and CPU blocks are free when this returns."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    group.set_status(SequenceStatus.FINISHED_ABORTED)
                    for seq in group.seqs:
                        self.block_manager.free(seq)
                    return group
        return None

    def num_running_seqs(self) -> int:
        return sum(g.num_seqs_reserved() for g in self.running)

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_swap + self.num_preemptions_recompute

    @staticmethod
    def _insert(queue: list[SequenceGroup], group: SequenceGroup) -> None:
        """Put a group in a queue at its arrival position (FCFS survives preemption)."""
        bisect.insort(queue, group, key=lambda g: g.arrival_index)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Draft tokens (speculative decoding) wait until everything else is placed (step 5).
        drafts = {s.seq_id: s.draft_token_ids for g in self.running for s in self._decoding(g)
                  if s.draft_token_ids}
        for group in self.running:
            for seq in group.seqs:
                seq.draft_token_ids = []

        # 0. Sliding windows: blocks no layer reads again go back to the pool first.
        for group in self.running:
            for seq in group.unfinished_seqs():
                self.block_manager.release_slid_out(seq)

        # 1. Running sequences that decode get one slot each, earliest request first.
        queue = deque(g for g in self.running if self._decoding(g))
        prefilling = [g for g in self.running if self._prefilling(g)]
        while queue:
            group = queue.popleft()
            seqs = self._decoding(group)
            while not self.block_manager.can_append_slots(seqs):
                lacking = self.block_manager.num_new_blocks(seqs) - self.block_manager.num_free_blocks
                if self.config.preemption_mode == "partial" and self._page_out_suspended(lacking, out):
                    continue              # blocks taken from requests that wait anyway
                # Out of blocks: evict the latest arrival (possibly this group itself).
                victim = max([group, *queue, *prefilling], key=lambda g: g.arrival_index)
                if victim in queue:
                    queue.remove(victim)
                if victim in prefilling:
                    prefilling.remove(victim)
                self._preempt(victim, out, lacking=lacking)
                if victim is group:
                    break
            else:
                budget -= self._schedule_decodes(group, out)

        # 2. Running requests still reading their prompt get their next chunk.
        for group in prefilling:
            budget -= self._schedule_prefill(group, budget, out)
        self.running = [g for g in self.running if g not in out.preempted]

        # 3. Swapped requests come back, earliest first, before anything new.
        while self.swapped and not out.preempted:
            group = self.swapped[0]
            if not self._can_resume(group):
                # demand paging: never wait on a request that itself waits (later suspended
                # requests give up what the head lacks)
                self._page_out_suspended(self._resume_lack(group), out, exclude=group)
            if (not self._can_resume(group) or not self._fits(group, budget)
                    or self.num_running_seqs() + group.num_seqs_reserved() > self.config.max_num_seqs):
                break
            self._insert(self.running, self.swapped.pop(0))
            mapping = self.block_manager.swap_in(group)
            out.blocks_to_swap_in.extend(mapping)
            self.blocks_swapped_in += len(mapping)
            group.set_status(SequenceStatus.RUNNING)
            budget -= self._schedule_decodes(group, out)
            budget -= self._schedule_prefill(group, budget, out)

        # 4. New (or recomputing) requests in arrival order; the first that does not fit blocks the rest.
        while self.waiting and not self.swapped and not out.preempted:
            group = self.waiting[0]
            if not self._fits(group, budget):
                break
            if self.num_running_seqs() + group.num_seqs_reserved() > self.config.max_num_seqs:
                break
            if self.block_manager.can_allocate(group) != AllocStatus.OK:
                break  # LATER; NEVER is refused before a request is queued
            # in a queue at every moment, so an interrupt here can never orphan blocks
            self._insert(self.running, self.waiting.pop(0))
            self.block_manager.allocate(group)
            group.set_status(SequenceStatus.RUNNING)
            # a recomputed request whose prefix is all cached but its newest token is a decode
            budget -= self._schedule_decodes(group, out)
            budget -= self._schedule_prefill(group, budget, out)

        # 5. Draft tokens take the slots and the budget left, earliest request first.
        if drafts and not out.preempted:
            self._place_drafts(out, drafts, budget)
        self._reserve_lookahead(out)
        return out

    # ------------------------------------------------------------------ what a group needs
    def decoding_seqs(self, group: SequenceGroup) -> list[Sequence]:
        """The group's sequences whose next step is a single decode (they may speculate)."""
        return self._decoding(group)

    @staticmethod
    def _decoding(group: SequenceGroup) -> list[Sequence]:
        """Sequences whose context is cached but for the newest token: one decode step each."""
        if group.in_prompt_phase():
            return []
        return [s for s in group.unfinished_seqs()
                if s.num_computed_tokens > 0 and s.num_uncomputed_tokens == 1]

    @staticmethod
    def _prefilling(group: SequenceGroup) -> list[Sequence]:
        """Sequences with a prompt (or, after recomputation, prompt + output) still to compute.

        While a request's samples all still hold just the prompt, the first computes it
        for all (the others share its blocks and follow it) until the first token is drawn.
        """
        if group.in_prompt_phase():
            return group.unfinished_seqs()[:1]
        return [s for s in group.unfinished_seqs()
                if s.num_computed_tokens == 0 or s.num_uncomputed_tokens > 1]

    def _prefill_tokens(self, group: SequenceGroup, budget: int) -> int:
        """Prompt tokens the group computes this step: with chunked prefill what the budget
        allows; without, whole sequences only (each fits a step: budget >= max_model_len)."""
        wanted = [s.num_uncomputed_tokens for s in self._prefilling(group)]
        if self.config.enable_chunked_prefill:
            return min(sum(wanted), budget)
        total = 0
        for n in wanted:
            if total + n > budget:
                break
            total += n
        return total

    def _fits(self, group: SequenceGroup, budget: int) -> bool:
        """Can the group make progress within the budget left this step?"""
        decodes = len(self._decoding(group))
        needs_prefill = bool(self._prefilling(group))
        return decodes <= budget and (not needs_prefill or self._prefill_tokens(group, budget - decodes) > 0)

    def _schedule_decodes(self, group: SequenceGroup, out: SchedulerOutput) -> int:
        """One slot (copy-on-write if shared) and one token for each decoding sequence."""
        seqs = self._decoding(group)
        for seq in seqs:
            self.block_manager.release_slid_out(seq)      # a request just resumed or admitted
            out.blocks_to_copy.extend(self.block_manager.append_slots(seq))
            out.scheduled.append(ScheduledSeq(group, seq, 1, do_sample=True, is_prefill=False))
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + 1)
        return len(seqs)

    def _place_drafts(self, out: SchedulerOutput, drafts: dict[int, list[int]], budget: int) -> None:
        """Give the scheduled decodes their draft tokens, earliest request first, each trimmed to
        the token budget and the free blocks left: a slot per draft, mapped ahead of the newest
        token's (``append_slots`` with a lookahead). Only the newest token's block was named for
        prefix caching: the drafts may be rejected."""
        bm = self.block_manager
        for item in out.scheduled:
            wanted = drafts.get(item.seq.seq_id)
            if item.is_prefill or not wanted or budget <= 0:
                continue
            k = min(len(wanted), budget)
            while k and bm.num_new_blocks([item.seq], k) > bm.num_free_blocks:
                k -= 1
            if not k:
                continue
            bm.append_slots(item.seq, k)      # the newest token's block is already private
            item.draft_token_ids = list(wanted[:k])
            item.num_new_tokens = 1 + k
            budget -= k

    def _schedule_prefill(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        """Schedule the group's next prompt tokens; returns how many."""
        num_tokens = self._prefill_tokens(group, budget)
        followers = group.unfinished_seqs()[1:] if group.in_prompt_phase() else []
        used = 0
        for seq in self._prefilling(group):
            n = min(seq.num_uncomputed_tokens, num_tokens - used)
            if n <= 0:
                break
            self.block_manager.release_slid_out(seq)      # a long prompt's earlier chunks
            out.scheduled.append(ScheduledSeq(
                group, seq, n, do_sample=seq.num_computed_tokens + n == seq.num_tokens,
                is_prefill=True, followers=followers))
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)
            used += n
        return used

    def _reserve_lookahead(self, out: SchedulerOutput) -> None:
        """Multi-step: a batch of pure decodes runs ``num_scheduler_steps`` steps if slots allow."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or not out.scheduled or any(s.is_prefill or s.group.beam for s in out.scheduled):
            return  # (beams change from step to step: they are chosen one step at a time)
        lookahead = {}
        for item in out.scheduled:
            params = item.group.sampling_params
            # tokens this sequence may still produce after this one
            room = min(params.max_tokens - item.seq.num_output_tokens,
                       self.config.max_model_len - item.seq.num_tokens) - 1
            lookahead[item.seq.seq_id] = max(min(steps - 1, room), 0)
        needed = sum(self.block_manager.num_new_blocks([item.seq], lookahead[item.seq.seq_id])
                     for item in out.scheduled)
        if needed > self.block_manager.num_free_blocks:
            return  # not enough room to run ahead: one step this time
        for item in out.scheduled:
            out.blocks_to_copy.extend(self.block_manager.append_slots(item.seq, lookahead[item.seq.seq_id]))
        out.num_steps = steps

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, lacking: int | None = None) -> None:
        """Take the group's device blocks back, by swapping or by recomputation; with
        preemption_mode "partial", only the ``lacking`` blocks the step needs (demand paging)."""
        mode = self.config.preemption_mode
        tokens = sum(s.num_tokens for s in group.unfinished_seqs())
        if mode == "auto" and tokens <= AUTO_RECOMPUTE_MAX_TOKENS:
            mode = "recompute"
        limit = max(lacking, 1) if mode == "partial" and lacking is not None else None
        if limit is not None and not self.block_manager.movable_blocks(group):
            limit = None        # every block is shared with another request: page it all out
        if mode != "recompute" and not self.block_manager.can_swap_out(group, limit):
            mode = "recompute"  # the CPU pool cannot hold it: recomputation always works
        if mode == "recompute":
            self._recompute(group)
        else:
            mapping = self.block_manager.swap_out(group, limit)
            out.blocks_to_swap_out.extend(mapping)
            self.blocks_swapped_out += len(mapping)
            group.set_status(SequenceStatus.SWAPPED)
            self._insert(self.swapped, group)
            self.num_preemptions_swap += 1
            self.num_preemptions_partial += limit is not None
        out.preempted.append(group)

    def _headroom(self) -> int:
        """Demand paging: blocks a resumed request must leave free, one per decoding sequence
        (each needs at most one new block in the next block_size steps), so that resuming it
        does not force the next step to page it out again (thrashing)."""
        if self.config.preemption_mode != "partial":
            return 0
        return sum(len(self._decoding(g)) for g in self.running)

    def _resume_lack(self, group: SequenceGroup) -> int:
        """Blocks missing for the group to come back with the headroom."""
        bm = self.block_manager
        needed = bm.missing_blocks(group) + bm.num_new_blocks(group.unfinished_seqs()) + bm.watermark_blocks
        return needed + self._headroom() - bm.num_free_blocks

    def _can_resume(self, group: SequenceGroup) -> bool:
        return self.block_manager.can_swap_in(group) and self._resume_lack(group) <= 0

    def _page_out_suspended(self, lacking: int, out: SchedulerOutput, exclude: SequenceGroup | None = None) -> bool:
        """Demand paging: take up to ``lacking`` blocks from suspended requests that still hold
        some (the latest arrival first, its tail first): they wait anyway, and they arrived
        after everyone running. Without swap space for them they are recomputed. Returns
        whether any block was freed.

        A block that several suspended requests share (a cached prompt prefix) is none of
        theirs to page out alone, and if such blocks are all they hold, every one of them
        waits on the others for ever. So when a pass frees too little, the latest suspended
        request holding a device block that no running request (nor ``exclude``) holds is
        recomputed; what it shared becomes the others' own, and the next pass can page it
        out. (A block a running request holds stays whoever else lets go of it.)"""
        freed = 0
        while freed < lacking:
            freed += self._take_movable(lacking - freed, out, exclude)
            if freed >= lacking:
                break
            holders = [g for g in self.running if g not in out.preempted] + ([exclude] if exclude else [])
            pinned = set().union(*(self.block_manager.resident_blocks(g) for g in holders))
            sharer = next((g for g in sorted(self.swapped, key=lambda g: -g.arrival_index)
                           if g is not exclude and self.block_manager.resident_blocks(g) - pinned), None)
            if sharer is None:
                break
            free_before = self.block_manager.num_free_blocks
            self.swapped.remove(sharer)
            self._recompute(sharer)
            freed += self.block_manager.num_free_blocks - free_before
        return freed > 0

    def _take_movable(self, lacking: int, out: SchedulerOutput, exclude: SequenceGroup | None) -> int:
        """One pass of ``_page_out_suspended`` over the blocks suspended requests hold alone;
        returns how many device blocks it freed."""
        freed = 0
        for group in sorted(self.swapped, key=lambda g: -g.arrival_index):
            if freed >= lacking:
                break
            movable = len(self.block_manager.movable_blocks(group)) if group is not exclude else 0
            if not movable:
                continue
            take = lacking - freed
            if self.block_manager.can_swap_out(group, take):
                mapping = self.block_manager.swap_out(group, take)
                out.blocks_to_swap_out.extend(mapping)
                self.blocks_swapped_out += len(mapping)
                freed += len(mapping)
            else:                          # the swap pool is full: recompute it
                self.swapped.remove(group)
                self._recompute(group)
                freed += movable
        return freed

    def _recompute(self, group: SequenceGroup) -> None:
        """Free the group's blocks in both pools and queue it to be computed again."""
        for seq in group.unfinished_seqs():
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        self._insert(self.waiting, group)
        self.num_preemptions_recompute += 1

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

