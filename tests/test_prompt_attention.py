"""The prompt kernel (kernels/prompt_attention.py) against the NumPy spec: whole prompts and
chunks over a longer context, every GQA group size, short and long tiles, and the routing that
sends long query runs on a float32 cache to it (and the rest to BLAS)."""

import numpy as np
import pytest

from minipaged.kernels.fast import prompt_attention
from minipaged.kernels.fast import attention
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels import reference as spec
from minipaged.kernels.kv_quant import KV_INT8
from minipaged.kernels.layout import KVQuant

from test_kernels import random_batch


def run_kernel(q, k_cache, v_cache, meta, threads):
    out = np.full(q.shape, np.nan, np.float32)
    qsl = meta.query_start_loc
    for s in range(len(meta.seq_lens)):
        a, b = qsl[s], qsl[s + 1]
        prompt_attention.prompt_attention(q[a:b], k_cache, v_cache, meta.block_tables[s], int(meta.seq_lens[s]),
                                          0.125, out[a:b], threads)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 4), (8, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_kernel_matches_the_spec(num_heads, num_kv_heads, threads):
    """Prompts of 1 to 300 tokens (short and partial query tiles, several key chunks) and chunks
    whose context runs past their queries, on shuffled blocks; (40, 150): a tile across a key
    chunk's edge, whose first rows see none of the second chunk's keys."""
    seqs = [(1, 1), (5, 5), (31, 31), (32, 32), (33, 33), (129, 129), (300, 300), (40, 340), (7, 150), (40, 150)]
    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(num_heads + threads), block_size=16,
                                             num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, seqs=seqs)
    got = run_kernel(q, k_cache, v_cache, meta, threads)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_prompt_kernel_other_block_sizes_and_head_dims():
    """Blocks of 8 and 32 slots (a tile of six keys crossing block edges), head_dim of one panel."""
    head_dim = prompt_attention.PANEL
    for block_size in (8, 32):
        q, k_cache, v_cache, meta = random_batch(np.random.default_rng(block_size), block_size=block_size,
                                                 num_heads=6, num_kv_heads=2, head_dim=head_dim,
                                                 seqs=[(70, 70), (45, 200)])
        got = run_kernel(q, k_cache, v_cache, meta, 2)
        want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                    0.125)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_prompt_kernel_fits_float_pools_with_whole_panels():
    pool = np.zeros((4, 3, 16, 64), np.float32)
    assert prompt_attention.fits(pool, pool, 64)
    assert not prompt_attention.fits(pool.astype(np.float16), pool.astype(np.float16), 64)
    assert not prompt_attention.fits(pool.astype(np.int8), pool.astype(np.int8), 64)
    odd = np.zeros((4, 3, 16, prompt_attention.PANEL + 8), np.float32)
    assert not prompt_attention.fits(odd, odd, odd.shape[-1])          # head_dim off the panel width
    strided = np.zeros((4, 16, 3, 64), np.float32).transpose(0, 2, 1, 3)
    assert not prompt_attention.fits(strided, strided, 64)              # not a plain pool


def test_long_query_runs_on_a_float_cache_take_the_prompt_kernel(monkeypatch):
    """paged_attention sends sequences of BLAS_MIN_QUERIES or more queries to the prompt kernel on
    a float32 cache, and to BLAS on a compressed one; decodes stay with the paged kernel."""
    calls = []
    real = prompt_attention.prompt_attention
    monkeypatch.setattr(prompt_attention, "prompt_attention", lambda q, *a: calls.append(len(q)) or real(q, *a))
    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(5), block_size=16, num_heads=9, num_kv_heads=3,
                                             head_dim=64, seqs=[(40, 40), (1, 90), (100, 130)])
    got = attention.paged_attention(q, k_cache, v_cache, meta, 0.125)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert calls == [40, 100]
    calls.clear()
    blas = attention.plan_attention(meta, None, FastTuning(prompt_kernel=False))
    np.testing.assert_allclose(attention.paged_attention(q, k_cache, v_cache, blas, 0.125), want, atol=2e-5, rtol=1e-5)
    assert calls == []
    scales = np.ones((k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]), np.float32)
    int8 = np.clip(np.round(k_cache * 20), -127, 127).astype(np.int8)
    attention.paged_attention(q, int8, int8, meta, 0.125, KVQuant(KV_INT8, scales, scales))
    assert calls == []
