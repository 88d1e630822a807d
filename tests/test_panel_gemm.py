"""The SIMD registers (``kernels/simd.py``) and the panel GEMM built on them
(``kernels/panel_gemm.py``), against their NumPy meaning: each intrinsic against the
expression its docstring names, every product against ``x @ w.T``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

from minipaged.kernels import reference
from minipaged.kernels.fast.simd import host_vector_shape
from minipaged.kernels.fast import linear as fast_linear
from minipaged.kernels.fast.tuning import DEFAULT_TUNING
from minipaged.kernels.fast.panel_gemm import PANEL, TILE_ROWS, PanelWeight, pack, panel_linear
from minipaged.kernels.fast.simd import (LANES, LANES_ENV, REGISTERS, host_vector_shape, vadd, vbroadcast, vfma,
                                    stack_floats, vload, vmax, vmax_lanes, vmul, vsplat, vstore, vsum, vzero)


@njit(cache=False)
def _simd_roundtrip(a, b, c, s, out):
    """out rows: vzero, vsplat(s), vload(a, 3), vfma(a[0:], b[0:], c[0:]), then a store at an
    offset, vadd(a[0:], c[0:]), vbroadcast(b, 2), vmul(a[0:], b[0:]) and vmax(a[0:], b[0:]) (each
    through vstore); returns vsum(a[0:]) and vmax_lanes(c[0:])."""
    vstore(out[0], 0, vzero())
    vstore(out[1], 0, vsplat(s))
    vstore(out[2], 0, vload(a, 3))
    vstore(out[3], 0, vfma(vload(a, 0), vload(b, 0), vload(c, 0)))
    vstore(out[4], 5, vload(b, 1))       # a store at an offset leaves the rest of the row alone
    vstore(out[5], 0, vadd(vload(a, 0), vload(c, 0)))
    vstore(out[6], 0, vbroadcast(b, 2))
    vstore(out[7], 0, vmul(vload(a, 0), vload(b, 0)))
    vstore(out[8], 0, vmax(vload(a, 0), vload(b, 0)))
    return vsum(vload(a, 0)), vmax_lanes(vload(c, 0))


def _halving_sum(v: np.ndarray) -> np.float32:
    """vsum's documented order: the upper half of the lanes added onto the lower, until one is left."""
    while len(v) > 1:
        v = v[:len(v) // 2] + v[len(v) // 2:]
    return v[0]


def test_each_simd_intrinsic_means_its_numpy_expression():
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(LANES + 8, dtype=np.float32) for _ in range(3))
    b[1] = a[1]                                                          # a tie: either is right
    out = np.full((9, LANES + 8), 7.0, np.float32)
    c[LANES // 2 + 1] = 9.0                                                # the top in an upper lane
    total, top = _simd_roundtrip(a, b, c, np.float32(2.5), out)
    np.testing.assert_array_equal(out[0, :LANES], np.zeros(LANES, np.float32))
    np.testing.assert_array_equal(out[1, :LANES], np.full(LANES, 2.5, np.float32))
    np.testing.assert_array_equal(out[2, :LANES], a[3:3 + LANES])
    fused = (a[:LANES].astype(np.float64) * b[:LANES] + c[:LANES]).astype(np.float32)   # one rounding
    np.testing.assert_array_equal(out[3, :LANES], fused)
    np.testing.assert_array_equal(out[4, 5:5 + LANES], b[1:1 + LANES])
    np.testing.assert_array_equal(out[5, :LANES], a[:LANES] + c[:LANES])
    np.testing.assert_array_equal(out[6, :LANES], np.full(LANES, b[2], np.float32))
    np.testing.assert_array_equal(out[7, :LANES], a[:LANES] * b[:LANES])
    np.testing.assert_array_equal(out[8, :LANES], np.maximum(a[:LANES], b[:LANES]))
    assert total == _halving_sum(a[:LANES].copy()) and isinstance(total, float)
    assert top == c[:LANES].max() == 9.0
    assert (out[4, :5] == 7.0).all() and (out[:4, LANES:] == 7.0).all()   # nothing past a register


_PAGE = 3 * LANES


@njit(cache=False)
def _stack_pages(x, times):
    """Each pass fills the stack page (one slot of the frame, reused pass after pass) with x * i,
    one register through vstore and the rest by index, and sums it."""
    sums = np.zeros(times, np.float32)
    for i in range(times):
        page = stack_floats(_PAGE)                                # (3 LANES,) float32
        vstore(page, 0, vmul(vload(x, 0), vsplat(np.float32(i))))
        for j in range(LANES, _PAGE):
            page[j] = x[j] * i
        sums[i] = page.sum()
    return sums


def test_a_stack_page_holds_what_is_written_to_it():
    """``stack_floats(n)``: n float32s on the kernel's stack, written and read as an array."""
    x = np.arange(_PAGE, dtype=np.float32)
    np.testing.assert_array_equal(_stack_pages(x, 4), np.array([x.sum() * i for i in range(4)], np.float32))


def test_pack_lays_panels_out_as_documented():
    w = np.arange(70 * 3, dtype=np.float32).reshape(70, 3)            # (out, in): 70 -> 3 or 5 panels
    packed = pack(w)
    panels = -(-70 // PANEL)
    assert packed.data.shape == (panels, 3, PANEL) and (packed.out_features, packed.in_features) == (70, 3)
    for p in range(panels):
        for k in range(3):
            want = np.zeros(PANEL, np.float32)
            rows = w[p * PANEL:(p + 1) * PANEL, k]
            want[:len(rows)] = rows                                    # padded with zero features
            np.testing.assert_array_equal(packed.data[p, k], want)
    assert packed.nbytes == packed.data.nbytes


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (32, 1), (100, 33), (7, 64), (40, 129)])
def test_panel_products_match_the_spec_for_every_row_count(n, k):
    rng = np.random.default_rng(n + k)
    w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)       # (out, in)
    packed = pack(w)
    for rows in (*range(0, 65), 71, 96, 127, 128):                    # up to PANEL_MAX_ROWS
        x = rng.standard_normal((rows, k), dtype=np.float32)           # (T, in)
        for threads in (1, 2, 3):
            got = panel_linear(x, packed, threads)
            assert got.shape == (rows, n) and got.dtype == np.float32 and got.flags.c_contiguous
            np.testing.assert_allclose(got, reference.linear(x, w), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_linear_multiplies_by_the_panels_up_to_their_limit(monkeypatch):
    """With panels, linear uses them for 1..PANEL_MAX_ROWS float32 rows and BLAS beyond; the
    answer is x @ w.T either way, strided or float64 rows included."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 24), dtype=np.float32)               # (out, in)
    packed = fast_linear.pack_linear(w)
    calls = []
    monkeypatch.setattr(PanelWeight, "apply", lambda self, x, t: calls.append(len(x)) or panel_linear(x, self, t))
    for rows in (1, 5, DEFAULT_TUNING.skinny_max_rows + 1, DEFAULT_TUNING.panel_max_rows, DEFAULT_TUNING.panel_max_rows + 1, 300):
        x = rng.standard_normal((rows, 24), dtype=np.float32)
        np.testing.assert_allclose(fast_linear.linear(x, w, packed), x @ w.T, rtol=1e-4, atol=1e-4)
    assert calls == [1, 5, DEFAULT_TUNING.skinny_max_rows + 1, DEFAULT_TUNING.panel_max_rows]
    strided = rng.standard_normal((3, 48), dtype=np.float32)[:, ::2]   # a view, not contiguous
    np.testing.assert_allclose(fast_linear.linear(strided, w, packed), strided @ w.T, rtol=1e-4, atol=1e-4)
    x64 = rng.standard_normal((4, 24))                                 # float64 rows: BLAS, same answer
    np.testing.assert_allclose(fast_linear.linear(x64, w, packed), x64 @ w.T.astype(np.float64), rtol=1e-6)
    assert fast_linear.linear(np.empty((0, 24), np.float32), w, packed).shape == (0, 40)


def test_bad_weights_and_mismatched_copies_are_refused():
    with pytest.raises(ValueError, match="float32 matrix"):
        pack(np.ones((4, 4), np.float64))
    with pytest.raises(ValueError, match="float32 matrix"):
        pack(np.ones(16, np.float32))
    assert fast_linear.pack_linear(np.ones((4, 4), np.float16)) is None        # not float32: no panels
    packed = pack(np.ones((8, 16), np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        panel_linear(np.ones((2, 8), np.float32), packed, 2)
    with pytest.raises(ValueError, match="the packed copy is"):
        fast_linear.linear(np.ones((2, 16), np.float32), np.ones((9, 16), np.float32), packed)


def test_panel_sums_lose_no_more_than_blas():
    """The sums run over K_RUN values of k at a time (``kernels/panel_gemm.py``): at SmolLM2's
    widest input (1536) the panels' rounding error, against float64, is no larger than BLAS's."""
    rng = np.random.default_rng(5)
    w = (0.05 * rng.standard_normal((576, 1536))).astype(np.float32)    # (out, in): the down projection
    x = rng.standard_normal((8, 1536)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)   # the sum of |products|
    panels = np.abs(panel_linear(x, pack(w), 2) - exact) / scale
    blas = np.abs(x @ w.T - exact) / scale
    assert panels.mean() <= blas.mean() and panels.max() <= 2 * blas.max()


def test_the_register_shape_follows_the_cpu_and_the_override():
    """16 lanes and 32 registers with AVX-512, else 8 and 16; the widest tile's sums leave
    registers for the weights and a broadcast; an override names a width or is refused."""
    assert (LANES, REGISTERS) in ((16, 32), (8, 16)) and PANEL == 2 * LANES
    assert 2 * TILE_ROWS + 3 <= REGISTERS and TILE_ROWS == {32: 8, 16: 6}[REGISTERS]
    if not os.environ.get(LANES_ENV):
        assert (LANES, REGISTERS) == host_vector_shape(None)
    assert host_vector_shape("8") == (8, 16) and host_vector_shape("16") == (16, 32)
    with pytest.raises(ValueError, match="MINIPAGED_SIMD_LANES must be 8 or 16"):
        host_vector_shape("12")


_OTHER_WIDTH_CHECK = textwrap.dedent("""
    import numpy as np
    from minipaged.kernels import reference
    from minipaged.kernels.fast.panel_gemm import PANEL, TILE_ROWS, pack, panel_linear
    from minipaged.kernels.fast.simd import LANES
    rng = np.random.default_rng(7)
    for n, k in ((960, 576), (100, 33), (40, 129)):
        w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
        packed = pack(w)
        assert packed.data.shape[2] == PANEL
        for rows in (*range(0, 18), 31, 64, 102, 128):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            for threads in (1, 2):
                np.testing.assert_allclose(panel_linear(x, packed, threads), reference.linear(x, w),
                                           rtol=1e-4, atol=1e-4 * np.sqrt(k))
    # paged attention's register kernel, built for this width: a whole register quad (64) and
    # single registers after the quads (48), decodes and a prompt chunk
    from minipaged.kernels.fast import attention, elementwise, simd, linear as fast_linear
    from minipaged.kernels.fast.tuning import DEFAULT_TUNING, FastTuning
    from minipaged.kernels.layout import AttentionMetadata
    meta = AttentionMetadata(np.zeros(1, np.int64), np.array([0, 1], np.int32), np.array([70], np.int32),
                             np.array([[3, 0, 5, 1, 2]], np.int32), 1, 70)
    k_cache, v_cache = (rng.standard_normal((7, 2, 16, 64), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, 6, 64), dtype=np.float32)
    from numba import get_num_threads
    plan = attention.plan_attention(meta, None, FastTuning(split_min_tokens=8))   # one long decode: a slice a thread
    assert len(plan.merges) == (1 if get_num_threads() > 1 else 0)
    np.testing.assert_allclose(attention.paged_attention(q, k_cache, v_cache, plan, 0.125),
                               reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                         meta.query_start_loc, 0.125), atol=2e-5, rtol=1e-5)
    for head_dim in (64, 48):
        tables = np.array([[3, 0, 5, 1, 2], [4, 6, -1, -1, -1]], np.int32)
        k_cache, v_cache = (rng.standard_normal((7, 2, 16, head_dim), dtype=np.float32) for _ in range(2))
        qsl, seq_lens = np.array([0, 1, 6], np.int32), np.array([70, 29], np.int32)
        q = rng.standard_normal((6, 6, head_dim), dtype=np.float32)
        meta = AttentionMetadata(np.zeros(6, np.int64), qsl, seq_lens, tables, 5, 70)
        got = attention.paged_attention(q, k_cache, v_cache, meta, 0.125)
        want = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # the prompt kernel at this width: a 70-token prompt (three query tiles), GQA groups of 3
    from minipaged.kernels.fast import prompt_attention
    k_cache, v_cache = (rng.standard_normal((7, 2, 16, 64), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((70, 6, 64), dtype=np.float32)
    table = np.array([3, 0, 5, 1, 2], np.int32)
    got = np.empty_like(q)
    prompt_attention.prompt_attention(q, k_cache, v_cache, table, 70, 0.125, got, 2)
    want = reference.paged_attention(q, k_cache, v_cache, table[None], np.array([70], np.int32),
                                     np.array([0, 70], np.int32), 0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # a row's maximum in registers of this width (vmax, vmax_lanes), with a tail
    row = rng.standard_normal(4 * LANES * 3 + 5, dtype=np.float32)
    for n in (3, 4 * LANES, 4 * LANES * 3 + 5):
        assert elementwise.vector_max(row, n) == row[:n].max()
    logits = rng.standard_normal((3, 300), dtype=np.float32)            # the sampler's normaliser, on it
    want = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
    np.testing.assert_allclose(elementwise.logsumexp(logits), want, rtol=1e-5)
    # the quantized panels at this width: a single row, and runs of k widened for the float32
    # tiles (4 rows; 12: a pair of AVX2's tiles of 6; 28: tiles of 8, then 4), over two runs of k
    from minipaged.kernels.fast.quant_panels import pack as pack_quant, quant_panel_linear
    from minipaged.kernels.weight_formats import quantize
    w = (0.05 * rng.standard_normal((3 * PANEL - 5, 160))).astype(np.float32)
    from minipaged.kernels.weight_formats import round_activations
    for fmt in ("bfloat16", "int8", "q4_1", "q8_0", "q4_1_a8", "q8_0_a8"):   # _a8: x rounded, integer products
        q = quantize(w, fmt)
        for rows in (1, 4, 12, 28):
            x = rng.standard_normal((rows, 160), dtype=np.float32)
            read = round_activations(x) if fmt.endswith("_a8") else x         # (rows, 160): what it multiplies
            want = read.astype(np.float64) @ q.dequantize().T.astype(np.float64)
            np.testing.assert_allclose(quant_panel_linear(x, pack_quant(q), 2), want, rtol=2e-5,
                                       atol=2e-5 * np.abs(want).max())
    print(LANES, PANEL, TILE_ROWS)
""")


@pytest.mark.parametrize("lanes", ["8", "16"])
def test_panel_products_match_the_spec_at_either_register_width(lanes, tmp_path):
    """The kernel built for the other machine's registers (AVX-512's on an AVX2 core and the
    reverse: LLVM splits or joins the vectors) gives x @ w.T too; it runs in a fresh process,
    compiled afresh under MINIPAGED_SIMD_LANES and cached nowhere. The machine's own width is
    what every other test compiles: only the other one runs here (~30 s of CI time each)."""
    if int(lanes) == host_vector_shape(None)[0]:
        pytest.skip(f"{lanes} lanes is this machine's own width: the rest of the suite runs it")
    env = dict(os.environ, **{LANES_ENV: lanes, "NUMBA_CACHE_DIR": str(tmp_path)})
    done = subprocess.run([sys.executable, "-c", _OTHER_WIDTH_CHECK], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    want = {"8": "8 16 6", "16": "16 32 8"}[lanes]
    assert done.stdout.split("\n")[-2] == want
    cached = [path.name for path in tmp_path.rglob("*.nbi")]          # index files of cached kernels
    assert not [name for name in cached if "panel" in name or "vector_attention" in name
                or "prompt_attention" in name or "row_max" in name or "logsumexp" in name], cached
