"""Weights in fewer bytes (kernels/weight_formats.py, kernels/fast/quant_panels.py).

The oracles: ml_dtypes' bfloat16 cast (the bfloat16 rounding), llama.cpp's own Python quantizers
and dequantizers (gguf.quants: the GGUF blocks' bytes and meaning), the NumPy product of the
dequantized weight (every kernel), and the dense reference forward (model/reference.py) on the
dequantized weights (whole models, both tiers).
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings, strategies as st

from minipaged import SamplingParams
from minipaged.config import ConfigError
from minipaged.kernels.fast.linear import quantized_linear
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels.fast.quant_panels import pack, quant_panel_linear
from minipaged.kernels.fast.panel_gemm import PANEL
from minipaged.kernels.fast.simd import (LANES, vload_bf16, vload_f16, vload_f32b, vload_high4_unit, vload_i8,
                                        vload_low4_unit, vstore)
from minipaged.kernels.simple import SimpleOps
from minipaged.kernels.weight_formats import (BLOCK_BYTES, QUANTIZED_FORMATS, ROUNDS_ACTIVATIONS, QuantizedWeight,
                                              concat_rows, quantize, round_activations)
from minipaged.model.config import LlamaConfig
from minipaged.model.errors import ModelFormatError
from minipaged.model.gguf_convert import read_gguf_weights
from minipaged.model.llama import LlamaModel
from minipaged.model.random_llama import random_tensors, tiny_config, write_tiny_llama
from minipaged.model.reference import reference_logits
from minipaged.model.weights import load_checkpoint, quantize_matrices
from numba import njit
from tiny_model import make_llm, prefill_then_decode

GGUF_KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _weight(rng, out_features, in_features, scale=0.1):
    return (rng.standard_normal((out_features, in_features)) * scale).astype(np.float32)   # (out, in)


# --------------------------------------------------------------------------- the formats (specs)

def test_bfloat16_rounds_as_ml_dtypes():
    rng = np.random.default_rng(0)
    w = np.concatenate([_weight(rng, 8, 64, 3.0),
                        np.array([[0.0, -0.0, 1e-40, -3.4e38, 1.00390625, 1.01171875, 65504.0, 2.5] * 8], np.float32)])
    got = quantize(w, "bfloat16")
    expected = w.astype(ml_dtypes.bfloat16).view(np.uint16)            # (9, 64) round to nearest even
    np.testing.assert_array_equal(got.data, expected)
    np.testing.assert_array_equal(got.dequantize(), w.astype(ml_dtypes.bfloat16).astype(np.float32))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(1, 80), st.floats(1e-3, 1e3), st.integers(0, 2**31))
def test_int8_has_one_scale_per_row_and_rounds_to_the_nearest_code(rows, cols, scale, seed):
    w = _weight(np.random.default_rng(seed), rows, cols, scale)
    w[0] = 0.0                                                          # an all-zero row: scale 0
    q = quantize(w, "int8")
    assert q.data.dtype == np.int8 and q.scales.shape == (rows,) and int(np.abs(q.data).max()) <= 127
    np.testing.assert_allclose(q.scales, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    err = np.abs(q.dequantize() - w)                                    # (rows, cols)
    assert (err <= q.scales[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all()
    assert (q.dequantize()[0] == 0).all()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_gguf_blocks_are_llama_cpps_bytes_and_meaning(fmt):
    w = _weight(np.random.default_rng(1), 6, 96)
    q = quantize(w, fmt)
    assert q.data.shape == (6, 3, {"q4_1": 20, "q8_0": 34}[fmt])
    np.testing.assert_array_equal(q.data.reshape(6, -1), gguf_quantize(w, GGUF_KINDS[fmt]))
    np.testing.assert_array_equal(q.dequantize(), gguf_dequantize(q.data.reshape(6, -1), GGUF_KINDS[fmt]))
    assert q.nbytes == {"q4_1": 6 * 96 * 20 // 32, "q8_0": 6 * 96 * 34 // 32}[fmt]


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_slices_and_stacks_of_a_quantized_weight(fmt):
    w = _weight(np.random.default_rng(2), 10, 128)
    q = quantize(w, fmt)
    full = q.dequantize()
    np.testing.assert_array_equal(q[2:7].dequantize(), full[2:7])
    np.testing.assert_array_equal(q[:, 32:96].dequantize(), full[:, 32:96])
    np.testing.assert_array_equal(q.rows(np.array([9, 0, 9])), full[[9, 0, 9]])
    np.testing.assert_array_equal(concat_rows([q[:3], q[3:]]).dequantize(), full)
    assert q[2:7].fmt == q[:, 32:96].fmt == concat_rows([q[:3], q[3:]]).fmt == fmt   # a shard keeps its format
    if fmt in BLOCK_BYTES:                               # GGUF's blocks, x rounded or not
        with pytest.raises(ValueError, match="multiples of 32"):
            q[:, 8:40]


def test_bad_quantizations_are_named():
    w = np.ones((4, 40), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(w, "q4_1")
    w[1, 2] = np.nan
    with pytest.raises(ValueError, match="nan or inf"):
        quantize(w, "int8")
    with pytest.raises(ValueError, match="weight format must be one of"):
        quantize(w, "int4")
    with pytest.raises(ValueError, match="uint16"):
        QuantizedWeight("bfloat16", np.zeros((2, 2), np.float32))


# --------------------------------------------------------------------------- the kernels

@njit
def _widen_all(b, i, out):
    vstore(out, 0, vload_bf16(b, i)); vstore(out, LANES, vload_i8(b, i)); vstore(out, 2 * LANES, vload_f16(b, i))  # noqa: E702
    vstore(out, 3 * LANES, vload_low4_unit(b, i)); vstore(out, 4 * LANES, vload_high4_unit(b, i))  # noqa: E702
    vstore(out, 5 * LANES, vload_f32b(b, i))


def test_the_byte_loads_widen_as_numpy_does():
    rng = np.random.default_rng(3)
    b = rng.integers(0, 256, 8 * LANES).astype(np.uint8)
    b[5:5 + 4 * LANES] = rng.standard_normal(LANES).astype(np.float32).view(np.uint8)
    out = np.zeros(6 * LANES, np.float32)
    _widen_all(b, 5, out)
    s = b[5:]
    expected = [(s[:2 * LANES].view(np.uint16).astype(np.uint32) << 16).view(np.float32),
                s[:LANES].view(np.int8).astype(np.float32), s[:2 * LANES].view(np.float16).astype(np.float32),
                1 + (s[:LANES] & 15).astype(np.float32) / 16, 1 + (s[:LANES] >> 4).astype(np.float32) / 16, s[:4 * LANES].view(np.float32)]
    np.testing.assert_array_equal(out, np.concatenate(expected))


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("shape", [(PANEL, 64), (3 * PANEL - 5, 96), (40, 320)])
def test_quantized_panels_multiply_as_the_spec(fmt, shape):
    """Every row count a decode step has (1, 2, and 3-8 padded to 4 or 8: the codes multiplied in
    registers, one, two or four rows at a time; tiles of 4, 8 and AVX2's 6 over runs of k widened on the
    stack: 12, 16, 28 = 8 + 8 + 8 + 4), out padded to whole panels, runs of k over K_RUN (320 =
    128 + 128 + 64): x @ w.dequantize().T within float32 rounding (x rounded first for q4_1_a8:
    its spec, ``round_activations``)."""
    rng = np.random.default_rng(4)
    q = quantize(_weight(rng, *shape), fmt)
    panels = pack(q)
    assert panels.nbytes == -(-shape[0] // PANEL) * PANEL * (q.nbytes // shape[0])   # out padded to whole panels
    for rows in (1, 2, 3, 4, 6, 8, 9, 12, 16, 28):
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        read = round_activations(x) if fmt in ROUNDS_ACTIVATIONS else x           # (rows, in)
        expected = read.astype(np.float64) @ q.dequantize().T.astype(np.float64)  # (rows, out)
        got = quant_panel_linear(x, panels, 2)
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
    # the panels are the fast tier's only copy: they give the weight back whole, and a prefill's
    # rows (more than the panels take) multiply that, widened
    back = panels.unpack()
    np.testing.assert_array_equal(back.data, q.data)
    assert (back.scales is None) == (q.scales is None) and (q.scales is None or (back.scales == q.scales).all())
    tuning = FastTuning()
    x = rng.standard_normal((tuning.panel_max_rows + 3, shape[1])).astype(np.float32)
    np.testing.assert_allclose(quantized_linear(x, panels, tuning), q.product(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("in_features", [33, 161])
def test_dense_formats_take_rows_of_any_width(fmt, in_features):
    """bfloat16 and int8 need no blocks: rows of 33 and 161 weights (a short last run of k after
    K_RUN) multiply as the spec for a single row, for 2 rows and 3 to 8 rows four at a time in
    registers, and for the widened tiles."""
    rng = np.random.default_rng(5)
    q = quantize(_weight(rng, 40, in_features), fmt)
    panels = pack(q)
    for rows in (1, 2, 3, 4, 8, 12, 28):
        x = rng.standard_normal((rows, in_features)).astype(np.float32)
        expected = x.astype(np.float64) @ q.dequantize().T.astype(np.float64)     # (rows, 40)
        np.testing.assert_allclose(quant_panel_linear(x, panels, 2), expected, rtol=2e-5,
                                   atol=2e-5 * np.abs(expected).max())


# --------------------------------------------------------------------------- whole models

@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4_1"])
def test_a_quantized_model_computes_its_dequantized_weights_on_both_tiers(fmt):
    """The tiny model stored in ``fmt``: a prefill then a decode step (the fast tier's persistent
    kernel) give the dense reference's logits of the dequantized weights, on both tiers."""
    config = tiny_config(intermediate_size=128)
    cfg = LlamaConfig.from_dict(config)
    tensors = random_tensors(config, 5)
    tensors = quantize_matrices(tensors, fmt)   # as load_weights gives them (a GGUF's: its blocks)
    prompt = 11
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=prompt + 1)
    logits = {}
    for ops in (SimpleOps(), FastOps()):
        model = LlamaModel(cfg, tensors, ops)
        assert all(isinstance(w, QuantizedWeight) for w in (model.layers[0].qkv, model.embed)) or ops.name == "fast"

        def runs_persistent(kv, step, model=model, ops=ops):   # the decode step runs as one persistent kernel
            if ops.name == "fast":
                assert model.weights.tier_state.persistent is not None and model.weights.tier_state.quantized
                assert ops.plan_step(model.weights, step, kv).path == "numba"
        logits[ops.name] = prefill_then_decode(model, cfg, ids, np.array([[3, 1, 6, 0]], np.int32), 4, runs_persistent)
    widened = {n: t.dequantize() if isinstance(t, QuantizedWeight) else t for n, t in tensors.items()}
    reference = reference_logits(cfg, widened, ids.tolist())[[prompt - 1, prompt]]   # (2, vocab)
    for name, got in logits.items():
        np.testing.assert_allclose(got, reference, rtol=1e-3, atol=1e-3, err_msg=name)


@pytest.fixture(scope="module")
def gguf_model_dir(tmp_path_factory) -> Path:
    """The tiny model as the default one ships: a GGUF file beside its dequantized safetensors
    (intermediate 128: each of two tensor-parallel ranks' MLP columns a whole number of blocks)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-gguf"), seed=3, gguf=True, intermediate_size=128)


def test_a_gguf_file_is_read_as_its_own_blocks(gguf_model_dir):
    blocks = read_gguf_weights(gguf_model_dir / "model.gguf")
    floats = load_checkpoint(gguf_model_dir)
    assert blocks["model.embed_tokens.weight"].fmt == "q8_0"
    assert blocks["model.layers.1.self_attn.q_proj.weight"].fmt == "q4_1"   # q and k rows un-permuted
    for name, t in floats.items():
        np.testing.assert_array_equal(blocks[name].dequantize() if isinstance(blocks[name], QuantizedWeight)
                                      else blocks[name], t, err_msg=name)


@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16"), dict(quantization="int8"), dict(quantization="gguf"),
                                    dict(quantization="gguf_a8")])
def test_every_format_gives_the_same_tokens_on_both_tiers_and_in_shards(gguf_model_dir, kwargs):
    """The engine with each format: the plain and the fast tier agree token for token, and so do
    two tensor-parallel ranks and two pipeline stages, whose shards carry the format. Nine
    sequences of different lengths: as the batch drains, the persistent kernel's decode steps
    widen 12 rows (nine padded) for the float32 tiles, then multiply the codes in registers at
    8 and 4 rows (padded), at 2 rows and at one."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 3 * i))} for i in range(9)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(9)]
    got = {}
    for name, extra in [("simple", dict(kernels="simple")), ("fast", dict(kernels="fast")),
                        ("tp2", dict(kernels="fast", tensor_parallel_size=2)),
                        ("pp2", dict(kernels="fast", pipeline_parallel_size=2))]:
        llm = make_llm(gguf_model_dir, num_blocks=64, **kwargs, **extra)
        assert llm.llm_engine.backend.weight_format == kwargs.get("quantization", "bfloat16")
        got[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got["simple"] == got["fast"] == got["tp2"] == got["pp2"]
    if kwargs.get("quantization") == "gguf":   # the float32 directory holds the same weights, widened
        full = make_llm(gguf_model_dir, num_blocks=64)
        assert got["fast"] == [o.outputs[0].token_ids for o in full.generate(prompts, params, use_tqdm=False)]


def test_a_split_inside_a_gguf_block_is_named(tmp_path):
    """Two ranks of the tiny model's 96 MLP columns would cut a block of 32 weights: refused by name."""
    model = write_tiny_llama(tmp_path / "g", gguf=True)
    with pytest.raises(ModelFormatError, match="tensor_parallel_size=2 cuts .*down_proj.* inside its blocks"):
        make_llm(model, num_blocks=16, quantization="gguf", tensor_parallel_size=2)


def test_formats_are_checked_and_named(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="quantization must be one of"):
        make_llm(tiny_model_dir, quantization="awq")
    with pytest.raises(ConfigError, match="both choose how the weights are stored"):
        make_llm(tiny_model_dir, quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="float16' is not supported on the CPU"):
        make_llm(tiny_model_dir, dtype="float16")
    with pytest.raises(ModelFormatError, match="holds no \\*.gguf file"):
        make_llm(tiny_model_dir, quantization="gguf")
