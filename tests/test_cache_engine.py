"""Sizing the GPU KV pool without a GPU: the arithmetic of ``kv_cache_blocks`` on fake memory
figures, and the benchmark dropping each engine before it builds the next (on a GPU, a live
engine's pool would leave the next one no memory)."""

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest

from minipaged.engine.cache_engine import kv_cache_blocks
from minipaged.engine.llm_engine import LLMEngine
from minipaged.entrypoints.args import engine_kwargs
from minipaged.entrypoints.cli import build_parser
from minipaged.tools import bench

GB = 10**9


def test_the_kv_pool_gets_the_share_left_after_what_is_in_use():
    # a 141 GB device; in use: 0.3 GB of weights + 0.5 GB of CUDA context; 2 GB of activations
    blocks = kv_cache_blocks(total=141 * GB, free=int(140.2 * GB), utilization=0.9, activations=2 * GB,
                             bytes_per_block=10**6)
    assert blocks == int((0.9 * 141 - 0.8 - 2) * 1000)          # 124100 blocks of 1 MB


def test_memory_held_by_another_engine_counts_and_never_goes_negative():
    # another engine still holds 126 GB: what is left of the 90% share is 0.1 GB, too little
    assert kv_cache_blocks(total=141 * GB, free=int(14.2 * GB), utilization=0.9, activations=2 * GB,
                           bytes_per_block=10**6) == 0
    # nothing free at all: still 0, not negative
    assert kv_cache_blocks(total=141 * GB, free=0, utilization=0.9, activations=2 * GB, bytes_per_block=1) == 0


class FakeDevice:
    """A device whose memory in use is what the live engines hold (weights + KV pool)."""

    def __init__(self, total: int, context: int) -> None:
        self.total, self.context = total, context
        self.engines: list[weakref.ref] = []

    def free(self) -> int:
        live = [e() for e in self.engines if e() is not None]
        return self.total - self.context - sum(e.model.nbytes + e.cache.total_bytes for e in live)


def run_small_bench(model_dir, workload: str, *extra: str) -> int:
    """``python -m minipaged bench WORKLOAD`` in this process: 2 tiny requests of 2 tokens."""
    args = build_parser().parse_args([
        "bench", workload, "--model", str(model_dir), "--device", "cpu", "--swap-space", "0",
        "--log-stats-interval", "0", "--num-prompts", "2", "--output-len", "2", "--min-prompt-len", "4",
        "--max-prompt-len", "8", *extra])
    return bench.cmd_bench(args, engine_kwargs(args))


def test_bench_drops_each_engine_before_building_the_next(tiny_model_dir, monkeypatch):
    """shared-prefix runs two engines; each is sized from the fake device's free memory as the
    GPU profiling pass would be, and both must get the same pool."""
    device = FakeDevice(total=40 * 2**20, context=2**20)
    pools = []

    def sized_engine(**kwargs):
        gc.collect()   # only what is really still referenced counts as in use
        probe = LLMEngine(**{**kwargs, "num_blocks": 1})
        num_blocks = kv_cache_blocks(total=device.total, free=device.free() - probe.model.nbytes,
                                     utilization=0.9, activations=2**20, bytes_per_block=probe.cache.bytes_per_block)
        del probe
        if num_blocks < 1:
            raise ValueError("no GPU memory left for the KV cache")
        engine = LLMEngine(**{**kwargs, "num_blocks": num_blocks})
        device.engines.append(weakref.ref(engine))
        pools.append(num_blocks)
        return engine

    monkeypatch.setattr(bench, "LLMEngine", sized_engine)
    assert run_small_bench(tiny_model_dir, "shared-prefix", "--prefix-len", "16") == 0
    assert len(pools) == 2 and pools[0] == pools[1] > 0, pools


def test_a_live_engine_leaves_the_next_one_nothing_on_the_fake_device(tiny_model_dir):
    """The failure the benchmark avoids: the same sizing with the first engine still alive."""
    device = FakeDevice(total=40 * 2**20, context=2**20)
    first = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=1)
    budget = kv_cache_blocks(total=device.total, free=device.free() - first.model.nbytes, utilization=0.9,
                             activations=2**20, bytes_per_block=first.cache.bytes_per_block)
    first = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=budget)
    device.engines.append(weakref.ref(first))
    second = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=1)
    left = kv_cache_blocks(total=device.total, free=device.free() - second.model.nbytes, utilization=0.9,
                           activations=2**20, bytes_per_block=second.cache.bytes_per_block)
    assert budget > 0 and left == 0


def test_bench_runs_the_peer_before_any_engine_exists(tiny_model_dir, monkeypatch):
    """An idle engine's thread pools slowed the peer when it ran second: it runs first now,
    on the same prompts the engine then gets, and the report names the libraries."""
    built = []
    seen = {}

    def fake_peer(peer, model_dir, prompts, output_len, **_):
        seen.update(engines_alive=len(built), prompts=prompts)
        return {"generation_tok_s": 1.0, "peer": "fake"}

    def engine(**kwargs):
        built.append(kwargs)
        return LLMEngine(**kwargs)

    monkeypatch.setattr(bench, "run_peer", fake_peer)
    monkeypatch.setattr(bench, "check_peer_installed", lambda peer: None)   # the fake needs no torch
    monkeypatch.setattr(bench, "LLMEngine", engine)
    assert run_small_bench(tiny_model_dir, "throughput", "--peer", "hf") == 0
    assert seen["engines_alive"] == 0 and len(built) == 1
    vocab = LLMEngine(str(tiny_model_dir), device="cpu", swap_space=0, num_blocks=8).model_config.vocab_size
    want = [r.prompt for r in bench.make_requests("throughput", {"num_prompts": 2, "min_prompt_len": 4,
                                                                 "max_prompt_len": 8, "output_len": 2}, vocab, 0)]
    assert seen["prompts"] == want


def test_the_peer_process_does_not_see_this_repository_as_its_path(monkeypatch):
    """``python -m`` puts its working directory first on sys.path; the peer must not start in
    a checkout, whose top-level kernels/ and model/ would shadow Hugging Face's packages."""
    from minipaged.tools import bench_peers

    calls = {}
    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        calls.update(cmd=cmd, **kwargs)
        probe = real_run([sys.executable, "-c", "import importlib.util, json, minipaged; "
                          "spec = importlib.util.find_spec('kernels'); "   # Hugging Face's, if installed
                          "print(json.dumps({'kernels': spec and spec.origin, 'minipaged': minipaged.__name__}))"],
                         capture_output=True, text=True, cwd=kwargs["cwd"], env=kwargs["env"])
        return subprocess.CompletedProcess(cmd, 0, probe.stdout, probe.stderr)

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(bench_peers.subprocess, "run", fake_run)
    got = bench_peers.run_peer("hf", "relative/model", [[1, 2]], 4)
    assert got["minipaged"] == "minipaged"
    assert got["kernels"] is None or not got["kernels"].startswith(checkout + os.sep)   # not ours
    assert not os.path.exists(os.path.join(calls["cwd"], "kernels", "__init__.py"))
    assert calls["cmd"][calls["cmd"].index("--model-dir") + 1] == os.path.abspath("relative/model")


def test_the_llamacpp_peer_names_the_gguf_file_it_needs(tiny_model_dir):
    """A model directory without a GGUF file: the error says the peer wants it (no quantization
    was asked for), before any process starts."""
    from minipaged.model.errors import ModelFormatError
    from minipaged.tools import bench_peers

    with pytest.raises(ModelFormatError, match="the llamacpp peer runs llama.cpp on the model's GGUF file, and .* "
                                               "holds no \\*.gguf file"):
        bench_peers.run_peer("llamacpp", str(tiny_model_dir), [[1, 2]], 4)


def test_weight_mb_under_tensor_parallelism_says_whose_it_is(tiny_model_dir, tmp_path):
    """-tp 2: the figure is the first worker's shard, and the report says so; one worker: no note."""
    for extra, scope in ((), None), (("-tp", "2"), "rank 0 of 2 workers (tp 2 x pp 1)"):
        out = tmp_path / f"t{len(extra)}.json"
        assert run_small_bench(tiny_model_dir, "throughput", *extra, "--out", str(out)) == 0
        result = json.loads(out.read_text())["result"]
        assert result["weight_mb"] > 0 and result.get("weight_mb_of") == scope
        if scope is None:
            whole = result["weight_mb"]
    assert result["weight_mb"] < whole       # the shard: half the heads and MLP columns


def test_a_peer_that_fails_in_its_process_is_one_error_with_its_last_words(tiny_model_dir, monkeypatch):
    from minipaged.tools import bench_peers

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nImportError: libllama.so: no such file")

    monkeypatch.setattr(bench_peers.subprocess, "run", failing_run)
    with pytest.raises(ValueError, match="the hf peer failed in its own process; its last output:\n"
                                         "Traceback ...\nImportError: libllama.so"):
        bench_peers.run_peer("hf", str(tiny_model_dir), [[1, 2]], 4)


def test_a_given_prompt_is_every_request_s_and_the_peer_s_too(tiny_model_dir, monkeypatch, tmp_path):
    """``--prompt TEXT``: the engine and the peer decode the text's tokens, as ``generate``
    tokenizes it; the report's prompt lengths are the text's."""
    from minipaged.model.tokenizer import Tokenizer

    seen, added = {}, []
    monkeypatch.setattr(bench, "run_peer", lambda peer, model_dir, prompts, output_len, **_:
                        seen.update(prompts=prompts) or {"generation_tok_s": 1.0})
    monkeypatch.setattr(bench, "check_peer_installed", lambda peer: None)   # the fake needs no package
    real_run = bench.run_workload

    def run(engine, requests, progress=True):
        added.extend(r.prompt for r in requests)
        return real_run(engine, requests, progress)

    monkeypatch.setattr(bench, "run_workload", run)
    text = "Once upon a time, a page table"
    out = tmp_path / "p.json"
    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(tiny_model_dir), "--device", "cpu", "--swap-space", "0",
        "--log-stats-interval", "0", "--num-prompts", "2", "--output-len", "2", "--prompt", text,
        "--peer", "hf", "--out", str(out)])
    assert bench.cmd_bench(args, engine_kwargs(args)) == 0
    want = Tokenizer.from_dir(tiny_model_dir).encode(text, add_special_tokens=True)
    assert seen["prompts"] == [want, want] and added[-2:] == [want, want]      # after the warm-up's
    report = json.loads(out.read_text())
    assert report["config"]["prompt"] == text and report["config"]["min_prompt_len"] == len(want)
    assert report["result"]["prompt_tokens"] == 2 * len(want)
