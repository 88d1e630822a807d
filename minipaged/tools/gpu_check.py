"""``python -m minipaged.gpu_check``: check and time every CUDA kernel, then the whole engine.

Run on a GPU machine by ``scripts/gpu_check.sh`` (one call, under ten minutes, no network).
``--preflight`` first, in seconds: the three CUDA C modules compiled by the engine's own
loader, and a one-line Numba CUDA kernel launched on a mapped (pinned) host array, as
swapping uses. Then:
  1. the device and its measured device-to-device copy bandwidth;
  2. every kernel against its NumPy spec on large random inputs;
  3. each kernel's time (CUDA events, median of many runs) and the bandwidth it reaches,
     as a share of the copy bandwidth (decode attention's goal: at least 60% at batch 64,
     context 2048, fp16 KV), over float16, int8 and fp8 blocks, and block-sparse decode
     against dense on an 8K context;
  4. the throughput benchmark end to end, minipaged against Hugging Face transformers (fp16),
     on a random model with SmolLM2-135M's shapes (the real weights cannot be fetched there),
     and greedy tokens of the GPU path against the CPU float32 path;
  5. tensor and pipeline parallelism: TP=3 x PP=2 with every worker on this GPU (``uni``)
     against one worker (tokens, the largest logit difference, seconds per step); the NCCL
     path needs at least 2 GPUs (tests/test_gpu.py runs it there), and is recorded as skipped
     on fewer.
``--smoke`` runs the same steps on the CPU (CUDA kernels through the CPU harness, tiny
shapes) so the script itself is tested in CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from ..kernels import reference as spec
from ..kernels.layout import AttentionMetadata

SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rope_theta=100000.0)


class Device:
    """The array module, the kernels and a timer, for the GPU or (smoke test) the CPU harness."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        if smoke:
            from ..kernels.cuda import cpu_harness_ops

            self.xp, self.ops = np, cpu_harness_ops()
        else:
            import cupy

            from ..kernels.cuda import gpu_ops

            self.xp, self.ops = cupy, gpu_ops()

    def asnumpy(self, a):
        return a if self.xp is np else self.xp.asnumpy(a)

    def time(self, fn, repeats: int) -> float:
        """Median seconds of ``fn()``: CUDA events on a GPU, perf_counter in the smoke test."""
        fn()
        samples = []
        for _ in range(repeats):
            if self.xp is np:
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
            else:
                start, stop = self.xp.cuda.Event(), self.xp.cuda.Event()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                samples.append(self.xp.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(samples))

    def info(self) -> dict:
        if self.xp is np:
            return {"device": "CPU harness (smoke test)", "machine": platform.processor()}
        props = self.xp.cuda.runtime.getDeviceProperties(0)
        return {"device": props["name"].decode(), "memory_gib": props["totalGlobalMem"] / 2**30,
                "compute_capability": f"{props['major']}.{props['minor']}",
                "multiprocessors": props["multiProcessorCount"]}


def copy_bandwidth(dev: Device, mib: int) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    a = dev.xp.ones(mib * 2**20 // 4, dtype=np.float32)
    b = dev.xp.empty_like(a)
    seconds = dev.time(lambda: dev.xp.copyto(b, a), repeats=5 if dev.smoke else 20)
    return 2 * a.nbytes / seconds


def paged_batch(rng, dev: Device, *, num_seqs, q_len, ctx, heads, kv_heads, head_dim, block_size, dtype):
    blocks = -(-ctx // block_size)
    num_blocks = num_seqs * blocks + 1
    k = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim), dtype=np.float32).astype(dtype)
    tables = rng.permutation(num_blocks)[:num_seqs * blocks].reshape(num_seqs, blocks).astype(np.int32)
    qsl = (np.arange(num_seqs + 1) * q_len).astype(np.int32)
    lens = np.full(num_seqs, ctx, np.int32)
    q = rng.standard_normal((num_seqs * q_len, heads, head_dim), dtype=np.float32).astype(dtype)
    host = (q, k, v, AttentionMetadata(np.zeros(len(q), np.int64), qsl, lens, tables, q_len, ctx))
    xp = dev.xp
    meta = AttentionMetadata(xp.asarray(host[3].slot_mapping), xp.asarray(qsl), xp.asarray(lens),
                             xp.asarray(tables), q_len, ctx)
    return host, (xp.asarray(q), xp.asarray(k), xp.asarray(v), meta)


def attention_case(dev: Device, rng, name: str, shape: dict, check: bool) -> dict:
    """One attention kernel checked against its spec and timed. ``shape`` may add ``fmt`` (a
    kv_quant format: the cache is compressed first, by the spec) and ``budget`` (block-sparse
    decode over the cache's key bounds, this many tokens a head)."""
    from ..kernels import kv_quant
    from ..kernels.layout import BlockBounds, KVQuant

    shape = dict(shape)
    fmt, budget = shape.pop("fmt", kv_quant.KV_FLOAT), shape.pop("budget", None)
    (q, k, v, meta), (dq, dk, dv, dmeta) = paged_batch(rng, dev, **shape)
    xp = dev.xp
    quant = bounds = None
    kd, vd = k.astype(np.float32), v.astype(np.float32)     # what the spec reads
    itemsize, scale_bytes = np.dtype(shape["dtype"]).itemsize, 0
    if fmt != kv_quant.KV_FLOAT:
        storage = kv_quant.STORAGE_DTYPE[fmt]
        per_token = fmt == kv_quant.KV_INT8
        scales = [np.zeros(k.shape[:3], np.float32) if per_token else np.full((1, 1, 1), 0.03, np.float32)
                  for _ in range(2)]
        host = KVQuant(fmt, *scales)
        kc, vc = np.zeros(k.shape, storage), np.zeros(v.shape, storage)
        rows = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, c.shape[1], c.shape[3]).astype(np.float32)  # noqa: E731
        spec.write_kv(kc, vc, rows(k), rows(v), np.arange(k.shape[0] * k.shape[2], dtype=np.int64), host)
        kd, vd = spec.dequantize_kv(kc, fmt, host.k_scale), spec.dequantize_kv(vc, fmt, host.v_scale)
        dk, dv = xp.asarray(kc), xp.asarray(vc)
        quant = KVQuant(fmt, xp.asarray(host.k_scale), xp.asarray(host.v_scale))
        itemsize, scale_bytes = 1, 4 if per_token else 0
    if budget is not None:
        key_min, key_max = spec.key_bounds(kd)
        bounds = BlockBounds(xp.asarray(key_min), xp.asarray(key_max), budget // shape["block_size"])
    plan = dev.ops.plan_attention(dmeta)
    run = lambda: dev.ops.paged_attention(dq, dk, dv, plan, 0.125, quant, bounds)   # noqa: E731
    out = run()
    row = {"kernel": name, **{k_: v_ for k_, v_ in shape.items() if k_ != "dtype"},
           "dtype": np.dtype(shape["dtype"]).name, "kv_cache_dtype": {v_: k_ for k_, v_ in
                                                                    kv_quant.KV_CACHE_DTYPES.items()}[fmt],
           "partitions": plan.num_partitions}
    if budget is not None:
        row["sparse_budget"] = budget
    if check:
        if budget is None:
            want = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, 0.125)
        else:
            want = spec.sparse_decode_attention(q.astype(np.float32), kd, vd, key_min, key_max, meta.block_tables,
                                                meta.seq_lens, 0.125, budget)
        row["max_abs_error"] = float(np.abs(dev.asnumpy(out).astype(np.float32) - want).max())
    seconds = dev.time(run, repeats=3 if dev.smoke else 50)
    tokens_read = min(shape["ctx"], budget) if budget is not None else shape["ctx"]   # per sequence and head
    kv_bytes = 2 * shape["num_seqs"] * tokens_read * shape["kv_heads"] * (shape["head_dim"] * itemsize + scale_bytes)
    row.update(seconds=seconds, kv_gb_per_s=kv_bytes / seconds / 1e9)
    return row


def kernel_report(dev: Device, smoke: bool) -> list[dict]:
    from ..kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8

    rng = np.random.default_rng(0)
    big = not smoke
    f16 = np.float16
    decode = dict(num_seqs=64 if big else 2, q_len=1, ctx=2048 if big else 40, heads=9 if big else 3,
                  kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16)
    long = dict(num_seqs=4 if big else 1, q_len=1, ctx=8192 if big else 300, heads=9 if big else 2,
                kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16)
    cases = [
        ("decode (batch 64, ctx 2048)", decode, True),
        ("decode split-K (batch 4, ctx 16384)", dict(num_seqs=4 if big else 1, q_len=1, ctx=16384 if big else 1200, heads=9 if big else 2,
                                                     kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16), True),
        ("decode fp32 (batch 64, ctx 2048)", {**decode, "dtype": np.float32}, True),
        ("prefill (8 x 512 tokens)", dict(num_seqs=8 if big else 1, q_len=512 if big else 20, ctx=512 if big else 20, heads=9 if big else 3,
                                          kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16), True),
        # the compressed KV cache: the same decode over 1-byte blocks (bytes read counted as stored)
        ("decode int8 KV (batch 64, ctx 2048)", {**decode, "fmt": KV_INT8}, True),
        ("decode fp8 e4m3 KV (batch 64, ctx 2048)", {**decode, "fmt": KV_FP8_E4M3}, True),
        ("decode fp8 e5m2 KV (batch 64, ctx 2048)", {**decode, "fmt": KV_FP8_E5M2}, True),
        ("prefill int8 KV (8 x 512 tokens)", dict(num_seqs=8 if big else 1, q_len=512 if big else 20, ctx=512 if big else 20,
                                                  heads=9 if big else 3, kv_heads=3 if big else 1, head_dim=64,
                                                  block_size=16, dtype=f16, fmt=KV_INT8), True),
        # block-sparse decode against dense on the same long context (bytes read: the budget's)
        ("decode dense (batch 4, ctx 8192)", long, True),
        ("decode sparse, budget 1024 (batch 4, ctx 8192)", {**long, "budget": 1024 if big else 64}, True),
    ]
    return [attention_case(dev, rng, name, shape, check) for name, shape, check in cases]


def elementwise_report(dev: Device, smoke: bool) -> list[dict]:
    rng = np.random.default_rng(1)
    xp, ops = dev.xp, dev.ops
    tokens = 16 if smoke else 8192
    rows = []
    x = rng.standard_normal((tokens, 576), dtype=np.float32).astype(np.float16)
    w = rng.standard_normal(576, dtype=np.float32).astype(np.float16)
    got = dev.asnumpy(ops.rms_norm(xp.asarray(x), xp.asarray(w), 1e-5)).astype(np.float32)
    err = np.abs(got - spec.rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5)).max()
    dx, dw = xp.asarray(x), xp.asarray(w)
    seconds = dev.time(lambda: ops.rms_norm(dx, dw, 1e-5), repeats=3 if smoke else 50)
    rows.append({"kernel": "rms_norm", "tokens": tokens, "max_abs_error": float(err), "seconds": seconds,
                 "gb_per_s": 2 * x.nbytes / seconds / 1e9})
    gu = rng.standard_normal((tokens, 3072), dtype=np.float32).astype(np.float16)
    got = dev.asnumpy(ops.silu_and_mul(xp.asarray(gu))).astype(np.float32)
    err = np.abs(got - spec.silu_and_mul(gu.astype(np.float32))).max()
    dgu = xp.asarray(gu)
    seconds = dev.time(lambda: ops.silu_and_mul(dgu), repeats=3 if smoke else 50)
    rows.append({"kernel": "silu_and_mul", "tokens": tokens, "max_abs_error": float(err), "seconds": seconds,
                 "gb_per_s": 1.5 * gu.nbytes / seconds / 1e9})
    k = rng.standard_normal((tokens, 3, 64), dtype=np.float32).astype(np.float16)
    cache = np.zeros((tokens // 16 + 1, 3, 16, 64), np.float16)
    slots = rng.permutation(cache.shape[0] * 16)[:tokens].astype(np.int64)
    dk, dc, dv, ds = xp.asarray(k), xp.asarray(cache), xp.asarray(cache), xp.asarray(slots)
    ops.write_kv(dc, dv, dk, dk, ds)
    want = cache.copy()
    spec.write_kv(want, want.copy(), k, k, slots)
    err = float(np.abs(dev.asnumpy(dc).astype(np.float32) - want.astype(np.float32)).max())
    seconds = dev.time(lambda: ops.write_kv(dc, dv, dk, dk, ds), repeats=3 if smoke else 50)
    rows.append({"kernel": "write_kv", "tokens": tokens, "max_abs_error": err, "seconds": seconds,
                 "gb_per_s": 4 * k.nbytes / seconds / 1e9})
    layers, blocks = (2, 8) if smoke else (30, 512)
    pool = xp.asarray(rng.standard_normal((layers, 2, blocks, 3, 16, 64), dtype=np.float32).astype(np.float16))
    pairs = np.stack([np.arange(blocks // 2), np.arange(blocks // 2, blocks)], axis=1)
    before = dev.asnumpy(pool)
    ops.copy_blocks(pool, pairs)
    after = dev.asnumpy(pool)
    exact = bool((after[:, :, pairs[:, 1]] == before[:, :, pairs[:, 0]]).all())
    seconds = dev.time(lambda: ops.copy_blocks(pool, pairs), repeats=3 if smoke else 20)
    moved = 2 * len(pairs) * before[:, :, 0].nbytes
    rows.append({"kernel": "copy_blocks (Numba CUDA)", "blocks": int(len(pairs)), "bit_exact": exact,
                 "seconds": seconds, "gb_per_s": moved / seconds / 1e9})
    # swapping: device -> pinned host pool -> other device blocks, bit for bit
    from ..engine.cache_engine import _pinned

    host = np.zeros((layers, 2, blocks, 3, 16, 64), np.float16) if smoke else _pinned((layers, 2, blocks, 3, 16, 64), np.float16)
    out_pairs = np.stack([np.arange(blocks // 2), np.arange(blocks // 2)], axis=1)
    snapshot = dev.asnumpy(pool)
    seconds_out = dev.time(lambda: ops.swap_blocks(pool, host, out_pairs), repeats=3 if smoke else 10)
    back_pairs = np.stack([np.arange(blocks // 2), np.arange(blocks // 2, blocks)], axis=1)
    ops.swap_blocks(host, pool, back_pairs)
    if not smoke:
        dev.xp.cuda.Device().synchronize()
    exact = bool((dev.asnumpy(pool)[:, :, back_pairs[:, 1]] == snapshot[:, :, out_pairs[:, 0]]).all())
    rows.append({"kernel": "swap_blocks to pinned host (Numba CUDA)", "blocks": int(len(out_pairs)),
                 "bit_exact": exact, "seconds": seconds_out,
                 "gb_per_s": len(out_pairs) * snapshot[:, :, 0].nbytes / seconds_out / 1e9})
    return rows


def write_random_model(path: Path, shapes: dict) -> Path:
    """An HF Llama directory with these shapes and random weights, and a byte-level tokenizer."""
    from ..model.random_llama import write_tiny_llama

    return write_tiny_llama(path, seed=0, embed_scale=0.2, **{**shapes, "vocab_size": max(shapes["vocab_size"], 259)})


def end_to_end(dev: Device, smoke: bool, out: dict) -> None:
    from ..engine.backend import release_device_memory
    from ..engine.llm_engine import LLMEngine
    from ..engine.metrics import Metrics
    from ..sampling_params import SamplingParams
    from .bench_peers import run_peer
    from .measure import run_workload
    from .workloads import make_requests

    shapes = dict(SMOLLM2_SHAPES) if not smoke else dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                          vocab_size=300, max_position_embeddings=512)
    model_dir = write_random_model(Path(tempfile.mkdtemp()) / "random-smollm2-shapes", shapes)
    device = "cpu" if smoke else "cuda"
    cfg = dict(num_prompts=64 if not smoke else 4, min_prompt_len=32, max_prompt_len=256 if not smoke else 40,
               output_len=128 if not smoke else 4)
    requests = make_requests("throughput", cfg, shapes["vocab_size"], seed=0)
    out["end_to_end"] = {"model": "random weights, SmolLM2-135M shapes", "workload": cfg}
    try:  # the peer first, while the GPU's memory is all free (smoke: on the CPU, if torch is there)
        out["end_to_end"]["hf_transformers"] = run_peer(
            "hf", str(model_dir), [r.prompt for r in requests], cfg["output_len"], device=device,
            dtype="float32" if smoke else "float16")
    except Exception as err:  # noqa: BLE001 (a broken peer must not cost minipaged's own numbers)
        out["end_to_end"]["hf_transformers"] = {"error": f"{type(err).__name__}: {str(err)[-1500:]}"}
    # No swap space: this run never preempts, and its headline number must not depend on
    # Numba CUDA (the block copies), which has its own section above.
    engine = LLMEngine(str(model_dir), device=device, dtype="float32" if smoke else "float16",
                       kv_cache_space=1.0 if smoke else None, swap_space=0, log_stats_interval=0)
    run_workload(engine, make_requests("throughput", {**cfg, "num_prompts": 2, "output_len": 2}, shapes["vocab_size"], 1),
                 progress=False)
    engine.metrics = Metrics()
    result = run_workload(engine, requests, progress=False)
    out["end_to_end"].update(minipaged=result, kv_blocks_total=engine.block_manager.num_blocks)
    peer = out["end_to_end"].get("hf_transformers", {})
    if "generation_tok_s" in peer:
        out["end_to_end"]["speedup_vs_hf"] = result["generation_tok_s"] / peer["generation_tok_s"]
    del engine
    release_device_memory()     # the next engine sizes its pool from what this one leaves
    # greedy tokens of this device's path against the CPU float32 path, same random model
    prompts = [{"prompt_token_ids": r.prompt[:48]} for r in requests[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, detokenize=False)
    from ..engine.llm import LLM

    gpu = LLM(str(model_dir), device=device, dtype="float32", num_blocks=1024, swap_space=0).generate(
        prompts, params, use_tqdm=False)
    cpu = LLM(str(model_dir), device="cpu", kv_cache_space=0.5, swap_space=0).generate(prompts, params, use_tqdm=False)
    agree, near_ties = 0, 0
    for a, b in zip(gpu, cpu):
        for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            if x != y:
                top = b.outputs[0].logprobs[i]
                margin = abs(top[y] - top.get(x, min(top.values())))
                near_ties += margin < 0.05
                break
            agree += 1
    out["greedy_vs_cpu_float32"] = {"tokens_agreeing_before_first_divergence": agree,
                                    "divergences_at_near_ties": near_ties}


def parallel_report(dev: Device, smoke: bool, out: dict) -> None:
    """Shards against one worker on the same device: tokens, logits, time per step."""
    from ..engine.backend import release_device_memory
    from ..engine.llm_engine import LLMEngine
    from ..sampling_params import SamplingParams

    shapes = dict(SMOLLM2_SHAPES, num_hidden_layers=4 if smoke else 30)
    if smoke:
        shapes.update(hidden_size=64, intermediate_size=96, vocab_size=300, max_position_embeddings=512)
    model_dir = write_random_model(Path(tempfile.mkdtemp()) / "random-parallel", shapes)
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "float16")
    prompts = [list(range(3 + 11 * i, 3 + 11 * i + 64)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8 if smoke else 64, ignore_eos=True, detokenize=False)
    rows = {}
    for name, split in (("one_worker", {}), ("uni_tp3_pp2", dict(tensor_parallel_size=3, pipeline_parallel_size=2))):
        engine = LLMEngine(str(model_dir), device=device, dtype=dtype, num_blocks=512, swap_space=0, **split)
        logits, tokens = [], {}
        execute = engine.executor.execute_model

        def recorded(model_input, execute=execute, logits=logits):
            result = execute(model_input)
            logits.append(dev.asnumpy(result).astype(np.float32))
            return result

        engine.executor.execute_model = recorded
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests() and steps < 1000:
            steps += 1
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
        rows[name] = dict(tokens=tokens, logits=logits, seconds_per_step=(time.perf_counter() - started) / steps)
        del engine
        release_device_memory()
    one, split = rows["one_worker"], rows["uni_tp3_pp2"]
    if len(one["logits"]) != len(split["logits"]):
        raise AssertionError(f"the split took {len(split['logits'])} forward passes, one worker "
                             f"{len(one['logits'])}: the driver should plan the same steps")
    diff = max([float(np.max(np.abs(a - b))) for a, b in zip(one["logits"], split["logits"]) if a.size] or [0.0])
    out["parallel"] = {"uni_tp3_pp2": {"same_tokens": one["tokens"] == split["tokens"], "max_logit_diff": diff,
                                       "seconds_per_step": split["seconds_per_step"],
                                       "one_worker_seconds_per_step": one["seconds_per_step"]}}
    gpus = 0 if smoke else int(dev.xp.cuda.runtime.getDeviceCount())
    out["parallel"]["nccl_over_ray"] = ("skipped: needs at least 2 GPUs, this machine has "
                                        f"{gpus}" if gpus < 2 else "run tests/test_gpu.py -k nccl")


def preflight(smoke: bool) -> int:
    """Fail in seconds, and say why, if the kernels cannot compile or Numba CUDA cannot launch."""
    import os  # noqa: PLC0415

    failures = []
    try:
        from ..kernels.cuda import cuda_include_dirs, kernel_sources  # noqa: PLC0415

        if smoke:
            from ..kernels.cuda import cpu_harness_ops  # noqa: PLC0415

            ops = cpu_harness_ops()
        else:
            import cupy  # noqa: PLC0415

            from ..kernels.cuda import gpu_ops  # noqa: PLC0415

            props = cupy.cuda.runtime.getDeviceProperties(0)
            print(f"GPU: {props['name'].decode()} (sm_{props['major']}{props['minor']}), CuPy {cupy.__version__}, "
                  f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, include dirs {cuda_include_dirs()}")
            ops = gpu_ops()      # the engine's own loader: every .cu file, the engine's flags
        print(f"compiled {', '.join(kernel_sources())}: {len(ops._kernels)} kernels")
    except Exception as err:  # noqa: BLE001 (reported, and the script stops)
        failures.append(f"the CUDA C kernels: {type(err).__name__}: {err}")
    try:
        if smoke:
            import numba  # noqa: PLC0415

            numba.config.ENABLE_CUDASIM = 1      # read when numba.cuda is first imported
        from ..kernels import block_copy  # noqa: PLC0415 (imports numba.cuda)

        if not block_copy.probe_mapped_launch():
            raise RuntimeError("the kernel ran but the mapped array does not hold its result")
        print(f"Numba CUDA: a kernel wrote a mapped host array ({'simulator' if smoke else 'device'}); "
              f"CUDA_HOME={os.environ.get('CUDA_HOME', '(unset)')}")
    except Exception as err:  # noqa: BLE001
        failures.append(f"Numba CUDA: {type(err).__name__}: {err} (on a toolkit install, is CUDA_HOME set?)")
    for failure in failures:
        print(f"PREFLIGHT FAILED: {failure}")
    print("preflight: ok" if not failures else "preflight: failed")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for gpu_results.json")
    p.add_argument("--smoke", action="store_true", help="run on the CPU harness with tiny shapes")
    p.add_argument("--preflight", action="store_true",
                   help="only check that the kernels compile and Numba CUDA launches (seconds)")
    args = p.parse_args(argv)
    if args.preflight:
        return preflight(args.smoke)
    out_file = Path(args.out) / "gpu_results.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d")}

    def section(name: str, fn) -> None:
        """Run one step; a failure is recorded and the next step still runs. The results so
        far are written after every step, so a time-out loses only the step it hit."""
        started = time.perf_counter()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (one broken step must not lose the others)
            report.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
        out_file.write_text(json.dumps(report, indent=2, default=str))
        print(f"[gpu_check] {name}: {report['seconds'][name]} s", flush=True)

    dev = Device(args.smoke)
    section("device", lambda: report.update(dev.info()))
    section("copy_bandwidth", lambda: report.update(
        copy_bandwidth_gb_per_s=copy_bandwidth(dev, 4 if args.smoke else 2048) / 1e9))

    def attention():
        report["attention"] = kernel_report(dev, args.smoke)
        for row in report["attention"]:
            row["share_of_copy_bandwidth"] = row["kv_gb_per_s"] / report["copy_bandwidth_gb_per_s"]

    section("attention", attention)
    section("other_kernels", lambda: report.update(other_kernels=elementwise_report(dev, args.smoke)))
    section("end_to_end", lambda: end_to_end(dev, args.smoke, report))
    section("parallel", lambda: parallel_report(dev, args.smoke, report))
    print(json.dumps(report, indent=2, default=str))
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
