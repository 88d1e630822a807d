"""x rounded to int8 for GGUF's Q4_1 and Q8_0 products ("q4_1_a8", "q8_0_a8", ``--quantization
gguf_a8``: kernels/weight_formats.py's ``round_activations``, kernels/fast/quant_a8.py and
int8_dot.py).

The oracles: the rounding's definition computed element by element in float32 scalars (the
spec), NumPy's integer dot products (each CPU's instructions for them), the spec's product
(``QuantizedWeight.product``: the plain tier), and the dense reference forward of the float
weights (how far the rounding moves a model's logits).
"""

import numpy as np
import pytest
from numba import njit
from numba.core.codegen import get_host_cpu_features

from minipaged import SamplingParams
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.int8_dot import (DOT_KINDS, block_dot, block_dot8, dot8_offset, dot_instructions, i32vec,
                                            izero, vfloat)
from minipaged.kernels.fast.quant_a8 import Q4_1_A8, bounce, rounded_size
from minipaged.kernels.fast.quant_panels import pack, quant_panel_linear
from minipaged.kernels.fast.simd import LANES, vstore
from minipaged.kernels.simple import SimpleOps
from minipaged.kernels.weight_formats import GGUF_BLOCK, QuantizedWeight, quantize, round_activations
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel
from minipaged.model.random_llama import random_tensors, tiny_config, write_tiny_llama
from minipaged.model.reference import reference_logits
from minipaged.model.weights import load_weights, quantize_matrices
from tiny_model import make_llm, prefill_then_decode


def _scalar_rounding(x: np.ndarray) -> np.ndarray:
    """The spec's words, one float32 scalar at a time: d = max |x| / 127 of a block of 32, the
    code rint(x * (1 / d)), x read back as code * d."""
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], GGUF_BLOCK):
            block = [np.float32(v) for v in x[r, b:b + GGUF_BLOCK]]
            d = np.float32(max(abs(v) for v in block)) / np.float32(127)
            inv = np.float32(1) / d if d > 0 else np.float32(0)
            for j, v in enumerate(block):
                out[r, b + j] = np.float32(np.rint(v * inv)) * d
    return out


def _fast_rounding(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fast tier's bounce buffer of x (rows, k): (d (rows, kb), s (rows, kb), codes (rows, k))."""
    rows, k = x.shape
    blob = np.empty(rounded_size(rows, k), np.float32)                         # (rounded_size,)
    assert np.shares_memory(bounce(np.ascontiguousarray(x).reshape(-1), Q4_1_A8, k, rows, blob), blob)
    kb = k // GGUF_BLOCK
    return (blob[:rows * kb].reshape(rows, kb), blob[rows * kb:2 * rows * kb].reshape(rows, kb),
            blob[2 * rows * kb:].view(np.int8).reshape(rows, k))


def test_the_rounding_is_its_definition_and_the_fast_tiers_codes_are_the_specs():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 128)) * np.array([1e-3, 1, 30, 1e4, 1e-30])[:, None]).astype(np.float32)
    x[0, :32] = 0                                     # an all-zero block: d = 0, codes 0
    spec = round_activations(x)
    np.testing.assert_array_equal(spec, _scalar_rounding(x))
    blocks = x.reshape(5, 4, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    assert (np.abs(spec.reshape(5, 4, 32) - blocks) <= d / 2 * (1 + 1e-4)).all()   # half a step (+ q * d's rounding)
    got_d, got_s, codes = _fast_rounding(x)
    assert codes.min() >= -127 and codes.max() <= 127
    peaks = np.abs(codes.reshape(5, 4, 32)).max(-1)                           # (rows, blocks)
    assert peaks[0, 0] == 0 and (np.delete(peaks.reshape(-1), 0) == 127).all()   # each block's largest: +-127
    np.testing.assert_array_equal(got_d, d[..., 0])
    np.testing.assert_array_equal((codes.reshape(5, 4, 32) * got_d[..., None]).reshape(5, 128), spec)
    np.testing.assert_array_equal(got_s, got_d * codes.reshape(5, 4, 32).sum(-1).astype(np.float32))


def test_a_block_with_a_nan_or_an_inf_reads_back_non_finite_on_both_tiers():
    x = np.ones((3, 64), np.float32)
    x[0, 3], x[1, 40] = np.nan, np.inf
    x[2, :32] = 1e-38                                 # d = 1e-38 / 127, subnormal: 1 / d overflows, codes 0
    spec = round_activations(x)
    got_d, _, codes = _fast_rounding(x)
    with np.errstate(over="ignore"):
        assert 0 < got_d[2, 0] < np.finfo(np.float32).tiny and np.isinf(np.float32(1) / got_d[2, 0])
    assert (spec[2, :32] == 0).all() and (codes[2, :32] == 0).all()
    w = quantize(np.full((40, 64), 0.1, np.float32), "q4_1_a8")
    out = quant_panel_linear(x, pack(w), 2)                                   # (3, 40): the products
    assert np.isnan(out[0]).all() and not np.isfinite(out[1]).any() and np.isfinite(out[2]).all()
    np.testing.assert_allclose(out[2], w.product(x[2:])[0], rtol=1e-6)
    assert not np.isfinite(spec[0, :32]).all() and np.isfinite(spec[0, 32:]).all()
    assert not np.isfinite(spec[1, 32:]).all() and np.isfinite(spec[1, :32]).all()
    assert np.isnan(got_d[0, 0]) and np.isnan(got_d[1, 1]) and got_d[0, 1] == got_d[1, 0] == np.float32(1 / 127)
    with pytest.raises(ValueError, match="blocks of 32"):
        round_activations(np.ones((1, 40), np.float32))


@pytest.mark.parametrize("features, lanes, kind", [
    ("+avx2,+avx512f,+avx512bw,+avx512vnni", 16, "vnni512"), ("+avx2,+avx512f,+avx512bw", 16, "bw512"),
    ("+avx2,+avx512f,+avx512bw,+avx512vnni", 8, "avx2"), ("+avx2,+avxvnni", 8, "avx2"), ("+neon", 8, "generic"),
    ("", 16, "generic")])
def test_the_instructions_follow_the_cpu(features, lanes, kind):
    assert dot_instructions(features, lanes) == kind


def _runnable(kind: str) -> bool:
    have = set(get_host_cpu_features().split(","))
    return {"vnni512": LANES == 16 and "+avx512vnni" in have, "bw512": LANES == 16 and "+avx512bw" in have,
            "avx2": "+avx2" in have, "generic": True}[kind]


@pytest.mark.parametrize("kind", DOT_KINDS)
def test_each_cpus_instructions_add_the_bytes_products(kind):
    """Each kind of instructions, compiled here (where this CPU runs them: AVX-512's need an
    AVX-512 core), gives NumPy's integer sums of a block: 4-bit codes 0..15 times int8 codes
    -127..127, group g's low nibbles with x's bytes 8g..8g+3 and its high ones with 8g+4..8g+7;
    at the extremes too (15 x 127 everywhere: AVX2's int16 sums of a block must not saturate)."""
    if not _runnable(kind):
        pytest.skip(f"{kind} instructions do not run on this CPU ({LANES} lanes)")
    dot = block_dot(kind)

    @njit
    def run(w, xb, out):
        acc = dot(izero(), w, 0, xb, 0)                     # features' words at group stride 8 LANES
        acc = dot(acc, w, 4 * LANES, xb, 32)                # the other words, x's bytes 32..63
        vstore(out, 0, vfloat(acc))

    rng = np.random.default_rng(1)
    cases = [(rng.integers(0, 16, (2, 2, 4, LANES, 4)), rng.integers(-127, 128, 64)),   # (part, nibble, g, lane, j)
             (np.full((2, 2, 4, LANES, 4), 15), np.full(64, 127)), (np.full((2, 2, 4, LANES, 4), 15), np.full(64, -127))]
    for nibbles, x in cases:
        nibbles, x = nibbles.astype(np.uint8), x.astype(np.int8)
        words = nibbles[:, 0] | (nibbles[:, 1] << 4)                         # (part, g, lane, 4 bytes)
        w = words.transpose(1, 0, 2, 3).reshape(-1)                          # group g: part 0's words, part 1's
        xb = np.zeros(16, np.float32)
        xb.view(np.int8)[:] = x
        out = np.zeros(LANES, np.float32)
        run(w, xb, out)
        xi = x.astype(np.int64).reshape(2, 4, 2, 4)                          # (part, g, nibble, j)
        want = sum(nibbles[p, h, g].astype(np.int64) @ xi[p, g, h] for p in range(2) for g in range(4) for h in range(2))
        np.testing.assert_array_equal(out, want.astype(np.float32))
    assert i32vec.name == f"i32x{LANES}"


@pytest.mark.parametrize("kind", DOT_KINDS)
def test_each_cpus_instructions_add_signed_codes_products(kind):
    """Q8_0's int8 codes (-128..127) times x's: NumPy's integer sums, plus dot8_offset(kind) times
    x's sum (VNNI's unsigned first operand reads c + 128); at the extremes too (-128 x -127
    everywhere: AVX2's pairs of products, 32512, must not saturate an int16)."""
    if not _runnable(kind):
        pytest.skip(f"{kind} instructions do not run on this CPU ({LANES} lanes)")
    dot = block_dot8(kind)

    @njit
    def run(w, xb, out):
        acc = dot(izero(), w, 0, xb, 0)                     # 8 groups of PANEL = 2 LANES words
        vstore(out, 0, vfloat(dot(acc, w, 4 * LANES, xb, 0)))   # the second LANES features: the same x

    rng = np.random.default_rng(5)
    cases = [(rng.integers(-128, 128, (8, 2, LANES, 4)), rng.integers(-127, 128, 32)),   # (g, part, lane, j)
             (np.full((8, 2, LANES, 4), -128), np.full(32, -127)), (np.full((8, 2, LANES, 4), 127), np.full(32, 127)),
             (np.full((8, 2, LANES, 4), -128), np.full(32, 127))]
    for codes, x in cases:
        codes, x = codes.astype(np.int8), x.astype(np.int8)
        xb = np.zeros(8, np.float32)
        xb.view(np.int8)[:] = x
        out = np.zeros(LANES, np.float32)
        run(codes.view(np.uint8).reshape(-1), xb, out)
        xi = x.astype(np.int64).reshape(8, 4)                                # (g, j)
        want = sum(codes[g, p].astype(np.int64) @ xi[g] for g in range(8) for p in range(2))   # (LANES,)
        np.testing.assert_array_equal(out, (want + dot8_offset(kind) * x.astype(np.int64).sum() * 2).astype(np.float32))


@pytest.mark.parametrize("fmt", ["q4_1_a8", "q8_0_a8"])
@pytest.mark.parametrize("shape", [(40, 64), (100, 576)])
def test_the_products_are_the_rounded_xs_at_every_row_count(shape, fmt):
    """1 and 2 rows, 3-8 (two rows at a time, an odd one last), a prefill's 300: the spec's
    product of the rounded x within float32 rounding, and the panels give the blocks back."""
    rng = np.random.default_rng(2)
    q = quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), fmt)
    panels = pack(q)
    assert panels.nbytes == q.nbytes + (-shape[0] % (2 * LANES)) * q.nbytes // shape[0]
    np.testing.assert_array_equal(panels.unpack().data, q.data)
    for rows in (1, 2, 3, 5, 8, 300):
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        want = round_activations(x).astype(np.float64) @ q.dequantize().T.astype(np.float64)
        np.testing.assert_allclose(quant_panel_linear(x, panels, 2), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_a8_formats_are_the_gguf_formats_bytes_and_meaning(fmt):
    w = (np.random.default_rng(3).standard_normal((8, 96)) * 0.1).astype(np.float32)
    a8, q41 = quantize(w, fmt + "_a8"), quantize(w, fmt)
    assert a8.fmt == fmt + "_a8" and np.array_equal(a8.data, q41.data) and a8.nbytes == q41.nbytes
    np.testing.assert_array_equal(a8.dequantize(), q41.dequantize())
    x = np.random.default_rng(4).standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_array_equal(a8.product(x), round_activations(x) @ q41.dequantize().T)
    np.testing.assert_array_equal(q41.product(x), x @ q41.dequantize().T)


def test_a_model_in_the_a8_formats_agrees_on_both_tiers_and_stays_near_its_float_weights():
    """The tiny model as gguf_a8 holds one, its layers' matrices in q4_1_a8 and its embedding (the
    tied head) in q8_0_a8: the fast tier (a prefill, then a decode step in the persistent kernel)
    gives the plain tier's logits; both stay within a few hundredths of the dense reference's
    logits of the same weights with x unrounded (the rounding's cost)."""
    config = tiny_config(intermediate_size=128)
    cfg = LlamaConfig.from_dict(config)
    raw = random_tensors(config, 5)
    tensors = quantize_matrices(raw, "q4_1_a8")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in raw:
            tensors[name] = quantize(raw[name], "q8_0_a8")
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=12)
    logits = {ops.name: prefill_then_decode(LlamaModel(cfg, tensors, ops), cfg, ids,
                                            np.array([[3, 1, 6, 0]], np.int32), 4)
              for ops in (SimpleOps(), FastOps())}
    np.testing.assert_allclose(logits["fast"], logits["simple"], rtol=1e-4, atol=1e-4)
    widened = {n: t.dequantize() if isinstance(t, QuantizedWeight) else t for n, t in tensors.items()}
    reference = reference_logits(cfg, widened, ids.tolist())[[10, 11]]        # (2, vocab)
    gap = np.abs(logits["simple"] - reference).max() / np.abs(reference).max()
    assert 0 < gap < 0.05, gap


def test_gguf_a8_loads_the_gguf_blocks_as_q4_1_a8_and_q8_0_a8(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "g", seed=3, gguf=True, intermediate_size=128)
    plain, a8 = load_weights(model_dir, "gguf"), load_weights(model_dir, "gguf_a8")
    with pytest.raises(ValueError, match="not 'gguf_a4'"):
        load_weights(model_dir, "gguf_a4")                   # named, not loaded as float32
    converted = 0
    for name, t in plain.items():
        if isinstance(t, QuantizedWeight):
            assert a8[name].fmt == t.fmt + "_a8", name
            assert np.array_equal(a8[name].data, t.data)
            converted += t.fmt == "q4_1"
    assert converted >= 4 * 2 and a8["model.embed_tokens.weight"].fmt == "q8_0_a8"   # every layer's matrices
    llm = make_llm(model_dir, num_blocks=32, quantization="gguf_a8")
    assert llm.llm_engine.backend.weight_format == "gguf_a8"
    layer = llm.llm_engine.runner.model.layers[0]
    assert {w.fmt for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {"q4_1_a8"}   # the panels'
    assert llm.llm_engine.runner.model.lm_head.fmt == "q8_0_a8"
    out = llm.generate([{"prompt_token_ids": list(range(5, 30))}],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
