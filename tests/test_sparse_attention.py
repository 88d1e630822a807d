"""Block-sparse decode attention (Quest): the page metadata, the block choice and the kernel
against their NumPy specs, exactness when the budget covers the context, and the engine's
preemption, copies and swaps carrying the metadata."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import LLM, LLMEngine, SamplingParams
from minipaged.config import ConfigError
from minipaged.kernels import kv_quant
from minipaged.kernels.fast import attention, kv_write
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels import reference as spec
from minipaged.kernels.layout import BlockBounds, KVQuant
from test_kernels import random_batch

SWAP_GIB = 0.002


def written_pool(rng, k_float, v_float, fmt=None):
    """Write every slot of a random pool through write_kv, keeping the key bounds (and, with
    ``fmt``, compressing it); returns the caches, the quant and the bounds arrays."""
    num_blocks, num_kv_heads, block_size, head_dim = k_float.shape
    key_min = np.zeros((num_blocks, num_kv_heads, head_dim), np.float32)
    key_max = np.zeros_like(key_min)
    tokens = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)   # noqa: E731
    slots = np.arange(num_blocks * block_size, dtype=np.int64)
    quant = None
    kc, vc = np.zeros_like(k_float), np.zeros_like(v_float)
    if fmt is not None:
        storage = kv_quant.STORAGE_DTYPE[fmt]
        kc, vc = np.zeros(k_float.shape, storage), np.zeros(v_float.shape, storage)
        shape = k_float.shape[:3] if fmt == kv_quant.KV_INT8 else (1, 1, 1)
        quant = KVQuant(fmt, np.ones(shape, np.float32), np.ones(shape, np.float32))
    kv_write.write_kv(kc, vc, tokens(k_float), tokens(v_float), slots, quant,
                 BlockBounds(key_min, key_max, 0))
    return kc, vc, quant, key_min, key_max


def test_write_kv_keeps_each_blocks_key_bounds():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 2, 4, 8)).astype(np.float32)
    kc, _, _, key_min, key_max = written_pool(rng, k, k.copy())
    want_min, want_max = spec.key_bounds(k)
    np.testing.assert_array_equal(key_min, want_min)
    np.testing.assert_array_equal(key_max, want_max)
    # a freed block written again: its first slot forgets the old bounds
    new = rng.standard_normal((2, 2, 8)).astype(np.float32) * 0.01
    kv_write.write_kv(kc, kc.copy(), new, new, np.array([8, 9], np.int64), None, BlockBounds(key_min, key_max, 0))
    np.testing.assert_array_equal(key_min[2], np.minimum(new[0], new[1]))
    np.testing.assert_array_equal(key_max[2], np.maximum(new[0], new[1]))


@st.composite
def sparse_cases(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 3]))
    seq_lens = draw(st.lists(st.integers(1, 160), min_size=1, max_size=4))
    keep = draw(st.integers(2, 6))
    fmt = draw(st.sampled_from([None, kv_quant.KV_INT8, kv_quant.KV_FP8_E4M3]))
    return block_size, num_kv_heads, group, seq_lens, keep, fmt, draw(st.integers(0, 2**31))


@settings(max_examples=30, deadline=None)   # 50 cost 15 s more of CI time
@given(sparse_cases())
def test_sparse_decode_matches_spec(case):
    """Decoding heads attend to the blocks the spec chooses (shuffled tables, partial last
    blocks, GQA, compressed blocks too), and a prompt in the same batch stays dense."""
    block_size, num_kv_heads, group, seq_lens, keep, fmt, seed = case
    rng = np.random.default_rng(seed)
    seqs = [(1, n) for n in seq_lens] + [(20, 20)]            # decodes, then a short prompt
    q, k_float, v_float, meta = random_batch(rng, block_size=block_size, num_heads=num_kv_heads * group,
                                             num_kv_heads=num_kv_heads, head_dim=16, seqs=seqs)
    kc, vc, quant, key_min, key_max = written_pool(rng, k_float, v_float, fmt)
    plan = attention.plan_attention(meta, None, FastTuning(prompt_min_queries=1 << 30))   # the Numba kernel, or BLAS
    got = attention.paged_attention(q, kc, vc, plan, 0.25, quant, BlockBounds(key_min, key_max, keep))
    kd = kc if fmt is None else spec.dequantize_kv(kc, fmt, quant.k_scale)
    vd = vc if fmt is None else spec.dequantize_kv(vc, fmt, quant.v_scale)
    decodes = len(seq_lens)
    want = spec.sparse_decode_attention(q[:decodes], kd, vd, key_min, key_max, meta.block_tables[:decodes],
                                        meta.seq_lens[:decodes], 0.25, keep * block_size)
    np.testing.assert_allclose(got[:decodes], want, atol=3e-5, rtol=1e-4)
    dense = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    np.testing.assert_allclose(got[decodes:], dense[decodes:], atol=3e-5, rtol=1e-4)


def test_a_budget_covering_the_context_is_dense_attention_exactly():
    rng = np.random.default_rng(3)
    q, k_float, v_float, meta = random_batch(rng, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                                             seqs=[(1, 200), (1, 37), (1, 16)])
    kc, vc, _, key_min, key_max = written_pool(rng, k_float, v_float)
    dense = attention.paged_attention(q, kc, vc, meta, 0.125)
    covering = attention.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 13))
    np.testing.assert_array_equal(covering, dense)
    sparse = attention.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 4))
    assert not np.array_equal(sparse[0], dense[0])              # 200 tokens in 13 blocks: 4 kept
    np.testing.assert_array_equal(sparse[1:], dense[1:])        # 3 and 1 blocks: all kept


@pytest.mark.parametrize("block_size", [1, 16, 512])
@pytest.mark.parametrize("split", [False, True])
def test_sparse_decode_over_several_chunks_and_slices(monkeypatch, block_size, split):
    """Sparse decode over contexts of several of the register kernel's chunks, and split-K
    slices of them in which a head (or every head) reads no block at all: the spec's answer,
    every value finite."""
    if split and attention.get_num_threads() < 2:
        pytest.skip("split-K slices a context over two or more threads")
    split_tuning = FastTuning(split_min_tokens=1 if split else 1 << 30)
    rng = np.random.default_rng(block_size)
    q, k_float, v_float, meta = random_batch(rng, block_size=block_size, num_heads=6, num_kv_heads=2,
                                             head_dim=24, seqs=[(1, 1100)])
    kc, vc, _, key_min, key_max = written_pool(rng, k_float, v_float)
    keep = 2                                   # the first and the last block: the middle slices read none
    got = attention.paged_attention(q, kc, vc, attention.plan_attention(meta, None, split_tuning), 0.3, None,
                                    BlockBounds(key_min, key_max, keep))
    want = spec.sparse_decode_attention(q, kc, vc, key_min, key_max, meta.block_tables, meta.seq_lens, 0.3,
                                        keep * block_size)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)


def test_the_choice_keeps_the_first_and_last_and_the_highest_bounds():
    rng = np.random.default_rng(5)
    key_min = rng.standard_normal((10, 8)).astype(np.float32)
    key_max = key_min + np.abs(rng.standard_normal((10, 8))).astype(np.float32)
    q = rng.standard_normal(8).astype(np.float32)
    chosen = spec.select_blocks(q, key_min, key_max, 10, 4)
    bound = np.maximum(q * key_min, q * key_max).sum(axis=1)
    assert chosen[0] == 0 and chosen[-1] == 9 and len(chosen) == 4
    middle = sorted(range(1, 9), key=lambda j: -bound[j])[:2]
    assert sorted(chosen[1:-1]) == sorted(middle)
    # the bound really bounds: no key inside a block's box scores above it
    for j in range(10):
        keys = rng.uniform(key_min[j], key_max[j], size=(200, 8)).astype(np.float32)
        assert (keys @ q).max() <= bound[j] + 1e-5


def test_the_engine_with_a_covering_budget_gives_the_dense_tokens(tiny_model_dir):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    dense = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB).generate(prompts, params, use_tqdm=False)
    covering = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, block_size=4,
                   sparse_attention_budget=4096).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in covering] == [o.outputs[0].token_ids for o in dense]


def test_swap_preemption_changes_no_token_with_sparse_attention(tiny_model_dir):
    """A tight budget (2 blocks of 2 tokens) really changes attention; swapping still changes
    no token, since swaps carry each block's bounds. (Recomputation does change tokens: it
    re-reads the generated tokens as a prompt, and prompts stay dense; docs/sparse_attention.md.)"""
    rng = np.random.default_rng(21)
    batch = [{"prompt_token_ids": rng.integers(3, 259, size=int(rng.integers(4, 30))).tolist()} for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, block_size=2, sparse_attention_budget=4)
    expected = [o.outputs[0].token_ids for o in roomy.generate(batch, params, use_tqdm=False)]
    dense = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, block_size=2)
    assert expected != [o.outputs[0].token_ids for o in dense.generate(batch, params, use_tqdm=False)]
    tight = LLM(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=24, swap_space=SWAP_GIB,
                preemption_mode="swap", sparse_attention_budget=4)
    assert [o.outputs[0].token_ids for o in tight.generate(batch, params, use_tqdm=False)] == expected
    stats = tight.get_stats()
    assert stats["num_preemptions_swap"] >= 3 and stats["kv_blocks_used"] == 0
    tight.llm_engine.block_manager.check_invariants()
    recomputing = LLM(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=24, swap_space=SWAP_GIB,
                      preemption_mode="recompute", sparse_attention_budget=4)
    outs = recomputing.generate(batch, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert recomputing.get_stats()["num_preemptions_recompute"] >= 3
    assert recomputing.get_stats()["kv_blocks_used"] == 0


def test_copy_on_write_carries_the_bounds(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB,
                       sparse_attention_budget=8)
    engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=2))
    engine.step()
    table = engine.block_manager.block_table(engine.groups["a"].seqs[0])
    free = [b for b in range(32) if b not in table][:2]
    engine.cache.copy([(table[0], free[0]), (table[1], free[1])])
    np.testing.assert_array_equal(engine.cache.key_bounds[:, :, free], engine.cache.key_bounds[:, :, table[:2]])


def test_bad_budgets_are_named(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"sparse_attention_budget must be .*>= 2 \* block_size \(32.*got 16"):
        LLMEngine(str(tiny_model_dir), device="cpu", sparse_attention_budget=16)
    with pytest.raises(ConfigError, match="sparse_attention_budget must be"):
        LLMEngine(str(tiny_model_dir), device="cpu", sparse_attention_budget="1024")


def test_the_pool_counts_the_key_bounds(tiny_model_dir):
    plain = LLMEngine(str(tiny_model_dir), device="cpu", kv_cache_space=0.01, swap_space=SWAP_GIB)
    sparse = LLMEngine(str(tiny_model_dir), device="cpu", kv_cache_space=0.01, swap_space=SWAP_GIB,
                       sparse_attention_budget=64)
    c = plain.model_config
    bounds = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert sparse.cache.bytes_per_block == plain.cache.bytes_per_block + bounds
    held = sparse.cache.kv_cache.nbytes + sparse.cache.key_bounds.nbytes
    assert held == sparse.cache.num_blocks * sparse.cache.bytes_per_block <= 0.01 * 2**30


def test_bench_sparse_refuses_a_budget_under_two_blocks_before_loading():
    from minipaged.tools.sparse_quality import check_sparse_args  # noqa: PLC0415

    with pytest.raises(ValueError, match="--budgets: 16 tokens is under two blocks of 16"):
        check_sparse_args({"context_lens": "512", "budgets": "16,1024", "trials": 1}, 16)
    with pytest.raises(ValueError, match="--context-lens must be comma-separated integers"):
        check_sparse_args({"context_lens": "4k", "budgets": "1024", "trials": 1}, 16)
    assert check_sparse_args({"context_lens": "512,2048", "budgets": "32", "trials": 2}, 16) == ([512, 2048], [32])


@pytest.mark.parametrize("fmt", [kv_quant.KV_INT8, kv_quant.KV_FP8_E4M3])
def test_split_k_over_compressed_blocks_and_short_chunks(monkeypatch, fmt):
    """Split-K slices of a compressed cache (fp8's layer scales in the partial sums) and of a
    5-query chunk merge to the spec."""
    from numba import get_num_threads  # noqa: PLC0415

    if get_num_threads() < 2:
        pytest.skip("split-K needs at least two threads")
    rng = np.random.default_rng(fmt)
    q, k_float, v_float, meta = random_batch(rng, block_size=4, num_heads=6, num_kv_heads=2, head_dim=16,
                                             seqs=[(5, 41)])
    kc, vc, quant, _, _ = written_pool(rng, k_float, v_float, fmt)
    if fmt != kv_quant.KV_INT8:
        quant.k_scale[...] = 0.5
        quant.v_scale[...] = 2.0
    plan = attention.plan_attention(meta, None, FastTuning(split_min_tokens=8))
    assert len(plan.merges) == 1
    got = attention.paged_attention(q, kc, vc, plan, 0.25, quant)
    want = spec.paged_attention(q, spec.dequantize_kv(kc, fmt, quant.k_scale), spec.dequantize_kv(vc, fmt, quant.v_scale),
                                meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)
