"""The speed instruments and paths of issue 15: ``bench roofline``, the linear layer's
row-by-row path, the bandwidth probe, and the BLAS thread setting whatever the import order.

Nothing here times anything against a threshold: the bench's figures are checked for
being computed right (against the model's own arrays and the definition of the bound),
not for being fast.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minipaged.entrypoints.args import engine_kwargs
from minipaged.entrypoints.cli import build_parser
from minipaged.kernels import reference
from minipaged.kernels.fast import packed_gemm
from minipaged.kernels.fast import elementwise, linear as fast_linear
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.linear_paths import LinearPaths
from minipaged.kernels.fast import thread_pools
from minipaged.tools import bench, roofline


@pytest.mark.parametrize("k,n", [(8, 16), (64, 100), (33, 7)])
def test_linear_matches_the_spec_for_every_row_count(k, n):
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((n, k), dtype=np.float32)              # (out, in)
    for rows in range(1, 65):
        x = rng.standard_normal((rows, k), dtype=np.float32)       # (T, in)
        got = fast_linear.linear(x, w)
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, reference.linear(x, w), rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 3072)])
def test_linear_matches_the_spec_at_smollm2_shapes(k, n):
    rng = np.random.default_rng(n)
    w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)    # (out, in)
    for rows in (1, 2, 3, 4, 5, 8, 16, 17):
        x = rng.standard_normal((rows, k), dtype=np.float32)
        np.testing.assert_allclose(fast_linear.linear(x, w), reference.linear(x, w), rtol=1e-4, atol=1e-4)


def test_linear_of_strided_rows_and_empty_batches():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 16), dtype=np.float32)             # (out, in)
    x = rng.standard_normal((3, 32), dtype=np.float32)[:, ::2]      # a view, not contiguous
    np.testing.assert_allclose(fast_linear.linear(x, w), reference.linear(x, w), rtol=1e-5, atol=1e-5)
    assert fast_linear.linear(np.empty((0, 16), np.float32), w).shape == (0, 24)
    x64 = rng.standard_normal((4, 16))                               # float64 rows: BLAS, same answer
    np.testing.assert_allclose(fast_linear.linear(x64, w), x64 @ w.T.astype(np.float64), rtol=1e-6)


def test_linear_refuses_shapes_that_do_not_fit():
    w = np.ones((8, 16), np.float32)                                  # (out, in)
    for x in (np.ones((2, 20), np.float32), np.ones((2, 8), np.float32), np.ones((70, 20), np.float32),
              np.ones(16, np.float32)):
        with pytest.raises(ValueError, match="do not fit"):
            fast_linear.linear(x, w)


def test_stream_sum_matches_the_spec():
    rng = np.random.default_rng(2)
    for n in (1, 17, 4096, 100_003):
        data = rng.random(n, dtype=np.float32)
        assert elementwise.stream_sum(data) == pytest.approx(reference.stream_sum(data), rel=1e-5)


def test_machine_probes_measure_something():
    assert roofline.matmul_peak(n=128, repeats=2) > 1e8          # FLOP/s
    assert roofline.read_bandwidth(nbytes=16 << 20, repeats=2) > 1e8   # bytes/s
    assert roofline.last_level_cache_bytes() >= 1 << 20


def run_roofline_bench(model_dir, out, monkeypatch, *extra: str) -> dict:
    """``bench roofline`` in this process on the tiny model, the machine probes made cheap."""
    peaks, bandwidths = iter([2e10, 1.5e10]), iter([0.5e10, 1e10])   # start, end: the better of each counts
    integers = iter([1e11, 0.8e11])
    monkeypatch.setattr(roofline, "matmul_peak", lambda: next(peaks))
    monkeypatch.setattr(roofline, "read_bandwidth", lambda: next(bandwidths))
    monkeypatch.setattr(roofline, "integer_peak", lambda: next(integers))
    args = build_parser().parse_args([
        "bench", "roofline", "--model", str(model_dir), "--device", "cpu", "--swap-space", "0",
        "--log-stats-interval", "0", "--out", str(out), *extra])
    assert bench.cmd_bench(args, engine_kwargs(args)) == 0
    return json.loads(out.read_text())


def test_roofline_rows_against_the_models_own_arrays(tiny_model_dir, tmp_path, monkeypatch):
    # our kernels by name: a decode step is then the persistent kernel, whatever "auto" measures here
    report = run_roofline_bench(tiny_model_dir, tmp_path / "r.json", monkeypatch, "--batch-sizes", "1,5,3",
                                "--context-len", "20", "--steps", "2", "--prefill-lens", "24,40,200",
                                "--prefill-repeats", "1", "--cpu-gemm", "numba")
    from minipaged.engine.llm_engine import LLMEngine   # the same model, to count its arrays
    engine = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=64, cpu_gemm="numba")
    model = engine.runner.model
    layer_weights = sum(int(w.size) for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = int(model.lm_head.size)
    kv = engine.cache.kv_cache                              # (layers, 2, blocks, kv_heads, block_size, head_dim)
    kv_token_bytes = kv.nbytes // (kv.shape[2] * kv.shape[4])
    c = engine.model_config
    vocab = c.vocab_size
    per_pair = 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers   # q.k and p.v, every head and layer
    machine = report["machine"]
    assert machine["matmul_peak"] == 2e10 and machine["read_bandwidth"] == 1e10
    assert machine["probes"] == [{"matmul_peak": 2e10, "read_bandwidth": 0.5e10, "integer_peak": 1e11},
                                 {"matmul_peak": 1.5e10, "read_bandwidth": 1e10, "integer_peak": 0.8e11}]
    assert [r["batch"] for r in report["decode"]] == [1, 3, 5]
    for row in report["decode"]:
        b = row["batch"]
        assert row["weight_bytes"] == 4 * (layer_weights + head)
        assert row["matmul_flops"] == 2 * b * (layer_weights + head) and row["integer_ops"] == 0   # float32
        # K and V of every context token read, and the new tokens' written
        assert row["kv_bytes"] == pytest.approx((row["mean_context"] * b + b) * kv_token_bytes)
        assert 20 <= row["mean_context"] <= 20 + 3 * (2 * 2 + 2)   # each size: 2 warm-ups, 2 + 2 steps
        assert row["bound_s"] == pytest.approx(max(row["bytes"] / 1e10, row["flops"] / 2e10))
        assert row["ratio"] == pytest.approx(row["step_s"] / row["bound_s"])
        # the serial bound: the products' own bound (weights and logits read, or their FLOPs),
        # then attention's (its K/V at the bandwidth, or its FLOPs, every query against its mean
        # context, every head and layer, at the peak)
        products = max((4 * (layer_weights + head) + 4 * b * vocab) / 1e10, 2 * b * (layer_weights + head) / 2e10)
        attention = max(row["kv_bytes"] / 1e10, row["mean_context"] * b * per_pair / 2e10)
        assert row["serial_bound_s"] == pytest.approx(products + attention)
        assert row["bound_s"] <= row["serial_bound_s"] <= row["bound_s"] * 2   # equal where bytes bound both
        assert row["serial_ratio"] == pytest.approx(row["step_s"] / row["serial_bound_s"])
        parts = row["breakdown_s"]
        assert set(parts) == {"matmuls", "lm_head", "attention", "other_kernels", "persistent", "sampler",
                              "python"}
        assert sum(parts.values()) == pytest.approx(row["step_s"], rel=1e-9)
        # a decode step runs as one persistent kernel (kernels/persistent_decode.py); attention
        # holds only plan_attention, made for the step before the kernel runs
        assert parts["persistent"] > 0 and parts["matmuls"] == parts["lm_head"] == 0
        # then the same steps layer by layer, kernel by kernel: the split into the kernels
        layers = row["layer_by_layer"]
        split = layers["breakdown_s"]
        assert split["matmuls"] > 0 and split["lm_head"] > 0 and split["attention"] > 0
        assert split["persistent"] == 0
        assert sum(split.values()) == pytest.approx(layers["step_s"], rel=1e-9)
        assert row["mean_context"] + 2 < layers["mean_context"] <= row["mean_context"] + 3   # later steps
        assert layers["bound_s"] == pytest.approx(max(layers["bytes"] / 1e10, layers["flops"] / 2e10))
        assert layers["ratio"] == pytest.approx(layers["step_s"] / layers["bound_s"])
        products = max((4 * (layer_weights + head) + 4 * b * vocab) / 1e10, 2 * b * (layer_weights + head) / 2e10)
        attention = max(layers["kv_bytes"] / 1e10, layers["mean_context"] * b * per_pair / 2e10)
        assert layers["serial_bound_s"] == pytest.approx(products + attention)
        assert layers["serial_ratio"] == pytest.approx(layers["step_s"] / layers["serial_bound_s"])
    assert [r["prompt_len"] for r in report["prefill"]] == [24, 40, 200]
    assert report["linear_paths"] == LinearPaths.every("numba").as_dict()
    assert {r["linear_path"] for r in report["decode"] + report["prefill"]} == {"numba"}
    for row in report["prefill"]:
        t = row["prompt_len"]
        assert row["matmul_flops"] == 2 * t * layer_weights + 2 * head     # one row gets logits
        assert row["fraction_of_peak"] == pytest.approx(row["flops"] / row["step_s"] / 2e10)
        assert row["kv_bytes"] == 2 * t * kv_token_bytes                    # its K/V written, then read
        products = max((4 * (layer_weights + head) + 4 * vocab) / 1e10, (2 * t * layer_weights + 2 * head) / 2e10)
        attention = max(row["kv_bytes"] / 1e10, per_pair * t * (t + 1) // 2 / 2e10)   # causal pairs
        assert row["serial_bound_s"] == pytest.approx(products + attention)
        assert row["serial_ratio"] == pytest.approx(row["step_s"] / row["serial_bound_s"])
        assert sum(row["breakdown_s"].values()) == pytest.approx(row["step_s"], rel=1e-9)
    versions = report["versions"]
    assert versions["numpy"] == np.__version__
    assert versions["cpu_vendor"] == packed_gemm.cpu_vendor()        # what /proc/cpuinfo says, or None
    assert versions["cpu_gemm"] == "numba"


def test_integer_products_are_set_against_the_integer_peak(tmp_path):
    """gguf_a8's products multiply bytes (kernels/fast/quant_a8.py), its layers' Q4_1 and its
    head's Q8_0: their arithmetic is counted apart and timed at the integer peak, the rest
    (attention's) at the matmul peak; the probe itself measures a positive rate."""
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.model.random_llama import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "g", seed=3, gguf=True, intermediate_size=128)
    engine = LLMEngine(str(model_dir), device="cpu", swap_space=0, num_blocks=16, quantization="gguf_a8")
    layer = engine.runner.model.layers[0]
    layer_weights = sum(int(w.size) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    c = engine.model_config
    cost = roofline.step_cost(engine, [1, 1, 1], [10, 20, 30], 3)
    head = int(engine.runner.model.lm_head.size)
    assert cost["integer_ops"] == 2 * 3 * (c.num_hidden_layers * layer_weights + head) == cost["matmul_flops"]
    assert cost["integer_ops"] < cost["flops"]                       # attention's stay float
    machine = {"matmul_peak": 1e10, "read_bandwidth": 1e9, "integer_peak": 4e10}
    compute = (cost["flops"] - cost["integer_ops"]) / 1e10 + cost["integer_ops"] / 4e10
    assert roofline.bound(cost, machine) == pytest.approx(max(cost["bytes"] / 1e9, compute))
    assert roofline.integer_peak(repeats=1, reps=1000) > 1e9   # a core does billions of these a second


def test_a_workloads_floor_counts_every_token_it_must_make(tiny_model_dir):
    """The floor of a whole workload, against a count from the model's own arrays: every prompt
    prefilled once (one row of logits), every later token one query over all before it; the
    weights read once per output token, every K and V read and written."""
    from minipaged.engine.llm_engine import LLMEngine
    engine = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=64)
    model, c = engine.runner.model, engine.model_config
    layer_weights = sum(int(w.size) for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = int(model.lm_head.size)
    kv = engine.cache.kv_cache                              # (layers, 2, blocks, kv_heads, block_size, head_dim)
    kv_token_bytes = kv.nbytes // (kv.shape[2] * kv.shape[4])
    per_pair = 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers   # q.k and p.v, every head and layer
    prompts, out = [5, 12, 1], 4
    flops = kv_tokens = 0
    for p in prompts:
        flops += 2 * p * layer_weights + 2 * head + per_pair * p * (p + 1) // 2   # the prefill: causal pairs
        kv_tokens += 2 * p                                                      # read (itself) and written
        for t in range(1, out):
            flops += 2 * (layer_weights + head) + per_pair * (p + t)
            kv_tokens += (p + t) + 1
    logits_bytes = 4 * len(prompts) * out * c.vocab_size
    nbytes = out * 4 * (layer_weights + head) + kv_tokens * kv_token_bytes + logits_bytes
    machine = {"matmul_peak": 1e9, "read_bandwidth": 2e9}
    floor = roofline.workload_floor(engine, prompts, out, machine)
    assert floor["flops"] == flops and floor["bytes"] == nbytes
    assert floor["compute_s"] == pytest.approx(flops / 1e9) and floor["memory_s"] == pytest.approx(nbytes / 2e9)
    assert floor["floor_s"] == max(floor["compute_s"], floor["memory_s"])
    assert floor["bound"] == ("compute" if flops / 1e9 >= nbytes / 2e9 else "memory")
    # a machine that reads slowly enough turns the same workload memory-bound
    slow = roofline.workload_floor(engine, prompts, out, {"matmul_peak": 1e12, "read_bandwidth": 1e6})
    assert slow["bound"] == "memory" and slow["floor_s"] == pytest.approx(nbytes / 1e6)


def test_bench_sets_the_run_and_the_peer_against_the_floor(tiny_model_dir, tmp_path, monkeypatch):
    """``bench throughput --peer hf`` reports the workload's floor on this machine, the share of
    it the run reached, and the most any engine could beat the peer by here. The machine is
    probed before the run and after it; each limit takes the better reading."""
    peaks, bandwidths = iter([3e9, 2e9]), iter([1e9, 4e9])               # before, after
    monkeypatch.setattr(bench, "matmul_peak", lambda: next(peaks))
    monkeypatch.setattr(bench, "read_bandwidth", lambda: next(bandwidths))
    monkeypatch.setattr(bench, "integer_peak", lambda: 5e9)
    monkeypatch.setattr(bench, "run_peer", lambda *a, **k: {"generation_tok_s": 2.0, "elapsed_s": 4.0})
    monkeypatch.setattr(bench, "check_peer_installed", lambda peer: None)   # the fake needs no torch
    out = tmp_path / "t.json"
    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(tiny_model_dir), "--device", "cpu", "--swap-space", "0",
        "--log-stats-interval", "0", "--num-prompts", "3", "--output-len", "5", "--min-prompt-len", "4",
        "--max-prompt-len", "9", "--peer", "hf", "--out", str(out)])
    assert bench.cmd_bench(args, engine_kwargs(args)) == 0
    report = json.loads(out.read_text())
    from minipaged.engine.llm_engine import LLMEngine
    engine = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=64)
    requests = bench.make_requests("throughput", report["config"], engine.model_config.vocab_size, 0)
    want = roofline.workload_floor(engine, [len(r.prompt) for r in requests], 5,
                                   {"matmul_peak": 3e9, "read_bandwidth": 4e9, "integer_peak": 5e9})
    floor, result = report["floor"], report["result"]
    assert {k: floor[k] for k in want} == pytest.approx(want)
    assert floor["machine"] == {"matmul_peak": 3e9, "read_bandwidth": 4e9, "integer_peak": 5e9,
                                "probes": [{"matmul_peak": 3e9, "read_bandwidth": 1e9, "integer_peak": 5e9},
                                           {"matmul_peak": 2e9, "read_bandwidth": 4e9, "integer_peak": 5e9}]}
    assert result["floor_s"] == pytest.approx(want["floor_s"]) and result["floor_bound"] == want["bound"]
    assert result["of_floor"] == pytest.approx(want["floor_s"] / result["elapsed_s"])
    assert result["max_speedup_vs_hf"] == pytest.approx(15 / want["floor_s"] / 2.0)
    assert result["speedup_vs_hf"] == pytest.approx(result["generation_tok_s"] / 2.0)
    # the engine each kind of step took: ours, on a model of which oneMKL would pack nothing
    assert re.fullmatch(r"((single-stream decode|batched decode|prefill) numba x \d+(, |$))+", result["linear_paths"])


@pytest.mark.skipif(packed_gemm.find_mkl_library() is None, reason="oneMKL is not installed")
def test_roofline_rows_name_the_engine_their_steps_took(tiny_model_dir, tmp_path, monkeypatch):
    report = run_roofline_bench(tiny_model_dir, tmp_path / "r.json", monkeypatch, "--batch-sizes", "1,2",
                                "--context-len", "20", "--steps", "1", "--prefill-lens", "200",
                                "--prefill-repeats", "1", "--cpu-gemm", "mkl")
    assert report["linear_paths"] == LinearPaths.every("mkl").as_dict()
    assert {r["linear_path"] for r in report["decode"] + report["prefill"]} == {"mkl"}
    assert all(r["breakdown_s"]["persistent"] == 0 and "layer_by_layer" not in r for r in report["decode"])


def test_roofline_refuses_what_it_cannot_measure_before_measuring(monkeypatch):
    monkeypatch.setattr(roofline, "matmul_peak", lambda: pytest.fail("measured before refusing"))
    cfg = dict(batch_sizes="1,2", context_len=256, prefill_lens="256,2048", steps=8, prefill_repeats=2)
    with pytest.raises(ValueError, match="--max-model-len 1024 is too short .* needs 2049 tokens"):
        roofline.run_roofline({"max_model_len": 1024}, cfg)
    with pytest.raises(ValueError, match="measures the CPU backend"):
        roofline.run_roofline({"device": "cuda"}, cfg)
    with pytest.raises(ValueError, match="--batch-sizes takes positive integers"):
        roofline.run_roofline({}, {**cfg, "batch_sizes": "1,\u00b2"})


def test_roofline_says_when_the_pool_is_too_small(tiny_model_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"the KV pool \(12 blocks\) cannot hold 4 sequences"):
        run_roofline_bench(tiny_model_dir, tmp_path / "r.json", monkeypatch, "--batch-sizes", "4",
                           "--context-len", "24", "--steps", "2", "--prefill-lens", "", "--num-blocks", "12",
                           "--block-size", "4", "--preemption-mode", "recompute")


def test_roofline_leaves_the_engine_whole(tiny_model_dir, tmp_path, monkeypatch):
    """The profiler's wrappers come off again: the model's ops are the backend's tier after it."""
    seen = {}
    real = roofline.measure_prefill

    def spy(engine, *args, **kwargs):
        rows = real(engine, *args, **kwargs)
        seen["ops"], seen["sampler"] = engine.runner.model.ops, engine.sampler
        seen["backend_ops"] = engine.backend.ops
        seen["unfinished"] = engine.has_unfinished_requests()
        return rows
    monkeypatch.setattr(roofline, "measure_prefill", spy)
    run_roofline_bench(tiny_model_dir, tmp_path / "r.json", monkeypatch, "--batch-sizes", "2",
                       "--context-len", "8", "--steps", "1", "--prefill-lens", "16", "--prefill-repeats", "1")
    assert seen["ops"] is seen["backend_ops"] and isinstance(seen["ops"], FastOps)
    assert type(seen["sampler"]).__name__ == "Sampler" and not seen["unfinished"]


def test_thread_timeout_is_read_as_openblas_reads_it(monkeypatch):
    assert [thread_pools.atoi(t) for t in ("16", "016", " 16", "+16", "-3", "16x", "abc", "")] == \
        [16, 16, 16, 16, -3, 16, 0, 0]
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "016")   # what OpenBLAS reads as 16: not "stuck"
    assert thread_pools.settle_blas_threads() == []
    assert all(thread_pools.thread_timeout(i["filepath"]) == 16 for i in thread_pools.openblas_libraries())


def test_a_users_wait_policy_keeps_minipaged_off_the_omp_spin():
    script = "import os, minipaged; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('KMP_BLOCKTIME'))"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    mine = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, "OMP_WAIT_POLICY": "PASSIVE"})
    ours = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in env.items() if k != "OMP_WAIT_POLICY"})
    assert mine.stdout.split() == ["None", "None"] and ours.stdout.split() == ["3000", "0"]


def test_blas_threads_settle_when_numpy_is_imported_first():
    """The spin setting reaches OpenBLAS even when numpy loaded it before minipaged did."""
    script = textwrap.dedent("""
        import json
        import numpy as np
        np.ones((64, 64)) @ np.ones((64, 64))          # the pool runs, with OpenBLAS's default
        from minipaged.kernels.fast.thread_pools import openblas_libraries, thread_timeout
        libs = [i["filepath"] for i in openblas_libraries()]
        before = [thread_timeout(p) for p in libs]
        from minipaged.engine.backend import select_backend
        select_backend("cpu", "auto")
        a = np.arange(9.0).reshape(3, 3)
        print(json.dumps({"before": before, "after": [thread_timeout(p) for p in libs], "a2": (a @ a)[2, 2]}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["before"]:
        pytest.skip("numpy here does not use OpenBLAS")
    assert all(t != 16 for t in result["before"])     # numpy came first: OpenBLAS read no setting
    assert result["after"] == [16] * len(result["before"])
    assert result["a2"] == 6 * 2 + 7 * 5 + 8 * 8      # and BLAS still computes, its pool restarted


@pytest.mark.parametrize("first", ["minipaged", "numba"])
def test_numba_runs_on_openmp_whatever_came_first(first):
    """TBB (the mkl wheel's dependency) would come before OpenMP in Numba's own order; minipaged
    puts OpenMP first, whether Numba was imported before it or not; a user's layer wins."""
    script = textwrap.dedent(f"""
        import {first}
        import numba, numpy as np
        from minipaged.engine.backend import select_backend
        from minipaged.kernels.fast import elementwise, linear as fast_linear
        from minipaged.kernels.fast.ops import FastOps
        select_backend("cpu", "auto", "numba")
        elementwise.silu_and_mul(np.ones((64, 4096), np.float32))   # a threaded kernel starts the pool
        print(numba.threading_layer())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_THREADING_LAYER")}
    ours = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    mine = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**env, "NUMBA_THREADING_LAYER": "workqueue"})
    assert mine.stdout.split()[-1:] == ["workqueue"], mine.stderr[-2000:]
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        pytest.skip("this Numba has no OpenMP layer")
    assert ours.stdout.split()[-1:] == ["omp"], ours.stderr[-2000:]
