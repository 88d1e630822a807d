"""SIMD registers for Numba kernels: a value of LANES float32s that lives in one vector register.

The hardware analogy: an ALU's register file. A CPU core does its arithmetic on 512-bit
(AVX-512), 256-bit (AVX2) or 128-bit (NEON) registers, 16, 8 or 4 float32s at once. Numba
leaves it to LLVM to find such vectors in scalar loops, and LLVM finds them in a dot product
(a reduction over k) but not in the layout a fast matrix product needs: many independent
sums, each a whole register, kept in registers across the whole k loop. This module names
that register directly, as GPU-Puzzles names a thread: ``F32Vec`` is a Numba type whose value
is an LLVM ``<LANES x float>``, and six intrinsics work on it:

    vzero()              a register of zeros
    vsplat(s)            a register with s in every lane (a broadcast)
    vload(a, i)          a[i : i + LANES] of a 1-D float32 array, into a register
    vstore(a, i, v)      v into a[i : i + LANES]
    vfma(a, b, c)        a * b + c, lane by lane, one fused multiply-add
    vadd(a, b)           a + b, lane by lane

Their NumPy meaning is the comment beside each; ``tests/test_panel_gemm.py`` checks each one
against it. LANES is 16 whatever the CPU: LLVM splits a <16 x float> into two AVX2 or four
NEON registers where the hardware's are narrower. No bounds are checked: a caller keeps
``i + LANES <= a.size``.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types as nb_types
from numba.extending import intrinsic, models, register_model

LANES = 16                                   # float32s in one register (AVX-512's zmm)
_VECTOR = ir.VectorType(ir.FloatType(), LANES)


class F32Vec(nb_types.Type):
    """The Numba type of a register of LANES float32s."""

    def __init__(self) -> None:
        super().__init__(name=f"f32x{LANES}")


f32vec = F32Vec()


@register_model(F32Vec)
class _F32VecModel(models.PrimitiveModel):
    """An F32Vec is held as LLVM's <LANES x float>: a register, not memory."""

    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _VECTOR)


def _float32_1d(arr) -> bool:
    return isinstance(arr, nb_types.Array) and arr.ndim == 1 and arr.dtype == nb_types.float32


def _vector_pointer(context, builder, arr_type, arr, index):
    """The address of arr[index], as a pointer to a whole register."""
    data = context.make_array(arr_type)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [index]), _VECTOR.as_pointer())


@intrinsic
def vzero(typingctx):
    """np.zeros(LANES, np.float32)"""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VECTOR, None)
    return f32vec(), codegen


@intrinsic
def vsplat(typingctx, s):
    """np.full(LANES, s, np.float32)"""
    if not isinstance(s, nb_types.Float):
        return None

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], nb_types.float32)
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), value, ir.IntType(32)(0))
        lane_zero = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        return builder.shuffle_vector(one, ir.Constant(_VECTOR, ir.Undefined), lane_zero)
    return f32vec(s), codegen


@intrinsic
def vload(typingctx, arr, index):
    """arr[index : index + LANES].copy()"""
    if not _float32_1d(arr) or not isinstance(index, nb_types.Integer):
        return None

    def codegen(context, builder, sig, args):
        index = context.cast(builder, args[1], sig.args[1], nb_types.intp)
        return builder.load(_vector_pointer(context, builder, sig.args[0], args[0], index), align=4)
    return f32vec(arr, index), codegen


@intrinsic
def vstore(typingctx, arr, index, v):
    """arr[index : index + LANES] = v"""
    if not _float32_1d(arr) or not isinstance(index, nb_types.Integer) or v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        index = context.cast(builder, args[1], sig.args[1], nb_types.intp)
        builder.store(args[2], _vector_pointer(context, builder, sig.args[0], args[0], index), align=4)
        return context.get_dummy_value()
    return nb_types.void(arr, index, v), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, rounded once per lane"""
    if not (a == b == c == f32vec):
        return None

    def codegen(context, builder, sig, args):
        name = f"llvm.fma.v{LANES}f32"
        fn = builder.module.globals.get(name) or ir.Function(
            builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), name)
        return builder.call(fn, args)
    return f32vec(a, b, c), codegen


@intrinsic
def vadd(typingctx, a, b):
    """a + b"""
    if not (a == b == f32vec):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32vec(a, b), codegen
