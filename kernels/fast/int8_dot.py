"""Integer dot products: bytes times bytes into 32-bit sums, with this CPU's own instructions.

The OS idea is the kernel's "alternatives" (Linux's ``alternative()``, patched at boot from the
CPU's feature bits): one operation in the source, and the instructions that carry it out picked
once for the CPU it runs on. Here the operation is a GGUF block's integer sums, sum(w_k x_k)
over four bytes to a 32-bit lane, and the choice (``DOT``) is read once from the CPU features
Numba compiles for:

- "vnni512": AVX512-VNNI's ``vpdpbusd``, four unsigned-by-signed byte products added into each
  int32 lane, in two chains;
- "bw512" and "avx2": ``vpmaddubsw`` (two products into an int16, saturating) then ``vpmaddwd``
  (two int16s into an int32);
- "generic": the same sums in plain LLVM vectors (widen, multiply, add), for any other CPU.

Two kinds of weight codes meet x's int8 codes (``quant_a8.py``'s bounce buffer):

- ``block_dot``, Q4_1's unsigned 4-bit codes (0..15): a block's eight ``vpmaddubsw`` sums stay
  under 32767 (2 x 15 x 127 each), so AVX2 adds them as int16s and widens once;
- ``block_dot8``, Q8_0's signed int8 codes. The byte products' first operand is unsigned, so
  VNNI reads c + 128 (the sign bit flipped: one xor) and its sums carry 128 sum(x) more
  (``dot8_offset``: the caller takes it off with x's block sum); AVX2 and AVX512-BW read |c|
  and x with c's sign (llama.cpp's way: 2 x 128 x 127 fits an int16) and widen every pair.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types as nb_types
from numba.extending import intrinsic, models, register_model

from .panel_gemm import PANEL
from .simd import _VECTOR, LANES, compiled_cpu_features, f32vec   # _VECTOR: LLVM's register of LANES float32s

DOT_KINDS = ("vnni512", "bw512", "avx2", "generic")


def dot_instructions(features: str, lanes: int) -> str:
    """Which instructions add bytes' products into 32-bit sums for a CPU with ``features``
    (LLVM's "+avx2,+avx512vnni,..." string) and registers of ``lanes`` float32s."""
    have = set(features.split(","))
    if lanes == 16 and "+avx512vnni" in have:
        return "vnni512"
    if lanes == 16 and "+avx512bw" in have:
        return "bw512"
    return "avx2" if "+avx2" in have else "generic"


def dot8_offset(kind: str) -> int:
    """What ``block_dot8(kind)``'s sums carry beyond sum(c x): that many times sum(x)."""
    return 128 if kind == "vnni512" else 0


DOT = dot_instructions(compiled_cpu_features(), LANES)
DOT8_OFFSET = dot8_offset(DOT)
_I32 = ir.VectorType(ir.IntType(32), LANES)


class I32Vec(nb_types.Type):
    """The Numba type of a register of LANES int32 sums."""

    def __init__(self) -> None:
        super().__init__(name=f"i32x{LANES}")


i32vec = I32Vec()


@register_model(I32Vec)
class _I32VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _I32)


def _declare(builder, name: str, ret: ir.Type, args: list) -> ir.Function:
    return builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ret, args), name)


def _lanes(builder, v, first: int, count: int):
    """Lanes first .. first + count of vector v."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), count),
                                                    list(range(first, first + count))))


def _signs_moved(builder, a, b):
    """(|a|, b with a's sign) bytewise, for signed bytes a: their products are a's times b's."""
    bytes_ = ir.VectorType(ir.IntType(8), 4 * LANES)
    a8, b8 = builder.bitcast(a, bytes_), builder.bitcast(b, bytes_)
    zero = ir.Constant(bytes_, [0] * (4 * LANES))
    negative = builder.icmp_signed("<", a8, zero)
    return (builder.bitcast(builder.select(negative, builder.sub(zero, a8), a8), _I32),
            builder.bitcast(builder.select(negative, builder.sub(zero, b8), b8), _I32))


def _block_dot_ir(builder, kind: str, acc, pairs: list, signed: bool):
    """acc + for each 32-bit lane, the sum over ``pairs`` (a, b) of its four bytes of a times
    b's (signed, -127..127); a's bytes unsigned (at most 15), or with ``signed`` int8 codes
    (-128..127; "vnni512" then adds 128 sum(b) more: ``dot8_offset``)."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    if kind == "vnni512":                                         # two chains of vpdpbusd, then added
        fn = _declare(builder, "llvm.x86.avx512.vpdpbusd.512", _I32, [_I32] * 3)
        flip = ir.Constant(_I32, [-0x7F7F7F80] * LANES)            # 0x80808080: c + 128 as unsigned bytes
        other = ir.Constant(_I32, [0] * LANES)
        for i, (a, b) in enumerate(pairs):
            a = builder.xor(a, flip) if signed else a
            if i % 2:
                other = builder.call(fn, [other, a, b])
            else:
                acc = builder.call(fn, [acc, a, b])
        return builder.add(acc, other)
    if kind in ("bw512", "avx2"):
        # vpmaddubsw adds two products into an int16: at most 2 x 15 x 127 = 3810 for 4-bit
        # codes, whose block's eight sums are added as int16s and widened once; 2 x 128 x 127 for
        # int8 codes (|c| times x with c's sign), widened pair by pair
        width = 16 if kind == "bw512" else 8                     # int32 lanes a call
        bytes_, words = ir.VectorType(i8, 4 * width), ir.VectorType(i16, 2 * width)
        name = ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if kind == "bw512" else \
            ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd")
        pairs_fn = _declare(builder, name[0], words, [bytes_, bytes_])
        quads_fn = _declare(builder, name[1], ir.VectorType(i32, width), [words, words])
        ones = ir.Constant(words, [1] * (2 * width))
        pairs = [_signs_moved(builder, a, b) for a, b in pairs] if signed else pairs
        parts = []
        for first in range(0, LANES, width):
            total = None
            for a, b in pairs:
                a_part, b_part = _lanes(builder, a, first, width), _lanes(builder, b, first, width)
                two = builder.call(pairs_fn, [builder.bitcast(a_part, bytes_), builder.bitcast(b_part, bytes_)])
                if signed:
                    two = builder.call(quads_fn, [two, ones])
                total = two if total is None else builder.add(total, two)
            parts.append(total if signed else builder.call(quads_fn, [total, ones]))
        while len(parts) > 1:                                     # rejoin the halves
            n = parts[0].type.count
            parts = [builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(i32, 2 * n),
                                                                             list(range(2 * n))))] + parts[2:]
        return builder.add(acc, parts[0])
    wide = ir.VectorType(i32, 4 * LANES)                          # generic: widen, multiply, add fours
    for a, b in pairs:
        a8 = builder.bitcast(a, ir.VectorType(i8, 4 * LANES))
        a32 = builder.sext(a8, wide) if signed else builder.zext(a8, wide)
        b32 = builder.sext(builder.bitcast(b, ir.VectorType(i8, 4 * LANES)), wide)
        prod = builder.mul(a32, b32)
        for j in range(4):
            pick = ir.Constant(ir.VectorType(i32, LANES), [4 * lane + j for lane in range(LANES)])
            acc = builder.add(acc, builder.shuffle_vector(prod, prod, pick))
    return acc


def byte_pointer(context, builder, aty, arr, offset, oty, to: ir.Type):
    """arr's data + ``offset`` bytes, as a pointer to ``to``."""
    data = context.make_array(aty)(context, builder, arr).data
    at = context.cast(builder, offset, oty, nb_types.intp)
    return builder.bitcast(builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [at]), to.as_pointer())


def broadcast_word(builder, word):
    """A 32-bit word (four bytes of x, or a pair of bfloat16) in every lane of a <LANES x i32>."""
    lanes0 = ir.Constant(_I32, [0] * LANES)
    return builder.shuffle_vector(builder.insert_element(lanes0, word, ir.IntType(32)(0)), lanes0, lanes0)


def _dot_intrinsic(kind: str, groups: int, nibbles: bool):
    """The intrinsic ``(acc, w, at, xb, xat)`` of ``block_dot`` (``nibbles``) or ``block_dot8``."""
    if kind not in DOT_KINDS:
        raise ValueError(f"block_dot: kind must be one of {DOT_KINDS}, got {kind!r}")

    def typer(typingctx, acc, w, at, xb, xat):
        if acc != i32vec or not isinstance(w, nb_types.Array) or not isinstance(xb, nb_types.Array):
            return None

        def codegen(context, builder, sig, args):
            acc_, w_, at_, xb_, xat_ = args
            mask, four = ir.Constant(_I32, [0x0F0F0F0F] * LANES), ir.Constant(_I32, [4] * LANES)
            x_at = byte_pointer(context, builder, sig.args[3], xb_, xat_, sig.args[4], ir.IntType(32))
            w_at = byte_pointer(context, builder, sig.args[1], w_, at_, sig.args[2], ir.IntType(8))
            pairs = []
            for g in range(groups):
                word_ptr = builder.bitcast(builder.gep(w_at, [ir.IntType(64)(4 * PANEL * g)]), _I32.as_pointer())
                codes = builder.load(word_ptr, align=1)
                halves = ((builder.and_(codes, mask), builder.and_(builder.lshr(codes, four), mask)) if nibbles
                          else (codes,))
                for half, part in enumerate(halves):
                    word = builder.load(builder.gep(x_at, [ir.IntType(64)(len(halves) * g + half)]), align=1)
                    pairs.append((part, broadcast_word(builder, word)))
            return _block_dot_ir(builder, kind, acc_, pairs, signed=not nibbles)
        return i32vec(acc, w, at, xb, xat), codegen
    return intrinsic(typer)


def block_dot(kind: str):
    """An intrinsic ``(acc, w, at, xb, xat)``: acc + one Q4_1 block's sums for LANES features:
    for each group g = 0..3, the word loads of uint8 panel w at byte ``at + 4 PANEL g``, their
    low nibbles times the 4 bytes of float32 array xb at byte ``xat + 8 g``, their high nibbles
    times the 4 after them. ``kind``: one of DOT_KINDS."""
    return _dot_intrinsic(kind, 4, nibbles=True)


def block_dot8(kind: str):
    """An intrinsic ``(acc, w, at, xb, xat)``: acc + one Q8_0 block's sums for LANES features:
    for each group g = 0..7, the word loads of panel w at byte ``at + 4 PANEL g`` (four int8
    codes each) times the 4 bytes of xb at byte ``xat + 4 g``; plus ``dot8_offset(kind)`` times
    the sum of xb's 32 bytes."""
    return _dot_intrinsic(kind, 8, nibbles=False)


block_dot_here, block_dot8_here = block_dot(DOT), block_dot8(DOT)      # this CPU's instructions


@intrinsic
def izero(typingctx):
    """A register of LANES zero int32 sums."""
    return i32vec(), lambda context, builder, sig, args: ir.Constant(_I32, [0] * LANES)


@intrinsic
def vfloat(typingctx, acc):
    """acc's int32 sums as float32s (exact up to 2**24)."""
    return f32vec(acc), lambda context, builder, sig, args: builder.sitofp(args[0], _VECTOR)


@intrinsic
def vrint(typingctx, v):
    """np.rint(v): each lane rounded to the nearest integer, ties to even"""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return builder.call(_declare(builder, f"llvm.rint.v{LANES}f32", _VECTOR, [_VECTOR]), args)
    return f32vec(v), codegen


@intrinsic
def vstore_i8(typingctx, arr, byte, v):
    """arr's bytes [byte : byte + LANES] = v.astype(np.int8) (v whole numbers in -127..127)"""
    if v != f32vec or not isinstance(arr, nb_types.Array):
        return None

    def codegen(context, builder, sig, args):
        vector = ir.VectorType(ir.IntType(8), LANES)
        codes = builder.trunc(builder.fptosi(args[2], _I32), vector)
        builder.store(codes, byte_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], vector), align=1)
        return context.get_dummy_value()
    return nb_types.void(arr, byte, v), codegen
