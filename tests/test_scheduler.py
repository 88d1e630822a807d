"""The FCFS scheduler on its own: a fake model appends one token per sampled sequence."""

from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.block_manager import BlockManager, blocks_for
from minipaged.config import SchedulerConfig
from minipaged.sampling_params import SamplingParams
from minipaged.scheduler import Scheduler
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def fake_step(scheduler: Scheduler, max_model_len: int) -> list:
    """What the engine does around the model: advance computed tokens, append, finish, free."""
    plan = scheduler.schedule()
    for item in plan.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.do_sample:
            item.seq.output_token_ids.append(1)
            if (item.seq.num_output_tokens >= item.group.sampling_params.max_tokens
                    or item.seq.num_tokens >= max_model_len):
                item.seq.status = SequenceStatus.FINISHED_LENGTH
    scheduler.free_finished()
    return plan


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 64))
    requests = [(draw(st.integers(1, max_model_len)), draw(st.integers(1, 20)))
                for _ in range(draw(st.integers(1, 12)))]
    # the pool must hold the largest single request (the engine refuses bigger ones at the door)
    largest = max(blocks_for(max(p, min(p + m, max_model_len) - 1), block_size) for p, m in requests)
    num_blocks = draw(st.integers(largest, largest * 4))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max(max_model_len, max_num_seqs), 3 * max_model_len))
    return block_size, max_model_len, requests, num_blocks, max_num_seqs, budget


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_every_request_finishes_in_order_within_budgets(workload):
    block_size, max_model_len, requests, num_blocks, max_num_seqs, budget = workload
    manager = BlockManager(num_blocks, block_size, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len, max_num_seqs, budget), manager)
    groups = []
    for i, (prompt_len, max_tokens) in enumerate(requests):
        group = SequenceGroup(str(i), [Sequence(i, [5] * prompt_len)], SamplingParams(max_tokens=max_tokens))
        groups.append(group)
        scheduler.add_seq_group(group)
    first_admitted = []
    for _ in range(10_000):
        if not scheduler.has_unfinished_seqs():
            break
        plan = fake_step(scheduler, max_model_len)
        assert plan.scheduled, "the scheduler stalled with work left"
        assert plan.num_batched_tokens <= budget
        assert scheduler.num_running_seqs() <= max_num_seqs
        for item in plan.scheduled:
            if item.group.request_id not in first_admitted:
                first_admitted.append(item.group.request_id)
        manager.check_invariants([s for g in groups for s in g.seqs])
        for group in scheduler.running:
            for seq in group.unfinished_seqs():
                assert manager.tables[seq.seq_id].num_tokens == seq.num_computed_tokens
    assert not scheduler.has_unfinished_seqs()
    assert first_admitted == [str(i) for i in range(len(requests))]          # FCFS
    assert manager.num_free_blocks == num_blocks                              # nothing leaked
    for group, (prompt_len, max_tokens) in zip(groups, requests):
        seq = group.seqs[0]
        assert seq.num_output_tokens == min(max_tokens, max(max_model_len - prompt_len, 1))


def test_latest_arrival_is_preempted_and_recomputed():
    manager = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=16), manager)
    # each needs at most 3 + 5 - 1 = 7 slots (4 blocks) alone, but not both at once
    a = SequenceGroup("a", [Sequence(0, [1, 2, 3])], SamplingParams(max_tokens=5))
    b = SequenceGroup("b", [Sequence(1, [1, 2, 3])], SamplingParams(max_tokens=5))
    scheduler.add_seq_group(a)
    scheduler.add_seq_group(b)
    fake_step(scheduler, 16)          # both prefill 3 tokens into 2 blocks each: the pool is full
    assert manager.num_free_blocks == 0
    plan = fake_step(scheduler, 16)   # decode token 4 fits in the second block
    assert not plan.preempted
    plan = fake_step(scheduler, 16)   # token 5 needs a third block: b (the latest) is preempted
    assert [g.request_id for g in plan.preempted] == ["b"]
    assert list(scheduler.waiting) == [b] and b.seqs[0].num_computed_tokens == 0
    assert b.seqs[0].num_output_tokens == 2               # its generated tokens are kept, to recompute
    while scheduler.has_unfinished_seqs():
        fake_step(scheduler, 16)
    assert a.seqs[0].num_output_tokens == b.seqs[0].num_output_tokens == 5
    assert manager.num_free_blocks == 4


def test_abort_anywhere_frees_blocks():
    manager = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=16, max_num_seqs=1), manager)
    for i in range(3):
        scheduler.add_seq_group(SequenceGroup(str(i), [Sequence(i, [1] * 5)], SamplingParams(max_tokens=4)))
    fake_step(scheduler, 16)
    assert scheduler.abort_seq_group("0").seqs[0].status == SequenceStatus.FINISHED_ABORTED  # running
    assert scheduler.abort_seq_group("2") is not None                                       # waiting
    assert manager.num_free_blocks == 8
    while scheduler.has_unfinished_seqs():
        fake_step(scheduler, 16)
    assert manager.num_free_blocks == 8
