"""The GPU backend's packaging and loading, without a GPU: the CuPy kernels load without Numba
CUDA (only copy-on-write and swapping need it, and they say so), the engine runs without a
swap space then and refuses the requests that would fork, and the KV pool is sized at an
H100's figures by the real ``profile_gpu_num_blocks`` on a fake ``cupy``."""

import dataclasses
import logging
import sys
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest

import minipaged.kernels as kernels_package
from minipaged import LLM, SamplingParams
from minipaged.config import CacheConfig, ConfigError
from minipaged.engine import llm_engine
from minipaged.engine.cache_engine import block_bytes, profile_gpu_num_blocks
from minipaged.engine.input_processor import RequestError
from minipaged.kernels import cuda
from minipaged.model.config import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]


def test_each_gpu_extra_names_cupy_and_numba_cuda_of_one_cuda_major_version():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, major in (("gpu", "13"), ("gpu-cu12", "12")):
        names = " ".join(extras[extra])
        assert f"cupy-cuda{major}x" in names and f"numba-cuda[cu{major}]" in names, (extra, names)


def without_numba_cuda(monkeypatch):
    """kernels/block_copy.py cannot be imported, as where numba-cuda is missing or broken."""
    monkeypatch.setitem(sys.modules, "minipaged.kernels.block_copy", None)
    monkeypatch.delattr(kernels_package, "block_copy", raising=False)


def fake_cupy(monkeypatch, runtime_version=13000):
    """Just what ``gpu_ops`` touches: NVRTC's version, RawModule, and arrays (numpy's)."""
    compiled = []

    class RawModule:
        def __init__(self, code, options):
            compiled.append(code)

        def get_function(self, name):
            return name

    module = types.ModuleType("cupy")
    module.ones, module.zeros = np.ones, np.zeros
    module.RawModule = RawModule
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(runtimeGetVersion=lambda: runtime_version))
    monkeypatch.setitem(sys.modules, "cupy", module)
    return compiled


def test_the_cupy_backend_loads_without_numba_cuda_and_only_copies_say_so(monkeypatch):
    without_numba_cuda(monkeypatch)
    compiled = fake_cupy(monkeypatch)
    ops = cuda.gpu_ops.__wrapped__()             # not the cached one a real GPU would hold
    assert len(compiled) == len(cuda.SOURCES) and "paged_decode_f16" in ops._kernels
    problem = ops.block_copy_problem()
    assert "numba-cuda" in problem and "minipaged[gpu]" in problem and "did not load: ModuleNotFoundError" in problem
    cache = np.zeros((1, 2, 4, 1, 2, 8), np.float16)   # (layers, K/V, blocks, kv_heads, block, dim)
    with pytest.raises(RuntimeError, match="copy-on-write and swapping on a GPU need Numba CUDA"):
        ops.copy_blocks(cache, [(0, 1)])


class NoCopies:
    """A CPU tier's ops that report what a GPU without Numba CUDA reports."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def block_copy_problem(self):
        return "copy-on-write and swapping on a GPU need Numba CUDA (the numba-cuda package), which did not load"


def engine_without_copies(monkeypatch, model_dir, **kwargs):
    real = llm_engine.select_backend

    def select(*args, **kw):
        backend = real(*args, **kw)
        return dataclasses.replace(backend, ops=NoCopies(backend.ops))

    monkeypatch.setattr(llm_engine, "select_backend", select)
    return LLM(str(model_dir), device="cpu", kernels="simple", num_blocks=64, **kwargs)


def test_without_block_copies_the_engine_drops_its_swap_space_and_refuses_forks(tiny_model_dir, monkeypatch,
                                                                                ):
    warnings = logging.Handler(logging.WARNING)
    warnings.emit = lambda record: seen.append(record.getMessage())
    seen = []
    logging.getLogger("minipaged").addHandler(warnings)
    try:
        llm = engine_without_copies(monkeypatch, tiny_model_dir, swap_space=1)
    finally:
        logging.getLogger("minipaged").removeHandler(warnings)
    assert any("need Numba CUDA (the numba-cuda package), which did not load; running without a swap space"
               in line for line in seen), seen
    assert llm.llm_engine.executor.num_cpu_blocks == 0
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestError, match="n=2 .*copy-on-write.*numba-cuda.*or send n=1"):
        llm.llm_engine.add_request("two", [1, 2, 3], dataclasses.replace(params, n=2))
    assert not llm.llm_engine.has_unfinished_requests()          # nothing was queued
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)     # n=1 runs as ever
    assert len(out[0].outputs[0].token_ids) == 4


def test_without_block_copies_a_swapping_preemption_mode_is_a_config_error(tiny_model_dir, monkeypatch):
    with pytest.raises(ConfigError, match="preemption_mode='swap' swaps blocks out.*Numba CUDA"):
        engine_without_copies(monkeypatch, tiny_model_dir, swap_space=1, preemption_mode="swap")


# ---------------------------------------------------------------- the pool at an H100's size

H100_TOTAL = 81559 * 2**20            # what cudaMemGetInfo reports on an H100 80GB HBM3
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192)


class FakeDeviceMemory:
    """CuPy's memory pool and cudaMemGetInfo over a fake 80 GB card: ``in_use`` bytes held
    before the pass (weights, CUDA context); a forward pass adds its activations to the pool."""

    def __init__(self, in_use: int) -> None:
        self.in_use, self.pool_bytes, self.peak = in_use, 0, 0

    def used_bytes(self):
        return self.pool_bytes

    def total_bytes(self):
        return self.peak

    def free_all_blocks(self):
        self.peak = self.pool_bytes

    def mem_get_info(self):
        return H100_TOTAL - self.in_use, H100_TOTAL


class FakeNet:
    """A model shard whose forward pass takes ``bytes_per_token`` of activations per token, and
    checks the batch profile_gpu_num_blocks builds."""

    def __init__(self, memory: FakeDeviceMemory, bytes_per_token: int, first_stage: bool = True):
        self.memory, self.bytes_per_token = memory, bytes_per_token
        self.shard = types.SimpleNamespace(is_first_stage=first_stage)
        self.nbytes = 270 * 10**6
        self.batches = []

    def run(self, inputs, positions, scratch, meta, last):
        tokens = len(positions)
        self.batches.append((tokens, scratch.shape, meta))
        self.memory.peak = max(self.memory.peak, self.memory.pool_bytes + tokens * self.bytes_per_token)
        return
        yield   # a generator, as the model's run is


def fake_cupy_memory(monkeypatch, memory: FakeDeviceMemory):
    module = types.ModuleType("cupy")
    module.zeros, module.asarray = np.zeros, np.asarray
    module.get_default_memory_pool = lambda: memory
    module.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None),
                                        runtime=types.SimpleNamespace(memGetInfo=memory.mem_get_info))
    monkeypatch.setitem(sys.modules, "cupy", module)


@pytest.mark.parametrize("tp", [1, 3])
def test_the_pool_of_an_80_gb_card_is_what_is_left_of_90_percent(monkeypatch, tp):
    """SmolLM2-135M in float16 with blocks of 16 on an H100: about 200k blocks of 360 KiB. A
    tensor-parallel stage's ranks run at once, so their activations add; each shard's pool holds
    its heads' share of a block id's bytes (``extra_bytes_per_block``: the other ranks')."""
    config = LlamaConfig(**SMOLLM2)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9)
    in_use = 270 * 10**6 + 500 * 2**20            # the weights and the CUDA context
    memory = FakeDeviceMemory(in_use)
    fake_cupy_memory(monkeypatch, memory)
    per_token = 2 * 10**5                           # activations: 1.6 GB at 8192 tokens
    nets = [FakeNet(memory, per_token) for _ in range(tp)]
    per_block = block_bytes(config, cache, np.float16)
    assert per_block == 30 * 2 * 3 * 16 * 64 * 2     # layers, K/V, kv heads, block, head dim, bytes
    shard = dataclasses.replace(config, num_attention_heads=9 // tp, num_key_value_heads=3 // tp)
    shard_block = block_bytes(shard, cache, np.float16)
    assert shard_block * tp == per_block
    num_blocks = profile_gpu_num_blocks(nets[0], shard, cache, max_num_batched_tokens=8192, max_model_len=8192,
                                        dtype=np.float16, extra_models=[(net, shard) for net in nets[1:]],
                                        extra_bytes_per_block=per_block - shard_block,
                                        group_sizes=(tp,))
    activations = tp * 8192 * per_token
    expected = int((0.9 * H100_TOTAL - in_use - activations) // per_block)
    assert num_blocks == expected and 190_000 < num_blocks < 215_000
    for net in nets:                                 # one sequence of 8192 tokens: 512 blocks
        (tokens, scratch_shape, meta), = net.batches
        assert tokens == 8192 and scratch_shape == (30, 2, 512, 3 // tp, 16, 64)
        assert meta.block_tables.shape == (1, 512) and meta.slot_mapping.max() == 512 * 16 - 1
    # a pool that size is addressable: the largest slot fits the kernels' int64 slot mapping,
    # and a layer's K (or V) cache stays under 2^31 elements for the kernels' 32-bit shapes
    assert num_blocks * 16 < 2**31 and num_blocks * 3 * 16 * 64 < 2**31


def test_an_80_gb_card_already_full_says_what_holds_it(monkeypatch):
    config = LlamaConfig(**SMOLLM2)
    memory = FakeDeviceMemory(in_use=H100_TOTAL - 2 * 2**30)      # another process holds all but 2 GiB
    fake_cupy_memory(monkeypatch, memory)
    with pytest.raises(ValueError, match=r"no GPU memory left for the KV cache: 77\.6 GiB of the device's 79\.6 GiB"):
        profile_gpu_num_blocks(FakeNet(memory, 10**5), config, CacheConfig(block_size=16), 8192, 8192, np.float16)
