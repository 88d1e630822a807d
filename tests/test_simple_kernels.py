"""The plain kernel tier (kernels/simple.py) against its NumPy specs (kernels/reference.py):
every call of KernelOps on random shapes, shuffled block tables, partial blocks, GQA, compressed
caches, block-sparse decode, and the errors a block id or a slot outside the pool raises."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_batches import random_batch
from minipaged.kernels import kv_quant
from minipaged.kernels import reference as spec
from minipaged.kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8
from minipaged.kernels.layout import BlockBounds, KVQuant
from minipaged.kernels.ops import KernelOps, LayerWeights, ModelWeights
from minipaged.kernels.simple import SimpleOps

OPS = SimpleOps()
FORMATS = [KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2]


def as_tokens(cache):
    """A pool (N, KVH, B, D) as the tokens of its slots in order: (N * B, KVH, D)."""
    return np.ascontiguousarray(cache.transpose(0, 2, 1, 3)).reshape(-1, cache.shape[1], cache.shape[3])


def empty_pool(rng, shape, fmt):
    """Zeroed K and V caches (N, KVH, B, D) of a format, and its KVQuant (None for floats); fp8's
    layer scales are not 1, so that their use is tested."""
    if fmt is None:
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32), None
    storage = kv_quant.STORAGE_DTYPE[fmt]
    if fmt == KV_INT8:
        scales = [np.zeros(shape[:3], np.float32) for _ in range(2)]
    else:
        scales = [np.full((1, 1, 1), rng.uniform(0.5, 2), np.float32) for _ in range(2)]
    return np.zeros(shape, storage), np.zeros(shape, storage), KVQuant(fmt, *scales)


def stored_pool(rng, k_float, v_float, fmt):
    """Every slot of float pools written, in order, through SimpleOps.write_kv (compressed with
    ``fmt``), keeping the key bounds: the caches, their quant, key_min, key_max."""
    kc, vc, quant = empty_pool(rng, k_float.shape, fmt)
    num_blocks, num_kv_heads, _, head_dim = k_float.shape
    key_min = np.zeros((num_blocks, num_kv_heads, head_dim), np.float32)
    key_max = np.zeros_like(key_min)
    slots = np.arange(num_blocks * k_float.shape[2], dtype=np.int64)
    OPS.write_kv(kc, vc, as_tokens(k_float), as_tokens(v_float), slots, quant, BlockBounds(key_min, key_max, 0))
    return kc, vc, quant, key_min, key_max


def readable(kc, vc, quant):
    """The float32 values a compressed pair of caches holds (floats as they are)."""
    if quant is None:
        return kc, vc
    return spec.dequantize_kv(kc, quant.fmt, quant.k_scale), spec.dequantize_kv(vc, quant.fmt, quant.v_scale)


def test_simple_ops_is_a_kernel_ops_tier():
    assert isinstance(SimpleOps(), KernelOps)
    assert OPS.name == "simple" and OPS.xp is np


def test_prepare_plan_and_decode_step():
    """The weights as they are, counted once each (a tied head is the embedding); the plan is
    the metadata; the plain tier declines the one-call decode step."""
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    embed = w(50, 8)
    layer = LayerWeights(w(8), w(16, 8), w(8, 8), w(8), w(24, 8), w(8, 12))
    weights = ModelWeights(embed, [layer], final_norm=w(8), lm_head=embed)
    assert OPS.prepare(weights) is weights
    assert OPS.weight_bytes(weights) == 4 * (50 * 8 + 8 + 16 * 8 + 8 * 8 + 8 + 24 * 8 + 8 * 12 + 8)
    _, _, _, meta = random_batch(rng, block_size=4, num_heads=2, num_kv_heads=1, head_dim=8, seqs=[(1, 5)])
    assert OPS.plan_step(weights, meta, None) is meta
    assert OPS.decode_step(weights, None, None, None, meta, None, 1.0, 1e-5, 2, True) is None


@pytest.mark.parametrize("tokens,hidden", [(1, 8), (5, 64), (17, 96)])
def test_rms_norm(tokens, hidden):
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((tokens, hidden)) * 3).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    np.testing.assert_allclose(OPS.rms_norm(x, weight, 1e-5), spec.rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 2), (6, 3, 16), (13, 4, 64)])
def test_rotary(tokens, heads, head_dim):
    """Contiguous and strided inputs (the model's q and k are column slices of one product)."""
    rng = np.random.default_rng(head_dim)
    angles = rng.uniform(0, 2 * np.pi, (64, head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = rng.integers(0, 64, tokens)
    wide = rng.standard_normal((tokens, heads + 1, head_dim)).astype(np.float32)
    for x in (np.ascontiguousarray(wide[:, :heads]), wide[:, 1:]):
        got = OPS.rotary(x, positions, cos, sin)
        np.testing.assert_allclose(got, spec.rotary(x, positions, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,ffn", [(1, 4), (7, 96)])
def test_silu_and_mul(tokens, ffn):
    rng = np.random.default_rng(ffn)
    gate_up = (rng.standard_normal((tokens, 2 * ffn)) * 4).astype(np.float32)
    gate_up[0, 0], gate_up[0, 1] = -120.0, 120.0                 # e^-g overflows / underflows
    np.testing.assert_allclose(OPS.silu_and_mul(gate_up), spec.silu_and_mul(gate_up), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens,fan_in,fan_out", [(1, 16, 8), (9, 64, 40), (33, 48, 96)])
def test_linear(tokens, fan_in, fan_out):
    rng = np.random.default_rng(fan_in)
    x = rng.standard_normal((tokens, fan_in)).astype(np.float32)
    w = rng.standard_normal((fan_out, fan_in)).astype(np.float32)
    np.testing.assert_allclose(OPS.linear(x, w, None), spec.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", [None] + FORMATS)
@pytest.mark.parametrize("block_size,num_tokens", [(1, 3), (8, 20), (16, 40)])
def test_write_kv_as_the_spec(fmt, block_size, num_tokens):
    """Scattered slots, a token not written (-1), an all-zero head: the same bytes and scales."""
    rng = np.random.default_rng(block_size * 10 + (fmt or 0))
    heads, head_dim, num_blocks = 3, 16, -(-num_tokens // block_size) + 2
    shape = (num_blocks, heads, block_size, head_dim)
    k = (rng.standard_normal((num_tokens, heads, head_dim)) * 3).astype(np.float32)
    v = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
    k[0, 0] = 0.0
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    slots[1] = -1
    kc, vc, quant = empty_pool(rng, shape, fmt)
    want_k, want_v, want_quant = empty_pool(rng, shape, fmt)
    if fmt in (KV_FP8_E4M3, KV_FP8_E5M2):
        want_quant = KVQuant(fmt, quant.k_scale.copy(), quant.v_scale.copy())
    OPS.write_kv(kc, vc, k, v, slots, quant)
    spec.write_kv(want_k, want_v, k, v, slots, want_quant)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    if quant is not None:
        np.testing.assert_array_equal(quant.k_scale, want_quant.k_scale)
        np.testing.assert_array_equal(quant.v_scale, want_quant.v_scale)


@pytest.mark.parametrize("fmt", [None, KV_INT8])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_write_kv_keeps_each_blocks_key_bounds(fmt, block_size):
    rng = np.random.default_rng(block_size)
    k = rng.standard_normal((5, 2, block_size, 8)).astype(np.float32)
    kc, vc, quant, key_min, key_max = stored_pool(rng, k, k.copy(), fmt)
    want_min, want_max = spec.key_bounds(k)
    np.testing.assert_array_equal(key_min, want_min)
    np.testing.assert_array_equal(key_max, want_max)
    # block 2 freed and written again: its first slot forgets the old bounds
    new = (rng.standard_normal((2, 2, 8)) * 0.01).astype(np.float32)
    slots = np.array([2 * block_size, 2 * block_size + 1][:min(2, block_size)], np.int64)
    OPS.write_kv(kc, vc, new[:len(slots)], new[:len(slots)], slots, quant, BlockBounds(key_min, key_max, 0))
    np.testing.assert_array_equal(key_min[2], new[:len(slots)].min(axis=0))
    np.testing.assert_array_equal(key_max[2], new[:len(slots)].max(axis=0))
    np.testing.assert_array_equal(key_min[3], want_min[3])        # other blocks untouched


def test_calibrate_kv_scales():
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((2, 7, 2, 8)) * [[[[5]]], [[[1]]]]).astype(np.float32)   # (7, 2, 8) each
    for k, v in [(k, v), (np.zeros((3, 1, 4), np.float32), np.zeros((3, 1, 4), np.float32))]:
        got = KVQuant(KV_FP8_E4M3, np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32))
        want = KVQuant(KV_FP8_E4M3, np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32))
        OPS.calibrate_kv_scales(k, v, got)
        spec.calibrate_kv_scales(k, v, want)
        np.testing.assert_array_equal(got.k_scale, want.k_scale)
        np.testing.assert_array_equal(got.v_scale, want.v_scale)


@pytest.mark.parametrize("tail", [(2, 4, 8), (2, 4)])        # K/V blocks (KVH, B, D), int8 scales (KVH, B)
def test_swap_and_copy_blocks(tail):
    rng = np.random.default_rng(len(tail))
    src = rng.standard_normal((3, 2, 6) + tail).astype(np.float32)      # (L, 2, N, ...)
    dst = rng.standard_normal((3, 2, 9) + tail).astype(np.float32)
    mapping = np.array([[4, 0], [1, 7], [5, 2]], np.int64)
    want = dst.copy()
    OPS.swap_blocks(src, dst, mapping)
    spec.swap_blocks(src, want, mapping)
    np.testing.assert_array_equal(dst, want)
    OPS.swap_blocks(src, dst, np.zeros((0, 2), np.int64))             # nothing to move
    np.testing.assert_array_equal(dst, want)
    cow = np.array([[0, 3], [2, 5]], np.int64)                        # fresh destinations
    src_want = src.copy()
    spec.swap_blocks(src_want, src_want, cow)
    OPS.copy_blocks(src, cow)
    np.testing.assert_array_equal(src, src_want)
    np.testing.assert_array_equal(src[:, :, 3], src[:, :, 0])


@st.composite
def attention_cases(draw):
    block_size = draw(st.sampled_from([1, 8, 16]))
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 3, 4]))
    head_dim = draw(st.sampled_from([8, 32]))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        seq_len = draw(st.integers(1, 60))
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        q_len = {"decode": 1, "prefill": seq_len}.get(kind) or draw(st.integers(1, seq_len))
        seqs.append((q_len, seq_len))
    fmt = draw(st.sampled_from([None, None] + FORMATS))
    return dict(block_size=block_size, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                head_dim=head_dim, seqs=seqs), fmt, draw(st.integers(0, 2**31))


@settings(max_examples=50, deadline=None)
@given(attention_cases())
def test_paged_attention_matches_spec(case):
    """Mixed prompts, chunks and decodes on shuffled blocks with partial last blocks, GQA, float
    and compressed caches: dense attention over what the cache holds."""
    shape, fmt, seed = case
    rng = np.random.default_rng(seed)
    q, k_float, v_float, meta = random_batch(rng, **shape)
    kc, vc, quant, _, _ = stored_pool(rng, k_float, v_float, fmt)
    scale = 1.0 / np.sqrt(shape["head_dim"])
    got = OPS.paged_attention(q, kc, vc, OPS.plan_step(None, meta, None), scale, quant)
    assert got.dtype == np.float32 and got.shape == q.shape
    kd, vd = readable(kc, vc, quant)
    want = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_paged_attention_every_group_and_block_size(group, block_size):
    """A prompt, a chunk and two decodes in one batch, q strided as the model's is."""
    rng = np.random.default_rng(group * 100 + block_size)
    q, kc, vc, meta = random_batch(rng, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                                   head_dim=16, seqs=[(1, 45), (12, 12), (5, 30), (1, 1)])
    wide = np.zeros(q.shape[:2] + (24,), np.float32)
    wide[..., 4:20] = q
    got = OPS.paged_attention(wide[..., 4:20], kc, vc, meta, 0.25)
    want = spec.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


@st.composite
def sparse_cases(draw):
    block_size = draw(st.sampled_from([1, 8, 16]))
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 3, 4]))
    seq_lens = draw(st.lists(st.integers(1, 130), min_size=1, max_size=3))
    keep = draw(st.integers(2, 6))
    fmt = draw(st.sampled_from([None, None] + FORMATS))
    return block_size, num_kv_heads, group, seq_lens, keep, fmt, draw(st.integers(0, 2**31))


@settings(max_examples=40, deadline=None)
@given(sparse_cases())
def test_sparse_decode_matches_spec(case):
    """Decoding heads attend to the blocks the spec chooses; a prompt in the batch stays dense."""
    block_size, num_kv_heads, group, seq_lens, keep, fmt, seed = case
    rng = np.random.default_rng(seed)
    seqs = [(1, n) for n in seq_lens] + [(9, 20)]
    q, k_float, v_float, meta = random_batch(rng, block_size=block_size, num_heads=num_kv_heads * group,
                                             num_kv_heads=num_kv_heads, head_dim=16, seqs=seqs)
    kc, vc, quant, key_min, key_max = stored_pool(rng, k_float, v_float, fmt)
    got = OPS.paged_attention(q, kc, vc, meta, 0.25, quant, BlockBounds(key_min, key_max, keep))
    kd, vd = readable(kc, vc, quant)
    decodes = len(seq_lens)
    want = spec.sparse_decode_attention(q[:decodes], kd, vd, key_min, key_max, meta.block_tables[:decodes],
                                        meta.seq_lens[:decodes], 0.25, keep * block_size)
    np.testing.assert_allclose(got[:decodes], want, rtol=1e-4, atol=3e-5)
    dense = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    np.testing.assert_allclose(got[decodes:], dense[decodes:], rtol=1e-4, atol=3e-5)


def test_a_budget_covering_every_context_is_dense_attention_exactly():
    rng = np.random.default_rng(3)
    q, k_float, v_float, meta = random_batch(rng, block_size=16, num_heads=6, num_kv_heads=2, head_dim=32,
                                             seqs=[(1, 200), (1, 37), (1, 16)])
    kc, vc, _, key_min, key_max = stored_pool(rng, k_float, v_float, None)
    dense = OPS.paged_attention(q, kc, vc, meta, 0.125)
    np.testing.assert_array_equal(OPS.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 13)),
                                  dense)
    sparse = OPS.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 4))
    assert not np.array_equal(sparse[0], dense[0])             # 200 tokens in 13 blocks: 4 kept
    np.testing.assert_array_equal(sparse[1:], dense[1:])       # 3 and 1 blocks: all kept


@pytest.mark.parametrize("bad", ["past the pool", "negative"])
def test_a_block_id_outside_the_pool_is_named(bad):
    rng = np.random.default_rng(4)
    q, kc, vc, meta = random_batch(rng, block_size=8, num_heads=2, num_kv_heads=1, head_dim=8,
                                   seqs=[(1, 20), (4, 9)])
    meta.block_tables[1, 1] = kc.shape[0] if bad == "past the pool" else -1
    before = kc.copy(), vc.copy()
    with pytest.raises(IndexError, match="simple"):
        OPS.paged_attention(q, kc, vc, meta, 0.3)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


@pytest.mark.parametrize("fmt", [None, KV_INT8])
@pytest.mark.parametrize("bad", [-2, 6 * 4])
def test_a_slot_outside_the_pool_is_named_and_nothing_is_written(fmt, bad):
    rng = np.random.default_rng(5)
    kc, vc, quant = empty_pool(rng, (6, 2, 4, 8), fmt)             # 24 slots
    key_min, key_max = np.zeros((6, 2, 8), np.float32), np.zeros((6, 2, 8), np.float32)
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([0, bad, 5], np.int64)
    with pytest.raises(IndexError, match="simple"):
        OPS.write_kv(kc, vc, k, k, slots, quant, BlockBounds(key_min, key_max, 0))
    assert not kc.any() and not vc.any() and not key_min.any() and not key_max.any()
    if quant is not None:
        assert not quant.k_scale.any() and not quant.v_scale.any()
