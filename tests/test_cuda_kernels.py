"""The CUDA kernels without a GPU: NVRTC compiles every .cu file (sm_80 with CUDA 12.9, sm_90 with CUDA 13), the CPU
harness runs the same sources (through the very host code the GPU backend uses) against the
NumPy specs, and the Numba CUDA block copies run under the CUDA simulator. NVRTC is loaded from both
CUDA toolkits the dev extra installs (12.9 and 13; tests/nvrtc.py). tests/test_gpu.py repeats the checks
on a real device and skips without one."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels import cuda
from minipaged.kernels import reference as spec
from minipaged.kernels.layout import AttentionMetadata

import nvrtc
from attention_batches import random_batch

KERNELS = Path(cuda.__file__).parent


# ---------------------------------------------------------------- NVRTC


TOOLKITS = nvrtc.toolkits()


def test_both_cuda_toolkits_are_installed():
    """CI compiles against CUDA 12.9 and CUDA 13 (the dev extra's wheels): GPU machines have either."""
    assert sorted({t.version[0] for t in TOOLKITS}) == [12, 13], [str(t) for t in TOOLKITS]


# each toolkit with one architecture: CUDA 12.9 for an A100's sm_80, CUDA 13 for an H100's sm_90
# (the GPU machine the project expects first); every pair would double the time for little
TARGETS = [(t, "sm_80" if t.version[0] == 12 else "sm_90") for t in TOOLKITS]


@pytest.mark.parametrize("toolkit, arch", TARGETS, ids=[f"{t}-{a}" for t, a in TARGETS])
@pytest.mark.parametrize("name", cuda.SOURCES)
def test_every_cu_file_compiles_with_nvrtc(name, arch, toolkit):
    ok, log, _ = nvrtc.compile_to_ptx(toolkit, (KERNELS / name).read_text(), name,
                                      [f"--gpu-architecture={arch}", "-std=c++17", f"-I{KERNELS}"])
    assert ok, log


@pytest.mark.parametrize("toolkit", TOOLKITS, ids=str)
def test_shared_tiles_read_as_float2_are_aligned_in_the_ptx(toolkit):
    """A float2 load needs an 8-byte aligned address; a plain ``__shared__ float`` array is only
    promised 4. Every shared array the sources read through a float2 pointer must be
    declared with at least 8-byte alignment in the PTX NVRTC emits."""
    for name in cuda.SOURCES:
        source = (KERNELS / name).read_text()
        read_as_float2 = set(re.findall(r"reinterpret_cast<const float2\*>\(&(\w+)", source))
        if not read_as_float2:
            continue
        ok, log, ptx = nvrtc.compile_to_ptx(toolkit, source, name, ["--gpu-architecture=sm_90", "-std=c++17",
                                                                     f"-I{KERNELS}"])
        assert ok, log
        for array in read_as_float2:
            align = re.findall(rf"\.shared \.align (\d+) \.b8 \w*{array}\w*\[", ptx)
            assert align, f"{array} not found among {name}'s shared arrays in the PTX"
            assert all(int(a) >= 8 for a in align), f"{name}: {array} is {align}-byte aligned, read as float2"


# ---------------------------------------------------------------- the CPU harness


@pytest.fixture(scope="module")
def ops():
    return cuda.cpu_harness_ops()


def check_attention(ops, q, k_cache, v_cache, meta, atol):
    got = ops.paged_attention(q, k_cache, v_cache, meta, 0.2)
    want = spec.paged_attention(q.astype(np.float32), k_cache.astype(np.float32), v_cache.astype(np.float32),
                                meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2)
    np.testing.assert_allclose(got.astype(np.float32), want, atol=atol, rtol=atol)


@st.composite
def attention_cases(draw):
    decode = draw(st.booleans())
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        seq_len = draw(st.integers(1, 70))
        q_len = 1 if decode else draw(st.sampled_from([1, seq_len, max(1, seq_len // 2)]))
        seqs.append((q_len, seq_len))
    num_kv_heads = draw(st.integers(1, 2))
    return dict(block_size=draw(st.sampled_from([1, 2, 8, 16, 64])),
                num_kv_heads=num_kv_heads, num_heads=num_kv_heads * draw(st.sampled_from([1, 3])),
                head_dim=draw(st.sampled_from([16, 64, 96])), seqs=seqs), draw(st.integers(0, 2**31))


@settings(max_examples=12, deadline=None)
@given(attention_cases())
def test_attention_kernels_match_the_spec(ops, case):
    shape, seed = case
    check_attention(ops, *random_batch(np.random.default_rng(seed), **shape), atol=2e-5)


def test_split_k_decode_matches_the_spec(ops):
    """Long contexts are split into partitions and merged by the reduce kernel."""
    ops = cuda.cpu_harness_ops(split_k_above=40, partition_size=32)
    rng = np.random.default_rng(5)
    batch = random_batch(rng, block_size=8, num_heads=2, num_kv_heads=1, head_dim=64,
                         seqs=[(1, 150), (1, 3), (1, 64)])
    assert ops.plan_attention(batch[3]).num_partitions == 5
    check_attention(ops, *batch, atol=2e-5)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_half_precision_kernels(ops, kind):
    rng = np.random.default_rng(9)
    seqs = [(1, 40), (1, 9)] if kind == "decode" else [(12, 40), (9, 9)]
    batch = random_batch(rng, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, seqs=seqs,
                         dtype=np.float16)
    check_attention(ops, *batch, atol=3e-3)   # fp16 output rounding; float32 accumulation


def test_write_kv_and_fused_kernels_match_the_spec(ops):
    rng = np.random.default_rng(2)
    for dtype, atol in ((np.float32, 1e-5), (np.float16, 2e-3)):
        caches = [rng.standard_normal((6, 2, 4, 16)).astype(dtype) for _ in range(2)]
        expected = [c.copy() for c in caches]
        k, v = (rng.standard_normal((5, 2, 16)).astype(dtype) for _ in range(2))
        slots = np.array([3, 22, -1, 0, 9], dtype=np.int64)
        ops.write_kv(caches[0], caches[1], k, v, slots)
        spec.write_kv(expected[0], expected[1], k, v, slots)
        np.testing.assert_array_equal(caches[0], expected[0])
        np.testing.assert_array_equal(caches[1], expected[1])

        x = rng.standard_normal((7, 96)).astype(dtype)
        w = rng.standard_normal(96).astype(dtype)
        np.testing.assert_allclose(ops.rms_norm(x, w, 1e-5).astype(np.float32),
                                   spec.rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5),
                                   atol=atol * 10, rtol=atol * 10)
        gate_up = rng.standard_normal((7, 64)).astype(dtype)
        np.testing.assert_allclose(ops.silu_and_mul(gate_up).astype(np.float32),
                                   spec.silu_and_mul(gate_up.astype(np.float32)), atol=atol, rtol=atol)
        heads = rng.standard_normal((7, 3, 16)).astype(dtype)
        positions = rng.integers(0, 100, size=7)
        angles = np.outer(np.arange(128), 1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        np.testing.assert_allclose(ops.rotary(heads.copy(), positions, cos, sin).astype(np.float32),   # in place
                                   spec.rotary(heads.astype(np.float32), positions, cos, sin), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_through_the_cuda_kernels_matches_the_reference(tiny_model_dir, ops, dtype):
    """The whole Llama forward with every op a CUDA kernel (on the CPU harness), against the
    dense reference: the host-side launch code of the GPU backend, end to end. In bfloat16 (weights,
    activations and KV cache, as a GPU runs a bf16 checkpoint) against the reference of the same
    weights rounded to bf16: each op rounds its output to 8 significant bits, a relative error of up
    to 2^-9 that ~10 ops a layer compound; the logits must stay within 2^-5 of their largest (a few
    units in their last place)."""
    from minipaged.kernels.layout import kv_cache_shape
    from minipaged.model.config import LlamaConfig
    from minipaged.model.llama import LlamaModel
    from minipaged.model.reference import DenseReference
    from minipaged.model.weights import load_checkpoint

    dtype = np.dtype(np.float32) if dtype == "float32" else cuda.BFLOAT16
    config = LlamaConfig.from_dir(tiny_model_dir)
    tensors = load_checkpoint(tiny_model_dir)
    model = LlamaModel(config, tensors, ops, dtype=dtype)
    ids = [5, 77, 31, 200, 9, 14, 150]
    block_size, table = 4, np.array([[3, 0]], dtype=np.int32)
    kv = np.zeros(kv_cache_shape(config.num_hidden_layers, 4, config.num_key_value_heads, block_size,
                                 config.head_dim), dtype)
    expected = DenseReference(config, {k: v.astype(dtype).astype(np.float32) for k, v in tensors.items()}).logits(ids)
    tolerance = 1e-4 if dtype == np.float32 else 2.0**-5 * float(np.abs(expected).max())
    slots = np.array([table[0, p // block_size] * block_size + p % block_size for p in range(7)])
    # prefill the first 6 tokens (prefill kernel), then decode the 7th (decode kernel)
    for first, last in ((0, 6), (6, 7)):
        n = last - first
        meta = AttentionMetadata(slots[first:last], np.array([0, n], np.int32), np.array([last], np.int32),
                                 table, n, last)
        logits = model.forward(np.array(ids[first:last]), np.arange(first, last), kv, meta, np.arange(n))
        assert logits.dtype == dtype
        np.testing.assert_allclose(logits.astype(np.float32), expected[first:last], atol=tolerance, rtol=1e-4)
    # a step of prompt chunks only samples nothing: no kernel may be launched on empty rows
    assert model.forward(np.array(ids[:3]), np.arange(3), kv, AttentionMetadata(
        slots[:3], np.array([0, 3], np.int32), np.array([3], np.int32), table, 3, 3),
        np.arange(0)).shape == (0, config.vocab_size)


# ---------------------------------------------------------------- Numba CUDA under the simulator

SIMULATED = """
import numpy as np
from minipaged.kernels import block_copy, reference as spec
rng = np.random.default_rng(0)
for num_layers, blocks, pairs in ((1, 4, 1), (2, 9, 5)):   # one pair, and several across layers
    src = rng.standard_normal((num_layers, 2, blocks, 2, 4, 8)).astype(np.float32)
    dst = rng.standard_normal((num_layers, 2, blocks + 3, 2, 4, 8)).astype(np.float32)
    mapping = np.stack([rng.choice(blocks, pairs, replace=False), rng.choice(blocks + 3, pairs, replace=False)], 1)
    want = dst.copy()
    spec.swap_blocks(src, want, mapping)
    block_copy.swap_blocks(src, dst, mapping)                  # swap: one pool to another
    assert dst.tobytes() == want.tobytes()
    cache = src.copy(); want = src.copy()
    cow = np.array([[0, blocks - 1]])
    spec.swap_blocks(want, want, cow)
    block_copy.copy_blocks(cache, cow)                         # copy-on-write inside a pool
    assert cache.tobytes() == want.tobytes()
    # what a block carries beside its K/V, one axis fewer: int8 scales, sparse key bounds
    for width in (4, 8):
        meta = rng.standard_normal((num_layers, 2, blocks, 2, width)).astype(np.float32)
        host = np.zeros((num_layers, 2, blocks + 3, 2, width), np.float32)
        want = host.copy()
        spec.swap_blocks(meta, want, mapping)
        block_copy.swap_blocks(meta, host, mapping)
        assert host.tobytes() == want.tobytes()
    codes = rng.integers(-127, 128, (num_layers, 2, blocks, 2, 4, 8)).astype(np.int8)   # int8 bytes
    moved = np.zeros((num_layers, 2, blocks + 3, 2, 4, 8), np.int8)
    want = moved.copy()
    spec.swap_blocks(codes, want, mapping)
    block_copy.swap_blocks(codes, moved, mapping)
    assert moved.tobytes() == want.tobytes()
# the engine's GPU ops reach these copies through NumbaCudaCopies, imported at the first copy
from minipaged.kernels.cuda import NumbaCudaCopies
copies = NumbaCudaCopies()
assert copies.problem() is None
want = dst.copy()
spec.swap_blocks(src, want, mapping)
copies.swap_blocks(src, dst, mapping)
assert dst.tobytes() == want.tobytes()
print("simulated ok")
"""


def test_numba_cuda_block_copies_under_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, "-c", SIMULATED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "simulated ok" in done.stdout
