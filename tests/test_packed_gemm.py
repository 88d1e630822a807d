"""oneMKL's packed GEMM (kernels/packed_gemm.py) against numpy's product, and the engine's choice of it."""

import numpy as np
import pytest

from minipaged import SamplingParams
from minipaged.config import ConfigError
from minipaged.kernels.fast import attention, linear as fast_linear
from minipaged.kernels.fast.tuning import DEFAULT_TUNING, FastTuning
from minipaged.kernels.fast import packed_gemm
from minipaged.kernels.fast.linear_paths import LinearPaths
from minipaged.kernels.fast.panel_gemm import PanelWeight
from attention_batches import random_batch
from tiny_model import make_llm


def _mkl_or_none():
    try:
        return packed_gemm.load_packed_gemm("mkl", 2)   # on any x86-64 maker's CPU, not only Intel's
    except ValueError:
        return None


GEMM = _mkl_or_none()
needs_mkl = pytest.mark.skipif(GEMM is None, reason="oneMKL is not installed (pip install 'minipaged[mkl]')")


@needs_mkl
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (49, 7), (1, 3)])
def test_packed_products_match_numpy(out_features, in_features):
    rng = np.random.default_rng(out_features)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)   # (out, in)
    packed = GEMM.pack(w)
    assert (packed.out_features, packed.in_features) == w.shape
    for rows in [*range(1, 65), 200, 0]:
        x = rng.standard_normal((rows, in_features)).astype(np.float32)        # (T, in)
        got = packed.apply(x)
        assert got.shape == (rows, out_features) and got.dtype == np.float32
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


@needs_mkl
def test_linear_takes_the_packed_copy_from_its_row_threshold(monkeypatch):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    packed = GEMM.pack(w)
    calls = []
    real = packed_gemm.PackedGemm.matmul
    monkeypatch.setattr(packed_gemm.PackedGemm, "matmul", lambda self, x, pw: calls.append(len(x)) or real(self, x, pw))
    for rows in (1, DEFAULT_TUNING.packed_min_rows, 9, 300):
        x = rng.standard_normal((rows, 32)).astype(np.float32)
        np.testing.assert_allclose(fast_linear.linear(x, w, packed), x @ w.T, rtol=1e-4, atol=1e-4)
    assert calls == [r for r in (1, DEFAULT_TUNING.packed_min_rows, 9, 300) if r >= DEFAULT_TUNING.packed_min_rows]
    with pytest.raises(ValueError, match="does not fit"):
        packed.apply(np.ones((2, 31), np.float32))
    with pytest.raises(ValueError, match="float32 matrix"):
        GEMM.pack(np.ones((3, 4), np.float64))


@needs_mkl
def test_small_weights_are_not_packed():
    assert GEMM.pack_if_worth_it(np.ones((64, 32), np.float32)) is None
    assert GEMM.pack_if_worth_it(np.ones((576, 576), np.float32)) is not None
    assert GEMM.pack_if_worth_it(np.ones((576, 576), np.float64)) is None


def test_the_choice_of_gemm(monkeypatch):
    """"auto" loads oneMKL wherever it is installed, whatever the CPU's maker (which kinds of
    step it then takes is measured: tests/test_linear_paths.py); "mkl" requires it; "numba" never."""
    assert packed_gemm.load_packed_gemm("numba", 2) is None
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        packed_gemm.load_packed_gemm("blis", 2)
    if GEMM is not None:
        for vendor in ("GenuineIntel", "AuthenticAMD"):
            monkeypatch.setattr(packed_gemm, "cpu_vendor", lambda: vendor)
            assert isinstance(packed_gemm.load_packed_gemm("auto", 2), packed_gemm.PackedGemm)
            assert isinstance(packed_gemm.load_packed_gemm("mkl", 2), packed_gemm.PackedGemm)
    monkeypatch.setattr(packed_gemm, "find_mkl_library", lambda: None)
    assert packed_gemm.load_packed_gemm("auto", 2) is None   # not installed: our kernels
    with pytest.raises(ValueError, match=r"pip install 'minipaged\[mkl\]'"):
        packed_gemm.load_packed_gemm("mkl", 2)


def test_cpu_vendor_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\n"
                    "vendor_id\t: AuthenticAMD\n")
    assert packed_gemm.cpu_vendor(str(info)) == "AuthenticAMD"
    assert packed_gemm.cpu_vendor(str(tmp_path / "absent")) is None
    info.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")   # an Arm machine names no vendor_id
    assert packed_gemm.cpu_vendor(str(info)) is None
    assert packed_gemm.cpuinfo_field("CPU implementer", str(info)) == "0x41"


def test_engine_refuses_an_unknown_gemm(tiny_model_dir):
    with pytest.raises(ConfigError, match="cpu_gemm must be one of"):
        make_llm(tiny_model_dir, cpu_gemm="openblas")


@needs_mkl
def test_greedy_tokens_are_the_same_through_mkl_and_numba(tiny_model_dir, monkeypatch):
    """The packed weights change no token: batched greedy decoding (products of 1 to 5 rows,
    and prefills, whose attention of 32 queries or more runs on MKL's sgemm too) through MKL
    equals the Numba panels and numpy's BLAS. (The tiny model's
    weights are below the packing size, and 5 rows below MKL's row threshold: both lowered, through
    the fast tier's FastTuning.)"""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [12] * 40, [13, 14], [15, 16, 17, 18, 19],
               [(7 * i) % 90 + 3 for i in range(70)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for choice in ("numba", "mkl"):
        llm = make_llm(tiny_model_dir, cpu_gemm=choice, num_blocks=64, max_model_len=128,
                       fast_tuning=FastTuning(packed_min_rows=2, min_packed_elements=0))
        engine = llm.llm_engine
        assert (engine.backend.gemm is None) == (choice == "numba")
        weights = engine.model.weights
        assert engine.backend.ops.linear_paths == LinearPaths.every(choice) and weights.tier_state.paths_made == (choice,)
        copy = PanelWeight if choice == "numba" else packed_gemm.PackedWeight   # the second copy's kind
        assert isinstance(getattr(weights.layers[0].qkv, choice), copy)
        assert isinstance(getattr(weights.lm_head, choice), copy)
        assert (engine.backend.ops.gemm is None) == (choice == "numba")
        outputs[choice] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["mkl"] == outputs["numba"]


@needs_mkl
@pytest.mark.parametrize("m,k,n", [(384, 64, 700), (5, 64, 1), (1, 1, 1), (0, 64, 3), (7, 0, 4)])
def test_plain_sgemm_matches_numpy(m, k, n):
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)       # (m, k)
    b = rng.standard_normal((k, n)).astype(np.float32)       # (k, n)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(GEMM.sgemm(a, b), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(GEMM.sgemm(a, np.ascontiguousarray(b.T), trans_b=True), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="do not multiply"):
        GEMM.sgemm(a, b.T if n != k else b[:, :0].T)


@needs_mkl
@pytest.mark.parametrize("seqs", [[(300, 300)], [(40, 90), (1, 17), (260, 260), (17, 33)]])
def test_prompt_attention_through_mkl_matches_the_spec(seqs):
    """A prompt's (and a chunk's) attention with MKL's products equals the NumPy spec, and numpy's path."""
    from minipaged.kernels import reference as spec

    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(len(seqs)), block_size=16, num_heads=9,
                                             num_kv_heads=3, head_dim=64, seqs=seqs)
    plan = attention.plan_attention(meta, GEMM)
    assert len(plan.prompt_seqs) >= 1 and plan.gemm is GEMM
    got = attention.paged_attention(q, k_cache, v_cache, plan, 0.125)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                0.125)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, attention.paged_attention(q, k_cache, v_cache, attention.plan_attention(meta), 0.125),
                               rtol=1e-5, atol=1e-5)
