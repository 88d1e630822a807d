"""x in eight bits: GGUF's panels times activations rounded to int8 ("q4_1_a8", "q8_0_a8").

The OS idea is the bounce buffer (Linux's swiotlb): a device that cannot read memory where it
lies is given a copy in a place and a form it can read, made once per transfer. Here the device
is the CPU's integer dot-product unit, which multiplies bytes by bytes, and x is copied once a
product (``round_rows``, into a float32 array: the **bounce buffer**) into int8 codes with a
scale a block of 32, which every panel of the weight then reads.

Why: a decode step of two to eight sequences on GGUF panels is bound by arithmetic, not by
memory (docs/weights.md, "What stops B=1"): widening each code to a float32 costs a multiply-add
a weight and row, with the widening beside it. With x in int8 one instruction multiplies LANES x
4 codes by four bytes of x each and adds each four products into a 32-bit sum
(``int8_dot.py``: ``vpdpbusd``, ``vpmaddubsw``, or plain LLVM vectors, as the CPU has them).
llama.cpp multiplies Q4_1 and Q8_0 this way (x as its q8_1 / q8_0 blocks), and so do vLLM's
GGUF kernels. The spec is ``weight_formats.round_activations`` followed by the dequantized
weight's plain product (``QuantizedWeight.product``).

A "q4_1_a8" panel of PANEL output features, for each block b of 32 k: PANEL float16 d, PANEL
float16 m (as the "q4_1" panels), then 4 groups of PANEL 32-bit words, word o of group g holding
feature o's codes of k = 32 b + 8 g + j (low nibble of byte j) and 32 b + 8 g + 4 + j (high
nibble), j = 0..3: one load is LANES features' words, and its low and high nibbles meet the four
bytes of x at k = 8 g .. 8 g + 3 and 8 g + 4 .. 8 g + 7. A "q8_0_a8" panel: PANEL float16 d,
then 8 groups of PANEL words, word o of group g holding feature o's int8 codes of k = 32 b + 4 g
+ j. The same 20 (34) bytes a 32 weights as GGUF's.

The bounce buffer of R rows of x (k_dim each, kb = k_dim / 32 blocks), float32 (``rounded_size``):
d (R, kb), then s = d * sum(q) (R, kb), then the codes q (R, k_dim) int8, four to a float.
A Q4_1 block's product is d_w d_x sum(q_w q_x) + m_w s_x, a Q8_0 block's d_w d_x sum(c_w q_x),
the integer sums exact (VNNI's Q8_0 sums carry 128 sum(q_x) more, taken off as -128 d_w s_x).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..weight_formats import GGUF_BLOCK
from .int8_dot import DOT8_OFFSET, block_dot8_here, block_dot_here, izero, vfloat, vrint, vstore_i8
from .panel_gemm import PANEL
from .simd import (LANES, SIMD_CACHE, prefetch, vadd, vfma, vload, vload_f16, vmax, vmax_lanes, vmul, vsplat,
                   vstore, vsum, vzero)
from .tuning import ROW_AHEAD

Q4_1_A8 = 5                            # quant_panels.FORMAT_CODES of "q4_1_a8"
Q8_0_A8 = 6                            # and of "q8_0_a8"
CACHE = SIMD_CACHE
BLOCK_PANEL_BYTES = 20 * PANEL         # one block of a "q4_1_a8" panel: d, m and the codes
BLOCK8_PANEL_BYTES = 34 * PANEL        # one block of a "q8_0_a8" panel: d and the codes


@njit(inline="always", cache=CACHE)
def rounds_x(fmt):
    """Whether a product in format code ``fmt`` reads x rounded (its bounce buffer)."""
    return fmt == Q4_1_A8 or fmt == Q8_0_A8


# --------------------------------------------------------------------------- the bounce buffer

@njit(inline="always", cache=CACHE)
def rounded_size(rows, k_dim):
    """float32s of the bounce buffer of ``rows`` rows of k_dim: d, s and the codes."""
    return 2 * rows * (k_dim // GGUF_BLOCK) + rows * k_dim // 4


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
    """What a product's kernels read as x: x itself, or for "q4_1_a8" and "q8_0_a8" (``fmt``)
    its bounce buffer, x rounded into ``blob`` (``round_rows``; at least ``rounded_size`` floats,
    the caller's: it must outlive every read of the returned view), once for every panel."""
    if not rounds_x(fmt):
        return x
    round_rows(x, rows, k_dim, blob)
    return blob


# --------------------------------------------------------------------------- the products

@njit(fastmath=True, inline="always", cache=CACHE)
def _block_sums(w, fmt, at, xb, xat):
    """One block's integer sums of one row (fmt a constant where this is inlined): (features
    0..LANES-1, LANES..PANEL-1)."""
    if fmt == Q4_1_A8:
        return block_dot_here(izero(), w, at, xb, xat), block_dot_here(izero(), w, at + 4 * LANES, xb, xat)
    return block_dot8_here(izero(), w, at, xb, xat), block_dot8_here(izero(), w, at + 4 * LANES, xb, xat)


@njit(inline="always", cache=CACHE)
def _next_panel_share(w, next_at, step, kb, passes, i, b):
    """Ask for block b's share of the next panel's lines (at byte ``next_at`` of w, kb blocks of
    ``step`` bytes) in pass i of ``passes`` over this panel: its kb step bytes are cut evenly over
    the passes' blocks, so that each line is asked for once. Two to eight rows read a panel in one
    to four passes (a pair of rows each), the later ones from L1; asked for only ROW_AHEAD bytes
    on, the memory idled through those, and reading and multiply-adds took turns: 8 rows (two
    threads, 96 MB of "q4_1_a8" panels from memory, Zen 5) 2.86, 2.93 ms against 2.61, 2.57
    spread this way, 4 rows 2.05, 2.13 against 1.90, 1.97 (docs/weights.md). A hint: the next
    panel may be another thread's, or past w's end."""
    first = (i * kb + b) * step // passes                      # this block's share: bytes [first, end)
    end = (i * kb + b + 1) * step // passes
    for line in range((first + 63) // 64, (end + 63) // 64):   # the lines that start in it
        prefetch(w, next_at + 64 * line)


@njit(fastmath=True, inline="always", cache=CACHE)
def _pair(xb, w, fmt, k_dim, rows, out, n_dim, p, r0, n):
    """Rows r0 .. r0 + n - 1 (n = 1 or 2, and fmt: constants where this is inlined) of the bounce
    buffer xb of ``rows`` rows, times panel p of w, into out (flat, rows of n_dim) at [PANEL p,
    PANEL (p + 1)). A Q8_0 block's m is -DOT8_OFFSET d (``int8_dot.dot8_offset``; none but VNNI's).
    Each pass asks for the panel's lines ROW_AHEAD bytes on (from the second pass on, from L1 but
    for the next panel's first), and with more than two rows for its share of the next panel's
    (``_next_panel_share``)."""
    kb = k_dim // GGUF_BLOCK
    step = BLOCK_PANEL_BYTES if fmt == Q4_1_A8 else BLOCK8_PANEL_BYTES
    scales = 4 * PANEL if fmt == Q4_1_A8 else 2 * PANEL        # bytes of a block's d (and m)
    minmax = fmt == Q4_1_A8 or DOT8_OFFSET != 0                 # a term in s_x (a constant)
    base = p * kb * step
    codes = 4 * 2 * rows * kb + r0 * k_dim                     # byte of row r0's codes in xb
    t0 = u0 = t1 = u1 = m_lo = m_hi = vzero()
    for b in range(kb):
        at = base + b * step
        for line in range(0, step, 64):                         # the lines ROW_AHEAD bytes on
            prefetch(w, at + ROW_AHEAD + line)
        if rows > 2:                                            # two passes or more
            _next_panel_share(w, base + kb * step, step, kb, (rows + 1) // 2, r0 // 2, b)
        d_lo, d_hi = vload_f16(w, at), vload_f16(w, at + 2 * LANES)
        if fmt == Q4_1_A8:
            m_lo, m_hi = vload_f16(w, at + 2 * PANEL), vload_f16(w, at + 2 * PANEL + 2 * LANES)
        elif minmax:
            m_lo, m_hi = vmul(d_lo, vsplat(np.float32(-DOT8_OFFSET))), vmul(d_hi, vsplat(np.float32(-DOT8_OFFSET)))
        a, c = _block_sums(w, fmt, at + scales, xb, codes + GGUF_BLOCK * b)
        dx, sx = vsplat(xb[r0 * kb + b]), vsplat(xb[(rows + r0) * kb + b])
        if minmax:
            t0, u0 = vfma(m_lo, sx, t0), vfma(m_hi, sx, u0)
        t0, u0 = vfma(vmul(d_lo, dx), vfloat(a), t0), vfma(vmul(d_hi, dx), vfloat(c), u0)
        if n == 2:
            a, c = _block_sums(w, fmt, at + scales, xb, codes + k_dim + GGUF_BLOCK * b)
            dx, sx = vsplat(xb[(r0 + 1) * kb + b]), vsplat(xb[(rows + r0 + 1) * kb + b])
            if minmax:
                t1, u1 = vfma(m_lo, sx, t1), vfma(m_hi, sx, u1)
            t1, u1 = vfma(vmul(d_lo, dx), vfloat(a), t1), vfma(vmul(d_hi, dx), vfloat(c), u1)
    o = r0 * n_dim + p * PANEL
    vstore(out, o, t0); vstore(out, o + LANES, u0)             # noqa: E702
    if n == 2:
        vstore(out, o + n_dim, t1); vstore(out, o + n_dim + LANES, u1)   # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _rows_of(xb, w, fmt, k_dim, rows, out, n_dim, p):
    """``a8_rows`` for one format (a constant where this is inlined): pairs of rows, an odd one last."""
    for r0 in range(0, rows - 1, 2):
        _pair(xb, w, fmt, k_dim, rows, out, n_dim, p, r0, 2)
    if rows % 2:
        _pair(xb, w, fmt, k_dim, rows, out, n_dim, p, rows - 1, 1)


@njit(fastmath=True, inline="always", cache=CACHE)
def a8_rows(xb, w, fmt, k_dim, rows, out, n_dim, p):
    """Every row of the bounce buffer xb (``bounce``) times panel p of a "q4_1_a8" or "q8_0_a8"
    weight (format code ``fmt``), two rows at a time (the panel's second pass from the core's
    caches), into out (flat, rows x n_dim): each format's loops compiled apart."""
    if fmt == Q4_1_A8:
        _rows_of(xb, w, Q4_1_A8, k_dim, rows, out, n_dim, p)
    else:
        _rows_of(xb, w, Q8_0_A8, k_dim, rows, out, n_dim, p)


# --------------------------------------------------------------------------- the layout

def pack_a8(data: np.ndarray) -> np.ndarray:
    """A "q4_1_a8" or "q8_0_a8" weight's GGUF blocks, (panels * PANEL, nb, 20 or 34) uint8 (rows
    padded with zero rows), as its panels: (panels, nb * 20 or 34 PANEL) uint8, the layout above."""
    rows, nb, size = data.shape
    panels = rows // PANEL
    blocks = data.reshape(panels, PANEL, nb, size).transpose(0, 2, 1, 3)    # (panels, nb, PANEL, size)
    if size == 34:                                                           # Q8_0: d, then the codes
        d, codes = blocks[..., 0:2], blocks[..., 2:]                         # (.., 2), (.., 32) bytes
        words = codes.reshape(panels, nb, PANEL, 8, 4).transpose(0, 1, 3, 2, 4)   # (panels, nb, 8 g, PANEL, 4 j)
        parts = [d.reshape(panels, nb, -1), words.reshape(panels, nb, -1)]
        return np.concatenate(parts, axis=2).reshape(panels, -1).astype(np.uint8)
    d, m, codes = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:]        # (.., 2), (.., 2), (.., 16) bytes
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)                  # (panels, nb, PANEL, 32) 0..15
    q = q.reshape(panels, nb, PANEL, 4, 2, 4)                                # k = 8 g + 4 half + j
    words = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)   # (panels, nb, 4 g, PANEL, 4 j)
    parts = [d.reshape(panels, nb, -1), m.reshape(panels, nb, -1), words.reshape(panels, nb, -1)]
    return np.concatenate(parts, axis=2).reshape(panels, -1).astype(np.uint8)


def unpack_a8(flat: np.ndarray, panels: int, nb: int, size: int) -> np.ndarray:
    """``pack_a8``'s inverse: the GGUF blocks (panels * PANEL, nb, size) uint8, size 20 or 34."""
    blocks = flat.reshape(panels, nb, size * PANEL)                          # (panels, nb, size PANEL)
    d = blocks[..., :2 * PANEL].reshape(panels, nb, PANEL, 2)                # (panels, nb, PANEL, 2) float16 bytes
    if size == 34:
        words = blocks[..., 2 * PANEL:].reshape(panels, nb, 8, PANEL, 4).transpose(0, 1, 3, 2, 4)   # (.., PANEL, g, j)
        parts = [d, words.reshape(panels, nb, PANEL, 32)]
    else:
        m = blocks[..., 2 * PANEL:4 * PANEL].reshape(panels, nb, PANEL, 2)   # (panels, nb, PANEL, 2)
        words = blocks[..., 4 * PANEL:].reshape(panels, nb, 4, PANEL, 4).transpose(0, 1, 3, 2, 4)   # (.., PANEL, g, j)
        q = np.stack([words & 0x0F, words >> 4], axis=-2).reshape(panels, nb, PANEL, 32)   # k = 8 g + 4 half + j
        parts = [d, m, q[..., :16] | (q[..., 16:] << 4)]                     # codes (panels, nb, PANEL, 16)
    raw = np.concatenate(parts, axis=-1).transpose(0, 2, 1, 3)              # (panels, PANEL, nb, size)
    return np.ascontiguousarray(raw.reshape(panels * PANEL, nb, size)).astype(np.uint8)


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
