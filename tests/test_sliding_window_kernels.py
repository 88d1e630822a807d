"""Sliding-window attention in every CPU kernel, against the NumPy spec (kernels/reference.py).

A query at position p reads positions max(0, p - window + 1) .. p. The block-table entries of
blocks wholly before every query's window are -1 here (freed, as the block manager frees them),
so a kernel that reads one fails or reads garbage. Each path of the fast tier is named: the
BLAS prompt path, the loop kernel (decodes, short chunks, split-K) on float and int8 caches.
"""

import numpy as np
import pytest

from attention_batches import random_batch
from minipaged.kernels import reference
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels.kv_quant import KV_INT8
from minipaged.kernels.layout import BlockBounds, KVQuant
from minipaged.kernels.simple import SimpleOps

# (query_len, seq_len) per sequence: decodes far past the window, a prompt, chunks, one short context
CASES = {
    "decodes": [(1, 70), (1, 9), (1, 33)],
    "one_long_decode": [(1, 200)],          # split-K slices on fast-split-k, most of them before the window
    "prompt": [(40, 40)],
    "chunk_past_window": [(24, 90)],
    "spec_decode_rows": [(4, 51), (3, 20)],
    "mixed": [(1, 64), (37, 37), (5, 80)],
}


def free_slid_out(meta, window, block_size):
    """The tables with -1 for each block wholly before the first position any query reads."""
    tables = meta.block_tables.copy()
    first_query = meta.seq_lens - np.diff(meta.query_start_loc)          # (S,)
    for s, f in enumerate(first_query):
        tables[s, :max(int(f) - window + 1, 0) // block_size] = -1
    return tables


def tiers():
    yield "simple", SimpleOps()
    yield "fast", FastOps(FastTuning())
    # every sequence to the BLAS path (no prompt kernel), and split-K slices for long decodes
    yield "fast-blas", FastOps(FastTuning(prompt_min_queries=2, prompt_kernel=False))
    yield "fast-split-k", FastOps(FastTuning(split_min_tokens=4))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 33])    # the token alone; several blocks, some contexts shorter
@pytest.mark.parametrize("tier", ["simple", "fast", "fast-blas", "fast-split-k"])
def test_window_matches_the_spec(case, window, tier):
    ops = dict(tiers())[tier]
    rng = np.random.default_rng(window)
    block_size = 8
    q, k_cache, v_cache, meta = random_batch(rng, block_size=block_size, num_heads=6, num_kv_heads=2,
                                             head_dim=32, seqs=CASES[case])
    want = reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, 0.2, window=window)
    freed = free_slid_out(meta, window, block_size)
    meta = type(meta)(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, freed,
                      meta.max_query_len, meta.max_seq_len)
    got = ops.paged_attention(q, k_cache, v_cache, meta, 0.2, window=window)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("tier", ["simple", "fast"])
def test_window_on_an_int8_cache(tier):
    ops = dict(tiers())[tier]
    rng = np.random.default_rng(3)
    block_size, window = 4, 10
    q, k_float, v_float, meta = random_batch(rng, block_size=block_size, num_heads=4, num_kv_heads=2,
                                             head_dim=16, seqs=[(1, 30), (3, 17)])
    k_codes = np.empty(k_float.shape, np.int8)
    v_codes = np.empty(v_float.shape, np.int8)
    k_scale = np.empty(k_float.shape[:3], np.float32)                  # (N, KVH, B)
    v_scale = np.empty(v_float.shape[:3], np.float32)
    for codes, scales, x in ((k_codes, k_scale, k_float), (v_codes, v_scale, v_float)):
        for b in range(x.shape[0]):
            for o in range(block_size):
                codes[b, :, o], scales[b, :, o] = reference.quantize_kv(x[b, :, o], KV_INT8, None)
    want = reference.paged_attention(q, reference.dequantize_kv(k_codes, KV_INT8, k_scale),
                                     reference.dequantize_kv(v_codes, KV_INT8, v_scale), meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, 0.25, window=window)
    freed = free_slid_out(meta, window, block_size)
    meta = type(meta)(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, freed,
                      meta.max_query_len, meta.max_seq_len)
    got = ops.paged_attention(q, k_codes, v_codes, meta, 0.25, KVQuant(KV_INT8, k_scale, v_scale), window=window)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def one_decode():
    """q, the pools and the metadata of one decode at position 29 (block size 4, head_dim 8)."""
    return random_batch(np.random.default_rng(0), block_size=4, num_heads=2, num_kv_heads=2, head_dim=8,
                        seqs=[(1, 30)])


@pytest.mark.parametrize("tier", ["simple", "fast"])
def test_a_freed_block_inside_the_window_is_named(tier):
    """A -1 entry the window still reads is a clear IndexError, not a read of block -1."""
    ops = dict(tiers())[tier]
    q, k_cache, v_cache, meta = one_decode()
    meta.block_tables[0, 3] = -1           # positions 12..15; the window of 20 reads 10..29
    with pytest.raises(IndexError, match="block id -1"):
        ops.paged_attention(q, k_cache, v_cache, meta, 0.3, window=20)


@pytest.mark.parametrize("tier", ["simple", "fast"])
def test_block_sparse_decode_with_a_window_is_refused(tier):
    ops = dict(tiers())[tier]
    q, k_cache, v_cache, meta = one_decode()
    bounds = BlockBounds(np.zeros((k_cache.shape[0], 2, 8), np.float32), np.zeros((k_cache.shape[0], 2, 8), np.float32), 2)
    with pytest.raises(ValueError, match="sliding window"):
        ops.paged_attention(q, k_cache, v_cache, meta, 0.3, bounds=bounds, window=8)


def test_split_k_slices_share_out_only_the_window():
    """Planned with the step's first positions read, the split-K slices of a long decode begin at
    its window (no slice of blocks nobody reads), and still match the spec."""
    from minipaged.kernels.fast.attention import paged_attention, plan_attention
    from minipaged.kernels.ops import window_first_read

    window = 40
    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(1), block_size=8, num_heads=6, num_kv_heads=2,
                                             head_dim=32, seqs=[(1, 300)])
    want = reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, 0.2, window=window)
    first = window_first_read(meta, window)                            # (1,) = 300 - 1 - 40 + 1
    plan = plan_attention(meta, tuning=FastTuning(split_min_tokens=4), first_read=first)
    assert len(plan.merges) == 1 and plan.items[:, 2].min() == first[0] == 260
    np.testing.assert_allclose(paged_attention(q, k_cache, v_cache, plan, 0.2, window=window), want,
                               rtol=2e-4, atol=2e-5)
