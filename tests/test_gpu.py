"""The GPU backend on a real device (``pytest -m gpu``); every test skips cleanly without one.

Kept apart from tests/test_cuda_kernels.py so that a GPU machine needs only numpy, pytest
and CuPy to run them (scripts/gpu_check.sh).
"""

import numpy as np
import pytest

from minipaged.engine.backend import cuda_available
from minipaged.kernels import reference as spec
from minipaged.kernels.layout import AttentionMetadata

from attention_batches import random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU with CuPy")]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpu_attention_matches_the_spec(dtype):
    import cupy

    from minipaged.kernels.cuda import gpu_ops

    ops = gpu_ops()
    rng = np.random.default_rng(0)
    for seqs in ([(1, 700), (1, 3000), (1, 17)], [(40, 300), (1, 50), (7, 7)]):
        q, k, v, meta = random_batch(rng, block_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
                                     seqs=seqs, dtype=dtype)
        device_meta = AttentionMetadata(*(cupy.asarray(a) for a in (meta.slot_mapping, meta.query_start_loc,
                                                                     meta.seq_lens, meta.block_tables)),
                                        meta.max_query_len, meta.max_seq_len)
        got = ops.paged_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), device_meta, 0.1)
        want = spec.paged_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                    meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.1)
        np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want,
                                   atol=3e-3 if dtype == np.float16 else 1e-4)


def test_gpu_swap_round_trip_is_bit_exact():
    import cupy

    from minipaged.engine.cache_engine import _pinned
    from minipaged.kernels.cuda import gpu_ops

    ops = gpu_ops()
    rng = np.random.default_rng(1)
    device = cupy.asarray(rng.standard_normal((2, 2, 12, 2, 16, 64)).astype(np.float16))
    original = cupy.asnumpy(device)
    host = _pinned((2, 2, 8, 2, 16, 64), np.float16)
    ops.swap_blocks(device, host, [(3, 0), (7, 5)])
    device[...] = 0
    ops.swap_blocks(host, device, [(0, 10), (5, 1)])
    cupy.cuda.Device().synchronize()
    back = cupy.asnumpy(device)
    assert back[:, :, 10].tobytes() == original[:, :, 3].tobytes()
    assert back[:, :, 1].tobytes() == original[:, :, 7].tobytes()


NEAR_TIE = 1e-3   # the golden tests' rule (tests/test_golden.py)


def assert_same_greedy_tokens(got, want, label) -> None:
    """GPU greedy tokens equal the CPU's, except at a near-tie: cuBLAS sums in another order
    and ``__expf`` rounds differently, which may flip two logits closer than NEAR_TIE. There
    the GPU must have picked the CPU's second choice; after it the continuations differ."""
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        for step, (x, y) in enumerate(zip(g.token_ids, w.token_ids)):
            if x == y:
                continue
            top2 = sorted(w.logprobs[step].items(), key=lambda kv: -kv[1])[:2]   # the CPU's view
            margin = top2[0][1] - top2[1][1]
            assert x == top2[1][0] and margin < NEAR_TIE, (
                f"{label}: step {step}: GPU {x}, CPU {y}, CPU top-2 {top2} (margin {margin:.2e})")
            break
        else:
            assert len(g.token_ids) == len(w.token_ids), label


def test_gpu_engine_matches_the_cpu_engine(tmp_path):
    """The same engine on the GPU (float32) gives the CPU's greedy tokens, chunked prefill and
    preemption included (up to near-ties)."""
    from minipaged import LLM, SamplingParams
    from minipaged.model.random_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", head_dim=64)
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 40 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    cpu = LLM(str(model), device="cpu", swap_space=0.01).generate(prompts, params, use_tqdm=False)
    for kwargs in (dict(num_blocks=256), dict(num_blocks=20, block_size=4, preemption_mode="swap"),
                   dict(num_blocks=256, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)):
        gpu = LLM(str(model), device="cuda", dtype="float32", swap_space=0.01, **kwargs)
        assert_same_greedy_tokens(gpu.generate(prompts, params, use_tqdm=False), cpu, kwargs)


def compressed_pool(rng, fmt, k, v):
    """Float caches -> byte caches, scales and dequantized copies, by the NumPy spec."""
    from minipaged.kernels import kv_quant
    from minipaged.kernels.layout import KVQuant

    storage = kv_quant.STORAGE_DTYPE[fmt]
    shape = k.shape[:3] if fmt == kv_quant.KV_INT8 else (1, 1, 1)
    fill = 0.0 if fmt == kv_quant.KV_INT8 else 0.03
    quant = KVQuant(fmt, np.full(shape, fill, np.float32), np.full(shape, fill, np.float32))
    kc, vc = np.zeros(k.shape, storage), np.zeros(v.shape, storage)
    rows = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, c.shape[1], c.shape[3]).astype(np.float32)  # noqa: E731
    spec.write_kv(kc, vc, rows(k), rows(v), np.arange(k.shape[0] * k.shape[2], dtype=np.int64), quant)
    return kc, vc, quant, spec.dequantize_kv(kc, fmt, quant.k_scale), spec.dequantize_kv(vc, fmt, quant.v_scale)


@pytest.mark.parametrize("fmt", [1, 2, 3])   # int8, fp8 e4m3, fp8 e5m2
def test_gpu_compressed_blocks_write_and_attend_as_the_spec_says(fmt):
    import cupy

    from minipaged.kernels.cuda import gpu_ops
    from minipaged.kernels.layout import KVQuant

    ops = gpu_ops()
    rng = np.random.default_rng(fmt)
    for seqs in ([(1, 700), (1, 3000), (1, 17)], [(40, 300), (1, 50), (7, 7)]):
        q, k, v, meta = random_batch(rng, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                                     seqs=seqs, dtype=np.float16)
        kc, vc, quant, kd, vd = compressed_pool(rng, fmt, k, v)
        # the device's write_kv makes the same bytes and scales (the real cuda_fp8.h conversions)
        dk, dv = cupy.zeros(kc.shape, kc.dtype), cupy.zeros(vc.shape, vc.dtype)
        start = (lambda a: np.zeros_like(a)) if fmt == 1 else (lambda a: a)   # int8's scales are written  # noqa: E731
        dquant = KVQuant(fmt, cupy.asarray(start(quant.k_scale)), cupy.asarray(start(quant.v_scale)))
        rows = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, c.shape[1], c.shape[3])  # noqa: E731
        ops.write_kv(dk, dv, cupy.asarray(rows(k)), cupy.asarray(rows(v)),
                     cupy.arange(k.shape[0] * k.shape[2], dtype=cupy.int64), dquant)
        np.testing.assert_array_equal(cupy.asnumpy(dk), kc)
        np.testing.assert_array_equal(cupy.asnumpy(dv), vc)
        np.testing.assert_array_equal(cupy.asnumpy(dquant.k_scale), quant.k_scale)
        device_meta = AttentionMetadata(*(cupy.asarray(a) for a in (meta.slot_mapping, meta.query_start_loc,
                                                                     meta.seq_lens, meta.block_tables)),
                                        meta.max_query_len, meta.max_seq_len)
        got = ops.paged_attention(cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc), device_meta, 0.1,
                                  KVQuant(fmt, cupy.asarray(quant.k_scale), cupy.asarray(quant.v_scale)))
        want = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.1)
        np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want, atol=3e-3)


def test_gpu_sparse_decode_matches_the_spec():
    import cupy

    from minipaged.kernels.cuda import gpu_ops
    from minipaged.kernels.layout import BlockBounds

    ops = gpu_ops()
    rng = np.random.default_rng(7)
    q, k, v, meta = random_batch(rng, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                                 seqs=[(1, 4000), (1, 900), (1, 30)], dtype=np.float32)
    key_min, key_max = (cupy.asarray(b) for b in spec.key_bounds(k))
    device_meta = AttentionMetadata(*(cupy.asarray(a) for a in (meta.slot_mapping, meta.query_start_loc,
                                                                 meta.seq_lens, meta.block_tables)),
                                    meta.max_query_len, meta.max_seq_len)
    got = ops.paged_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), device_meta, 0.125, None,
                              BlockBounds(key_min, key_max, 32))
    want = spec.sparse_decode_attention(q, k, v, cupy.asnumpy(key_min), cupy.asnumpy(key_max), meta.block_tables,
                                        meta.seq_lens, 0.125, 512)
    np.testing.assert_allclose(cupy.asnumpy(got), want, atol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
                                    dict(sparse_attention_budget=16, block_size=4)])
def test_gpu_engine_with_compressed_or_sparse_blocks_matches_the_cpu_engine(tmp_path, kwargs):
    """int8 / fp8 blocks and block-sparse decode on the GPU give the CPU engine's greedy tokens
    with the same settings (up to near-ties), under swap preemption too."""
    from minipaged import LLM, SamplingParams
    from minipaged.model.random_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", head_dim=64)
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 40 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    cpu = LLM(str(model), device="cpu", swap_space=0.01, **kwargs).generate(prompts, params, use_tqdm=False)
    for extra in (dict(num_blocks=256), dict(num_blocks=24, block_size=4, preemption_mode="swap")):
        gpu = LLM(str(model), device="cuda", dtype="float32", swap_space=0.01, **{**kwargs, **extra})
        assert_same_greedy_tokens(gpu.generate(prompts, params, use_tqdm=False), cpu, {**kwargs, **extra})


@pytest.mark.parametrize("fmt", [None, 1, 2])   # float16, int8, fp8 e4m3 blocks
def test_gpu_sparse_decode_in_a_mixed_batch_matches_the_spec(fmt):
    """Decodes next to a prompt (the prefill kernel skips the unchosen blocks), half-precision
    activations, compressed blocks, key bounds written by the device's write_kv."""
    import cupy

    from minipaged.kernels.cuda import gpu_ops
    from minipaged.kernels.layout import BlockBounds, KVQuant

    ops = gpu_ops()
    rng = np.random.default_rng(11)
    q, k, v, meta = random_batch(rng, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                                 seqs=[(1, 2000), (1, 700), (33, 33)], dtype=np.float16)
    if fmt is None:
        kd, vd, dk, dv, quant = k.astype(np.float32), v.astype(np.float32), cupy.asarray(k), cupy.asarray(v), None
    else:
        kc, vc, host, kd, vd = compressed_pool(rng, fmt, k, v)
        dk, dv = cupy.asarray(kc), cupy.asarray(vc)
        quant = KVQuant(fmt, cupy.asarray(host.k_scale), cupy.asarray(host.v_scale))
    # the bounds through the device's own kernel: every slot written once, in order
    key_min = cupy.zeros((k.shape[0], 3, 64), np.float32)
    key_max = cupy.zeros_like(key_min)
    rows = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, c.shape[1], c.shape[3])  # noqa: E731
    scratch_k, scratch_v = cupy.zeros(k.shape, np.float16), cupy.zeros(v.shape, np.float16)
    ops.write_kv(scratch_k, scratch_v, cupy.asarray(rows(kd).astype(np.float16)), cupy.asarray(rows(vd).astype(np.float16)),
                 cupy.arange(k.shape[0] * 16, dtype=cupy.int64), None, BlockBounds(key_min, key_max, 0))
    want_min, want_max = spec.key_bounds(rows(kd).astype(np.float16).astype(np.float32).reshape(k.shape[0], 16, 3, 64)
                                         .transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(cupy.asnumpy(key_min), want_min)
    np.testing.assert_array_equal(cupy.asnumpy(key_max), want_max)
    device_meta = AttentionMetadata(*(cupy.asarray(a) for a in (meta.slot_mapping, meta.query_start_loc,
                                                                 meta.seq_lens, meta.block_tables)),
                                    meta.max_query_len, meta.max_seq_len)
    got = cupy.asnumpy(ops.paged_attention(cupy.asarray(q), dk, dv, device_meta, 0.125, quant,
                                           BlockBounds(key_min, key_max, 16))).astype(np.float32)
    want = spec.sparse_decode_attention(q[:2].astype(np.float32), kd, vd, want_min, want_max, meta.block_tables[:2],
                                        meta.seq_lens[:2], 0.125, 256)
    np.testing.assert_allclose(got[:2], want, atol=3e-3)
    dense = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, 0.125)
    np.testing.assert_allclose(got[2:], dense[2:], atol=3e-3)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_gpu_engine_with_speculative_decoding_matches_the_cpu_engine(tmp_path, method):
    """Drafts verified in one pass on the device (a k + 1 row query through the prefill kernel),
    rolled back through the block table: the CPU engine's greedy tokens, up to near-ties."""
    from minipaged import LLM, SamplingParams
    from minipaged.model.random_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", head_dim=64)
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        config["model"] = str(model)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 3}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    cpu = LLM(str(model), device="cpu", swap_space=0.01).generate(prompts, params, use_tqdm=False)
    for extra in (dict(num_blocks=256), dict(num_blocks=24, block_size=4, preemption_mode="swap")):
        gpu = LLM(str(model), device="cuda", dtype="float32", swap_space=0.01, speculative_config=config, **extra)
        assert_same_greedy_tokens(gpu.generate(prompts, params, use_tqdm=False), cpu, {**config, **extra})
        assert gpu.llm_engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0


def gpu_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def test_gpu_tensor_and_pipeline_shards_match_one_worker(tmp_path):
    """TP=3 x PP=2 with every worker on this one GPU (``uni``): each step's logits as one worker's,
    the same greedy tokens, under swap preemption too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from minipaged.model.random_llama import write_tiny_llama
    from parallel_workload import Run, assert_same_run, workload

    model = write_tiny_llama(tmp_path / "tiny", head_dim=64, num_attention_heads=6, num_key_value_heads=3)
    common = dict(device="cuda", dtype="float32", num_blocks=30, block_size=4, preemption_mode="swap",
                  swap_space=0.01, enable_prefix_caching=True)
    want = Run(model, workload("every block was free"), **common)
    got = Run(model, workload("every block was free"), **common, tensor_parallel_size=3, pipeline_parallel_size=2)
    assert want.stats["num_preemptions"] > 0
    assert_same_run(got, want, atol=1e-3)


@pytest.mark.skipif(not cuda_available() or gpu_count() < 2, reason="NCCL tensor parallelism needs 2 GPUs")
def test_nccl_tensor_parallel_over_ray_matches_one_worker(tmp_path):
    """TP=2 over Ray actors, one GPU each, all-reducing through NCCL."""
    import sys
    from pathlib import Path

    ray = pytest.importorskip("ray")
    sys.path.insert(0, str(Path(__file__).parent))
    from minipaged.model.random_llama import write_tiny_llama
    from parallel_workload import Run, assert_same_run, workload

    model = write_tiny_llama(tmp_path / "tiny", head_dim=64)     # 4 query heads, 2 KV heads
    common = dict(device="cuda", dtype="float32", num_blocks=30, block_size=4, swap_space=0.01)
    want = Run(model, workload("every block was free"), **common)
    ray.init(num_gpus=2, include_dashboard=False)
    try:
        got = Run(model, workload("every block was free"), **common, tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        assert_same_run(got, want, atol=1e-3)
        got.engine.shutdown()
    finally:
        ray.shutdown()
