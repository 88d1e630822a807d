"""BlockTable: the page table of one sequence.

Logical block i of a sequence (its tokens ``i*block_size .. (i+1)*block_size-1``)
lives in physical block ``block_ids[i]``, anywhere in the pool. ``fills[i]`` says
how many of its slots hold tokens: every block but the last is full, exactly as
a process's pages are all in use except the tail of its heap.

``present[i]`` is the page-table entry's present bit: True when ``block_ids[i]`` is a
block of the device pool, False when the block was paged out and ``block_ids[i]`` is
its block in the CPU swap pool. A table may mix both (demand paging); a sequence
runs only when every entry is present.

A sliding-window model never reads a token again once it is further back than every layer's
window, so the leading blocks that hold only such tokens are unmapped as the window slides
(``unmap_before``): their entries become ``SLID_OUT`` (-1), the way an OS unmaps pages a
process will never touch again. The logical numbering of the entries after them is unchanged.
"""

from __future__ import annotations

SLID_OUT = -1   # the block id of an entry whose block slid out of the window and went back to the pool


class BlockTable:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_ids: list[int] = []  # (num_logical_blocks,) physical block of each logical block
        self.fills: list[int] = []      # (num_logical_blocks,) slots in use in each block
        self.names: list[int] = []      # prefix caching: chain hashes of the leading full, computed blocks
        self.present: list[bool] = []   # (num_logical_blocks,) True: a device block; False: paged out (a CPU block)

    @property
    def num_tokens(self) -> int:
        """Token slots this table maps (the sequence's cached + about-to-be-written tokens)."""
        if not self.fills:
            return 0
        return (len(self.fills) - 1) * self.block_size + self.fills[-1]

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def resident(self) -> bool:
        """Every entry present: the sequence can run."""
        return all(self.present)

    @property
    def num_present(self) -> int:
        """Device blocks the table maps (entries that slid out map none)."""
        return sum(1 for block, here in zip(self.block_ids, self.present) if here and block != SLID_OUT)

    @property
    def num_slid_out(self) -> int:
        """Leading entries unmapped because the window slid past them."""
        count = 0
        while count < len(self.block_ids) and self.block_ids[count] == SLID_OUT:
            count += 1
        return count

    def mapped(self):
        """(index, block, present) of every entry that maps a block (not slid out)."""
        return [(i, b, here) for i, (b, here) in enumerate(zip(self.block_ids, self.present)) if b != SLID_OUT]

    def unmap_before(self, position: int) -> list[tuple[int, bool]]:
        """Unmap the entries of the blocks wholly before ``position`` (a sliding window's first
        position read): they become SLID_OUT. Returns their (block, present) for the caller to free."""
        released = []
        for i in range(self.num_slid_out, min(position // self.block_size, len(self.block_ids))):
            released.append((self.block_ids[i], self.present[i]))
            self.block_ids[i] = SLID_OUT
            self.present[i] = True          # an unmapped entry keeps nothing out of the device
        return released

    def needs_new_block(self) -> bool:
        """The next token has no slot yet: the table is empty or its last block is full."""
        return not self.fills or self.fills[-1] == self.block_size

    def append_block(self, block_id: int) -> None:
        """Map the next logical block to a device block (a new page is always present)."""
        self.block_ids.append(block_id)
        self.fills.append(0)
        self.present.append(True)

    def add_token(self) -> None:
        """Claim the next slot of the last block (the caller ensured there is one)."""
        assert self.fills and self.fills[-1] < self.block_size, "no free slot in the last block"
        self.fills[-1] += 1

    def truncate(self, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` slots: the fill counts drop, and blocks left empty leave
        the table (returned, last first, for the caller to free)."""
        removed = []
        while self.num_tokens > num_tokens:
            excess = self.num_tokens - num_tokens
            if self.fills[-1] <= excess:
                self.fills.pop()
                self.present.pop()
                removed.append(self.block_ids.pop())
            else:
                self.fills[-1] -= excess
        return removed

    def copy(self) -> "BlockTable":
        """A second table mapping the same physical blocks (the caller counts the new holders)."""
        twin = BlockTable(self.block_size)
        twin.block_ids = list(self.block_ids)
        twin.fills = list(self.fills)
        twin.names = list(self.names)
        twin.present = list(self.present)
        return twin

    def slot(self, position: int) -> int:
        """Physical slot of a token position: frame * page_size + offset (of a present block)."""
        block_index, offset = divmod(position, self.block_size)
        assert self.present[block_index], f"position {position} is in a block that is paged out"
        assert self.block_ids[block_index] != SLID_OUT, f"position {position} slid out of the window"
        return self.block_ids[block_index] * self.block_size + offset

    def check_invariants(self, expected_tokens: int | None = None) -> None:
        assert len(self.block_ids) == len(self.fills) == len(self.present)
        assert all(f == self.block_size for f in self.fills[:-1]), "a block before the last is not full"
        assert not self.fills or 0 < self.fills[-1] <= self.block_size, "the last block is empty"
        assert sum(self.fills) == self.num_tokens
        slid = self.num_slid_out
        assert SLID_OUT not in self.block_ids[slid:], "a slid-out entry after a mapped one"
        assert all(self.present[:slid]), "a slid-out entry marked paged out"
        if expected_tokens is not None:
            assert self.num_tokens == expected_tokens, (
                f"fill counts sum to {self.num_tokens}, sequence has {expected_tokens} slotted tokens")
