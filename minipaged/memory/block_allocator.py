"""BlockAllocator: the physical frame allocator of one memory pool.

Like an OS frame allocator it hands out fixed-size frames (KV blocks) from a
free list and takes them back when the last user lets go. The list is hot-first, as
Linux's per-CPU page lists are: a freed frame goes to the front and is the next one
handed out, because its memory is likely still in the cache (and, on the CPU, already
mapped: a frame never touched before costs a page fault on its first write). Reference counts make
sharing possible: a block held by two block tables (forked samples, a cached
prefix) has ref count 2 and is freed only when both have released it.
"""

from __future__ import annotations

from collections import deque

from .prefix_cache import PrefixCache


class NoFreeBlocksError(RuntimeError):
    """The pool is exhausted: the caller should have checked ``num_free`` first."""


class BlockAllocator:
    """A hot-first free list + ref counts over the block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int, name: str = "device", cache: PrefixCache | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"a {name} pool cannot have {num_blocks} blocks")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks            # (num_blocks,) holders of each block
        # hot-first (LIFO): a freed block goes to the front and is handed out next;
        # untouched blocks come after, in id order
        self.free_list: deque[int] = deque(range(num_blocks))
        # With prefix caching, freed blocks that hold a named full block wait in the
        # cache's LRU queue instead, still free, until a hit revives them or need evicts them.
        self.cache = cache

    @property
    def num_free(self) -> int:
        return len(self.free_list) + (len(self.cache.evictable) if self.cache else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0 for an empty pool)."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self) -> int:
        """Take a free block (a plain one first, else evict the oldest cached one); ref count 1."""
        if self.free_list:
            block_id = self.free_list.popleft()
        elif self.cache and self.cache.evictable:
            block_id = self.cache.evict()
        else:
            raise NoFreeBlocksError(f"the {self.name} KV pool has no free block")
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_id: int) -> None:
        """Allocate one particular free block (the contiguous baseline needs runs).
        O(n) in the free list: only the baseline uses it."""
        assert self.ref_counts[block_id] == 0, f"{self.name} block {block_id} is not free"
        self.free_list.remove(block_id)
        self.ref_counts[block_id] = 1

    def revive(self, block_id: int) -> None:
        """A prefix-cache hit on a freed, parked block: it is held again."""
        assert self.ref_counts[block_id] == 0
        self.cache.revive(block_id)
        self.ref_counts[block_id] = 1

    def incref(self, block_id: int) -> None:
        """Another holder shares an allocated block (fork, prefix hit)."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} is free and cannot be shared"
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """One holder lets go; the block returns to the free list when none is left."""
        assert self.ref_counts[block_id] > 0, f"double free of {self.name} block {block_id}"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0 and not (self.cache and self.cache.park(block_id)):
            self.free_list.appendleft(block_id)

    def check_invariants(self) -> None:
        """Every block is free (ref 0, in exactly one free list once) or used (ref > 0, in none)."""
        queued = set(self.free_list)
        assert len(queued) == len(self.free_list), f"a {self.name} block is queued twice"
        if self.cache:
            parked = set(self.cache.evictable)
            assert not parked & queued, f"a {self.name} block is both free and parked in the cache"
            assert parked <= set(self.cache.name_of), "a parked block has no name"
            queued |= parked
        for block_id, refs in enumerate(self.ref_counts):
            assert refs >= 0, f"negative ref count on block {block_id}"
            assert (refs == 0) == (block_id in queued), (
                f"{self.name} block {block_id}: ref count {refs} but "
                f"{'in' if block_id in queued else 'not in'} the free list")
