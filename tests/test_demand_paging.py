"""Demand paging (preemption_mode="partial"): present bits in the block table, partial swap-outs
of only the blocks a step lacks, swap-ins of only what is out, sharing surviving partial
residency, and preemption staying invisible (greedy outputs equal a big pool's)."""

import numpy as np
import pytest

from minipaged import LLM, BeamSearchParams, LLMEngine, SamplingParams
from minipaged.memory.block_manager import BlockManager
from minipaged.sequence import Sequence, SequenceGroup

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(n, seed, lo=8, hi=50):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 259, size=int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def group(rid: int, prompt_len: int, n: int = 1) -> SequenceGroup:
    return SequenceGroup(str(rid), [Sequence(rid * 10 + i, list(range(prompt_len))) for i in range(n)],
                         SamplingParams(n=n))


def test_a_partial_swap_out_moves_the_tail_and_a_swap_in_only_what_is_out():
    m = BlockManager(16, 4, num_cpu_blocks=16, watermark=0.0)
    g = group(1, 22)                                    # 6 blocks
    m.allocate(g)
    table = m.tables[10]
    before = list(table.block_ids)
    mapping = m.swap_out(g, max_blocks=2)
    assert sorted(d for d, _ in mapping) == sorted(before[-2:])       # the tail
    assert table.present == [True] * 4 + [False] * 2
    assert table.block_ids[:4] == before[:4] and m.num_free_blocks == 16 - 4
    assert m.missing_blocks(g) == 2 and not m.is_resident(10)
    m.check_invariants()
    back = m.swap_in(g)
    assert sorted(c for c, _ in back) == sorted(c for _, c in mapping)   # exactly what went out
    assert table.resident and m.cpu_allocator.num_free == 16
    m.check_invariants()


def test_shared_blocks_go_out_once_and_blocks_other_requests_hold_stay():
    m = BlockManager(20, 4, num_cpu_blocks=20, watermark=0.0, enable_prefix_caching=True)
    samples = group(1, 13, n=3)                         # 4 blocks of prompt, shared by 3 samples
    m.allocate(samples)
    mapping = m.swap_out(samples, max_blocks=2)
    assert len(mapping) == 2                            # two blocks, each moved once for 3 tables
    for seq in samples.seqs:
        assert m.tables[seq.seq_id].present == [True, True, False, False]
    assert m.cpu_allocator.ref_counts[mapping[0][1]] == 3
    m.check_invariants()
    m.swap_in(samples)
    # a prefix-cache hit: the second request maps the first's full blocks
    first, second = group(2, 16), group(3, 16)
    m.allocate(first)
    m.cache_full_blocks(first.seqs[0], 16)
    first.seqs[0].num_computed_tokens = 16
    m.allocate(second)
    shared = set(m.tables[20].block_ids) & set(m.tables[30].block_ids)
    assert shared                                        # 3 full blocks hit, the last recomputed
    movable = m.movable_blocks(second)
    assert not set(movable) & shared                     # paging those out would free nothing
    m.swap_out(second, max_blocks=10)
    assert [b for b, p in zip(m.tables[30].block_ids, m.tables[30].present) if p] == sorted(shared, key=m.tables[20].block_ids.index)
    m.check_invariants()


@pytest.fixture(scope="module")
def batch():
    return prompts(8, seed=5)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, batch):
    return [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), device="cpu", swap_space=0.01).generate(
        batch, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [dict(block_size=2, num_blocks=40), dict(block_size=4, num_blocks=24),
                                    dict(block_size=2, num_blocks=40, enable_prefix_caching=True),
                                    dict(block_size=4, num_blocks=24, enable_chunked_prefill=True,
                                         max_num_batched_tokens=16, max_num_seqs=8)])
def test_partial_preemption_changes_no_token(tiny_model_dir, batch, expected, kwargs):
    llm = LLM(str(tiny_model_dir), device="cpu", swap_space=0.01, preemption_mode="partial", **kwargs)
    out = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    assert out == expected
    stats = llm.get_stats()
    assert stats["num_preemptions_partial"] > 0
    assert stats["blocks_swapped_out"] == stats["blocks_swapped_in"] > 0      # every block came back once
    assert stats["kv_blocks_used"] == 0 and stats["cpu_kv_usage"] == 0.0


def test_samples_and_beams_under_partial_preemption(tiny_model_dir):
    prompt = {"prompt_token_ids": list(range(3, 30))}
    sampled = SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=24, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True)
    big = LLM(str(tiny_model_dir), device="cpu", swap_space=0.01)
    want = ([c.token_ids for c in big.generate([prompt] * 3, sampled, use_tqdm=False)[0].outputs],
            [s.tokens for s in big.beam_search([prompt], beams)[0].sequences])
    small = LLM(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=90, swap_space=0.01,
                preemption_mode="partial")
    got = ([c.token_ids for c in small.generate([prompt] * 3, sampled, use_tqdm=False)[0].outputs],
           [s.tokens for s in small.beam_search([prompt], beams)[0].sequences])
    assert got == want
    assert small.get_stats()["num_preemptions_partial"] > 0


def test_only_what_a_step_lacks_moves(tiny_model_dir, batch):
    """Every partial swap-out in a run moves at most the blocks its step lacked, and the run
    moves less than full swapping on the same work."""
    moved = {}
    for mode in ("swap", "partial"):
        engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=40, swap_space=0.01,
                           preemption_mode=mode)
        schedule, free_before, sizes = engine.scheduler.schedule, [], []

        def look():
            free_before.append(engine.block_manager.num_free_blocks)
            plan = schedule()
            if plan.blocks_to_swap_out and mode == "partial":
                # a decode needs at most one new block a step: nothing beyond the step's shortfall moves
                decodes = sum(1 for i in plan.scheduled if not i.is_prefill)
                sizes.append((len(plan.blocks_to_swap_out), decodes + len(plan.preempted)))
            return plan

        engine.scheduler.schedule = look
        for i, p in enumerate(batch):
            engine.add_request(str(i), p, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        moved[mode] = engine.get_stats()["blocks_swapped_out"]
        if mode == "partial":
            assert sizes and all(out <= need for out, need in sizes), sizes
    assert 0 < moved["partial"] < moved["swap"], moved


@pytest.mark.slow
@pytest.mark.one_tier   # SmolLM2 on the plain tier: tests/test_tiers.py
def test_smollm2_greedy_is_unchanged_by_partial_preemption():
    prompts_ = ["The history of paging in operating systems", "A block table maps each logical block",
                "When memory runs short, the operating system", "def fibonacci(n):"]
    want = [o.outputs[0].token_ids for o in LLM("smollm2-135m-instruct", device="cpu", kv_cache_space=0.25).generate(
        prompts_, GREEDY, use_tqdm=False)]
    small = LLM("smollm2-135m-instruct", device="cpu", block_size=4, num_blocks=30, swap_space=0.1,
                preemption_mode="partial")
    assert [o.outputs[0].token_ids for o in small.generate(prompts_, GREEDY, use_tqdm=False)] == want
    assert small.get_stats()["num_preemptions_partial"] > 0


def test_a_preemption_moves_exactly_what_the_step_lacks():
    """Two decodes short of one block each, a later request holding six: it gives two, its
    tail, and keeps four resident; the swap-in brings back those two and nothing else."""
    from minipaged.config import SchedulerConfig
    from minipaged.scheduler.scheduler import Scheduler
    from minipaged.sequence import SequenceStatus

    m = BlockManager(10, 4, num_cpu_blocks=10, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(64, max_num_seqs=8, max_num_batched_tokens=64,
                                          preemption_mode="partial"), m)
    groups = []
    for rid, prompt_len in ((0, 8), (1, 8), (2, 24)):     # 2 + 2 + 6 full blocks: the pool is full
        g = SequenceGroup(str(rid), [Sequence(rid, list(range(prompt_len)))], SamplingParams(max_tokens=40))
        m.allocate(g)
        g.seqs[0].num_computed_tokens = prompt_len
        g.seqs[0].output_token_ids.append(1)                  # its first token: the next decode needs a block
        g.set_status(SequenceStatus.RUNNING)
        scheduler.add_seq_group(g)
        groups.append(g)
    scheduler.waiting, scheduler.running = [], list(groups)
    plan = scheduler.schedule()
    assert [g.request_id for g in plan.preempted] == ["2"]    # the latest arrival, once
    assert len(plan.blocks_to_swap_out) == 2                  # what requests 0 and 1 lacked, no more
    assert m.tables[2].present == [True] * 4 + [False] * 2    # its tail went out
    assert m.missing_blocks(groups[2]) == 2 and scheduler.num_preemptions_partial == 1
    for g in groups[:2]:                                       # they finish; room again
        g.seqs[0].status = SequenceStatus.FINISHED_LENGTH
    scheduler.free_finished()
    plan = scheduler.schedule()
    assert len(plan.blocks_to_swap_in) == 2 and m.is_resident(groups[2].seqs[0])


def test_suspended_requests_that_only_share_a_prefix_do_not_wait_on_each_other():
    """Found by the scheduler's state machine: two suspended requests whose only resident blocks
    are a cached prompt prefix they share, and a swap pool too small for more. Neither could
    page the prefix out alone, so the one running request, then everyone, waited for ever.
    Now the later sharer is recomputed, the prefix becomes the other's own and can go, and
    every request finishes with the tokens it asked for."""
    from minipaged.config import SchedulerConfig
    from minipaged.scheduler.scheduler import Scheduler

    from test_scheduler import fake_step

    manager = BlockManager(11, 1, num_cpu_blocks=3, watermark=0.0, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(10, 3, 10, preemption_mode="partial"), manager)
    shared = [1, 1, 1, 2, 2, 1, 0]
    wanted = {"0": 5, "1": 3, "2": 2}
    groups = [SequenceGroup(rid, [Sequence(i * 10, prompt)], SamplingParams(max_tokens=wanted[rid]))
              for i, (rid, prompt) in enumerate([("0", [0]), ("1", shared), ("2", shared + [0])])]
    for g in groups:
        scheduler.add_seq_group(g)
    sharers_suspended = False
    for _ in range(30):
        if not scheduler.has_unfinished_seqs():
            break
        sharers_suspended |= (len(scheduler.swapped) == 2 and all(
            manager.resident_blocks(g) and not manager.movable_blocks(g) for g in scheduler.swapped))
        plan = fake_step(scheduler, 10)
        assert not plan.is_empty or plan.preempted, "the scheduler stalled with work left"
        manager.check_invariants([s for g in groups for s in g.seqs])
    assert sharers_suspended and scheduler.num_preemptions_recompute >= 1   # the case, and its way out
    assert not scheduler.has_unfinished_seqs()
    assert all(g.seqs[0].num_output_tokens == wanted[g.request_id] for g in groups)
    assert manager.num_free_blocks == 11 and manager.cpu_allocator.num_free == 3
