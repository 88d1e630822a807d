"""memory: the virtual-memory manager of the KV cache.

Frames, page tables and the page cache, as an operating system keeps them. Pure
bookkeeping: the standard library and numpy only, no model, no kernels, no GPU
library, so every invariant is property-tested on a CPU (tests/test_block_manager.py).
It never touches KV data: it returns plans (copy, swap) that the engine executes.

    block_allocator.py       the frame allocator: a hot-first free list and reference counts (device pool, swap pool)
    block_table.py           the page table of one sequence: logical block -> physical block, fill counts,
                             entries unmapped as a sliding window passes them
    block_manager.py         the virtual-memory manager: allocate, append slots (copy-on-write), fork,
                             swap out / in, release what a sliding window passed, free
    invariants.py            the audit (fsck): every invariant of the block manager's books, for the tests
    prefix_cache.py          the page cache: full blocks named by a chain hash, LRU eviction
    contiguous_allocator.py  memory without paging: the "traditional" baseline that reserves one run per request
    fragmentation.py         where the slots go: used / reserved / internal / external accounting

It sits below the scheduler (scheduler/), which decides who gets memory; it reads the
process descriptors (minipaged/sequence.py) and nothing above them.
"""
