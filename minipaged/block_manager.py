"""BlockManager: the memory manager, mapping every sequence's tokens to physical KV slots.

It plays the part of an OS virtual-memory manager: it owns the frame allocator
and one page table (BlockTable) per sequence, decides whether a new process
fits (``can_allocate``), grows a process's memory one page at a time
(``append_slots``) and releases everything when it exits (``free``).
It never touches the KV data itself; it only hands out addresses.
"""

from __future__ import annotations

import enum

from .block_allocator import BlockAllocator
from .block_table import BlockTable
from .sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = "ok"        # fits now
    LATER = "later"  # fits once other requests free their blocks
    NEVER = "never"  # larger than the pool minus the watermark: can never be admitted


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil division


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, name="device")
        # Keep a few blocks free when admitting new prompts, so running
        # sequences can still grow right after an admission (no thrashing).
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[int, BlockTable] = {}  # seq_id -> its page table

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id].block_ids

    def slot(self, seq: Sequence, position: int) -> int:
        return self.tables[seq.seq_id].slot(position)

    # ------------------------------------------------------------------ admission
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Could every sequence of ``group`` get slots for all its tokens?"""
        needed = sum(blocks_for(s.num_tokens, self.block_size) for s in group.unfinished_seqs())
        if needed > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_blocks - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Give each sequence of a newly admitted group a page table covering its tokens."""
        for seq in group.unfinished_seqs():
            assert seq.seq_id not in self.tables, f"sequence {seq.seq_id} is already allocated"
            self.tables[seq.seq_id] = BlockTable(self.block_size)
            self._grow(seq)

    # ------------------------------------------------------------------ growth
    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Is there a free block for every running sequence that needs a new one this step?"""
        needed = sum(1 for s in group.unfinished_seqs()
                     if self.tables[s.seq_id].num_tokens < s.num_tokens
                     and self.tables[s.seq_id].needs_new_block())
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Map the slot of the token this decode step writes (a new block if the last is full)."""
        self._grow(seq)

    def _grow(self, seq: Sequence) -> None:
        table = self.tables[seq.seq_id]
        while table.num_tokens < seq.num_tokens:
            if table.needs_new_block():
                table.append_block(self.allocator.allocate())
            table.add_token()

    # ------------------------------------------------------------------ release
    def free(self, seq: Sequence) -> None:
        """The process exits: drop its page table and release each frame once."""
        table = self.tables.pop(seq.seq_id, None)
        if table is None:
            return
        for block_id in table.block_ids:
            self.allocator.free(block_id)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, seqs: list[Sequence] | None = None) -> None:
        """Ref count == number of tables holding the block; free blocks are held by no table."""
        self.allocator.check_invariants()
        holders = [0] * self.num_blocks
        for table in self.tables.values():
            table.check_invariants()
            for block_id in table.block_ids:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert count == self.allocator.ref_counts[block_id], (
                f"block {block_id}: {count} tables hold it but its ref count is "
                f"{self.allocator.ref_counts[block_id]}")
        for seq in seqs or []:
            table = self.tables.get(seq.seq_id)
            if table is not None:
                assert table.num_tokens <= seq.num_tokens, (
                    f"sequence {seq.seq_id} maps {table.num_tokens} slots for {seq.num_tokens} tokens")
