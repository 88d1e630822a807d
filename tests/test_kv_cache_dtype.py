"""A compressed KV cache (kv_cache_dtype int8 / fp8) through the whole engine: pool sizing,
swaps and copies that carry the scales, preemption, chunked prefill, samples, beams and
prefix caching, all on the tiny random Llama."""

import numpy as np
import pytest

from minipaged import LLM, BeamSearchParams, LLMEngine, SamplingParams
from minipaged.config import ConfigError
from minipaged.kernels import reference as spec
from minipaged.kernels.layout import kv_bytes_per_block
from test_preemption import prompts, tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SWAP_GIB = 0.002
DTYPES = ["int8", "fp8", "fp8_e5m2"]


@pytest.fixture(scope="module")
def batch():
    return prompts(8, seed=21)


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_the_same_space_holds_about_four_times_the_blocks(tiny_model_dir, kv_cache_dtype):
    plain = LLMEngine(str(tiny_model_dir), device="cpu", kv_cache_space=0.01, swap_space=SWAP_GIB)
    small = LLMEngine(str(tiny_model_dir), device="cpu", kv_cache_space=0.01, swap_space=SWAP_GIB,
                      kv_cache_dtype=kv_cache_dtype)
    c = plain.model_config
    per_token_head = c.head_dim * 1 + (4 if kv_cache_dtype == "int8" else 0)     # bytes, K or V
    assert small.cache.bytes_per_block == 2 * c.num_hidden_layers * c.num_key_value_heads * 16 * per_token_head
    assert small.cache.bytes_per_block == kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, 16,
                                                             c.head_dim, 1, 4 if kv_cache_dtype == "int8" else 0)
    factor = small.cache.num_blocks / plain.cache.num_blocks
    assert factor == pytest.approx(4 * c.head_dim / per_token_head, rel=0.01)
    assert small.cache.kv_cache.dtype == (np.int8 if kv_cache_dtype == "int8" else np.uint8)


def test_a_bad_kv_cache_dtype_is_named(tiny_model_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of .*got 'int4'"):
        LLMEngine(str(tiny_model_dir), device="cpu", kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_the_cache_holds_what_the_spec_quantizes(tiny_model_dir, kv_cache_dtype):
    """After a prefill, each written slot holds the spec's quantization of the K/V the model
    computed (recomputed here with the dense float reference of the same write)."""
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB,
                       kv_cache_dtype=kv_cache_dtype)
    auto = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB)
    for e in (engine, auto):
        e.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=1))
        e.step()
    table = engine.block_manager.block_table(engine.groups["a"].seqs[0]) if "a" in engine.groups else None
    # the request finished and freed its blocks, but their bytes stay: blocks 0.. in order
    table = table or list(range(-(-27 // 4)))
    first = 0   # layer 0's K: computed from the embeddings, identical in both engines
    fmt = engine.cache.kv_format
    scales = engine.cache.kv_scales[first, 0]
    stored = spec.dequantize_kv(engine.cache.kv_cache[first, 0], fmt, scales)
    exact = auto.cache.kv_cache[first, 0]
    for block in table:
        for offset in range(4):
            if block * 4 + offset >= 27:
                break
            want = exact[block, :, offset]
            got = stored[block, :, offset]
            codes, _ = spec.quantize_kv(want, fmt, engine.cache.kv_scales[first, 0])
            np.testing.assert_array_equal(engine.cache.kv_cache[first, 0, block, :, offset], codes)
            assert np.abs(got - want).max() <= np.abs(want).max() * (0.5 / 127 if fmt == 1 else 0.13) + 0.01


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_changes_no_token_with_compressed_blocks(tiny_model_dir, batch, kv_cache_dtype, mode):
    roomy = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, kv_cache_dtype=kv_cache_dtype)
    expected = tokens(roomy, batch)
    assert roomy.get_stats()["num_preemptions"] == 0
    tight = LLM(str(tiny_model_dir), device="cpu", block_size=2, num_blocks=40, swap_space=SWAP_GIB,
                preemption_mode=mode, kv_cache_dtype=kv_cache_dtype)
    assert tokens(tight, batch) == expected
    stats = tight.get_stats()
    assert stats["num_preemptions"] >= 3
    if mode == "swap":
        assert stats["blocks_swapped_out"] == stats["blocks_swapped_in"] > 0
    assert stats["kv_blocks_used"] == 0
    tight.llm_engine.block_manager.check_invariants()


def test_a_swap_round_trip_carries_the_int8_scales(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB,
                       preemption_mode="swap", kv_cache_dtype="int8")
    engine.add_request("a", list(range(3, 40)), GREEDY)
    engine.step()
    group = engine.groups["a"]
    seq = group.seqs[0]
    table = list(engine.block_manager.block_table(seq))
    before = engine.cache.kv_cache[:, :, table].copy(), engine.cache.kv_scales[:, :, table].copy()
    assert np.all(before[1][:, :, :-1] > 0)               # every full block has its scales
    engine.cache.swap_out(engine.block_manager.swap_out(group))
    engine.cache.kv_cache[:] = 0                          # the device pool is reused by others
    engine.cache.kv_scales[:] = np.nan
    engine.cache.swap_in(engine.block_manager.swap_in(group))
    new_table = engine.block_manager.block_table(seq)
    assert engine.cache.kv_cache[:, :, new_table].tobytes() == before[0].tobytes()
    assert engine.cache.kv_scales[:, :, new_table].tobytes() == before[1].tobytes()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_chunked_prefill_samples_beams_and_prefix_caching_with_compressed_blocks(tiny_model_dir, batch,
                                                                                  kv_cache_dtype):
    base = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, kv_cache_dtype=kv_cache_dtype)
    expected = tokens(base, batch)
    chunked = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, kv_cache_dtype=kv_cache_dtype,
                  enable_chunked_prefill=True, max_num_batched_tokens=13, max_num_seqs=8)
    assert tokens(chunked, batch) == expected
    # copy-on-write: n greedy samples of one prompt share its blocks, and all equal the single one
    forked = base.generate([batch[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3),
                           use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [expected[0]] * 3
    # beams copy blocks on write too; the best beam's tokens are a valid continuation
    beams = base.beam_search([batch[1]], BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)
    assert len(beams[0].sequences) == 3
    # prefix caching: a second pass over the same prompts hits cached blocks, same tokens
    cached = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB, kv_cache_dtype=kv_cache_dtype,
                 enable_prefix_caching=True, block_size=4)
    first = tokens(cached, batch)
    again = tokens(cached, batch)
    assert again == first == expected
    assert cached.get_stats()["prefix_cache_hit_rate"] > 0
    for llm in (base, chunked, cached):
        assert llm.get_stats()["kv_blocks_used"] == 0
        llm.llm_engine.block_manager.check_invariants()


def test_int8_outputs_stay_close_to_float(tiny_model_dir, batch):
    """Not equal (int8 rounds every K/V value), but the logprobs of the float run's own greedy
    tokens barely move: teacher-forced through prompt_logprobs."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    long_prompts = prompts(4, seed=3, lo=40, hi=60)
    plain = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB).generate(long_prompts, params, use_tqdm=False)
    small = LLM(str(tiny_model_dir), device="cpu", swap_space=SWAP_GIB,
                kv_cache_dtype="int8").generate(long_prompts, params, use_tqdm=False)
    for a, b in zip(plain, small):
        ids = a.prompt_token_ids[1:]
        la = np.array([d[t] for d, t in zip(a.prompt_logprobs[1:], ids)])
        lb = np.array([d[t] for d, t in zip(b.prompt_logprobs[1:], ids)])
        assert np.abs(la - lb).max() < 0.05 * max(1.0, np.abs(la).max())


def test_calculate_kv_scales_sets_fp8_layer_scales_from_the_first_step(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB,
                       kv_cache_dtype="fp8", calculate_kv_scales=True)
    auto = LLMEngine(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=32, swap_space=SWAP_GIB)
    assert np.all(engine.cache.kv_scales == 1.0)
    prompt = list(range(3, 30))
    for e in (engine, auto):
        e.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        e.step()
    # layer 0's K and V come from the embeddings alone: the same in both engines
    k0 = np.concatenate([auto.cache.kv_cache[0, 0, b, :, o] for b in range(7) for o in range(4)
                         if b * 4 + o < len(prompt)])
    v0 = np.concatenate([auto.cache.kv_cache[0, 1, b, :, o] for b in range(7) for o in range(4)
                         if b * 4 + o < len(prompt)])
    assert engine.cache.kv_scales[0, 0].item() == pytest.approx(np.abs(k0).max() / 200, rel=1e-6)
    assert engine.cache.kv_scales[0, 1].item() == pytest.approx(np.abs(v0).max() / 100, rel=1e-6)
    assert np.all(engine.cache.kv_scales != 1.0)            # every layer was calibrated
    frozen = engine.cache.kv_scales.copy()
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", list(range(100, 140)), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    np.testing.assert_array_equal(engine.cache.kv_scales, frozen)   # set once, by the first step
    # int8 and auto ignore it (int8's scales are per token already)
    LLMEngine(str(tiny_model_dir), device="cpu", num_blocks=8, swap_space=SWAP_GIB, kv_cache_dtype="int8",
              calculate_kv_scales=True)
