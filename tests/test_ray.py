"""Pipeline parallelism over Ray, for real: a local cluster, each stage an actor process.

The fixture starts the cluster (``ray.init()``) and shuts it down. The oracle is the
single-worker engine in this process: the same tokens, logits within 1e-4.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minipaged import SamplingParams, WorkerError
from minipaged.config import ConfigError
from minipaged.engine.parallel import ray_executor
from minipaged.model.errors import ModelFormatError
from minipaged.model.random_llama import write_tiny_llama
from parallel_workload import Run, assert_same_run, workload
from tiny_model import make_llm

ray = pytest.importorskip("ray")

PREFIX = "every block was free"


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("ray_model"), num_attention_heads=6, num_key_value_heads=3,
                            num_hidden_layers=3)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids, seconds: float = 30.0) -> list[int]:
    """The pids still alive after up to ``seconds`` (bounded: polls every 0.2 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_a_program_that_exits_leaves_no_worker_behind(model_dir):
    """No cluster running: the executor starts Ray itself; the program then just ends."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tiny_model import make_llm
        from minipaged import SamplingParams
        llm = make_llm({str(model_dir)!r}, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        print(json.dumps({{"pids": llm.llm_engine.executor.pids, "tokens": out[0].outputs[0].token_ids}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["tokens"]) == 4
    assert wait_gone(report["pids"], seconds=60) == []


def test_two_engines_on_the_ray_minipaged_started(model_dir):
    """minipaged starts Ray for the first engine; deleting it must not stop Ray under the second."""
    script = textwrap.dedent(f"""
        import gc, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import ray
        from tiny_model import make_llm
        from minipaged import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=4)
        a = make_llm({str(model_dir)!r}, num_blocks=16, distributed_executor_backend="ray")
        b = make_llm({str(model_dir)!r}, num_blocks=16, distributed_executor_backend="ray")
        want = a.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
        del a
        gc.collect()
        assert ray.is_initialized()
        assert b.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids == want
        del b
        gc.collect()
        print("ray stopped:", not ray.is_initialized())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ray stopped: True" in done.stdout


@pytest.mark.parametrize("address, words", [("127.0.0.1:1", "no Ray cluster answers at RAY_ADDRESS='127.0.0.1:1'"),
                                            ("auto", "could not reach a Ray cluster (RAY_ADDRESS='auto')")])
def test_a_ray_address_with_no_cluster_is_one_line_at_once(model_dir, address, words):
    """Runs before the module's cluster starts (RAY_ADDRESS=auto would find that one)."""
    env = {**os.environ, "RAY_ADDRESS": address}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "minipaged", "generate", "x", "--model", str(model_dir),
                           "--device", "cpu", "--max-tokens", "2", "-pp", "2", "--distributed-executor-backend",
                           "ray"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and words in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 60


def test_bundles_hold_what_the_actors_ask_for():
    for gpu in (False, True):
        bundle, options = ray_executor.worker_resources(gpu)
        assert bundle.get("CPU", 0) >= options["num_cpus"] and bundle.get("GPU", 0) >= options["num_gpus"]


def test_a_worker_that_cannot_load_raises_its_own_error(cluster, model_dir, tmp_path):
    """A checkpoint missing a tensor: the worker's ModelFormatError, as one line, not 'the actor died'."""
    from safetensors.numpy import load_file, save_file

    broken = write_tiny_llama(tmp_path / "broken", num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=3)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]       # the last stage's
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelFormatError, match="model.layers.2.mlp.down_proj.weight"):
        make_llm(broken, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="kv_cache_space=1e-09 GiB holds no block"):
        make_llm(model_dir, kv_cache_space=1e-9, distributed_executor_backend="ray")


def test_a_shut_down_engine_says_so(cluster, model_dir):
    llm = make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    pids = llm.llm_engine.executor.pids
    llm.llm_engine.shutdown()
    assert wait_gone(pids) == []
    with pytest.raises(WorkerError, match="this engine was shut down"):
        llm.generate("hello", workload(PREFIX)[0][2], use_tqdm=False)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_pp2_over_ray_is_the_same_as_one_worker(cluster, model_dir, mode):
    common = dict(num_blocks=30, block_size=4, preemption_mode=mode, enable_prefix_caching=True)
    want = Run(model_dir, workload(PREFIX), **common)
    got = Run(model_dir, workload(PREFIX), **common, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert want.stats["num_preemptions"] > 0 and want.stats["prefix_cache_hits"] > 0 and want.copies > 0
    assert_same_run(got, want)
    executor = got.engine.executor
    assert len(set(executor.pids)) == 2 and os.getpid() not in executor.pids     # two actor processes
    # each stage's pool holds only its layers (2 + 1 of 3)
    whole = want.engine.executor.pool_bytes()[0]
    assert executor.pool_bytes() == [whole * 2 // 3, whole // 3]
    pids = executor.pids
    del got, executor
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("kwargs", [dict(quantization="int8"), dict(dtype="bfloat16")])
def test_ray_stages_carry_the_weight_format(cluster, model_dir, kwargs):
    """Each actor loads the driver's weight format (docs/weights.md): the same tokens as one worker."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = make_llm(model_dir, num_blocks=32, **kwargs)
    two = make_llm(model_dir, num_blocks=32, pipeline_parallel_size=2, distributed_executor_backend="ray", **kwargs)
    assert two.llm_engine.backend.weight_format == one.llm_engine.backend.weight_format != "float32"
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del two
    gc.collect()


def test_deleting_the_llm_stops_its_actors(cluster, model_dir):
    llm = make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    pids = llm.llm_engine.executor.pids
    assert all(alive(p) for p in pids)
    del llm
    gc.collect()
    assert wait_gone(pids) == []
    assert ray.is_initialized()           # the cluster was the program's: it stays up


def test_a_dead_worker_fails_the_next_step_loudly(cluster, model_dir):
    llm = make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    engine = llm.llm_engine
    executor = engine.executor
    engine.add_request("r", "hello", workload(PREFIX)[0][2])
    engine.step()
    ray.kill(executor.actors[1])
    start = time.monotonic()
    with pytest.raises(WorkerError, match="a Ray worker died"):
        for _ in range(20):               # the kill lands within a step or two
            engine.step()
    assert time.monotonic() - start < 60
    with pytest.raises(WorkerError):      # and every later step says so at once
        engine.step()
    pids = executor.pids
    del llm, engine, executor
    gc.collect()
    assert wait_gone(pids) == []


def test_tensor_parallelism_over_ray_on_cpus_is_refused(cluster, model_dir):
    with pytest.raises(ConfigError) as err:
        make_llm(model_dir, num_blocks=16, tensor_parallel_size=3, distributed_executor_backend="ray")
    assert "NCCL" in str(err.value) and "'uni'" in str(err.value) and "pipeline_parallel_size" in str(err.value)


def test_a_cluster_too_small_is_refused_at_once(cluster, model_dir):
    start = time.monotonic()
    with pytest.raises(ConfigError, match="cannot place 3 workers of 1 CPU each: it has 2 CPUs in all"):
        make_llm(model_dir, num_blocks=16, pipeline_parallel_size=3, distributed_executor_backend="ray")
    assert time.monotonic() - start < 30
    llm = make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert len(llm.llm_engine.executor.pids) == 2


def test_a_busy_cluster_is_refused_not_left_pending(cluster, model_dir, monkeypatch):
    """Both CPUs held by a first engine's workers: the second cannot be placed, and says why."""
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 3.0)
    first = make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match="found no room for 2 workers of 1 CPU each in 3 s: it has 2 CPUs, 0 of"):
        make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    del first
    gc.collect()
    # the reservations were given back: a pipeline that fits starts again
    llm = make_llm(model_dir, num_blocks=16, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert len(llm.llm_engine.executor.pids) == 2




