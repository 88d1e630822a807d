"""bfloat16 pair dot products (kernels/fast/bf16_dot.py): AVX512-BF16's ``vdpbf16ps`` and the
shift-and-multiply-add every other CPU uses.

The oracles: ``pair_dot_spec`` (NumPy's float32 arithmetic, one rounding a step), and beside it
the same sums in float64 from ml_dtypes' own bfloat16 (the spec's reading of the bits).
"""

import ml_dtypes
import numpy as np
import pytest
from numba import njit
from numba.core.codegen import get_host_cpu_features

from minipaged.kernels.fast.bf16_dot import BF16_DOT, BF16_DOT_KINDS, bf16_dot_instructions, pair_dot, pair_dot_spec
from minipaged.kernels.fast.simd import LANES, vload, vstore
from minipaged.kernels.weight_formats import float32_to_bf16


def _runnable(kind: str) -> bool:
    """The generic kind runs anywhere; vdpbf16ps where Numba compiles for it (BF16_DOT) and this
    CPU has it."""
    return kind == "generic" or (BF16_DOT == "avx512bf16" and "+avx512bf16" in get_host_cpu_features().split(","))


@pytest.mark.parametrize("features, lanes, llvm_major, kind", [
    ("+avx2,+avx512f,+avx512bf16", 16, 22, "avx512bf16"), ("+avx2,+avx512f,+avx512bf16", 16, 14, "generic"),
    ("+avx2,+avx512f,+avx512bf16", 8, 22, "generic"), ("+avx2,+avx512f", 16, 22, "generic"),
    ("+neon", 8, 22, "generic")])
def test_the_instructions_follow_the_cpu_and_llvm(features, lanes, llvm_major, kind):
    assert bf16_dot_instructions(features, lanes, llvm_major) == kind


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="pair_dot: kind must be one of"):
        pair_dot("amx")


def _pairs(values: np.ndarray) -> np.ndarray:
    """float32 values (..., 2 n), already bfloat16, -> (..., n) uint32 words: k even low, k odd high."""
    return float32_to_bf16(values).view(np.uint32)


@pytest.mark.parametrize("kind", BF16_DOT_KINDS)
def test_each_cpus_instructions_give_the_specs_sums(kind):
    """Eight steps of a 16-k product, compiled with each kind's instructions (where this CPU runs
    them), equal the spec bit for bit, and the float64 sums of ml_dtypes' bfloat16 to float32's
    rounding; with mixed signs, large and small magnitudes, and a start that is not zero."""
    if not _runnable(kind):
        pytest.skip(f"{kind} instructions do not run on this CPU ({LANES} lanes)")
    dot = pair_dot(kind)
    steps = 8

    @njit
    def run(w, xb, acc, out):
        a = vload(acc, 0)
        for j in range(steps):
            a = dot(a, w, 4 * LANES * j, xb, 4 * j)
        vstore(out, 0, a)

    rng = np.random.default_rng(3)
    for scale in (1.0, 1e-3, 1e3):
        w = (rng.standard_normal((LANES, 2 * steps)) * scale).astype(ml_dtypes.bfloat16).astype(np.float32)
        x = rng.standard_normal(2 * steps).astype(ml_dtypes.bfloat16).astype(np.float32)   # (2 steps,)
        acc = rng.standard_normal(LANES).astype(np.float32)                                # (LANES,)
        words = np.ascontiguousarray(_pairs(w).T)                          # (steps, LANES): step j's words
        xw = _pairs(x)                                                     # (steps,)
        out = np.zeros(LANES, np.float32)
        run(words.reshape(-1).view(np.uint8), xw.view(np.uint8), acc, out)
        want = acc.copy()
        for j in range(steps):
            want = pair_dot_spec(want, words[j], int(xw[j]))
        np.testing.assert_array_equal(out, want)
        exact = acc.astype(np.float64) + w.astype(np.float64) @ x.astype(np.float64)       # (LANES,)
        size = np.abs(acc).astype(np.float64) + np.abs(w).astype(np.float64) @ np.abs(x).astype(np.float64)
        # 2 steps roundings, each at most half a float32 step of the largest partial sum
        np.testing.assert_allclose(out, exact, rtol=0, atol=steps * np.spacing(np.float32(size.max())))


def test_the_spec_reads_the_pairs_as_ml_dtypes_does():
    """One step: each half a bfloat16 as ml_dtypes reads it, the high halves' product and the low
    halves' added to acc; the two order cases below pin which comes first (the odd k's, the
    high half), and that each is rounded on its own."""
    w = np.array([[1.5, -2.0], [0.25, 8.0]], np.float32)                  # (features, 2 k)
    x = np.array([3.0, 0.5], np.float32)
    acc = np.array([1.0, -1.0], np.float32)
    got = pair_dot_spec(acc, _pairs(w)[:, 0], int(_pairs(x)[0]))
    np.testing.assert_array_equal(got, np.array([1.0 + 4.5 - 1.0, -1.0 + 0.75 + 4.0], np.float32))
    high_first, high_alone = (pair_dot_spec(*case)[0] for case in _ORDER_CASES)
    assert high_first == np.float32(2.0 ** 24 + 4)   # + 2 (odd k), then + 1: a tie, to even (low first: + 2)
    assert high_alone == np.float32(2.0 ** 24 + 2)   # + 1: a tie, back to 2^24, then + 2 (one rounding: + 4)


def _order_case(x_pair: list[float]) -> tuple:
    """acc 2^24 in every lane, every feature's pair (1, 1), and x's pair (k even, k odd)."""
    return (np.full(LANES, 2.0 ** 24, np.float32), _pairs(np.ones((LANES, 2), np.float32))[:, 0],
            int(_pairs(np.array(x_pair, np.float32))[0]))


# x (1, 2): odd k first gives 2^24 + 4, even first 2^24 + 2; x (2, 1): odd k first, each product
# rounded, gives 2^24 + 2, the sum of both rounded once (or even k first) 2^24 + 4
_ORDER_CASES = (_order_case([1.0, 2.0]), _order_case([2.0, 1.0]))


@pytest.mark.parametrize("kind", BF16_DOT_KINDS)
def test_each_cpus_instructions_add_the_odd_k_first(kind):
    if not _runnable(kind):
        pytest.skip(f"{kind} instructions do not run on this CPU ({LANES} lanes)")
    dot = pair_dot(kind)

    @njit
    def run(w, xb, acc, out):
        vstore(out, 0, dot(vload(acc, 0), w, 0, xb, 0))

    for case in _ORDER_CASES:
        acc, words, x_word = case
        out = np.zeros(LANES, np.float32)
        run(words.view(np.uint8), np.array([x_word], np.uint32).view(np.uint8), acc, out)
        np.testing.assert_array_equal(out, pair_dot_spec(*case))
