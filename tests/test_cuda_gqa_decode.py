"""The decode kernel that serves a whole GQA group per thread block (kernels/paged_attention.cu),
on the CPU harness against the NumPy spec: every group size (1 to 16, one thread block or several
per KV head), head dims read as whole vectors (64, 128, 256), with idle lanes (80) or element by
element (6, 20), float / half / bfloat16 queries over float, int8 and fp8 blocks, split-K,
sliding windows, block-sparse heads of one group choosing different blocks; and the launch: one
thread block per KV head (not per query head), split-K scratch allocated once a step."""

import numpy as np
import pytest

from minipaged.kernels import cuda
from minipaged.kernels import reference as spec
from minipaged.kernels.cuda import BFLOAT16, decode_group_width
from minipaged.kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8
from minipaged.kernels.layout import AttentionMetadata, BlockBounds
from test_cuda_kernels import random_batch
from test_cuda_kv_compression import bounded_pool, compressed

SEQS = [(1, 70), (1, 5), (1, 33), (1, 16)]     # partial and whole last blocks, one of a single block


@pytest.fixture(scope="module")
def ops():
    return cuda.cpu_harness_ops()


def spec_decode(q, kd, vd, meta, scale, window=0):
    return spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, window)


@pytest.mark.parametrize("num_kv_heads, group, head_dim", [
    (2, 1, 64), (2, 3, 64), (1, 4, 128), (2, 5, 64), (1, 8, 256), (1, 9, 64), (1, 16, 128),   # whole vectors
    (2, 3, 80), (1, 7, 96),                     # idle lanes past head_dim (80: 10 of 16)
    (2, 2, 6), (1, 3, 20),                       # not a multiple of 8: element by element
])
def test_every_group_size_and_head_dim_matches_the_spec(ops, num_kv_heads, group, head_dim):
    rng = np.random.default_rng(group * 1000 + head_dim)
    q, k, v, meta = random_batch(rng, block_size=16, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, seqs=SEQS)
    got = ops.paged_attention(q, k, v, meta, 0.2)
    np.testing.assert_allclose(got, spec_decode(q, k, v, meta, 0.2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", [None, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_half_and_bfloat16_queries_over_every_block_format(ops, fmt, dtype):
    rng = np.random.default_rng(7)
    q, k, v, meta = random_batch(rng, block_size=8, num_heads=6, num_kv_heads=2, head_dim=64, seqs=SEQS)
    if fmt is None:
        k, v = k.astype(dtype), v.astype(dtype)
        kc, vc, quant, kd, vd = k, v, None, k.astype(np.float32), v.astype(np.float32)
    else:
        kc, vc, quant, kd, vd = compressed(rng, fmt, k, v)
    q = q.astype(dtype)
    got = ops.paged_attention(q, kc, vc, meta, 0.2, quant)
    assert got.dtype == np.dtype(dtype)
    rounding = 2.0**-8 if dtype is BFLOAT16 else 2.0**-11       # the output rounds once
    np.testing.assert_allclose(got.astype(np.float32), spec_decode(q, kd, vd, meta, 0.2),
                               atol=4 * rounding, rtol=4 * rounding)


@pytest.mark.parametrize("fmt", [None, KV_INT8, KV_FP8_E4M3])
@pytest.mark.parametrize("window", [0, 24])
def test_split_k_with_a_window_over_every_format(ops, fmt, window):
    ops = cuda.cpu_harness_ops(split_k_above=40, partition_size=16)
    rng = np.random.default_rng(11)
    q, k, v, meta = random_batch(rng, block_size=4, num_heads=9, num_kv_heads=3, head_dim=64,
                                 seqs=[(1, 150), (1, 41), (1, 3)])
    kc, vc, quant, kd, vd = (k, v, None, k, v) if fmt is None else compressed(rng, fmt, k, v)
    if window:                          # blocks wholly before the window freed, as the block manager does
        tables = meta.block_tables.copy()
        for s, n in enumerate(meta.seq_lens):
            tables[s, :max(int(n) - window, 0) // 4] = -1
        meta = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables,
                                 meta.max_query_len, meta.max_seq_len)
    plan = ops.plan_attention(meta)
    assert ops.decode_partitions(plan, window, 4) > 1
    got = ops.paged_attention(q, kc, vc, plan, 0.2, quant, window=window)
    np.testing.assert_allclose(got, spec_decode(q, kd, vd, meta, 0.2, window), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("group, fmt", [(4, None), (9, KV_INT8), (3, KV_FP8_E5M2)])
def test_heads_of_one_group_choosing_different_blocks(ops, group, fmt):
    """Block-sparse decode: the thread block reads a block if any of its heads chose it, and each
    head's softmax takes only the blocks it chose."""
    rng = np.random.default_rng(group)
    q, k, v, meta = random_batch(rng, block_size=4, num_heads=2 * group, num_kv_heads=2, head_dim=64,
                                 seqs=[(1, 90), (1, 47), (1, 9)])
    kc, vc, quant, key_min, key_max, kd, vd = bounded_pool(ops, rng, k, v, fmt)
    keep = 3
    got = ops.paged_attention(q, kc, vc, meta, 0.25, quant, BlockBounds(key_min, key_max, keep))
    want = spec.sparse_decode_attention(q, kd, vd, key_min, key_max, meta.block_tables, meta.seq_lens, 0.25,
                                        keep * 4)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)
    # the heads of one group did choose different blocks (what this test is for)
    differ = 0
    for s_, n in enumerate(meta.seq_lens):
        blocks = -(-int(n) // 4)
        for kv_head in range(2):
            ids = meta.block_tables[s_, :blocks]
            picks = {tuple(spec.select_blocks(q[s_, h], key_min[ids, kv_head], key_max[ids, kv_head], blocks, keep))
                     for h in range(kv_head * group, (kv_head + 1) * group)}
            differ += len(picks) > 1
    assert differ > 0


def test_one_thread_block_per_kv_head_and_split_k_scratch_once_a_step(ops, monkeypatch):
    """SmolLM2's shape (9 heads on 3 KV heads): 3 thread blocks a sequence, not 9; two layers of
    one step launch with the same split-K scratch arrays."""
    assert decode_group_width(9, 3) == (4, 1) and decode_group_width(14, 2) == (8, 1)
    assert decode_group_width(4, 4) == (1, 1) and decode_group_width(32, 2) == (8, 2)
    ops = cuda.cpu_harness_ops(split_k_above=40)
    launches = []
    launch = ops._launch

    def recorded(name, dtype, grid, block, args):
        launches.append((name, grid, args))
        launch(name, dtype, grid, block, args)

    monkeypatch.setattr(ops, "_launch", recorded)
    rng = np.random.default_rng(3)
    q, k, v, meta = random_batch(rng, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                                 seqs=[(1, 1500), (1, 40)])
    plan = ops.plan_attention(meta)
    for _ in range(2):                                   # two layers of one step
        got = ops.paged_attention(q, k, v, plan, 0.2)
        np.testing.assert_allclose(got, spec_decode(q, k, v, meta, 0.2), atol=3e-5, rtol=1e-4)
    decodes = [(grid, args) for name, grid, args in launches if name == "paged_decode"]
    assert [grid for grid, _ in decodes] == [(3, 2, plan.num_partitions)] * 2
    first, second = (args[1:4] for _, args in decodes)
    assert all(a is b for a, b in zip(first, second))


def test_q_k_and_v_are_read_where_they_lie_in_the_fused_projection(ops):
    """q, k, v as the model cuts them from the (T, q + 2kv) projection: rotary turns q and k in
    place (no copy), the KV write and both attention kernels read the rows a stride apart, and
    every result equals the spec's on contiguous copies."""
    rng = np.random.default_rng(21)
    heads, kv_heads, dim, block = 6, 2, 64, 8
    seqs = [(1, 30), (7, 19)]                       # a decode and a chunk: both attention kernels
    qkv = rng.standard_normal((8, (heads + 2 * kv_heads) * dim)).astype(np.float32)   # (T, q + 2kv)
    q = qkv[:, :heads * dim].reshape(8, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(8, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].reshape(8, kv_heads, dim)
    positions = np.array([29] + list(range(12, 19)))
    angles = np.outer(np.arange(64), 1.0 / 10000 ** (np.arange(0, dim, 2) / dim))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    want_q, want_k = spec.rotary(q.copy(), positions, cos, sin), spec.rotary(k.copy(), positions, cos, sin)
    rq, rk = ops.rotary(q, positions, cos, sin), ops.rotary(k, positions, cos, sin)
    assert np.shares_memory(rq, qkv) and np.shares_memory(rk, qkv)        # rotated where they lie
    np.testing.assert_allclose(rq, want_q, atol=1e-5)
    np.testing.assert_allclose(rk, want_k, atol=1e-5)
    _, k_cache, v_cache, meta = random_batch(rng, block_size=block, num_heads=heads, num_kv_heads=kv_heads,
                                             head_dim=dim, seqs=seqs)
    slots = np.concatenate([meta.block_tables[0, 29 // block:29 // block + 1] * block + 29 % block,
                            meta.block_tables[1, np.arange(12, 19) // block] * block + np.arange(12, 19) % block])
    want_k_cache, want_v_cache = k_cache.copy(), v_cache.copy()
    spec.write_kv(want_k_cache, want_v_cache, np.ascontiguousarray(rk), np.ascontiguousarray(v), slots)
    ops.write_kv(k_cache, v_cache, rk, v, slots)
    np.testing.assert_array_equal(k_cache, want_k_cache)
    np.testing.assert_array_equal(v_cache, want_v_cache)
    got = ops.paged_attention(rq, k_cache, v_cache, meta, 0.2)
    np.testing.assert_allclose(got, spec_decode(np.ascontiguousarray(rq), k_cache, v_cache, meta, 0.2),
                               atol=2e-5, rtol=1e-4)


def test_a_prefill_step_is_planned_from_the_host_copy_of_its_query_starts(ops):
    """On a GPU the step's metadata lives on the device; the prefill tiles are planned from the
    host copy the model runner keeps (host_query_start_loc), never by reading the device's back."""
    class DeviceArray:                      # what a CuPy array would be: reading it back is a sync
        def get(self):
            raise AssertionError("the device copy of query_start_loc was read back")

    host = np.array([0, 20, 23], np.int32)
    meta = AttentionMetadata(np.zeros(23, np.int64), DeviceArray(), np.array([20, 40], np.int32),
                             np.zeros((2, 3), np.int32), 20, 40, host_query_start_loc=host)
    plan = ops.plan_attention(meta)
    assert not plan.decode_only
    assert plan.tiles.tolist() == [[0, 0], [0, 16], [1, 20]]     # (sequence, first query row), 16 a tile
