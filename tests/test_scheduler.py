"""The scheduler on its own, driven by a fake model that appends one token per sampled sequence.

A hypothesis state machine plays random arrivals, prompt and output lengths, pool
and swap-space sizes, budgets, chunked prefill, preemption modes (demand paging
included: partly resident requests), multi-step decoding, speculative decodes and
aborts, and checks after every step: no block leaked or owned
twice in either pool, FCFS admission, budgets respected, and in the end every
request that was not aborted finished with exactly the tokens it asked for.
"""

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged.memory.block_manager import BlockManager, blocks_for
from minipaged.config import SchedulerConfig
from minipaged.sampling_params import SamplingParams
from minipaged.scheduler.scheduler import AUTO_RECOMPUTE_MAX_TOKENS, Scheduler, SchedulerOutput
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def fake_step(scheduler: Scheduler, max_model_len: int, draft=None, verdict=None):
    """What the engine does around the model: advance computed tokens, append, finish, free.

    With ``draft(seq)`` (the draft length a decoding sequence asks for) and ``verdict(k)`` (how
    many of k drafts stand), decodes speculate as the engine's do: draft tokens before the
    schedule, then the tokens that stood and one more appended, and the table rolled back."""
    manager = scheduler.block_manager
    if draft is not None:
        for group in scheduler.running:
            for seq in scheduler.decoding_seqs(group):
                room = min(group.sampling_params.max_tokens - seq.num_output_tokens - 1,
                           max_model_len - seq.num_tokens)
                seq.draft_token_ids = [1] * max(min(draft(seq), room), 0)
    plan = scheduler.schedule()
    items = plan.scheduled
    for sub_step in range(plan.num_steps):
        if sub_step:
            items = [dataclasses.replace(i, num_new_tokens=1) for i in items if not i.seq.is_finished()]
        for item in items:
            table = manager.tables[item.seq.seq_id]
            assert item.seq.num_computed_tokens + item.num_new_tokens <= table.num_tokens, "no slot"
            k = len(item.draft_token_ids)
            item.seq.num_computed_tokens += item.num_new_tokens - k
            for follower in item.followers:
                follower.num_computed_tokens = item.seq.num_computed_tokens
            if item.do_sample:
                stood = verdict(k) if k else 0
                for seq in [item.seq, *item.followers]:
                    for _ in range(1 + stood):           # the drafts that stood, then one more
                        seq.output_token_ids.append(1)
                        if (seq.num_output_tokens >= item.group.sampling_params.max_tokens
                                or seq.num_tokens >= max_model_len):
                            seq.status = SequenceStatus.FINISHED_LENGTH
                            break
                if k:
                    seq = item.seq
                    seq.num_computed_tokens = min(seq.num_computed_tokens + stood, seq.num_tokens - 1)
                    if not seq.is_finished():
                        manager.rollback(seq, seq.num_computed_tokens)
                        assert manager.tables[seq.seq_id].num_tokens == seq.num_computed_tokens
                    seq.draft_token_ids = []
    scheduler.free_finished()
    return plan


def footprint(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The most tokens a request ever has cached at once (the engine's admission rule)."""
    return max(prompt_len, min(prompt_len + max_tokens, max_model_len) - 1)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), max_model_len=st.integers(8, 64),
                num_blocks=st.integers(4, 40), num_cpu_blocks=st.integers(0, 40),
                max_num_seqs=st.integers(1, 6), chunked=st.booleans(),
                mode=st.sampled_from(["swap", "recompute", "auto", "partial"]), steps=st.sampled_from([1, 1, 3]),
                budget_extra=st.integers(0, 64), caching=st.booleans(), speculate=st.booleans(),
                window=st.sampled_from([0, 0, 2, 5, 9]))
    def setup(self, block_size, max_model_len, num_blocks, num_cpu_blocks, max_num_seqs, chunked,
              mode, steps, budget_extra, caching, speculate, window):
        self.max_model_len = max_model_len
        # speculative decoding (never with multi-step, as the engine refuses the pair)
        self.speculate = speculate and steps == 1
        floor = max_num_seqs if chunked else max(max_model_len, max_num_seqs)
        self.budget = floor + budget_extra
        # window > 0: a sliding-window model, whose blocks slide out as its sequences run
        self.manager = BlockManager(num_blocks, block_size, num_cpu_blocks, watermark=0.0,
                                    enable_prefix_caching=caching, sliding_window=window)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len, max_num_seqs, self.budget, enable_chunked_prefill=chunked,
            preemption_mode=mode, num_scheduler_steps=steps), self.manager)
        self.groups: dict[str, SequenceGroup] = {}
        self.wanted: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.admitted: list[str] = []
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=64), max_tokens=st.integers(1, 20),
          n=st.sampled_from([1, 1, 2, 3]))
    def add_request(self, prompt, max_tokens, n):
        prompt = prompt[:self.max_model_len]       # a small alphabet: shared prefixes are common
        need = n * blocks_for(footprint(len(prompt), max_tokens, self.max_model_len), self.manager.block_size)
        if need > self.manager.num_blocks or n > self.scheduler.config.max_num_seqs:
            return  # the engine refuses it at the door
        rid = str(self.next_id)
        seqs = [Sequence(self.next_id * 10 + i, list(prompt)) for i in range(n)]
        self.next_id += 1
        group = SequenceGroup(rid, seqs, SamplingParams(max_tokens=max_tokens, n=n))
        self.groups[rid] = group
        self.wanted[rid] = min(max_tokens, max(self.max_model_len - len(prompt), 1))
        self.scheduler.add_seq_group(group)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.groups)))
        if self.scheduler.abort_seq_group(rid) is not None:
            self.aborted.add(rid)

    @rule(data=st.data())
    def step(self, data=None):
        draft = verdict = None
        if self.speculate and data is not None:
            draft = lambda seq: data.draw(st.integers(0, 5), label="draft length")     # noqa: E731
            verdict = lambda k: data.draw(st.integers(0, k), label="drafts that stand")  # noqa: E731
        elif self.speculate:   # teardown: drafts of fixed shape
            draft, verdict = (lambda seq: 2), (lambda k: k // 2)
        plan = fake_step(self.scheduler, self.max_model_len, draft, verdict)
        if self.scheduler.has_unfinished_seqs():
            assert not plan.is_empty or plan.preempted, "the scheduler stalled with work left"
        assert plan.num_batched_tokens <= self.budget
        for item in plan.scheduled:
            if item.group.request_id not in self.admitted:
                self.admitted.append(item.group.request_id)
        assert self.scheduler.num_running_seqs() <= self.scheduler.config.max_num_seqs

    @invariant()
    def books_balance(self):
        m, s = self.manager, self.scheduler
        m.check_invariants([q for g in self.groups.values() for q in g.seqs])
        for group in s.running:
            assert all(seq.seq_id not in m.on_cpu for seq in group.unfinished_seqs())
        for group in s.swapped:   # paged out: wholly, or (demand paging) at least one block of it
            out = [seq.seq_id in m.on_cpu for seq in group.unfinished_seqs()]
            assert any(out) if s.config.preemption_mode == "partial" else all(out)
        for group in s.waiting:
            assert all(seq.seq_id not in m.tables for seq in group.seqs)
        held = {seq.seq_id for g in s.running + s.swapped for seq in g.unfinished_seqs()}
        assert set(m.tables) == held                                     # nothing leaked
        for queue in (s.waiting, s.running, s.swapped):                  # each queue in arrival order
            assert [g.arrival_index for g in queue] == sorted(g.arrival_index for g in queue)
        # FCFS: requests are first admitted in arrival order
        assert self.admitted == sorted(self.admitted, key=int)

    def teardown(self):
        for _ in range(5000):
            if not self.scheduler.has_unfinished_seqs():
                break
            self.step()
        assert not self.scheduler.has_unfinished_seqs(), "requests never finished (livelock)"
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.cpu_allocator.num_free == self.manager.cpu_allocator.num_blocks
        for rid, group in self.groups.items():
            if rid not in self.aborted:
                assert all(seq.num_output_tokens == self.wanted[rid] for seq in group.seqs), rid


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def make(prompt_len: int, max_tokens: int, seq_id: int) -> SequenceGroup:
    return SequenceGroup(str(seq_id), [Sequence(seq_id, [1] * prompt_len)], SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_latest_arrival_is_preempted(mode):
    manager = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=8, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=16, preemption_mode=mode), manager)
    # each needs at most 3 + 5 - 1 = 7 slots (4 blocks) alone, but not both at once
    a, b = make(3, 5, 0), make(3, 5, 1)
    scheduler.add_seq_group(a)
    scheduler.add_seq_group(b)
    fake_step(scheduler, 16)          # both prefill 3 tokens into 2 blocks each: the pool is full
    assert manager.num_free_blocks == 0
    plan = fake_step(scheduler, 16)   # decode token 4 fits in the second block
    assert not plan.preempted
    plan = fake_step(scheduler, 16)   # token 5 needs a third block: b (the latest) is preempted
    assert plan.preempted == [b]
    if mode == "recompute":
        assert scheduler.waiting == [b] and b.seqs[0].num_computed_tokens == 0
        assert scheduler.num_preemptions_recompute == 1
    else:
        assert scheduler.swapped == [b] and len(plan.blocks_to_swap_out) == 2
        assert b.seqs[0].num_computed_tokens == 4 and b.seqs[0].status == SequenceStatus.SWAPPED
        assert scheduler.num_preemptions_swap == 1 and manager.cpu_allocator.num_used == 2
    assert b.seqs[0].num_output_tokens == 2          # its generated tokens are kept
    while scheduler.has_unfinished_seqs():
        fake_step(scheduler, 16)
    assert a.seqs[0].num_output_tokens == b.seqs[0].num_output_tokens == 5
    assert manager.num_free_blocks == 4 and manager.cpu_allocator.num_used == 0


def test_auto_recomputes_short_and_swaps_long():
    manager = BlockManager(num_blocks=40, block_size=4, num_cpu_blocks=40, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=200, preemption_mode="auto"), manager)
    short, long = make(10, 5, 0), make(100, 5, 1)    # 11 and 101 tokens after the first step
    for g in (short, long):
        scheduler.add_seq_group(g)
    fake_step(scheduler, 200)
    plan = SchedulerOutput()
    for group in (short, long):                      # preempt both by hand
        scheduler.running.remove(group)
        scheduler._preempt(group, plan)
    assert scheduler.waiting == [short] and scheduler.swapped == [long]
    assert AUTO_RECOMPUTE_MAX_TOKENS < 101


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    manager = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=1, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, preemption_mode="swap"), manager)
    a, b = make(9, 8, 0), make(9, 8, 1)
    for g in (a, b):
        scheduler.add_seq_group(g)
    while scheduler.has_unfinished_seqs():
        fake_step(scheduler, 64)
    assert scheduler.num_preemptions_recompute >= 1 and scheduler.num_preemptions_swap == 0


def test_chunked_prefill_spreads_a_prompt_and_decodes_go_first():
    manager = BlockManager(num_blocks=64, block_size=4, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
                                          enable_chunked_prefill=True), manager)
    running = make(3, 10, 0)
    scheduler.add_seq_group(running)
    fake_step(scheduler, 64)                                         # short prompt: one step
    long = make(30, 2, 1)
    scheduler.add_seq_group(long)
    chunks = []
    while long.seqs[0].num_output_tokens == 0:
        plan = fake_step(scheduler, 64)
        assert plan.scheduled[0].group is running                    # the decode is served first
        chunk = [i for i in plan.scheduled if i.group is long]
        assert len(chunk) == 1 and plan.num_batched_tokens <= 8
        chunks.append((chunk[0].num_new_tokens, chunk[0].do_sample))
    assert [n for n, _ in chunks] == [7, 7, 7, 7, 2]                 # 8-token budget minus the decode
    assert [s for _, s in chunks] == [False] * 4 + [True]            # sampling only after the last chunk


@pytest.mark.parametrize("state", ["waiting", "decoding", "mid-prefill", "swapped"])
def test_abort_in_any_state_frees_blocks_of_both_pools(state):
    manager = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=20, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32, max_num_seqs=3, max_num_batched_tokens=6,
                                          enable_chunked_prefill=True, preemption_mode="swap"), manager)
    groups = [make(5, 14, 0), make(5, 14, 1), make(20, 4, 2), make(5, 4, 3)]
    for g in groups:
        scheduler.add_seq_group(g)

    def find():
        queues = {"waiting": scheduler.waiting, "swapped": scheduler.swapped,
                  "decoding": [g for g in scheduler.running if not g.is_prefilling()],
                  "mid-prefill": [g for g in scheduler.running
                                  if g.is_prefilling() and g.seqs[0].num_computed_tokens > 0]}
        return queues[state][0] if queues[state] else None

    for _ in range(40):
        if find() is not None:
            break
        fake_step(scheduler, 32)
    victim = find()
    assert victim is not None, f"the scenario never reached a {state} request"
    scheduler.abort_seq_group(victim.request_id)
    assert victim.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert victim.seqs[0].seq_id not in manager.tables                 # its blocks are free at once
    manager.check_invariants()
    while scheduler.has_unfinished_seqs():
        fake_step(scheduler, 32)
    for g in groups:
        if g is not victim:
            assert g.seqs[0].num_output_tokens == g.sampling_params.max_tokens
    assert manager.num_free_blocks == 8 and manager.cpu_allocator.num_used == 0
