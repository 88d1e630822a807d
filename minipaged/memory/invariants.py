"""The block manager's audit: every invariant of its books, checked from scratch.

The OS idea is fsck: walk every structure and check that the counts agree, the reference count
of each frame against the page-table entries that hold it, in each pool (device and swap); the
page cache's two maps against each other; and, for the sequences given, that each has a slot for
every token it cached, that its sliding window never freed a block its next query reads, and that
a named block holds exactly the tokens its name says. Called by the tests after every step and
operation; it never changes anything.
"""

from __future__ import annotations


def check_block_manager(bm, seqs: list | None = None) -> None:
    """Audit ``bm``, a BlockManager (passed in: this module sits below it), and the live sequences
    ``seqs``. In each pool: ref count == number of table entries holding the block (an entry's
    present bit says which pool); free blocks are held by none. Tables may mix pools."""
    for table in bm.tables.values():
        table.check_invariants()
    for pool, present in ((bm.allocator, True), (bm.cpu_allocator, False)):
        pool.check_invariants()
        holders = [0] * pool.num_blocks
        for table in bm.tables.values():
            for _, block_id, here in table.mapped():
                if here == present:
                    holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert count == pool.ref_counts[block_id], (
                f"{pool.name} block {block_id}: {count} table entries hold it but its ref count is "
                f"{pool.ref_counts[block_id]}")
    if bm.cache is not None:
        assert set(bm.cache.block_of.values()) == set(bm.cache.name_of)
        assert all(bm.cache.block_of[n] == b for b, n in bm.cache.name_of.items())
    for seq in seqs or []:
        table = bm.tables.get(seq.seq_id)
        if table is None:
            continue
        assert table.num_tokens >= seq.num_computed_tokens, (
            f"sequence {seq.seq_id} has {seq.num_computed_tokens} cached tokens but "
            f"only {table.num_tokens} slots")
        # a window never frees a block its next query still reads
        first_read = max(seq.num_computed_tokens - bm.sliding_window + 1, 0) if bm.sliding_window else 0
        assert table.num_slid_out <= first_read // bm.block_size, (
            f"sequence {seq.seq_id}: a block its window still reads slid out")
        if bm.cache is not None and table.resident:
            size, tokens = bm.block_size, seq.token_ids
            for i, block, _ in table.mapped():          # a named block holds exactly its tokens
                if block in bm.cache.name_of and (i + 1) * size <= seq.num_computed_tokens:
                    assert bm.cache.tokens_of[block] == tuple(tokens[i * size:(i + 1) * size]), (
                        f"block {block} is cached under other tokens than sequence {seq.seq_id} holds")
