"""SIMD registers for Numba kernels: a value of LANES float32s that lives in one vector register.

The hardware analogy: an ALU's register file. A CPU core does its arithmetic on 512-bit
(AVX-512), 256-bit (AVX2) or 128-bit (NEON) registers, 16, 8 or 4 float32s at once. Numba
leaves it to LLVM to find such vectors in scalar loops, and LLVM finds them in a dot product
(a reduction over k) but not in the layout a fast matrix product needs: many independent
sums, each a whole register, kept in registers across the whole k loop. This module names
that register directly, as GPU-Puzzles names a thread: ``F32Vec`` is a Numba type whose value
is an LLVM ``<LANES x float>``, and eleven intrinsics work on it:

    vzero()              a register of zeros
    vsplat(s)            a register with s in every lane (a broadcast)
    vbroadcast(a, i)     a register with a[i] in every lane (one load, no index wraparound)
    vload(a, i)          a[i : i + LANES] of a 1-D float32 array, into a register
    vstore(a, i, v)      v into a[i : i + LANES]
    vfma(a, b, c)        a * b + c, lane by lane, one fused multiply-add
    vadd(a, b)           a + b, lane by lane
    vmul(a, b)           a * b, lane by lane
    vmax(a, b)           np.where(a > b, a, b), lane by lane (one max instruction)
    vmax_lanes(a)        a.max(): the largest lane, as one float32
    vsum(a)              a.sum(): the lanes added into one float32

and one memory hint beside them, ``prefetch(arr, byte_offset)``, which changes no value, and
one scratch page, ``stack_floats(n)``: n float32s on the kernel's stack.

Six more widen a compact weight (``kernels/weight_formats.py``) as it is loaded: each reads
LANES values from a 1-D uint8 array at a *byte* offset (a quantized panel, ``quant_panels.py``)
and gives a register of float32s:

    vload_bf16(b, i)     bfloat16 bits, shifted into the top half of each float32
    vload_i8(b, i)       int8 codes, converted
    vload_f16(b, i)      float16 values (a GGUF block's d and m), converted
    vload_low4_unit(b, i)   1 + q / 16 for the low 4 bits q of each byte (integer operations only)
    vload_high4_unit(b, i)  1 + q / 16 for the high 4 bits
    vload_f32b(b, i)     float32s stored in the bytes (a panel's int8 scales)

(checked against their NumPy meaning in ``tests/test_weight_formats.py``; a caller keeps
``i + LANES * bytes-per-value <= b.size``)

Their NumPy meaning is the comment beside each; ``tests/test_panel_gemm.py`` checks each one
against it. No bounds are checked: a caller keeps ``i + LANES <= a.size`` (``vbroadcast``:
``0 <= i < a.size``; unlike ``vsplat(a[i])`` it never tests i for a negative index, a test
that cost an AVX2 core half its multiply-adds in the panel kernel's inner loop).

LANES and REGISTERS are this machine's, read once from the CPU features Numba compiles for
(``host_vector_shape``): 16 lanes and 32 registers with AVX-512, else 8 lanes and 16 registers
(AVX2's ymm; on NEON LLVM splits each value into two of its 32 q registers, the same budget).
A kernel sizes its tiles from them: on an AVX2 core the AVX-512 shapes (16 lanes, 16 sums)
asked for 32 ymm registers of 16, spilled its sums to the stack and ran at a third of the
speed (docs/benchmarks.md). ``MINIPAGED_SIMD_LANES=8|16`` overrides the width, for tests that
check the other machine's shapes; kernels compiled under an override are not cached on disk.
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import config as numba_config
from numba.core.codegen import get_host_cpu_features
from numba import types as nb_types
from numba.extending import intrinsic, models, register_model

LANES_ENV = "MINIPAGED_SIMD_LANES"


def compiled_cpu_features() -> str:
    """The CPU features Numba compiles for, LLVM's "+avx2,+avx512f,..." string: NUMBA_CPU_FEATURES
    when the user pins a target, else Numba's own reading ("" where the host's can't be read, no
    avx* under NUMBA_ENABLE_AVX=0)."""
    features = numba_config.CPU_FEATURES
    return get_host_cpu_features() if features is None else features


def host_vector_shape(override: str | None = None) -> tuple[int, int]:
    """(lanes, registers) of the vector unit Numba compiles for: (16, 32) with AVX-512, else
    (8, 16); ``override`` ("8" or "16", ``MINIPAGED_SIMD_LANES``) picks a width instead."""
    if override:
        if override not in ("8", "16"):
            raise ValueError(f"{LANES_ENV} must be 8 or 16 (float32 lanes of a register), got {override!r}")
        return (16, 32) if override == "16" else (8, 16)
    return (16, 32) if "+avx512f" in compiled_cpu_features().split(",") else (8, 16)


_OVERRIDE = os.environ.get(LANES_ENV)
LANES_OVERRIDDEN = bool(_OVERRIDE)
# Whether kernels built on these registers may be cached on disk: not under an override, since
# Numba's cache is keyed by the CPU, not by the LANES a kernel was built for. (Numba also checks
# only the kernel's own file for changes: after an edit here, clear the kernels' __pycache__.)
SIMD_CACHE = not LANES_OVERRIDDEN
LANES, REGISTERS = host_vector_shape(_OVERRIDE)   # float32s in one register; how many registers
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
    """A 1-D float32 array known to be contiguous (Numba's 'C' layout): the intrinsics address
    arr[i] as the data pointer plus i, which a strided view would make wrong."""
    return (isinstance(arr, nb_types.Array) and arr.ndim == 1 and arr.dtype == nb_types.float32
            and arr.layout == "C")


def _address(context, builder, sig, args):
    """LLVM: the address of arr[index] for an intrinsic's (arr, index, ...) arguments."""
    index = context.cast(builder, args[1], sig.args[1], nb_types.intp)
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    return builder.gep(data, [index])


def _vector_pointer(context, builder, sig, args):
    """The address of arr[index], as a pointer to a whole register."""
    return builder.bitcast(_address(context, builder, sig, args), _VECTOR.as_pointer())


def _splat(builder, value):
    """LLVM: a float32 value into every lane of a register."""
    one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), value, ir.IntType(32)(0))
    lane_zero = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
    return builder.shuffle_vector(one, ir.Constant(_VECTOR, ir.Undefined), lane_zero)


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
        return _splat(builder, context.cast(builder, args[0], sig.args[0], nb_types.float32))
    return f32vec(s), codegen


@intrinsic
def vbroadcast(typingctx, arr, index):
    """np.full(LANES, arr[index], np.float32)"""
    if not _float32_1d(arr) or not isinstance(index, nb_types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, builder.load(_address(context, builder, sig, args), align=4))
    return f32vec(arr, index), codegen


@intrinsic
def vload(typingctx, arr, index):
    """arr[index : index + LANES].copy()"""
    if not _float32_1d(arr) or not isinstance(index, nb_types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_vector_pointer(context, builder, sig, args), align=4)
    return f32vec(arr, index), codegen


@intrinsic
def vstore(typingctx, arr, index, v):
    """arr[index : index + LANES] = v"""
    if not _float32_1d(arr) or not isinstance(index, nb_types.Integer) or v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _vector_pointer(context, builder, sig, args), align=4)
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


@intrinsic
def vmul(typingctx, a, b):
    """a * b"""
    if not (a == b == f32vec):
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32vec(a, b), codegen


@intrinsic
def vmax(typingctx, a, b):
    """np.where(a > b, a, b): the larger lane of each pair (b where they are equal or one is NaN)"""
    if not (a == b == f32vec):
        return None

    def codegen(context, builder, sig, args):
        return _larger(builder, args[0], args[1])
    return f32vec(a, b), codegen


def _larger(builder, a, b):
    """LLVM: a where a > b, else b (lane by lane for registers)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _fold_lanes(builder, value, combine):
    """LLVM: one float32 from a register, the upper half of its lanes combined with the lower
    (``combine(builder, low, high)``), halving until one lane is left: log2(LANES) steps."""
    width = LANES
    while width > 1:
        width //= 2
        low = builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                               list(range(width))))
        high = builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                                list(range(width, 2 * width))))
        value = combine(builder, low, high)
    return builder.extract_element(value, ir.IntType(32)(0))


@intrinsic
def vmax_lanes(typingctx, a):
    """a.max() as a float32: the lanes halved as in ``vsum``, with the larger of each pair kept"""
    if a != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return _fold_lanes(builder, args[0], _larger)
    return nb_types.float32(a), codegen


@intrinsic
def vsum(typingctx, a):
    """a.sum() as a float32: the upper half of the lanes added onto the lower, halving until one
    lane is left (log2(LANES) shuffles and adds; in a fastmath kernel LLVM may reorder them)"""
    if a != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return _fold_lanes(builder, args[0], lambda b, low, high: b.fadd(low, high))
    return nb_types.float32(a), codegen


def _uint8_1d(arr) -> bool:
    return (isinstance(arr, nb_types.Array) and arr.ndim == 1 and arr.dtype == nb_types.uint8
            and arr.layout == "C")


def _byte_load(element: ir.Type, widen):
    """An intrinsic (b, i): LANES ``element``s loaded from uint8 array b at byte i (no alignment
    assumed), then ``widen(builder, vector)`` into a register of float32s."""
    vector = ir.VectorType(element, LANES)

    def typer(typingctx, arr, index):
        if not _uint8_1d(arr) or not isinstance(index, nb_types.Integer):
            return None

        def codegen(context, builder, sig, args):
            pointer = builder.bitcast(_address(context, builder, sig, args), vector.as_pointer())
            return widen(builder, builder.load(pointer, align=1))
        return f32vec(arr, index), codegen
    return typer


def _splat_int(width: int, value: int):
    return ir.Constant(ir.VectorType(ir.IntType(width), LANES), [value] * LANES)


def _from_bf16(builder, v):
    wide = builder.zext(v, ir.VectorType(ir.IntType(32), LANES))
    return builder.bitcast(builder.shl(wide, _splat_int(32, 16)), _VECTOR)


vload_bf16 = intrinsic(_byte_load(ir.IntType(16), _from_bf16))
vload_bf16.__doc__ = "(b[i : i + 2 LANES].view(np.uint16).astype(np.uint32) << 16).view(np.float32)"
vload_i8 = intrinsic(_byte_load(ir.IntType(8), lambda builder, v: builder.sitofp(v, _VECTOR)))
vload_i8.__doc__ = "b[i : i + LANES].view(np.int8).astype(np.float32)"
vload_f16 = intrinsic(_byte_load(ir.HalfType(), lambda builder, v: builder.fpext(v, _VECTOR)))
vload_f16.__doc__ = "b[i : i + 2 LANES].view(np.float16).astype(np.float32)"
vload_f32b = intrinsic(_byte_load(ir.FloatType(), lambda builder, v: v))
vload_f32b.__doc__ = "b[i : i + 4 LANES].view(np.float32)"


def _unit_nibble(shift: int):
    """1 + q / 16 for the 4-bit code q at bit ``shift`` of each byte: the code moved into the
    top of a float32's mantissa under 1.0's exponent, with integer operations only (no
    conversion on the floating-point ports the multiply-adds need)."""
    def widen(builder, v):
        wide = builder.zext(v, ir.VectorType(ir.IntType(32), LANES))
        code = builder.and_(wide, _splat_int(32, 15 << shift))
        bits = builder.or_(builder.shl(code, _splat_int(32, 19 - shift)), _splat_int(32, 0x3F800000))
        return builder.bitcast(bits, _VECTOR)
    return widen


vload_low4_unit = intrinsic(_byte_load(ir.IntType(8), _unit_nibble(0)))
vload_low4_unit.__doc__ = "1 + (b[i : i + LANES] & 15).astype(np.float32) / 16, exactly"
vload_high4_unit = intrinsic(_byte_load(ir.IntType(8), _unit_nibble(4)))
vload_high4_unit.__doc__ = "1 + (b[i : i + LANES] >> 4).astype(np.float32) / 16, exactly"


@intrinsic
def stack_floats(typingctx, n):
    """np.empty(n, np.float32) on the stack (n a constant): one slot of the frame of the compiled
    function it ends up in (inlined callers share their caller's), reused by every pass of a
    loop, so never returned or kept. A scratch page that costs no allocation
    (``quant_panels.quant_rows`` widens runs of a panel into one)"""
    if not isinstance(n, nb_types.IntegerLiteral):
        return None
    size = n.literal_value
    array = nb_types.Array(nb_types.float32, 1, "C")

    def codegen(context, builder, sig, args):
        with builder.goto_entry_block():        # one slot of the frame, not one per loop pass
            data = builder.alloca(ir.ArrayType(ir.FloatType(), size))
            data.align = 64
        intp = context.get_value_type(nb_types.intp)
        view = context.make_array(array)(context, builder)
        context.populate_array(view, data=builder.bitcast(data, ir.FloatType().as_pointer()),
                               shape=[intp(size)], strides=[intp(4)], itemsize=intp(4), meminfo=None)
        return view._getvalue()
    return array(n), codegen


@intrinsic
def prefetch(typingctx, arr, byte_offset):
    """Ask the CPU to start loading the cache line ``byte_offset`` bytes into ``arr``'s data.

    A hint (x86 ``prefetcht0``): it never faults and returns nothing. The decode attention
    kernels read each K/V block from a page of its own, wherever the allocator put it; the CPU's
    own prefetcher follows a stream within a page but cannot guess the next page of a block
    table, so the kernel names it while it works on the current block. The panel products
    name the weight lines they will read next, so that memory keeps streaming while the
    multiply-adds of a tile run (kernels/panel_gemm.py).
    """
    if not isinstance(arr, nb_types.Array) or not isinstance(byte_offset, nb_types.Integer):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        address = builder.gep(builder.bitcast(data, byte), [args[1]])
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(   # named for this LLVM's pointers: .p0i8 or .p0
            "llvm.prefetch", [byte], ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]))
        builder.call(fn, [address, i32(0), i32(3), i32(1)])   # read, into every level, data
        return context.get_dummy_value()
    return nb_types.void(arr, nb_types.intp), codegen
