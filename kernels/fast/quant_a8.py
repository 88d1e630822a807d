"""x in eight bits: GGUF's Q4_1 panels times activations rounded to int8 (format "q4_1_a8").

The OS idea is the bounce buffer (Linux's swiotlb): a device that cannot read memory where it
lies is given a copy in a place and a form it can read, made once per transfer. Here the device
is the CPU's integer dot-product unit, which multiplies bytes by bytes, and x is copied once a
product (``round_rows``, into a float32 array: the **bounce buffer**) into int8 codes with a
scale a block of 32, which every panel of the weight then reads.

Why: a decode step of two to eight sequences on Q4_1 panels is bound by arithmetic, not by
memory (docs/weights.md, "What stops B=1"): widening each 4-bit code to a float32 costs a
multiply-add a weight and row, with the widening beside it. With x in int8 one instruction
multiplies LANES x 4 codes by four bytes of x each and adds each four products into a 32-bit
sum: ``vpdpbusd`` (AVX512-VNNI), or ``vpmaddubsw`` then ``vpmaddwd`` (AVX2, AVX512-BW), or the
same sums in plain LLVM vectors on another CPU (``DOT``, read once from the CPU features Numba
compiles for). llama.cpp multiplies Q4_1 this way (x as its q8_1 blocks), and so do vLLM's
GGUF kernels. The spec is ``weight_formats.round_activations`` followed by the dequantized
weight's plain product (``QuantizedWeight.product``).

A panel of PANEL output features, for each block b of 32 k: PANEL float16 d, PANEL float16 m
(as the "q4_1" panels), then 4 groups of PANEL 32-bit words, word o of group g holding feature
o's codes of k = 32 b + 8 g + j (low nibble of byte j) and 32 b + 8 g + 4 + j (high nibble),
j = 0..3: one load is LANES features' words, and its low and high nibbles meet the four bytes
of x at k = 8 g .. 8 g + 3 and 8 g + 4 .. 8 g + 7. The same 20 bytes a 32 weights as GGUF's.

The bounce buffer of R rows of x (k_dim each, kb = k_dim / 32 blocks), float32 (``rounded_size``):
d (R, kb), then s = d * sum(q) (R, kb), then the codes q (R, k_dim) int8, four to a float.
A block's product is d_w d_x sum(q_w q_x) + m_w s_x, the integer sum exact.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types as nb_types
from numba.extending import intrinsic, models, register_model

from ..weight_formats import GGUF_BLOCK
from .panel_gemm import PANEL
from .simd import (LANES, SIMD_CACHE, compiled_cpu_features, f32vec, prefetch, vadd, vfma, vload, vload_f16, vmax,
                   vmax_lanes, vmul, vsplat, vstore, vsum, vzero)
from .tuning import ROW_AHEAD

Q4_1_A8 = 5                            # quant_panels.FORMAT_CODES of "q4_1_a8"
CACHE = SIMD_CACHE
BLOCK_PANEL_BYTES = 20 * PANEL         # one block of a panel: d, m and the codes
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


DOT = dot_instructions(compiled_cpu_features(), LANES)
_I32 = ir.VectorType(ir.IntType(32), LANES)
_F32 = ir.VectorType(ir.FloatType(), LANES)


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


def _block_dot_ir(builder, kind: str, acc, pairs: list):
    """acc + for each 32-bit lane, the sum over ``pairs`` (a, b) of its four bytes of a
    (unsigned, at most 15) times b's (signed, -127..127): one block's products."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    if kind == "vnni512":                                         # two chains of vpdpbusd, then added
        fn = _declare(builder, "llvm.x86.avx512.vpdpbusd.512", _I32, [_I32] * 3)
        other = ir.Constant(_I32, [0] * LANES)
        for i, (a, b) in enumerate(pairs):
            if i % 2:
                other = builder.call(fn, [other, a, b])
            else:
                acc = builder.call(fn, [acc, a, b])
        return builder.add(acc, other)
    if kind in ("bw512", "avx2"):
        # vpmaddubsw adds two products into an int16 (at most 2 x 15 x 127 = 3810); a block's
        # eight such sums stay under 32767, so they are added as int16s and widened once
        width = 16 if kind == "bw512" else 8                     # int32 lanes a call
        bytes_, words = ir.VectorType(i8, 4 * width), ir.VectorType(i16, 2 * width)
        name = ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if kind == "bw512" else \
            ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd")
        pairs_fn = _declare(builder, name[0], words, [bytes_, bytes_])
        quads_fn = _declare(builder, name[1], ir.VectorType(i32, width), [words, words])
        parts = []
        for first in range(0, LANES, width):
            total = None
            for a, b in pairs:
                a_part, b_part = _lanes(builder, a, first, width), _lanes(builder, b, first, width)
                two = builder.call(pairs_fn, [builder.bitcast(a_part, bytes_), builder.bitcast(b_part, bytes_)])
                total = two if total is None else builder.add(total, two)
            parts.append(builder.call(quads_fn, [total, ir.Constant(words, [1] * (2 * width))]))
        while len(parts) > 1:                                     # rejoin the halves
            n = parts[0].type.count
            parts = [builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(i32, 2 * n),
                                                                             list(range(2 * n))))] + parts[2:]
        return builder.add(acc, parts[0])
    wide = ir.VectorType(i32, 4 * LANES)                          # generic: widen, multiply, add fours
    for a, b in pairs:
        a32 = builder.zext(builder.bitcast(a, ir.VectorType(i8, 4 * LANES)), wide)
        b32 = builder.sext(builder.bitcast(b, ir.VectorType(i8, 4 * LANES)), wide)
        prod = builder.mul(a32, b32)
        for j in range(4):
            pick = ir.Constant(ir.VectorType(i32, LANES), [4 * lane + j for lane in range(LANES)])
            acc = builder.add(acc, builder.shuffle_vector(prod, prod, pick))
    return acc


def _byte_pointer(context, builder, aty, arr, offset, oty, to: ir.Type):
    """arr's data + ``offset`` bytes, as a pointer to ``to``."""
    data = context.make_array(aty)(context, builder, arr).data
    at = context.cast(builder, offset, oty, nb_types.intp)
    return builder.bitcast(builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [at]), to.as_pointer())


def block_dot(kind: str):
    """An intrinsic ``(acc, w, at, xb, xat)``: acc + one block's sums for LANES features: for
    each group g = 0..3, the word loads of uint8 panel w at byte ``at + 4 PANEL g``, their low
    nibbles times the 4 bytes of float32 array xb at byte ``xat + 8 g``, their high nibbles
    times the 4 after them. ``kind``: one of DOT_KINDS."""
    if kind not in DOT_KINDS:
        raise ValueError(f"block_dot: kind must be one of {DOT_KINDS}, got {kind!r}")

    def typer(typingctx, acc, w, at, xb, xat):
        if acc != i32vec or not isinstance(w, nb_types.Array) or not isinstance(xb, nb_types.Array):
            return None

        def codegen(context, builder, sig, args):
            acc_, w_, at_, xb_, xat_ = args
            mask, four = ir.Constant(_I32, [0x0F0F0F0F] * LANES), ir.Constant(_I32, [4] * LANES)
            x_at = _byte_pointer(context, builder, sig.args[3], xb_, xat_, sig.args[4], ir.IntType(32))
            w_at = _byte_pointer(context, builder, sig.args[1], w_, at_, sig.args[2], ir.IntType(8))
            lanes0 = ir.Constant(_I32, [0] * LANES)
            pairs = []
            for g in range(4):
                word_ptr = builder.bitcast(builder.gep(w_at, [ir.IntType(64)(4 * PANEL * g)]), _I32.as_pointer())
                codes = builder.load(word_ptr, align=1)
                for half, nibbles in enumerate((builder.and_(codes, mask),
                                                builder.and_(builder.lshr(codes, four), mask))):
                    word = builder.load(builder.gep(x_at, [ir.IntType(64)(2 * g + half)]), align=1)
                    x4 = builder.shuffle_vector(builder.insert_element(lanes0, word, ir.IntType(32)(0)), lanes0,
                                                lanes0)
                    pairs.append((nibbles, x4))
            return _block_dot_ir(builder, kind, acc_, pairs)
        return i32vec(acc, w, at, xb, xat), codegen
    return intrinsic(typer)


block_dot_here = block_dot(DOT)          # this CPU's instructions


@intrinsic
def izero(typingctx):
    """A register of LANES zero int32 sums."""
    return i32vec(), lambda context, builder, sig, args: ir.Constant(_I32, [0] * LANES)


@intrinsic
def vfloat(typingctx, acc):
    """acc's int32 sums as float32s (exact up to 2**24)."""
    return f32vec(acc), lambda context, builder, sig, args: builder.sitofp(args[0], _F32)


# --------------------------------------------------------------------------- the bounce buffer

@njit(inline="always", cache=CACHE)
def rounded_size(rows, k_dim):
    """float32s of the bounce buffer of ``rows`` rows of k_dim: d, s and the codes."""
    return 2 * rows * (k_dim // GGUF_BLOCK) + rows * k_dim // 4


@intrinsic
def vrint(typingctx, v):
    """np.rint(v): each lane rounded to the nearest integer, ties to even"""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return builder.call(_declare(builder, f"llvm.rint.v{LANES}f32", _F32, [_F32]), args)
    return f32vec(v), codegen


@intrinsic
def vstore_i8(typingctx, arr, byte, v):
    """arr's bytes [byte : byte + LANES] = v.astype(np.int8) (v whole numbers in -127..127)"""
    if v != f32vec or not isinstance(arr, nb_types.Array):
        return None

    def codegen(context, builder, sig, args):
        vector = ir.VectorType(ir.IntType(8), LANES)
        codes = builder.trunc(builder.fptosi(args[2], _I32), vector)
        builder.store(codes, _byte_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], vector), align=1)
        return context.get_dummy_value()
    return nb_types.void(arr, byte, v), codegen


# fastmath=False said, not left out: a function compiled for a fastmath caller inherits its
# flags unless it names its own, and this one's d = amax / 127 and 1 / d must round as the spec's
@njit(fastmath=False, cache=CACHE)
def round_rows(x, rows, k_dim, blob):
    """Rows of x (flat, rows x k_dim) rounded into the bounce buffer blob (``rounded_size``):
    ``weight_formats.round_activations``'s codes and d, and s = d sum(q), a register of LANES
    values at a time. A block holding a nan or an inf gets d = nan (its products nan, as the
    spec's; its codes are then never read)."""
    kb = k_dim // GGUF_BLOCK
    codes = 8 * rows * kb                                      # byte of the codes in blob
    minus, zero = vsplat(np.float32(-1.0)), vzero()
    for r in range(rows):
        for b in range(kb):
            at = r * k_dim + GGUF_BLOCK * b
            top = poison = vzero()
            for j in range(0, GGUF_BLOCK, LANES):
                v = vload(x, at + j)
                top = vmax(top, vmax(v, vmul(v, minus)))       # |x|
                poison = vadd(poison, vmul(v, zero))           # nan where any is nan or inf
            d = vmax_lanes(top) / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            inv = vsplat(inv if inv < np.inf else np.float32(0.0))   # (a subnormal d: codes 0, as the spec's)
            total = vzero()
            for j in range(0, GGUF_BLOCK, LANES):
                q = vrint(vmul(vload(x, at + j), inv))        # (LANES,) whole numbers, -127..127
                vstore_i8(blob, codes + at + j, q)
                total = vadd(total, q)
            d = d + vsum(poison)
            blob[r * kb + b] = d
            blob[(rows + r) * kb + b] = d * vsum(total)        # the codes' sum: exact in float32


@njit(cache=CACHE)
def bounce(x, fmt, k_dim, rows, blob):
    """What a product's kernels read as x: x itself, or for "q4_1_a8" (``fmt``) its bounce
    buffer, x rounded into ``blob`` (``round_rows``; at least ``rounded_size`` floats, the
    caller's: it must outlive every read of the returned view), once for every panel."""
    if fmt != Q4_1_A8:
        return x
    round_rows(x, rows, k_dim, blob)
    return blob


# --------------------------------------------------------------------------- the products

@njit(fastmath=True, inline="always", cache=CACHE)
def _block_sums(w, at, xb, xat):
    """One block's integer sums of one row: (features 0..LANES-1, LANES..PANEL-1)."""
    return block_dot_here(izero(), w, at, xb, xat), block_dot_here(izero(), w, at + 4 * LANES, xb, xat)


@njit(fastmath=True, inline="always", cache=CACHE)
def _pair(xb, w, k_dim, rows, out, n_dim, p, r0, n):
    """Rows r0 .. r0 + n - 1 (n = 1 or 2, a constant where this is inlined) of the bounce buffer
    xb of ``rows`` rows, times panel p of w, into out (flat, rows of n_dim) at [PANEL p, PANEL (p + 1))."""
    kb = k_dim // GGUF_BLOCK
    base = p * kb * BLOCK_PANEL_BYTES
    codes = 4 * 2 * rows * kb + r0 * k_dim                     # byte of row r0's codes in xb
    t0 = u0 = t1 = u1 = vzero()
    for b in range(kb):
        at = base + b * BLOCK_PANEL_BYTES
        for line in range(0, BLOCK_PANEL_BYTES, 64):            # the lines ROW_AHEAD bytes on
            prefetch(w, at + ROW_AHEAD + line)
        d_lo, d_hi = vload_f16(w, at), vload_f16(w, at + 2 * LANES)
        m_lo, m_hi = vload_f16(w, at + 2 * PANEL), vload_f16(w, at + 2 * PANEL + 2 * LANES)
        a, c = _block_sums(w, at + 4 * PANEL, xb, codes + GGUF_BLOCK * b)
        dx, sx = vsplat(xb[r0 * kb + b]), vsplat(xb[(rows + r0) * kb + b])
        t0 = vfma(vmul(d_lo, dx), vfloat(a), vfma(m_lo, sx, t0))
        u0 = vfma(vmul(d_hi, dx), vfloat(c), vfma(m_hi, sx, u0))
        if n == 2:
            a, c = _block_sums(w, at + 4 * PANEL, xb, codes + k_dim + GGUF_BLOCK * b)
            dx, sx = vsplat(xb[(r0 + 1) * kb + b]), vsplat(xb[(rows + r0 + 1) * kb + b])
            t1 = vfma(vmul(d_lo, dx), vfloat(a), vfma(m_lo, sx, t1))
            u1 = vfma(vmul(d_hi, dx), vfloat(c), vfma(m_hi, sx, u1))
    o = r0 * n_dim + p * PANEL
    vstore(out, o, t0); vstore(out, o + LANES, u0)             # noqa: E702
    if n == 2:
        vstore(out, o + n_dim, t1); vstore(out, o + n_dim + LANES, u1)   # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def a8_rows(xb, w, k_dim, rows, out, n_dim, p):
    """Every row of the bounce buffer xb (``bounce``) times panel p of a "q4_1_a8" weight, two
    rows at a time (the panel's second pass from the core's caches), into out (flat, rows x n_dim)."""
    for r0 in range(0, rows - 1, 2):
        _pair(xb, w, k_dim, rows, out, n_dim, p, r0, 2)
    if rows % 2:
        _pair(xb, w, k_dim, rows, out, n_dim, p, rows - 1, 1)


# --------------------------------------------------------------------------- the layout

def pack_a8(data: np.ndarray) -> np.ndarray:
    """A "q4_1_a8" weight's GGUF blocks, (panels * PANEL, nb, 20) uint8 (rows padded with zero
    rows), as its panels: (panels, nb * BLOCK_PANEL_BYTES) uint8 in the layout above."""
    rows, nb = data.shape[0], data.shape[1]
    panels = rows // PANEL
    blocks = data.reshape(panels, PANEL, nb, 20).transpose(0, 2, 1, 3)      # (panels, nb, PANEL, 20)
    d, m, codes = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:]        # (.., 2), (.., 2), (.., 16) bytes
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)                  # (panels, nb, PANEL, 32) 0..15
    q = q.reshape(panels, nb, PANEL, 4, 2, 4)                                # k = 8 g + 4 half + j
    words = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)   # (panels, nb, 4 g, PANEL, 4 j)
    parts = [d.reshape(panels, nb, -1), m.reshape(panels, nb, -1), words.reshape(panels, nb, -1)]
    return np.concatenate(parts, axis=2).reshape(panels, -1).astype(np.uint8)


def unpack_a8(flat: np.ndarray, panels: int, nb: int) -> np.ndarray:
    """``pack_a8``'s inverse: the GGUF blocks (panels * PANEL, nb, 20) uint8."""
    blocks = flat.reshape(panels, nb, BLOCK_PANEL_BYTES)                     # (panels, nb, 20 PANEL)
    d = blocks[..., :2 * PANEL].reshape(panels, nb, PANEL, 2)                # (panels, nb, PANEL, 2) float16 bytes
    m = blocks[..., 2 * PANEL:4 * PANEL].reshape(panels, nb, PANEL, 2)       # (panels, nb, PANEL, 2)
    words = blocks[..., 4 * PANEL:].reshape(panels, nb, 4, PANEL, 4).transpose(0, 1, 3, 2, 4)   # (.., PANEL, g, j)
    q = np.stack([words & 0x0F, words >> 4], axis=-2).reshape(panels, nb, PANEL, 32)   # k = 8 g + 4 half + j
    codes = q[..., :16] | (q[..., 16:] << 4)                                 # (panels, nb, PANEL, 16)
    raw = np.concatenate([d, m, codes], axis=-1).transpose(0, 2, 1, 3)       # (panels, PANEL, nb, 20)
    return np.ascontiguousarray(raw.reshape(panels * PANEL, nb, 20)).astype(np.uint8)


# --------------------------------------------------------------------------- the arithmetic's peak

@njit(fastmath=True, parallel=True, cache=CACHE)
def dot_peak_probe(w, xb, reps, threads):
    """A block's products (``block_dot``: word loads, their nibbles, the dot products) ``reps``
    times in four independent chains on each of ``threads`` threads, all of it in L1: 128 LANES
    multiply-adds a pass (``bench roofline``'s integer peak). w: (16 x 32 LANES,) uint8 codes,
    a pass reading the next 32 LANES of them (else LLVM would hoist the loads and products out of
    the loop); xb: (16,) float32, 64 bytes. Returns the sums' total (so that no chain is left out)."""
    total = np.zeros(threads, np.float32)                      # (threads,)
    for t in prange(threads):
        a0 = a1 = a2 = a3 = izero()
        for i in range(reps):
            at = (i % 16) * 32 * LANES
            a0 = block_dot_here(a0, w, at, xb, 0)
            a1 = block_dot_here(a1, w, at + 4 * LANES, xb, 0)
            a2 = block_dot_here(a2, w, at, xb, 32)
            a3 = block_dot_here(a3, w, at + 4 * LANES, xb, 32)
        total[t] = vsum(vadd(vadd(vfloat(a0), vfloat(a1)), vadd(vfloat(a2), vfloat(a3))))
    return total.sum()
