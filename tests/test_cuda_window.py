"""Sliding-window attention in the CUDA C kernels (on the CPU harness), against the NumPy spec
(kernels/reference.py ``paged_attention(..., window)``): decode, split-K decode and prefill, over
every KV format the kernels read (float32, float16, bfloat16, int8, fp8 e4m3 and e5m2).

A query at position p reads positions max(0, p - window + 1) .. p. The block-table entries of
blocks wholly before every query's window are -1 here (freed, as the block manager frees them),
and every cache's block -1 is poison (NaN, or the scales' NaN for int8): a kernel that followed
a freed entry would carry a NaN into its output."""

import numpy as np
import pytest

from minipaged.kernels import cuda
from minipaged.kernels import reference as spec
from minipaged.kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8
from minipaged.kernels.layout import AttentionMetadata, BlockBounds

from attention_batches import random_batch
from test_cuda_bf16 import BF16, assert_rounded_once
from test_cuda_kv_compression import compressed

FORMATS = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16,
           "int8": KV_INT8, "fp8_e4m3": KV_FP8_E4M3, "fp8_e5m2": KV_FP8_E5M2}
# (query_len, seq_len) per sequence: decodes past the window, a prompt, a chunk past the window, mixed
CASES = [[(1, 30), (1, 9), (1, 17)], [(20, 20), (9, 30)], [(1, 26), (12, 12), (3, 21)]]


@pytest.fixture(scope="module")
def ops():
    return cuda.cpu_harness_ops()


def slid_out(meta, window, block_size):
    """The batch's metadata with -1 in its tables for each block wholly before every query's window."""
    tables = meta.block_tables.copy()                                               # (S, max_blocks)
    first_query = meta.seq_lens - np.diff(meta.query_start_loc)                     # (S,) its position
    for s, p in enumerate(first_query):
        tables[s, :max(int(p) - window + 1, 0) // block_size] = -1
    return AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables,
                             meta.max_query_len, meta.max_seq_len)


def poisoned(array, poison):
    """A copy of array (blocks, ...) whose block -1, the memory just before it, holds ``poison``."""
    room = np.empty((array.shape[0] + 1, *array.shape[1:]), array.dtype)
    room[0] = poison
    room[1:] = array
    return room[1:]


def batch(rng, fmt, seqs, block_size=4):
    """q, the K and V caches (block -1 poisoned), the quant (or None), the float32 caches the spec
    reads, and the metadata: 4 query heads over 2 KV heads of 32 dims."""
    q, k, v, meta = random_batch(rng, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=32, seqs=seqs)
    if not isinstance(fmt, int):                     # a float cache of the activations' type
        q, k, v = q.astype(fmt), k.astype(fmt), v.astype(fmt)
        nan = np.array(np.nan, fmt)
        return q, poisoned(k, nan), poisoned(v, nan), None, k.astype(np.float32), v.astype(np.float32), meta
    kc, vc, quant, kd, vd = compressed(rng, fmt, k, v)
    if fmt == KV_INT8:                               # codes have no NaN: the scales of block -1 do
        quant = type(quant)(fmt, poisoned(quant.k_scale, np.nan), poisoned(quant.v_scale, np.nan))
    return q, poisoned(kc, 0x7F), poisoned(vc, 0x7F), quant, kd, vd, meta   # 0x7F: NaN in e4m3 and e5m2


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_window_attention_matches_the_spec(ops, name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(len(name))
    for seqs in CASES:
        q, k, v, quant, kd, vd, meta = batch(rng, fmt, seqs)
        for window in (1, 6, 16):
            want = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, 0.2, window=window)
            got = ops.paged_attention(q, k, v, slid_out(meta, window, 4), 0.2, quant, window=window)
            assert got.dtype == q.dtype and not np.isnan(got.astype(np.float32)).any(), (seqs, window)
            assert_rounded_once(got, want, q.dtype)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8"])
def test_split_k_decode_launches_only_the_windows_partitions(ops, monkeypatch, name):
    """Partitions of 16 positions over contexts of up to 150: with a window of 20 (its blocks span
    at most 23 positions) two partitions, not ten; the reduce kernel merges them."""
    ops = cuda.cpu_harness_ops(split_k_above=40, partition_size=16)
    launched = []
    kernels = dict(ops._kernels)
    for suffix in ("f32", "bf16"):
        def spy(grid, block, args, launch=kernels[f"paged_decode_{suffix}"]):
            launched.append(grid)
            return launch(grid, block, args)
        monkeypatch.setitem(ops._kernels, f"paged_decode_{suffix}", spy)
    rng = np.random.default_rng(7)
    q, k, v, quant, kd, vd, meta = batch(rng, FORMATS[name], [(1, 150), (1, 3), (1, 64), (1, 21)])
    assert ops.plan_attention(meta).num_partitions == 10
    for window, parts in ((20, 2), (40, 3), (1, 1)):
        want = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.2, window=window)
        got = ops.paged_attention(q, k, v, slid_out(meta, window, 4), 0.2, quant, window=window)
        assert launched[-1][2] == parts
        assert_rounded_once(got, want, q.dtype)


def test_block_sparse_decode_with_a_window_is_refused(ops):
    rng = np.random.default_rng(0)
    q, k, v, meta = random_batch(rng, block_size=4, num_heads=2, num_kv_heads=2, head_dim=8, seqs=[(1, 30)])
    bounds = BlockBounds(np.zeros((k.shape[0], 2, 8), np.float32), np.zeros((k.shape[0], 2, 8), np.float32), 2)
    with pytest.raises(ValueError, match="block-sparse decode attention with a sliding window is not supported"):
        ops.paged_attention(q, k, v, meta, 0.3, None, bounds, window=8)
    ops.paged_attention(q, k, v, meta, 0.3, None, BlockBounds(bounds.key_min, bounds.key_max, 0), window=8)
