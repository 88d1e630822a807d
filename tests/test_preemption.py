"""Preemption, chunked prefill and multi-step are invisible: the same tokens, whatever the memory.

Tiny random Llama (fast) and SmolLM2 (slow): greedy outputs under a pool small
enough to force many preemptions by swapping, by recomputation and in auto
mode, and with chunked prefill at several chunk sizes, equal those of a large
pool that never preempts.
"""

import numpy as np
import pytest

from minipaged import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SWAP_GIB = 0.002   # a small CPU swap pool keeps the tiny model's block bookkeeping small


def prompts(n, seed, lo=1, hi=60):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 259, size=int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def tokens(llm, batch, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def batch():
    return prompts(8, seed=21)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, batch):
    llm = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB)
    out = tokens(llm, batch)
    assert llm.get_stats()["num_preemptions"] == 0
    return out


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto", "partial"])
def test_preemption_changes_no_token(tiny_model_dir, batch, expected, mode):
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=40, swap_space=SWAP_GIB,
              preemption_mode=mode)
    assert tokens(llm, batch) == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] >= 3
    if mode == "swap":
        assert stats["num_preemptions_swap"] == stats["num_preemptions"] > 0
        assert stats["blocks_swapped_out"] == stats["blocks_swapped_in"] > 0
        assert stats["bytes_swapped_out"] == stats["blocks_swapped_out"] * llm.llm_engine.cache.bytes_per_block
    elif mode == "recompute":
        assert stats["num_preemptions_recompute"] == stats["num_preemptions"]
        assert stats["blocks_swapped_out"] == 0
    elif mode == "partial":   # demand paging: every swap moved only part of its victim
        assert stats["num_preemptions_partial"] == stats["num_preemptions_swap"] > 0
        assert stats["blocks_swapped_out"] == stats["blocks_swapped_in"] > 0
    else:  # short sequences are recomputed, long ones swapped
        assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] == stats["num_preemptions"]
    assert stats["kv_blocks_used"] == 0 and stats["cpu_kv_usage"] == 0.0
    llm.llm_engine.block_manager.check_invariants()


@pytest.mark.parametrize("budget", [8, 13, 32])
def test_chunked_prefill_changes_no_token(tiny_model_dir, batch, expected, budget):
    llm = LLM(str(tiny_model_dir), device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=budget,
              max_num_seqs=8, swap_space=SWAP_GIB)
    assert tokens(llm, batch) == expected
    # and with preemption on top
    llm = LLM(str(tiny_model_dir), device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=budget,
              max_num_seqs=8, block_size=2, num_blocks=40, swap_space=SWAP_GIB, preemption_mode="swap")
    assert tokens(llm, batch) == expected


def test_multi_step_changes_no_token(tiny_model_dir, batch, expected):
    llm = LLM(str(tiny_model_dir), device="cpu", num_scheduler_steps=4, swap_space=SWAP_GIB)
    assert tokens(llm, batch) == expected
    assert llm.get_stats()["num_steps"] < 12       # 12 tokens took fewer than 12 scheduling steps


def test_swap_round_trip_through_the_engine_is_bit_exact(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB,
                       preemption_mode="swap")
    engine.add_request("a", list(range(3, 40)), GREEDY)
    engine.step()
    group = engine.groups["a"]
    seq = group.seqs[0]
    table = list(engine.block_manager.block_table(seq))
    before = engine.cache.kv_cache[:, :, table].copy()
    plan = engine.block_manager.swap_out(group)
    engine.cache.swap_out(plan)
    engine.cache.kv_cache[:] = np.nan                     # the device pool is reused by others
    engine.cache.swap_in(engine.block_manager.swap_in(group))
    after = engine.cache.kv_cache[:, :, engine.block_manager.block_table(seq)]
    assert after.tobytes() == before.tobytes()


def test_a_request_needing_almost_the_whole_pool_finishes(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=16, swap_space=SWAP_GIB,
                       max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True)
    # 50 + 14 - 1 = 63 cached tokens at most: 16 blocks, the whole pool
    engine.add_request("big", list(range(3, 53)), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    engine.add_request("small", [5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    done = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
    assert done == {"big": 14, "small": 30}
    assert engine.block_manager.num_used_blocks == 0


def test_abort_a_swapped_request(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=30, swap_space=SWAP_GIB,
                       preemption_mode="swap")
    for i, p in enumerate(prompts(4, seed=3, lo=10, hi=20)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(60):
        engine.step()
        if engine.scheduler.swapped:
            break
    victim = engine.scheduler.swapped[0]
    engine.abort_request(victim.request_id)
    assert engine.get_stats()["cpu_kv_blocks_used"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_stats_keys_and_log_line(tiny_model_dir, caplog):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=30, swap_space=SWAP_GIB,
                       log_stats_interval=1e-9)
    for i, p in enumerate(prompts(3, seed=4)):
        engine.add_request(str(i), p, GREEDY)
    import logging
    logger = logging.getLogger("minipaged")
    logger.addHandler(caplog.handler)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        logger.removeHandler(caplog.handler)
    stats = engine.get_stats()
    for key in ("num_running", "num_waiting", "num_swapped", "kv_usage", "cpu_kv_usage", "num_preemptions",
                "num_preemptions_swap", "num_preemptions_recompute", "blocks_swapped_out", "blocks_swapped_in",
                "bytes_swapped_out", "bytes_swapped_in", "prompt_throughput", "generation_throughput",
                "ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99"):
        assert key in stats, key
    assert stats["ttft_p50"] > 0 and stats["tpot_p50"] > 0
    assert any("Avg prompt throughput" in r.getMessage() and "Swapped:" in r.getMessage()
               for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(block_size=4, num_blocks=24, preemption_mode="swap"),
    dict(block_size=4, num_blocks=24, preemption_mode="recompute"),
    dict(block_size=4, num_blocks=24, preemption_mode="auto"),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4),
])
@pytest.mark.one_tier   # SmolLM2 on the plain tier: tests/test_tiers.py
def test_smollm2_preemption_and_chunking_change_no_token(golden, kwargs):
    cases = golden["prompts"]
    batch = [{"prompt_token_ids": c["prompt_ids"]} for c in cases]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    big = tokens(LLM("smollm2-135m-instruct", device="cpu", kv_cache_space=0.25, swap_space=0.25), batch, params)
    llm = LLM("smollm2-135m-instruct", device="cpu", swap_space=0.25, **kwargs)
    assert tokens(llm, batch, params) == big
    if "num_blocks" in kwargs:
        assert llm.get_stats()["num_preemptions"] > 0
