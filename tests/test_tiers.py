"""The plain tier (kernels/simple.py) and the fast tier (kernels/fast/) behind one interface.

The plain tier is the oracle here: one readable function per operation, checked against the
NumPy specs (tests/test_simple_kernels.py). Both tiers must give the same greedy tokens as the
dense reference model and as each other: any batch, any block size, every preemption mode,
chunked prefill, and the real model's golden prompts. Choosing a tier changes no model or engine
code: the model names neither (checked here by reading it).
"""

import re
from pathlib import Path

import numpy as np
import pytest

from minipaged import LLMEngine, SamplingParams
from minipaged.config import ConfigError, EngineConfig
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.kernels.ops import KernelOps
from minipaged.kernels.simple import SimpleOps
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel
from minipaged.model.random_llama import random_tensors, tiny_config
from test_engine import GREEDY, random_prompts
from tiny_model import make_llm, prefill_then_decode

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("simple", "fast")
SWAP_GIB = 0.01


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_both_tiers_are_kernel_ops():
    assert isinstance(SimpleOps(), KernelOps) and isinstance(FastOps(), KernelOps)
    assert {SimpleOps.name, FastOps.name} == set(TIERS)


def test_the_model_names_no_backend():
    """model/llama.py reads like the reference forward with a paged cache: no word of a tier's tricks."""
    source = (ROOT / "model" / "llama.py").read_text()
    words = re.findall(r"\b(gemm|packed|persistent|huge|panels?|mkl|numba|simd)\b", source, flags=re.IGNORECASE)
    assert not words, f"model/llama.py names {sorted(set(words))}"


@pytest.mark.parametrize("kwargs", [
    dict(),                                                                           # one batch
    dict(block_size=2, num_blocks=40, preemption_mode="swap", swap_space=SWAP_GIB),   # swapped out and in
    dict(block_size=2, num_blocks=40, preemption_mode="recompute"),                   # killed and recomputed
    dict(block_size=4, num_blocks=40, preemption_mode="partial", swap_space=SWAP_GIB),   # some blocks paged out
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8),     # prompts in chunks
    dict(enable_prefix_caching=True, block_size=4),                                   # shared prefixes
    dict(block_size=2, sparse_attention_budget=4),                                    # block-sparse decode
])
def test_the_tiers_agree_token_for_token(tiny_model_dir, kwargs):
    """The same greedy tokens from both tiers in every mode; within a tier, the same tokens for a
    prompt alone as in the batch (batch invariance). (Each tier against the dense reference:
    tests/test_engine.py, whose tests run [fast] and [simple].)"""
    prompts = random_prompts(6, seed=11) + [[7, 8, 9] * 5 + [10]] * 2
    got = {}
    for kernels in TIERS:
        llm = make_llm(tiny_model_dir, kernels=kernels, **kwargs)
        got[kernels] = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
        alone = _tokens([llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts[:3]])
        assert alone == got[kernels][:3]
    assert got["simple"] == got["fast"]


def test_the_tiers_compute_the_same_logits(tiny_model_dir):
    """One model's forward on each tier, a prefill then a decode: logits within float32 rounding."""
    config = tiny_config()
    cfg = LlamaConfig.from_dict(config)
    tensors = random_tensors(config, 3)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=14)      # a prompt of 13, then a decode
    table = np.array([[5, 2, 7, 0]], np.int32)
    logits = {ops.name: prefill_then_decode(LlamaModel(cfg, tensors, ops), cfg, ids, table, 4)
              for ops in (SimpleOps(), FastOps())}
    np.testing.assert_allclose(logits["simple"], logits["fast"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_tiers_agree_over_a_compressed_cache(tiny_model_dir, kv_cache_dtype):
    prompts = random_prompts(4, seed=5)
    got = {kernels: _tokens(make_llm(tiny_model_dir, kernels=kernels, kv_cache_dtype=kv_cache_dtype).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)) for kernels in TIERS}
    assert got["simple"] == got["fast"]


def test_the_tier_is_a_config_field(tiny_model_dir, monkeypatch):
    with pytest.raises(ConfigError, match="kernels must be one of"):
        make_llm(tiny_model_dir, kernels="turbo")
    with pytest.raises(ConfigError, match="cpu_gemm='mkl' is an engine of the fast tier"):
        make_llm(tiny_model_dir, kernels="simple", cpu_gemm="mkl")
    with pytest.raises(ConfigError, match="fast_tuning must be a FastTuning"):
        make_llm(tiny_model_dir, fast_tuning={"vector_attention": False})
    with pytest.raises(ValueError, match="FastTuning.split_min_tokens must be an integer"):
        FastTuning(split_min_tokens=-1)
    monkeypatch.setenv("MINIPAGED_KERNELS", "simple")            # the default, as vLLM's backend variable
    assert EngineConfig().kernels == "simple" and EngineConfig(kernels="fast").kernels == "fast"
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=16)
    assert engine.backend.kernels == "simple" and isinstance(engine.model.ops, SimpleOps)
    monkeypatch.setenv("MINIPAGED_KERNELS", "turbo")
    with pytest.raises(ConfigError, match=r"from \$MINIPAGED_KERNELS"):
        EngineConfig()


def test_fast_tuning_reaches_the_engine(tiny_model_dir):
    """The fast tier's switches are constructor arguments: an engine with the persistent kernel and
    the register attention off runs layer by layer, with the same tokens."""
    prompts = random_prompts(3, seed=2)
    off = make_llm(tiny_model_dir, kernels="fast", cpu_gemm="numba",
                   fast_tuning=FastTuning(persistent_decode=False, vector_attention=False))
    assert off.llm_engine.backend.ops.tuning.persistent_decode is False
    on = make_llm(tiny_model_dir, kernels="fast", cpu_gemm="numba")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _tokens(off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)) == \
        _tokens(on.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


@pytest.mark.slow
def test_golden_prompts_on_the_plain_tier(golden):
    """SmolLM2 on the plain tier: the golden continuations of an independent implementation."""
    from minipaged import LLM
    from test_golden import check_against_golden

    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_space=0.25, kernels="simple")
    cases = golden["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, skip_special_tokens=False)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outputs):
        check_against_golden(case, out.outputs[0].token_ids)


@pytest.mark.parametrize("ops", [SimpleOps(), FastOps()], ids=["simple", "fast"])
def test_a_block_id_out_of_the_pool_is_an_error_at_the_ops_boundary(ops):
    """A block table naming a block past the pool, or a slot past it, reaches a tier through the
    model: an IndexError naming the tier before any kernel reads or writes, the pool untouched."""
    config = tiny_config()
    cfg = LlamaConfig.from_dict(config)
    model = LlamaModel(cfg, random_tensors(config, 1), ops)
    kv = np.zeros(kv_cache_shape(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, 4, cfg.head_dim),
                  np.float32)   # (layers, 2, 4 blocks, kv_heads, 4, head_dim)
    ids = np.array([5, 6, 7])
    for table, slots in (([[0, 9]], [4, 5, 36]),        # block 9 of 4; slot 36 of 16
                         ([[0, 1]], [4, 5, 16]),        # slot 16: one past the pool
                         ([[-1, 1]], [4, 5, 6])):       # a -1 where the context reads a block
        meta = AttentionMetadata(np.array(slots, np.int64), np.array([0, 3], np.int32), np.array([7], np.int32),
                                 np.array(table, np.int32), 3, 7)
        with pytest.raises(IndexError, match=ops.name):
            model.forward(ids, np.array([4, 5, 6]), kv, meta, np.array([2]))
        assert not kv.any()
