"""ContiguousBlockManager: the "traditional" KV allocator PagedAttention replaced, for comparison.

Like a system without virtual memory, it gives each request one contiguous run of
physical blocks, big enough for the longest the request may become (prompt +
max_tokens, or max_model_len), reserved when the request is admitted. Nothing is
ever added later, so nothing is ever preempted; but the reservation sits unused
while the request grows into it (reservation), is never filled if the request
ends early (internal fragmentation), and a request may wait although enough
blocks are free, because no free run is long enough (external fragmentation).

It keeps the block manager's interface, so the same scheduler and kernels serve it:
the block table still maps logical to physical blocks, which here simply happen
to be consecutive. Finding a run scans the pool (O(num_blocks)): fine for a baseline.
"""

from __future__ import annotations

from .block_manager import AllocStatus, BlockManager, blocks_for
from ..sequence import Sequence, SequenceGroup
from .block_table import BlockTable

RESERVE_POLICIES = ("max_tokens", "max_model_len")


class ContiguousBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 reserve: str = "max_model_len") -> None:
        if reserve not in RESERVE_POLICIES:
            raise ValueError(f"contiguous reserve must be one of {RESERVE_POLICIES}, got {reserve!r}")
        super().__init__(num_blocks, block_size, num_cpu_blocks=0, watermark=0.0)
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.reserved: dict[int, list[int]] = {}  # seq_id -> blocks of its run not yet mapped

    def reservation_tokens(self, seq: Sequence, max_tokens: int) -> int:
        """Slots a request reserves: everything it may ever hold (the last token is never cached)."""
        if self.reserve == "max_model_len":
            return self.max_model_len
        return max(seq.num_prompt_tokens, min(seq.num_prompt_tokens + max_tokens, self.max_model_len) - 1)

    def _run_length(self, group: SequenceGroup) -> int:
        seq = group.unfinished_seqs()[0]
        return blocks_for(self.reservation_tokens(seq, group.sampling_params.max_tokens), self.block_size)

    def _find_run(self, length: int) -> int | None:
        """First block of the first run of ``length`` free blocks (first fit), if any."""
        free = set(self.allocator.free_list)
        run_start, run = 0, 0
        for block in range(self.num_blocks):
            if block in free:
                if run == 0:
                    run_start = block
                run += 1
                if run == length:
                    return run_start
            else:
                run = 0
        return None

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        assert len(group.unfinished_seqs()) == 1, "the contiguous allocator serves one sequence a request"
        length = self._run_length(group)
        if length > self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self._find_run(length) is not None else AllocStatus.LATER

    def blocked_by_fragmentation(self, group: SequenceGroup) -> bool:
        """Enough blocks are free in total, but no run is long enough: external fragmentation."""
        length = self._run_length(group)
        return self.num_free_blocks >= length and self._find_run(length) is None

    def allocate(self, group: SequenceGroup) -> None:
        (seq,) = group.unfinished_seqs()
        length = self._run_length(group)
        start = self._find_run(length)
        assert start is not None, "allocate() without can_allocate()"
        for block in range(start, start + length):
            self.allocator.take(block)
        self.tables[seq.seq_id] = BlockTable(self.block_size)
        self.reserved[seq.seq_id] = list(range(start, start + length))
        self._grow(seq, seq.num_tokens)

    def _grow(self, seq: Sequence, num_slots: int) -> None:
        """Map the next slots from the request's own run: no allocation after admission."""
        table, run = self.tables[seq.seq_id], self.reserved[seq.seq_id]
        while table.num_tokens < num_slots:
            if table.needs_new_block():
                assert run, f"sequence {seq.seq_id} outgrew its reservation"
                table.append_block(run.pop(0))
            table.add_token()

    def num_new_blocks(self, seqs: list[Sequence], num_lookahead: int = 0) -> int:
        return 0  # growth comes out of the reservation

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        for block in self.reserved.pop(seq.seq_id, []):
            self.allocator.free(block)

    def reserved_blocks(self, seq: Sequence) -> list[int]:
        return self.reserved.get(seq.seq_id, [])

    def swap_out(self, group: SequenceGroup, max_blocks: int | None = None) -> list[tuple[int, int]]:
        raise RuntimeError("the contiguous allocator never preempts: growth is reserved up front")

    def check_invariants(self, seqs: list[Sequence] | None = None) -> None:
        self.allocator.check_invariants()
        held = [b for t in self.tables.values() for b in t.block_ids] + [b for r in self.reserved.values() for b in r]
        assert len(held) == len(set(held)), "a block is in two runs"
        assert sorted(held) == sorted(b for b in range(self.num_blocks) if self.allocator.ref_counts[b] > 0)
        for seq_id, table in self.tables.items():
            run = table.block_ids + self.reserved[seq_id]
            assert run == list(range(run[0], run[0] + len(run))), f"sequence {seq_id}'s run is not contiguous"
