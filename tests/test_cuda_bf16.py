"""The bfloat16 variants of the CUDA C kernels (``*_bf16``), on the CPU harness, against the NumPy
specs; the harness's bfloat16 against ml_dtypes'; and the GPU's choice of dtype (engine/backend.py).

bfloat16 keeps float32's 8 exponent bits and 8 significant bits (7 stored): a bf16 checkpoint's
activations may pass float16's largest value (65504), so on a GPU such a model computes in bf16.
The kernels compute in float32 and round each output to bf16 once, when they store it; the spec
computes in float32 from the same bf16 inputs. So a kernel's output lies within half a bf16 unit
in the last place of the spec's, 2^-8 of its magnitude (``assert_rounded_once``), plus float32's
own noise. NVRTC compiles the same sources with CUDA 12.9's and 13's cuda_bf16.h
(tests/test_cuda_kernels.py)."""

import ml_dtypes
import numpy as np
import pytest

from minipaged.engine.backend import gpu_dtype
from minipaged.kernels import cuda, cuda_harness
from minipaged.kernels import reference as spec
from minipaged.kernels.kv_quant import KV_FP8_E4M3, KV_INT8
from minipaged.kernels.layout import BlockBounds

from attention_batches import random_batch

BF16 = np.dtype(ml_dtypes.bfloat16)
# Half a unit in the last place of each type's significand: the most one rounding moves a value,
# relative to it (float32's row stands for the accumulation-order noise the f32 tests allow).
HALF_ULP = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2.0**-11, BF16: 2.0**-8}


def assert_rounded_once(got, want, dtype=BF16):
    """got (a kernel's output in ``dtype``) is the float32 spec ``want`` rounded once to ``dtype``:
    within half an ulp of it, plus float32 noise (1e-5, relative and absolute)."""
    np.testing.assert_allclose(np.asarray(got).astype(np.float32), want, rtol=HALF_ULP[np.dtype(dtype)] + 1e-5,
                               atol=1e-5)


@pytest.fixture(scope="module")
def ops():
    return cuda.cpu_harness_ops()


# ---------------------------------------------------------------- the harness's bfloat16

ROUND_TRIP = """
#include "common.cuh"
extern "C" __global__ void round_trip_bf16(__nv_bfloat16* __restrict__ out, float* __restrict__ back,
                                           const float* __restrict__ x, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        store(out + i, x[i]);          // float -> bfloat16 (__float2bfloat16)
        back[i] = to_float(out[i]);    // and back (__bfloat162float)
    }
}
"""


def test_the_harness_rounds_to_bfloat16_as_ml_dtypes_does(tmp_path):
    """The shim's __float2bfloat16 (through common.cuh's store) on every bf16 value, every midpoint
    between neighbours (ties to even), random float32 bit patterns (subnormals, infinities, NaNs)
    and values past bf16's largest (infinity); __bfloat162float gives each value back exactly."""
    source = tmp_path / "round_trip.cu"
    source.write_text(ROUND_TRIP)
    kernel = cuda_harness.load(source, tmp_path).round_trip_bf16
    every = np.arange(2**16, dtype=np.uint16).view(BF16).astype(np.float32)      # all 65536 patterns
    finite = np.unique(every[np.isfinite(every)])
    midpoints = (finite[:-1].astype(np.float64) + finite[1:]) / 2                  # exact in float32
    random_bits = np.random.default_rng(0).integers(0, 2**32, 2**15, dtype=np.uint64).astype(np.uint32)
    big = float(np.finfo(BF16).max)
    past_the_largest = [big * 1.001, -big * 1.001, big * 1.003, -big * 1.003, 3.4e38]   # to max / to inf
    x = np.concatenate([every, midpoints.astype(np.float32), random_bits.view(np.float32),
                        np.float32(past_the_largest + [np.inf, -np.inf, 0.0, -0.0])])
    assert (midpoints.astype(np.float32) == midpoints).all()
    out, back = np.empty(len(x), BF16), np.empty(len(x), np.float32)
    kernel((1,), (32,), [out, back, x, np.int32(len(x))])
    with np.errstate(invalid="ignore"):                                     # NaNs stay NaNs
        want = x.astype(BF16)
    assert np.isinf(want[-9:-6].astype(np.float32)).tolist() == [False, False, True]
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(out.astype(np.float32)) == nan).all()
    wrong = (out.view(np.uint16) != want.view(np.uint16)) & ~nan
    assert not wrong.any(), (x[wrong][:5], out[wrong][:5], want[wrong][:5])
    np.testing.assert_array_equal(back, out.astype(np.float32))


def test_every_kernel_has_a_bfloat16_variant():
    """Each kernel comes as _f32, _f16 and _bf16 entry points, taking the same parameters
    (the activations' pointers excepted)."""
    for name in cuda.SOURCES:
        signatures = cuda_harness.kernel_signatures((cuda.KERNEL_DIR / name).read_text())
        stems = {k.rsplit("_", 1)[0] for k in signatures}
        for stem in stems:
            assert {f"{stem}_f32", f"{stem}_f16", f"{stem}_bf16"} <= set(signatures), (name, stem)
            plain = [t.replace("float", "T") for t in signatures[f"{stem}_f32"]]
            assert [t.replace("__nv_bfloat16", "T").replace("float", "T") for t in signatures[f"{stem}_bf16"]] \
                == plain, (name, stem)


# ---------------------------------------------------------------- each kernel against its spec


def bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


def test_write_kv_and_the_fused_kernels_in_bfloat16(ops):
    from test_cuda_kv_compression import bounded_pool

    rng = np.random.default_rng(2)
    caches = [bf16(rng, (6, 2, 4, 16)) for _ in range(2)]
    expected = [c.copy() for c in caches]
    k, v = bf16(rng, (5, 2, 16)), bf16(rng, (5, 2, 16))
    slots = np.array([3, 22, -1, 0, 9], dtype=np.int64)
    ops.write_kv(caches[0], caches[1], k, v, slots)
    spec.write_kv(expected[0], expected[1], k, v, slots)
    assert caches[0].tobytes() == expected[0].tobytes() and caches[1].tobytes() == expected[1].tobytes()
    k_pool = bf16(rng, (5, 2, 4, 16))                        # every slot written, keeping the key bounds
    _, _, _, key_min, key_max, _, _ = bounded_pool(ops, rng, k_pool, k_pool.copy())
    want_min, want_max = spec.key_bounds(k_pool.astype(np.float32))
    np.testing.assert_array_equal(key_min, want_min)
    np.testing.assert_array_equal(key_max, want_max)

    x, w = bf16(rng, (7, 96), 30.0), bf16(rng, 96)            # large values: bf16's range, not fp16's
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == BF16
    assert_rounded_once(got, spec.rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5))
    gate_up = bf16(rng, (7, 64), 3.0)
    assert_rounded_once(ops.silu_and_mul(gate_up), spec.silu_and_mul(gate_up.astype(np.float32)))
    heads, positions = bf16(rng, (7, 3, 16)), rng.integers(0, 100, size=7)
    angles = np.outer(np.arange(128), 1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    assert_rounded_once(ops.rotary(heads.copy(), positions, cos, sin),   # rotates in place
                        spec.rotary(heads.astype(np.float32), positions, cos, sin))
    # a linear layer: bf16 in, float32 accumulation, bf16 out (cuBLAS gemmEx on a GPU)
    a, b = bf16(rng, (5, 40)), bf16(rng, (24, 40))
    assert_rounded_once(ops.linear(a, b), a.astype(np.float32) @ b.astype(np.float32).T)


@pytest.mark.parametrize("kind", ["decode", "split-K", "prefill", "mixed"])
def test_attention_in_bfloat16(ops, kind):
    ops = cuda.cpu_harness_ops(split_k_above=40, partition_size=32)
    seqs = {"decode": [(1, 40), (1, 9)], "split-K": [(1, 150), (1, 3)], "prefill": [(12, 40), (9, 9)],
            "mixed": [(1, 33), (20, 20), (4, 30)]}[kind]
    rng = np.random.default_rng(len(kind))
    q, k, v, meta = random_batch(rng, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seqs=seqs,
                                 dtype=BF16)
    assert (ops.plan_attention(meta).num_partitions > 1) == (kind == "split-K")
    got = ops.paged_attention(q, k, v, meta, 0.2)
    assert got.dtype == BF16
    want = spec.paged_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2)
    assert_rounded_once(got, want)


@pytest.mark.parametrize("fmt", [KV_INT8, KV_FP8_E4M3])
def test_bfloat16_queries_over_compressed_blocks_and_sparse_decode(ops, fmt):
    """bf16 activations over byte blocks (decode and a prompt), and block-sparse decode's block
    choice from a bf16 query (paged_select_blocks_bf16)."""
    from test_cuda_kv_compression import bounded_pool, compressed

    rng = np.random.default_rng(fmt)
    q, k_float, v_float, meta = random_batch(rng, block_size=4, num_heads=4, num_kv_heads=2, head_dim=32,
                                             seqs=[(1, 37), (14, 14), (1, 20)])
    q = q.astype(BF16)
    kc, vc, quant, kd, vd = compressed(rng, fmt, k_float, v_float)
    want = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 0.2)
    assert_rounded_once(ops.paged_attention(q, kc, vc, meta, 0.2, quant), want)

    q, k_float, v_float, meta = random_batch(rng, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16,
                                             seqs=[(1, 70), (1, 33)])
    q = q.astype(BF16)
    kc, vc, quant, key_min, key_max, kd, vd = bounded_pool(ops, rng, k_float, v_float, fmt)
    got = ops.paged_attention(q, kc, vc, meta, 0.25, quant, BlockBounds(key_min, key_max, 3))
    want = spec.sparse_decode_attention(q.astype(np.float32), kd, vd, key_min, key_max, meta.block_tables,
                                        meta.seq_lens, 0.25, 3 * 4)
    assert_rounded_once(got, want)


# ---------------------------------------------------------------- which dtype a GPU computes in


def test_a_gpu_computes_a_bfloat16_checkpoint_in_bfloat16():
    """"auto" follows a bf16 checkpoint where CuPy has bfloat16 (CuPy 14); without it, float32,
    never float16 (whose range a bf16 model may overflow). Other checkpoints: float16."""
    def has(answer):
        return lambda: answer

    assert gpu_dtype("auto", "bfloat16", has(True)) == BF16
    assert gpu_dtype("auto", "bfloat16", has(False)) == np.float32
    assert gpu_dtype("auto", "float32", has(True)) == np.float16
    assert gpu_dtype("auto", "float16", has(True)) == np.float16
    assert gpu_dtype("bfloat16", "float32", has(True)) == BF16
    assert gpu_dtype("float32", "bfloat16", has(True)) == np.float32
    assert gpu_dtype("float16", "bfloat16", has(True)) == np.float16
    with pytest.raises(ValueError, match="CuPy 14"):
        gpu_dtype("bfloat16", "bfloat16", has(False))
    with pytest.raises(ValueError, match="not supported on a GPU"):
        gpu_dtype("float64")
