"""Property tests of the memory manager: BlockAllocator, BlockTable, BlockManager.

A hypothesis state machine plays processes arriving (allocate), growing one
token at a time (append_slots), speculating (slots for draft tokens, then a
rollback past the rejected ones) and exiting (free) in random orders, and checks
the block manager's invariants (docs/architecture.md) after every operation.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged.memory.block_allocator import BlockAllocator
from minipaged.memory.block_manager import AllocStatus, BlockManager, blocks_for
from minipaged.memory.block_table import BlockTable
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup


def make_group(seq_id: int, prompt_len: int) -> SequenceGroup:
    return SequenceGroup(str(seq_id), [Sequence(seq_id, list(range(prompt_len)))], SamplingParams())


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.manager = BlockManager(num_blocks, block_size, watermark=0.0)
        self.live: dict[int, Sequence] = {}
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 70))
    def allocate(self, prompt_len):
        group = make_group(self.next_id, prompt_len)
        self.next_id += 1
        status = self.manager.can_allocate(group)
        needed = blocks_for(prompt_len, self.manager.block_size)
        if needed > self.manager.num_blocks:
            assert status == AllocStatus.NEVER
        elif needed <= self.manager.num_free_blocks:
            assert status == AllocStatus.OK
            free_before = self.manager.num_free_blocks
            self.manager.allocate(group)
            assert self.manager.num_free_blocks == free_before - needed
            self.live[group.seqs[0].seq_id] = group.seqs[0]
        else:
            assert status == AllocStatus.LATER

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append_token(self, data):
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        seq.output_token_ids.append(7)       # a decode step produced one more token to cache
        group = SequenceGroup("g", [seq], SamplingParams())
        if self.manager.can_append_slots([seq]):
            table = self.manager.tables[seq.seq_id]
            grows = table.needs_new_block()
            free_before = self.manager.num_free_blocks
            self.manager.append_slots(seq)
            assert self.manager.num_free_blocks == free_before - grows
        else:
            assert self.manager.num_free_blocks == 0
            seq.output_token_ids.pop()       # the step could not run; nothing changed

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 8))
    def speculate(self, data, k):
        """A decode with k draft tokens: slots for the newest token and the k drafts, then a
        verdict keeps some of the drafts and the table rolls back to the tokens that stood."""
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        m = self.manager
        seq.output_token_ids.append(7)       # the newest token
        if not m.can_append_slots([seq], k):
            seq.output_token_ids.pop()       # no room to speculate this step: nothing changed
            return
        used = m.num_used_blocks
        m.append_slots(seq, k)
        assert m.tables[seq.seq_id].num_tokens == seq.num_tokens + k
        assert m.num_used_blocks - used == blocks_for(seq.num_tokens + k, m.block_size) - blocks_for(
            seq.num_tokens - 1, m.block_size)
        stood = data.draw(st.integers(0, k))
        seq.output_token_ids += [8] * stood  # the drafts that stood join the sequence
        mapped = m.num_used_blocks
        m.rollback(seq, seq.num_tokens)      # the rejected ones' slots are unmapped at once
        assert mapped - m.num_used_blocks == (blocks_for(seq.num_tokens + k - stood, m.block_size)
                                              - blocks_for(seq.num_tokens, m.block_size))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.manager.free(seq)
        self.manager.free(seq)               # freeing twice is harmless (the table is gone)

    @invariant()
    def invariants(self):
        m = self.manager
        m.check_invariants(list(self.live.values()))
        for seq_id, seq in self.live.items():
            table = m.tables[seq_id]
            assert table.num_tokens == seq.num_tokens                  # fill counts sum to length
            assert len(table) == blocks_for(seq.num_tokens, m.block_size)
        held = sum(len(m.tables[s]) for s in self.live)
        assert m.num_used_blocks == held                               # nothing leaked
        assert m.num_free_blocks + m.num_used_blocks == m.num_blocks
        assert set(m.tables) == set(self.live)

    def teardown(self):
        for seq in self.live.values():
            self.manager.free(seq)
        assert self.manager.num_free_blocks == self.manager.num_blocks  # everything came back
        self.manager.check_invariants()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_allocator_refcounts_and_double_free():
    pool = BlockAllocator(3)
    a = pool.allocate()
    pool.incref(a)
    pool.free(a)
    assert pool.num_free == 2            # still held once
    pool.free(a)
    assert pool.num_free == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a)


def test_allocator_reuses_the_hottest_free_block_first():
    pool = BlockAllocator(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2)        # untouched blocks in id order
    pool.free(b)
    pool.free(a)
    assert list(pool.free_list) == [a, b, 3]
    assert pool.allocate() == a          # the last freed goes out first (hot-first)
    assert pool.allocate() == b
    assert pool.allocate() == 3          # then the untouched ones
    pool.check_invariants()


def test_a_finished_table_is_handed_out_again_in_its_own_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    group = make_group(0, 10)
    bm.allocate(group)
    table = bm.block_table(group.seqs[0])
    bm.free(group.seqs[0])
    assert list(bm.allocator.free_list)[:len(table)] == table


def test_block_table_slots_follow_the_table():
    table = BlockTable(block_size=4)
    for block in (7, 2, 9):
        table.append_block(block)
        for _ in range(4 if block != 9 else 1):
            table.add_token()
    assert table.fills == [4, 4, 1] and table.num_tokens == 9
    assert [table.slot(p) for p in (0, 3, 4, 8)] == [28, 31, 8, 36]
    table.check_invariants(expected_tokens=9)


def test_watermark_keeps_blocks_for_running_sequences():
    manager = BlockManager(num_blocks=100, block_size=1, watermark=0.05)
    assert manager.can_allocate(make_group(0, 95)) == AllocStatus.OK
    assert manager.can_allocate(make_group(1, 96)) == AllocStatus.NEVER
    manager.allocate(make_group(2, 10))
    assert manager.can_allocate(make_group(3, 86)) == AllocStatus.LATER


# ---------------------------------------------------------------- sharing: fork, CoW, prefix cache


class SharingMachine(RuleBasedStateMachine):
    """Forks, copy-on-write, pruning and prefix-cache hits against a shadow copy of the KV pool.

    ``memory[block][offset]`` records which token each slot holds; every write and every
    copy plan is applied to it. After each operation every sequence must read its own
    tokens through its table (a write by one never changes what another reads), every
    cached name must point at a block holding exactly its tokens, and the books balance.
    """

    @initialize(num_blocks=st.integers(4, 48), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans(), window=st.sampled_from([0, 0, 1, 3, 6]))
    def setup(self, num_blocks, block_size, caching, window):
        # window > 0: a sliding-window model; blocks slide out as the sequences grow
        self.manager = BlockManager(num_blocks, block_size, watermark=0.0, enable_prefix_caching=caching,
                                    sliding_window=window)
        self.memory = {b: [None] * block_size for b in range(num_blocks)}
        self.live: dict[int, Sequence] = {}
        self.next_id = 0

    def _write(self, seq: Sequence, first: int) -> None:
        """Write the KV of positions first.. of seq (as a step would) after CoW copies."""
        table = self.manager.tables[seq.seq_id]
        for pos in range(first, seq.num_tokens):
            block, off = divmod(pos, self.manager.block_size)
            self.memory[table.block_ids[block]][off] = seq.token_ids[pos]
        seq.num_computed_tokens = seq.num_tokens

    def _copy(self, plan):
        for src, dst in plan:
            self.memory[dst] = list(self.memory[src])

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=24))
    def admit(self, prompt):
        """A request arrives; with a small alphabet, prompts often share prefixes."""
        seq = Sequence(self.next_id, list(prompt))
        self.next_id += 1
        group = SequenceGroup(str(seq.seq_id), [seq], SamplingParams())
        if self.manager.can_allocate(group) != AllocStatus.OK:
            return
        self.manager.allocate(group)                    # prefix hits set num_computed_tokens
        first = seq.num_computed_tokens
        self.manager.cache_full_blocks(seq, seq.num_tokens)
        self._write(seq, first)
        self.live[seq.seq_id] = seq

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = Sequence(self.next_id, list(parent.prompt_token_ids), list(parent.output_token_ids),
                         num_computed_tokens=parent.num_computed_tokens)
        self.next_id += 1
        self.manager.fork(parent, child)
        self.live[child.seq_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        seq.output_token_ids.append(token)              # sampled last step; written now
        group = SequenceGroup("g", [seq], SamplingParams())
        self.manager.release_slid_out(seq)              # as the scheduler does before each step
        if not self.manager.can_append_slots([seq]):
            seq.output_token_ids.pop()
            return
        self._copy(self.manager.append_slots(seq))
        self.manager.cache_full_blocks(seq, seq.num_tokens)
        self._write(seq, seq.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def slide(self, data):
        """A step begins: the blocks wholly before the window go (named ones to the cache's LRU)."""
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        m = self.manager
        table = m.tables[seq.seq_id]
        before, used = table.num_slid_out, m.num_used_blocks
        released = m.release_slid_out(seq)
        assert table.num_slid_out == before + released
        if m.sliding_window:
            assert table.num_slid_out == max(seq.num_computed_tokens - m.sliding_window + 1, 0) // m.block_size
        else:
            assert released == 0
        assert m.num_used_blocks <= used

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prune(self, data):
        self.manager.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @invariant()
    def each_reads_its_own_tokens(self):
        m = self.manager
        m.check_invariants(list(self.live.values()))
        for seq in self.live.values():
            table = m.tables[seq.seq_id]
            # what the next query reads: the window's positions (all of them without a window)
            first = max(seq.num_computed_tokens - m.sliding_window + 1, 0) if m.sliding_window else 0
            read = [self.memory[table.block_ids[p // m.block_size]][p % m.block_size]
                    for p in range(first, seq.num_computed_tokens)]
            assert read == seq.token_ids[first:seq.num_computed_tokens]
        if m.cache is not None:
            for block, tokens in m.cache.tokens_of.items():
                assert tuple(self.memory[block]) == tokens, "a cached name points at other tokens"
        holders = sum(len(t.mapped()) for t in m.tables.values())
        assert m.num_used_blocks <= holders                                  # sharing never costs
        assert m.num_mapped_blocks == holders

    def teardown(self):
        for seq in self.live.values():
            self.manager.free(seq)
        assert self.manager.num_free_blocks == self.manager.num_blocks
        self.manager.check_invariants()


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
