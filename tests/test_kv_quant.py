"""The compressed KV cache's kernels (int8, fp8 e4m3, fp8 e5m2) against their NumPy specs,
with ml_dtypes as the independent float8 reference."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels import kv_quant
from minipaged.kernels.fast import attention, kv_write
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels import reference as spec
from minipaged.kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8
from minipaged.kernels.layout import KVQuant
from test_kernels import random_batch

FP8 = {KV_FP8_E4M3: ml_dtypes.float8_e4m3fn, KV_FP8_E5M2: ml_dtypes.float8_e5m2}
FORMATS = [KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2]


@pytest.mark.parametrize("fmt", [KV_FP8_E4M3, KV_FP8_E5M2])
def test_fp8_conversions_match_ml_dtypes(fmt):
    dtype = FP8[fmt]
    every_code = np.arange(256, dtype=np.uint8)
    values = every_code.view(dtype).astype(np.float32)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(kv_quant.fp8_table(fmt)[finite], values[finite])
    # narrowing: random magnitudes over the whole range, every exact value and every midpoint
    # between neighbours (ties go to the even code), and values beyond the largest (saturate)
    rng = np.random.default_rng(fmt)
    exact = np.unique(values[finite])
    x = np.concatenate([rng.standard_normal(20_000) * s for s in (1e-5, 1e-3, 0.1, 1, 50, 1e4, 1e6)]
                       + [exact, (exact[:-1] + exact[1:]) / 2, [0.0, -0.0]]).astype(np.float32)
    largest = float(np.finfo(dtype).max)
    want = np.clip(x, -largest, largest).astype(dtype)
    np.testing.assert_array_equal(kv_quant.to_fp8(x, fmt), want.view(np.uint8))   # the bytes: -0.0 is 0x80
    np.testing.assert_array_equal(kv_quant.fp8_table(fmt)[kv_quant.to_fp8(x, fmt)], want.astype(np.float32))
    assert kv_quant.to_fp8(np.array([np.nan, -np.nan]), fmt).tolist() == [0x7F, 0xFF]   # NaN stays NaN


def quant_pool(rng, fmt, num_blocks, num_kv_heads, block_size, head_dim):
    """Empty byte caches and scales for one layer, as the cache engine makes them."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    storage = kv_quant.STORAGE_DTYPE[fmt]
    caches = [np.zeros(shape, storage), np.zeros(shape, storage)]
    if fmt == KV_INT8:
        scales = [np.zeros(shape[:3], np.float32), np.zeros(shape[:3], np.float32)]
    else:   # a layer scale other than 1, so that its use is tested
        scales = [np.full((1, 1, 1), rng.uniform(0.5, 2), np.float32) for _ in range(2)]
    return caches, scales


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size,num_tokens", [(1, 3), (4, 10), (16, 40)])
def test_write_kv_quantizes_as_the_spec_says(fmt, block_size, num_tokens):
    rng = np.random.default_rng(block_size * 10 + fmt)
    heads, head_dim, num_blocks = 3, 16, -(-num_tokens // block_size) + 2
    k = (rng.standard_normal((num_tokens, heads, head_dim)) * 3).astype(np.float32)
    v = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
    k[0, 0] = 0.0                                          # an all-zero head: scale 0, codes 0
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    slots[1] = -1                                          # a token not written
    (kc, vc), (ks, vs) = quant_pool(rng, fmt, num_blocks, heads, block_size, head_dim)
    (ekc, evc), (eks, evs) = quant_pool(rng, fmt, num_blocks, heads, block_size, head_dim)
    if fmt != KV_INT8:
        eks[:], evs[:] = ks, vs
    kv_write.write_kv(kc, vc, k, v, slots, KVQuant(fmt, ks, vs))
    spec.write_kv(ekc, evc, k, v, slots, KVQuant(fmt, eks, evs))
    np.testing.assert_array_equal(kc, ekc)
    np.testing.assert_array_equal(vc, evc)
    np.testing.assert_array_equal(ks, eks)
    np.testing.assert_array_equal(vs, evs)
    # and what was written reads back close to what was given
    got = spec.dequantize_kv(kc, fmt, ks)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        stored = got[slot // block_size, :, slot % block_size]
        step = np.abs(k[t]).max(axis=-1, keepdims=True) / 127 if fmt == KV_INT8 else np.abs(k[t]) / 8
        subnormal = 0 if fmt == KV_INT8 else 2.0 ** -8 * ks.reshape(-1)[0]    # fp8's finest step, scaled
        assert np.all(np.abs(stored - k[t]) <= step * (0.5 if fmt == KV_INT8 else 1) + subnormal + 1e-6)


@st.composite
def quant_attention_cases(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 3]))
    head_dim = draw(st.sampled_from([8, 64]))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        seq_len = draw(st.integers(1, 70))
        kind = draw(st.sampled_from(["decode", "prefill", "partial"]))
        q_len = {"decode": 1, "prefill": seq_len}.get(kind) or draw(st.integers(1, seq_len))
        seqs.append((q_len, seq_len))
    return (draw(st.sampled_from(FORMATS)), block_size, num_kv_heads, group, head_dim, seqs,
            draw(st.integers(0, 2**31)), draw(st.sampled_from(["numba", "blas"])))


@settings(max_examples=20, deadline=None)   # 60 cost a minute of CI time, 30 half a minute
@given(quant_attention_cases())
def test_paged_attention_over_compressed_blocks_matches_spec(case):
    """The kernels read the bytes (shuffled tables, partial blocks, both paths) and give what
    dense attention gives over the dequantized cache."""
    fmt, block_size, num_kv_heads, group, head_dim, seqs, seed, path = case
    rng = np.random.default_rng(seed)
    q, k_float, v_float, meta = random_batch(rng, block_size=block_size, num_heads=num_kv_heads * group,
                                             num_kv_heads=num_kv_heads, head_dim=head_dim, seqs=seqs)
    num_blocks = k_float.shape[0]
    (kc, vc), (ks, vs) = quant_pool(rng, fmt, num_blocks, num_kv_heads, block_size, head_dim)
    every_slot = np.arange(num_blocks * block_size, dtype=np.int64)
    tokens = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)   # noqa: E731
    kv_write.write_kv(kc, vc, tokens(k_float), tokens(v_float), every_slot, KVQuant(fmt, ks, vs))
    plan = attention.plan_attention(meta, None, FastTuning(prompt_min_queries=1 if path == "blas" else 1 << 30))   # the Numba kernel, or BLAS
    got = attention.paged_attention(q, kc, vc, plan, 1 / np.sqrt(head_dim), KVQuant(fmt, ks, vs))
    want = spec.paged_attention(q, spec.dequantize_kv(kc, fmt, ks), spec.dequantize_kv(vc, fmt, vs),
                                meta.block_tables, meta.seq_lens, meta.query_start_loc, 1 / np.sqrt(head_dim))
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)
