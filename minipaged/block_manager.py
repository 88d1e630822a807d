"""BlockManager: the memory manager, mapping every sequence's tokens to physical KV slots.

It plays the part of an OS virtual-memory manager: it owns the frame allocators
(the device pool and the CPU swap pool) and one page table (BlockTable) per
sequence, decides whether a new process fits (``can_allocate``), grows a
process's memory one page at a time (``append_slots``), pages a whole process
out to swap and back (``swap_out`` / ``swap_in``) and releases everything when
it exits (``free``). It never touches the KV data itself: swapping returns a
plan of (source block, destination block) pairs that the cache engine executes,
the way a kernel programs a DMA engine.
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
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, name="device")
        self.cpu_allocator = BlockAllocator(num_cpu_blocks, name="cpu")  # the swap pool
        # Keep a few blocks free when admitting new prompts, so running
        # sequences can still grow right after an admission (no thrashing).
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[int, BlockTable] = {}  # seq_id -> its page table (device or CPU blocks)
        self.on_cpu: set[int] = set()            # seq_ids whose table points into the swap pool

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

    def _blocks_of(self, group: SequenceGroup) -> list[int]:
        """The distinct physical blocks the group's live sequences hold (shared ones once)."""
        seen: dict[int, None] = {}
        for seq in group.unfinished_seqs():
            for block in self.tables[seq.seq_id].block_ids:
                seen[block] = None
        return list(seen)

    def num_new_blocks(self, seqs: list[Sequence], num_lookahead: int = 0) -> int:
        """Blocks these sequences need to slot their newest token and ``num_lookahead`` more."""
        needed = 0
        for seq in seqs:
            table = self.tables[seq.seq_id]
            needed += max(blocks_for(seq.num_tokens + num_lookahead, self.block_size) - len(table), 0)
        return needed

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
            self._grow(seq, seq.num_tokens)

    # ------------------------------------------------------------------ growth
    def can_append_slots(self, group: SequenceGroup, num_lookahead: int = 0) -> bool:
        """Is there a free block for every running sequence that needs one this step?"""
        return self.num_new_blocks(group.unfinished_seqs(), num_lookahead) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Map the slots this step writes: the newest token, plus ``num_lookahead`` more
        for a multi-step decode (a new block whenever the last one is full)."""
        self._grow(seq, seq.num_tokens + num_lookahead)

    def _grow(self, seq: Sequence, num_slots: int) -> None:
        table = self.tables[seq.seq_id]
        while table.num_tokens < num_slots:
            if table.needs_new_block():
                table.append_block(self.allocator.allocate())
            table.add_token()

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._blocks_of(group)) <= self.cpu_allocator.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Page the group out: CPU blocks replace its device blocks in every table.

        Returns the copy plan [(device block, CPU block)]; a block shared by several
        sequences is copied once and stays shared on the CPU side.
        """
        return self._move(group, self.allocator, self.cpu_allocator, to_cpu=True)

    def can_swap_in(self, group: SequenceGroup, num_lookahead: int = 0) -> bool:
        """Room for its blocks and their next growth, leaving the watermark free."""
        needed = len(self._blocks_of(group)) + self.num_new_blocks(group.unfinished_seqs(), num_lookahead)
        return self.num_free_blocks - needed >= self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Page the group back in; returns the copy plan [(CPU block, device block)]."""
        return self._move(group, self.cpu_allocator, self.allocator, to_cpu=False)

    def _move(self, group: SequenceGroup, src: BlockAllocator, dst: BlockAllocator,
              to_cpu: bool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}  # source block -> destination block
        for seq in group.unfinished_seqs():
            table = self.tables[seq.seq_id]
            assert (seq.seq_id in self.on_cpu) != to_cpu, f"sequence {seq.seq_id} is already there"
            for i, block in enumerate(table.block_ids):
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                table.block_ids[i] = mapping[block]
                src.free(block)
            if to_cpu:
                self.on_cpu.add(seq.seq_id)
            else:
                self.on_cpu.discard(seq.seq_id)
        return list(mapping.items())

    # ------------------------------------------------------------------ release
    def free(self, seq: Sequence) -> None:
        """The process exits: drop its page table and release each frame once."""
        table = self.tables.pop(seq.seq_id, None)
        if table is None:
            return
        pool = self.cpu_allocator if seq.seq_id in self.on_cpu else self.allocator
        self.on_cpu.discard(seq.seq_id)
        for block_id in table.block_ids:
            pool.free(block_id)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, seqs: list[Sequence] | None = None) -> None:
        """In each pool: ref count == number of tables holding the block; free blocks are held by none."""
        for pool, on_cpu in ((self.allocator, False), (self.cpu_allocator, True)):
            pool.check_invariants()
            holders = [0] * pool.num_blocks
            for seq_id, table in self.tables.items():
                if (seq_id in self.on_cpu) == on_cpu:
                    table.check_invariants()
                    for block_id in table.block_ids:
                        holders[block_id] += 1
            for block_id, count in enumerate(holders):
                assert count == pool.ref_counts[block_id], (
                    f"{pool.name} block {block_id}: {count} tables hold it but its ref count is "
                    f"{pool.ref_counts[block_id]}")
        assert self.on_cpu <= set(self.tables), "a swapped-out sequence has no table"
        for seq in seqs or []:
            table = self.tables.get(seq.seq_id)
            if table is not None:
                assert table.num_tokens >= seq.num_computed_tokens, (
                    f"sequence {seq.seq_id} has {seq.num_computed_tokens} cached tokens but "
                    f"only {table.num_tokens} slots")
