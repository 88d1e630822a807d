"""BlockManager: the memory manager, mapping every sequence's tokens to physical KV slots.

It plays the part of an OS virtual-memory manager: it owns the frame allocators
(the device pool and the CPU swap pool) and one page table (BlockTable) per
sequence, decides whether a new process fits (``can_allocate``), grows a
process's memory one page at a time (``append_slots``), gives back the pages a
speculation did not need (``rollback``), pages a whole process out to swap and
back (``swap_out`` / ``swap_in``) and releases everything when it exits (``free``). It never touches the KV data itself: swapping returns a
plan of (source block, destination block) pairs that the cache engine executes,
the way a kernel programs a DMA engine.

Demand paging: a swap-out may move only some of a sequence's blocks (``swap_out(group,
max_blocks=k)``, the tail first); each table entry's present bit says which pool its
block is in, and ``swap_in`` brings back exactly the entries that are out.

Sliding windows: with ``sliding_window`` w (every layer of the model slides), the blocks a
sequence will never read again (wholly before its next query's position - w + 1) are released
as it runs (``release_slid_out``): back to the free list, or, named by the prefix cache, to its
LRU where a later identical prompt can still hit them. A long generation then holds about
w / block_size + 2 blocks, not one per block_size tokens.
"""

from __future__ import annotations

import enum

from .block_allocator import BlockAllocator
from .block_table import SLID_OUT, BlockTable
from .invariants import check_block_manager
from .prefix_cache import PrefixCache, chain_hash, prompt_block_hashes
from ..sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = "ok"        # fits now
    LATER = "later"  # fits once other requests free their blocks
    NEVER = "never"  # larger than the pool minus the watermark: can never be admitted


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil division


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False, sliding_window: int = 0) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window   # 0: some layer reads every token (nothing slides out)
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.allocator = BlockAllocator(num_blocks, name="device", cache=self.cache)
        self.cpu_allocator = BlockAllocator(num_cpu_blocks, name="cpu")  # the swap pool
        # Keep a few blocks free when admitting new prompts, so running
        # sequences can still grow right after an admission (no thrashing).
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[int, BlockTable] = {}  # seq_id -> its page table (device and/or CPU blocks)

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

    @property
    def num_mapped_blocks(self) -> int:
        """Device blocks all page tables map, shared ones counted per holder: what the
        same sequences would occupy if nothing were shared."""
        return sum(t.num_present for t in self.tables.values())

    def is_resident(self, seq: Sequence | int) -> bool:
        """Has the sequence a table with every entry present (so it can run)?"""
        table = self.tables.get(seq if isinstance(seq, int) else seq.seq_id)
        return table is not None and table.resident

    @property
    def on_cpu(self) -> set[int]:
        """The sequences with at least one block paged out (swapped, wholly or partly)."""
        return {sid for sid, t in self.tables.items() if not t.resident}

    def pool(self, present: bool) -> BlockAllocator:
        """The allocator a table entry's block belongs to: device if present, else the swap pool."""
        return self.allocator if present else self.cpu_allocator

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id].block_ids

    def slot(self, seq: Sequence, position: int) -> int:
        return self.tables[seq.seq_id].slot(position)

    def _blocks_of(self, group: SequenceGroup, present: bool | None = None) -> list[tuple[bool, int]]:
        """The distinct (present, physical block) entries the group's live sequences hold
        (shared ones once), or only those in one pool."""
        seen: dict[tuple[bool, int], None] = {}
        for seq in group.unfinished_seqs():
            for _, block, here in self.tables[seq.seq_id].mapped():
                if present is None or here == present:
                    seen[(here, block)] = None
        return list(seen)

    def num_new_blocks(self, seqs: list[Sequence], num_lookahead: int = 0) -> int:
        """Blocks these sequences need to slot their newest token and ``num_lookahead`` more
        (a copy-on-write copy counts as one)."""
        needed = 0
        for seq in seqs:
            table = self.tables[seq.seq_id]
            needed += max(blocks_for(seq.num_tokens + num_lookahead, self.block_size) - len(table), 0)
            needed += self._shared_write_block(seq) is not None
        return needed

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the table of a shared block this sequence's next write lands in, if any."""
        table = self.tables[seq.seq_id]
        index = seq.num_computed_tokens // self.block_size   # the first position written now
        # sharing survives swaps: the ref count is the one of the pool the block is in
        if index < len(table) and self.pool(table.present[index]).ref_counts[table.block_ids[index]] > 1:
            return index
        return None

    # ------------------------------------------------------------------ admission
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Could every sequence of ``group`` get slots for all its tokens?"""
        seqs = group.unfinished_seqs()
        if group.in_prompt_phase():
            seqs = seqs[:1]   # the samples will share one copy of the prompt
        # cached blocks already held by someone cost nothing more
        hits = self._takes_cache_hits(group)
        needed = sum(blocks_for(s.num_tokens, self.block_size) - (self._cached_in_use(s) if hits else 0)
                     for s in seqs)
        if needed > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_blocks - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    @staticmethod
    def _takes_cache_hits(group: SequenceGroup) -> bool:
        """A request that asked for prompt_logprobs needs logits at every prompt position,
        and a cached block brings its K/V but no logits: it computes its whole prompt (as
        vLLM V1 does). The blocks it fills are still named, for others to hit."""
        return group.sampling_params.prompt_logprobs is None

    def _cache_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block, name) of each block of the longest cached prefix of the sequence's tokens.

        Only blocks that end before its last token count: that token is always
        computed again, so the step has logits to sample from.
        """
        if self.cache is None:
            return []
        size = self.block_size
        tokens = seq.token_ids
        hits = []
        for i, name in enumerate(prompt_block_hashes(tokens, size, (len(tokens) - 1) // size, seq.cache_salt)):
            block = self.cache.lookup(name, tuple(tokens[i * size:(i + 1) * size]))
            if block is None:
                break
            hits.append((block, name))
        return hits

    def _cached_in_use(self, seq: Sequence) -> int:
        return sum(1 for b, _ in self._cache_hits(seq) if self.allocator.ref_counts[b] > 0)

    def allocate(self, group: SequenceGroup) -> None:
        """Give each sequence of a newly admitted group a page table covering its tokens.

        The samples of a fresh group share one copy of the prompt: the first gets the
        blocks, the others fork its table (fork() of a process: same frames, ref count up).
        With prefix caching the table starts with every block of the longest cached
        prefix (shared, like a library page already in memory), and those tokens count
        as computed.
        """
        seqs = group.unfinished_seqs()
        share = group.in_prompt_phase()
        use_cache = self.cache is not None and self._takes_cache_hits(group)
        for seq in seqs[:1] if share else seqs:
            assert seq.seq_id not in self.tables, f"sequence {seq.seq_id} is already allocated"
            table = self.tables[seq.seq_id] = BlockTable(self.block_size)
            hits = self._cache_hits(seq) if use_cache else []
            for block, name in hits:
                if self.allocator.ref_counts[block] == 0:
                    self.allocator.revive(block)
                else:
                    self.allocator.incref(block)
                table.append_block(block)
                table.fills[-1] = self.block_size
                table.names.append(name)
            if use_cache:
                self.cache.queries += seq.num_tokens
                self.cache.hits += len(hits) * self.block_size
                seq.num_computed_tokens = len(hits) * self.block_size
            if group.num_cached_tokens is None:   # what its first admission found cached
                group.num_cached_tokens = len(hits) * self.block_size
            self._grow(seq, seq.num_tokens)
        if share:
            for seq in seqs[1:]:
                self.fork(seqs[0], seq)
                seq.num_computed_tokens = seqs[0].num_computed_tokens

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Name the blocks the sequence's first ``num_tokens`` tokens fill, so others can hit them.

        Called when a step is scheduled with the tokens it will have computed: a request
        admitted later in the same step may then share them, as its attention reads
        them after this step's KV writes (every layer writes before it attends).
        """
        if self.cache is None or not self.is_resident(seq):
            return
        table = self.tables[seq.seq_id]
        full = min(num_tokens // self.block_size, len(table))
        assert SLID_OUT not in table.block_ids[len(table.names):full], "a block slid out before it was named"
        if len(table.names) >= full:
            return
        tokens = seq.token_ids
        while len(table.names) < full:
            i = len(table.names)
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            name = chain_hash(table.names[-1] if table.names else None, block_tokens, seq.cache_salt)
            table.names.append(name)
            self.cache.register(table.block_ids[i], name, block_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child's table points at the parent's blocks; each gains a holder."""
        assert child.seq_id not in self.tables, f"sequence {child.seq_id} is already allocated"
        self.tables[child.seq_id] = self.tables[parent.seq_id].copy()
        for _, block, present in self.tables[child.seq_id].mapped():
            self.pool(present).incref(block)

    # ------------------------------------------------------------------ growth
    def can_append_slots(self, seqs: list[Sequence], num_lookahead: int = 0) -> bool:
        """Is there a free block for each of these decoding sequences that needs one this step?"""
        return self.num_new_blocks(seqs, num_lookahead) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_lookahead: int = 0) -> list[tuple[int, int]]:
        """Map the slots this step writes: the newest token, plus ``num_lookahead`` more
        for a multi-step decode (a new block whenever the last one is full).

        Copy-on-write: if the write lands in a block other sequences still hold (a forked
        sample's partly filled prompt block), this sequence gets a private copy first.
        Returns the copy plan [(shared block, new block)] for the cache engine.
        """
        copies = []
        index = self._shared_write_block(seq)
        if index is not None:
            table = self.tables[seq.seq_id]
            shared = table.block_ids[index]
            table.block_ids[index] = self.allocator.allocate()
            self.allocator.free(shared)            # one holder fewer; the others keep it
            copies.append((shared, table.block_ids[index]))
        self._grow(seq, seq.num_tokens + num_lookahead)
        return copies

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Unmap every slot past the sequence's first ``num_tokens`` (speculative decoding: the
        positions of drafts the model rejected). The last block's fill count drops, and a block
        that held only rejected positions goes back to the free list at once. Those blocks were
        mapped this step for the lookahead, so no other table holds them and no prefix-cache
        name covers them (names cover computed tokens only)."""
        table = self.tables[seq.seq_id]
        assert len(table.names) * self.block_size <= num_tokens, "a rollback into named (cached) blocks"
        assert table.resident, "a rollback of a sequence that is paged out"
        for block_id in table.truncate(num_tokens):
            self.allocator.free(block_id)

    def release_slid_out(self, seq: Sequence) -> int:
        """Sliding windows: free the blocks the sequence will never read again, those wholly before
        its next query's position (its computed tokens) - sliding_window + 1. Each holder releases
        its own entry; a named block goes to the prefix cache's LRU. Returns how many entries."""
        table = self.tables.get(seq.seq_id)
        if not self.sliding_window or table is None:
            return 0
        self.cache_full_blocks(seq, seq.num_computed_tokens)   # named first: a later prompt may hit them
        released = table.unmap_before(max(seq.num_computed_tokens - self.sliding_window + 1, 0))
        for block, present in released:
            self.pool(present).free(block)
        return len(released)

    def _grow(self, seq: Sequence, num_slots: int) -> None:
        table = self.tables[seq.seq_id]
        while table.num_tokens < num_slots:
            if table.needs_new_block():
                table.append_block(self.allocator.allocate())
            table.add_token()

    # ------------------------------------------------------------------ swapping (paging)
    def movable_blocks(self, group: SequenceGroup) -> list[int]:
        """The group's present blocks no other request holds, in the order a partial swap-out
        takes them: each sequence's tail first (the newest tokens, last to be read again by
        a prefix hit and first to be rewritten), latest logical block first. Paging out one
        of them frees a device block; a block shared with another request (a prefix-cache
        hit) would only be copied, so it stays."""
        holders: dict[int, int] = {}
        tails: list[tuple[int, int]] = []        # (-logical index, block): deepest first
        for seq in group.unfinished_seqs():
            for i, block, present in self.tables[seq.seq_id].mapped():
                if present:
                    holders[block] = holders.get(block, 0) + 1
                    tails.append((-i, block))
        order: dict[int, None] = {}
        for _, block in sorted(tails, key=lambda t: t[0]):
            if self.allocator.ref_counts[block] == holders[block]:
                order[block] = None
        return list(order)

    def can_swap_out(self, group: SequenceGroup, max_blocks: int | None = None) -> bool:
        """Room in the swap pool for the blocks ``swap_out`` would move."""
        moving = len(self._blocks_of(group, present=True)) if max_blocks is None else \
            min(max_blocks, len(self.movable_blocks(group)))
        return moving <= self.cpu_allocator.num_free

    def swap_out(self, group: SequenceGroup, max_blocks: int | None = None) -> list[tuple[int, int]]:
        """Page the group out: CPU blocks replace its device blocks in every table.

        ``max_blocks=None``: every present block (a whole swap; a block shared with another
        request is copied, the other keeps the device copy). ``max_blocks=k``: only the first k
        of ``movable_blocks`` (demand paging: the tail first); the rest stay resident.
        Returns the copy plan [(device block, CPU block)]; a block shared by several
        sequences is copied once and stays shared on the CPU side.
        """
        chosen = None if max_blocks is None else set(self.movable_blocks(group)[:max_blocks])
        return self._move(group, to_cpu=True, only=chosen)

    def resident_blocks(self, group: SequenceGroup) -> set[int]:
        """The device blocks the group's live sequences hold (shared ones included)."""
        return {block for _, block in self._blocks_of(group, present=True)}

    def missing_blocks(self, group: SequenceGroup) -> int:
        """Distinct blocks of the group that are paged out (what a swap-in copies back)."""
        return len(self._blocks_of(group, present=False))

    def can_swap_in(self, group: SequenceGroup, num_lookahead: int = 0) -> bool:
        """Room for its paged-out blocks and their next growth, leaving the watermark free."""
        needed = self.missing_blocks(group) + self.num_new_blocks(group.unfinished_seqs(), num_lookahead)
        return self.num_free_blocks - needed >= self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Page back in exactly the entries that are out; returns the copy plan [(CPU block, device block)]."""
        return self._move(group, to_cpu=False)

    def _move(self, group: SequenceGroup, to_cpu: bool, only: set[int] | None = None) -> list[tuple[int, int]]:
        """Move the group's entries that are in the source pool (``only``: just these source
        blocks) to the other pool, flipping their present bits."""
        src, dst = (self.allocator, self.cpu_allocator) if to_cpu else (self.cpu_allocator, self.allocator)
        mapping: dict[int, int] = {}  # source block -> destination block
        for seq in group.unfinished_seqs():
            table = self.tables[seq.seq_id]
            for i, block, here in table.mapped():
                if here != to_cpu or (only is not None and block not in only):
                    continue              # already in the destination pool, or not chosen
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                table.block_ids[i] = mapping[block]
                table.present[i] = not to_cpu
                src.free(block)
        return list(mapping.items())

    # ------------------------------------------------------------------ accounting hooks
    def reserved_blocks(self, seq: Sequence) -> list[int]:
        """Blocks held for the sequence but not yet in its table (paging reserves none)."""
        return []

    def blocked_by_fragmentation(self, group: SequenceGroup) -> bool:
        """Would the group fit in the free blocks but for their layout? Never, with paging."""
        return False

    # ------------------------------------------------------------------ release
    def free(self, seq: Sequence) -> None:
        """The process exits: drop its page table and release each frame once, the last
        first: the hot-first free list then hands them out again in the table's order, and
        with prefix caching a prompt's tail (the part least likely shared) is evicted first."""
        table = self.tables.pop(seq.seq_id, None)
        if table is None:
            return
        for _, block_id, present in reversed(table.mapped()):
            self.pool(present).free(block_id)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, seqs: list[Sequence] | None = None) -> None:
        """Audit the books (``memory/invariants.py``): ref counts against table entries in each
        pool, the prefix cache's names, each live sequence's slots, window and cached tokens."""
        check_block_manager(self, seqs)
