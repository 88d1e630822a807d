"""bfloat16 dot products: pairs of bfloat16 weights times a pair of bfloat16 x, into float32 sums.

The OS idea is the kernel's "alternatives", as in ``int8_dot.py``: one operation in the source,
and the instructions that carry it out picked once for the CPU it runs on. Here the operation is
one step of a product whose weights and x are both bfloat16: each float32 lane adds the products
of two consecutive k of its output feature,

    acc[i] + w_hi[i] * x_hi + w_lo[i] * x_lo,   the high halves' product added first,

where word i of the weight holds feature i's pair (bits 0-15: k even, 16-31: k odd) and one word
of x holds x's pair the same way (broadcast to every lane). The choice (``BF16_DOT``) is read once
from the CPU features Numba compiles for:

- "avx512bf16": AVX512-BF16's ``vdpbf16ps``, 32 multiply-adds an instruction, twice float32's
  ``vfmadd`` (Zen 4 and 5, Sapphire Rapids; LLVM 17 on, which types its operands as bfloat);
- "generic": each half shifted into a float32, then two multiply-adds, for any other CPU.

Both give the same float32 sums: a bfloat16 times a bfloat16 (8-bit significands) is exact in
float32, so each step rounds once, in the same order. (``vdpbf16ps`` also flushes subnormal
inputs and results to zero; the weights and activations of a model are never that small.)
``pair_dot_spec`` is the NumPy meaning, checked in ``tests/test_bf16_dot.py``.

Measured on Zen 5 (one core, a 576 x 576 weight in L2, docs/weights.md): 1.2-1.6x the shift and
multiply-add of float32 x at one to four rows, 2.2-2.4x at 8 to 32. It rounds x to bfloat16, which
the ``bfloat16`` weight format does not (its x stays float32): this is the instruction alone, for
a format that rounds x.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types as nb_types
from numba.extending import intrinsic

from .int8_dot import _I32, _declare, broadcast_word, byte_pointer
from .simd import _VECTOR, LANES, compiled_cpu_features, f32vec   # _VECTOR: LLVM's register of LANES float32s

BF16_DOT_KINDS = ("avx512bf16", "generic")


def bf16_dot_instructions(features: str, lanes: int, llvm_major: int = llvm_version_info[0]) -> str:
    """Which instructions multiply bfloat16 pairs for a CPU with ``features`` (LLVM's
    "+avx512bf16,..." string), registers of ``lanes`` float32s, and LLVM ``llvm_major``."""
    have = set(features.split(","))
    return "avx512bf16" if lanes == 16 and "+avx512bf16" in have and llvm_major >= 17 else "generic"


BF16_DOT = bf16_dot_instructions(compiled_cpu_features(), LANES)


def pair_dot_spec(acc: np.ndarray, w_words: np.ndarray, x_word: int) -> np.ndarray:
    """The NumPy meaning of one ``pair_dot``: acc (LANES,) float32; w_words (LANES,) uint32, each a
    feature's pair of bfloat16 (k even in the low half); x_word, x's pair the same way ->
    (LANES,) float32."""
    w = np.asarray(w_words, np.uint32)                                   # (LANES,)
    x = np.full(w.shape, x_word, np.uint32)                              # (LANES,)
    acc = (np.asarray(acc, np.float32) + _odd_k(w) * _odd_k(x)).astype(np.float32)
    return (acc + _even_k(w) * _even_k(x)).astype(np.float32)


def _odd_k(words: np.ndarray) -> np.ndarray:
    """(n,) uint32 pairs -> (n,) float32: the high halves, bfloat16 bits already in place."""
    return (words & np.uint32(0xFFFF0000)).view(np.float32)


def _even_k(words: np.ndarray) -> np.ndarray:
    """(n,) uint32 pairs -> (n,) float32: the low halves, shifted into a float32's top bits."""
    return (words << np.uint32(16)).view(np.float32)


class _BFloat(ir.Type):
    """LLVM's ``bfloat``, which llvmlite does not name (vdpbf16ps's operands, LLVM 17 on)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_PAIRS = ir.VectorType(_BFloat(), 2 * LANES)                             # LANES pairs of bfloat16


def _pair_dot_ir(builder, kind: str, acc, w, x):
    """acc + w's pairs times x's (both <LANES x i32>, a pair of bfloat16 in each lane)."""
    if kind == "avx512bf16":
        fn = _declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", _VECTOR, [_VECTOR, _PAIRS, _PAIRS])
        return builder.call(fn, [acc, builder.bitcast(x, _PAIRS), builder.bitcast(w, _PAIRS)])
    high = ir.Constant(_I32, [-0x10000] * LANES)                         # 0xFFFF0000: the odd k's bits
    sixteen = ir.Constant(_I32, [16] * LANES)
    fma = _declare(builder, f"llvm.fma.v{LANES}f32", _VECTOR, [_VECTOR] * 3)
    w_hi, x_hi = (builder.bitcast(builder.and_(v, high), _VECTOR) for v in (w, x))
    w_lo, x_lo = (builder.bitcast(builder.shl(v, sixteen), _VECTOR) for v in (w, x))
    return builder.call(fma, [w_lo, x_lo, builder.call(fma, [w_hi, x_hi, acc])])


def pair_dot(kind: str):
    """An intrinsic ``(acc, w, at, xb, xat)``: acc + LANES features' pairs of bfloat16 (the words
    of uint8 array w from byte ``at``) times x's pair (the word of array xb at byte ``xat``): one
    step of ``pair_dot_spec``. ``kind``: one of BF16_DOT_KINDS."""
    if kind not in BF16_DOT_KINDS:
        raise ValueError(f"pair_dot: kind must be one of {BF16_DOT_KINDS}, got {kind!r}")

    def typer(typingctx, acc, w, at, xb, xat):
        if acc != f32vec or not isinstance(w, nb_types.Array) or not isinstance(xb, nb_types.Array):
            return None

        def codegen(context, builder, sig, args):
            acc_, w_, at_, xb_, xat_ = args
            words = builder.load(byte_pointer(context, builder, sig.args[1], w_, at_, sig.args[2], _I32), align=1)
            word = builder.load(byte_pointer(context, builder, sig.args[3], xb_, xat_, sig.args[4], ir.IntType(32)),
                                align=1)
            return _pair_dot_ir(builder, kind, acc_, words, broadcast_word(builder, word))
        return f32vec(acc, w, at, xb, xat), codegen
    return intrinsic(typer)
