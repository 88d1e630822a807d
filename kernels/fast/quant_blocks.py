"""GGUF's blocks in registers: the decode step's products on Q4_1 and Q8_0 panels.

The OS analogy is a compressed page expanded by the CPU as it is read (zram): only the
compact bytes cross the memory bus, and the widening is paid in registers.

A block holds 32 weights along a row and its scales (``quant_panels.py`` lays the blocks out
by panel): q4_1 ``w = d q + m`` with 4-bit codes, q8_0 ``w = d q`` with int8 codes. Three
loops, by how many rows of x share each widened weight:

- **a single row** (a one-sequence step, bound by the weights' bytes) sums ``x q`` over each
  block and scales the block's sum once, ``d sum(x q) + m sum(x)``: one multiply-add a weight;
- **tiles of 8 rows** (AVX-512; 4 with AVX2) widen a whole panel's k (two registers) to
  ``d q + m`` and share it among the tile's rows, as the float32 panels' tiles do;
- **wide tiles** (``wide_block_rows``: 16 rows with AVX-512, 8 with AVX2) take one *half* of a
  panel at a time, one register of sums a row, so each widened register serves twice as many
  rows. At 16 rows and more the products are bound by arithmetic, and the widening runs on the
  vector ports the multiply-adds need: sharing it more widely cut q4_1's products at 32 rows
  from 1.27x float32's time to ~1.16x (2-core Zen 4, docs/weights.md).

A q4_1 code is widened with integer operations only (``unit_codes``): 1 + q / 16, the code
moved into a float32's mantissa, scaled by 16 d and offset by m - 16 d (``block_scales``). The
sums run over at most one block (the tiles) or K_RUN k (the wide tiles) before joining their
row's total. ``QuantizedWeight.dequantize()`` then ``x @ w.T`` is the spec
(``tests/test_weight_formats.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..weight_formats import GGUF_BLOCK
from .panel_gemm import K_RUN, PANEL, TILE_ROWS, _add_four_rows, _four_rows, _store_four_rows
from .simd import (LANES, REGISTERS, SIMD_CACHE, vadd, vbroadcast, vfma, vload, vload_f16, vload_high4_unit,
                   vload_i8, vload_low4_unit, vmul, vsplat, vstore, vsum, vzero)

Q4_1, Q8_0 = 3, 4            # quant_panels.FORMAT_CODES of GGUF's two block formats
WIDE_ROWS = 16 if REGISTERS == 32 else 8     # rows of a wide tile: one register of sums each
BLOCKS_PER_RUN = K_RUN // GGUF_BLOCK
SIXTEEN, MINUS_ONE = np.float32(16.0), np.float32(-1.0)
CACHE = SIMD_CACHE


@njit(fastmath=True, inline="always", cache=CACHE)
def block_scales(w, at, fmt):
    """A GGUF block's scales for the panel's two registers of features, (d_lo, d_hi, m_lo, m_hi),
    the block's bytes starting at ``at``. q8_0: d (its m is never used). q4_1: 16 d and m - 16 d,
    the scales of its codes as ``unit_codes`` widens them, 1 + q / 16: (1 + q / 16) 16 d + m - 16 d
    = d q + m."""
    d_lo, d_hi = vload_f16(w, at), vload_f16(w, at + 2 * LANES)
    if fmt != Q4_1:
        return d_lo, d_hi, d_lo, d_hi
    d_lo, d_hi = vmul(d_lo, vsplat(SIXTEEN)), vmul(d_hi, vsplat(SIXTEEN))
    return (d_lo, d_hi, vfma(d_lo, vsplat(MINUS_ONE), vload_f16(w, at + 2 * PANEL)),
            vfma(d_hi, vsplat(MINUS_ONE), vload_f16(w, at + 2 * PANEL + 2 * LANES)))


@njit(fastmath=True, inline="always", cache=CACHE)
def unit_codes(w, c):
    """A q4_1 row of codes at byte c (a register of bytes), widened: 1 + q / 16 of its low
    nibbles and of its high ones (weights j and 16 + j of the block). Integer operations only:
    the code is moved into the mantissa under 1.0's exponent, leaving the floating-point ports,
    which a tile of rows keeps busy with multiply-adds, to them (a conversion per register
    made whole batched products ~5% slower)."""
    return vload_low4_unit(w, c), vload_high4_unit(w, c)


@njit(fastmath=True, inline="always", cache=CACHE)
def block_at(w, fmt, codes, j, d_lo, d_hi, m_lo, m_hi):
    """Weights 32 b + j of a GGUF block (codes row at byte ``codes``), widened: (lo, hi) of the
    first row of the pair; q4_1 also gives weight 32 b + 16 + j from the same bytes."""
    if fmt == Q4_1:
        c = codes + j * PANEL
        lo, lo2 = unit_codes(w, c)
        hi, hi2 = unit_codes(w, c + LANES)
        return vfma(lo, d_lo, m_lo), vfma(hi, d_hi, m_hi), vfma(lo2, d_lo, m_lo), vfma(hi2, d_hi, m_hi)
    c, c2 = codes + j * PANEL, codes + (j + 16) * PANEL
    return (vmul(vload_i8(w, c), d_lo), vmul(vload_i8(w, c + LANES), d_hi),
            vmul(vload_i8(w, c2), d_lo), vmul(vload_i8(w, c2 + LANES), d_hi))


@njit(fastmath=True, inline="always", cache=CACHE)
def _block_sum(x, at):
    """x[at : at + 32].sum() as a float32 (one GGUF block of a row of x)."""
    s = vload(x, at)
    for i in range(LANES, GGUF_BLOCK, LANES):
        s = vadd(s, vload(x, at + i))
    return vsum(s)


@njit(fastmath=True, inline="always", cache=CACHE)
def block_rows(x, w, fmt, k_dim, rows, out, n_dim, p):
    """Every row of x times panel p of a q4_1 or q8_0 weight: wide tiles first (``wide_block_rows``),
    then tiles of 8 and 4 rows and single rows; each block's d (and m) widened once, its codes a
    pair of k at a time (j and j + 16), each block's sums then added to the totals."""
    size = (20 if fmt == Q4_1 else 34) * PANEL             # bytes of one block of a panel
    blocks = k_dim // GGUF_BLOCK
    base = p * blocks * size
    codes_from = 4 * PANEL if fmt == Q4_1 else 2 * PANEL
    m = wide_block_rows(x, w, fmt, k_dim, rows, out, n_dim, p, 0)
    while TILE_ROWS == 8 and m + 8 <= rows:               # AVX-512: 8 rows share each widened k
        t0 = u0 = t1 = u1 = t2 = u2 = t3 = u3 = vzero()
        t4 = u4 = t5 = u5 = t6 = u6 = t7 = u7 = vzero()
        r = m * k_dim
        for b in range(blocks):
            at = base + b * size
            d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
            a4 = b4 = a5 = b5 = a6 = b6 = a7 = b7 = vzero()
            k = b * GGUF_BLOCK
            for j in range(16):
                lo, hi, lo2, hi2 = block_at(w, fmt, at + codes_from, j, d_lo, d_hi, m_lo, m_hi)
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k + j, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3)
                a4, b4, a5, b5, a6, b6, a7, b7 = _four_rows(x, r + 4 * k_dim, k_dim, k + j, lo, hi,
                                                            a4, b4, a5, b5, a6, b6, a7, b7)
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k + 16 + j, lo2, hi2,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
                a4, b4, a5, b5, a6, b6, a7, b7 = _four_rows(x, r + 4 * k_dim, k_dim, k + 16 + j, lo2, hi2,
                                                            a4, b4, a5, b5, a6, b6, a7, b7)
            t0, u0, t1, u1, t2, u2, t3, u3 = _add_four_rows(t0, u0, t1, u1, t2, u2, t3, u3,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
            t4, u4, t5, u5, t6, u6, t7, u7 = _add_four_rows(t4, u4, t5, u5, t6, u6, t7, u7,
                                                            a4, b4, a5, b5, a6, b6, a7, b7)
        o = m * n_dim + p * PANEL
        _store_four_rows(out, o, n_dim, t0, u0, t1, u1, t2, u2, t3, u3)
        _store_four_rows(out, o + 4 * n_dim, n_dim, t4, u4, t5, u5, t6, u6, t7, u7)
        m += 8
    while m + 4 <= rows:
        t0 = u0 = t1 = u1 = t2 = u2 = t3 = u3 = vzero()
        r = m * k_dim
        for b in range(blocks):
            at = base + b * size
            d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
            k = b * GGUF_BLOCK
            for j in range(16):
                lo, hi, lo2, hi2 = block_at(w, fmt, at + codes_from, j, d_lo, d_hi, m_lo, m_hi)
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k + j, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3)
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k + 16 + j, lo2, hi2,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
            t0, u0, t1, u1, t2, u2, t3, u3 = _add_four_rows(t0, u0, t1, u1, t2, u2, t3, u3,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
        _store_four_rows(out, m * n_dim + p * PANEL, n_dim, t0, u0, t1, u1, t2, u2, t3, u3)
        m += 4
    while m < rows:
        t0 = u0 = vzero()
        r = m * k_dim
        for b in range(blocks):
            at = base + b * size
            d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
            # one row: the codes' sums first, sum_k x q, scaled once a block (d sum x q + m sum x):
            # a multiply-add a weight fewer than widening each one
            a0 = b0 = vzero()
            k = r + b * GGUF_BLOCK
            c = at + codes_from
            for j in range(16):
                x0, x1 = vbroadcast(x, k + j), vbroadcast(x, k + 16 + j)
                if fmt == Q4_1:
                    lo, lo2 = unit_codes(w, c)
                    hi, hi2 = unit_codes(w, c + LANES)
                    a0, b0 = vfma(x1, lo2, vfma(x0, lo, a0)), vfma(x1, hi2, vfma(x0, hi, b0))
                    c += PANEL
                else:
                    a0, b0 = vfma(x0, vload_i8(w, c), a0), vfma(x0, vload_i8(w, c + LANES), b0)
                    c2 = c + 16 * PANEL
                    a0, b0 = vfma(x1, vload_i8(w, c2), a0), vfma(x1, vload_i8(w, c2 + LANES), b0)
                    c += PANEL
            t0, u0 = vfma(d_lo, a0, t0), vfma(d_hi, b0, u0)
            if fmt == Q4_1:                                 # + m times the block's sum of x
                xsum = vsplat(_block_sum(x, k))
                t0, u0 = vfma(m_lo, xsum, t0), vfma(m_hi, xsum, u0)
        vstore(out, m * n_dim + p * PANEL, t0); vstore(out, m * n_dim + p * PANEL + LANES, u0)  # noqa: E702
        m += 1


@njit(fastmath=True, inline="always", cache=CACHE)
def _eight(x, r, k_dim, k, v, a0, a1, a2, a3, a4, a5, a6, a7):
    """One k of eight rows' sums (x's rows r / k_dim ..) times one register of weights v."""
    return (vfma(vbroadcast(x, r + k), v, a0), vfma(vbroadcast(x, r + k_dim + k), v, a1),
            vfma(vbroadcast(x, r + 2 * k_dim + k), v, a2), vfma(vbroadcast(x, r + 3 * k_dim + k), v, a3),
            vfma(vbroadcast(x, r + 4 * k_dim + k), v, a4), vfma(vbroadcast(x, r + 5 * k_dim + k), v, a5),
            vfma(vbroadcast(x, r + 6 * k_dim + k), v, a6), vfma(vbroadcast(x, r + 7 * k_dim + k), v, a7))


@njit(fastmath=True, inline="always", cache=CACHE)
def _join(out, o, n_dim, first, a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight rows' run sums into their totals in out (flat, rows of n_dim; row 0's at o): stored
    by the first run, added by the later ones."""
    if first:
        vstore(out, o, a0); vstore(out, o + n_dim, a1)                              # noqa: E702
        vstore(out, o + 2 * n_dim, a2); vstore(out, o + 3 * n_dim, a3)              # noqa: E702
        vstore(out, o + 4 * n_dim, a4); vstore(out, o + 5 * n_dim, a5)              # noqa: E702
        vstore(out, o + 6 * n_dim, a6); vstore(out, o + 7 * n_dim, a7)              # noqa: E702
    else:
        vstore(out, o, vadd(vload(out, o), a0)); vstore(out, o + n_dim, vadd(vload(out, o + n_dim), a1))  # noqa: E702
        o2, o3, o4, o5 = o + 2 * n_dim, o + 3 * n_dim, o + 4 * n_dim, o + 5 * n_dim
        vstore(out, o2, vadd(vload(out, o2), a2)); vstore(out, o3, vadd(vload(out, o3), a3))  # noqa: E702
        vstore(out, o4, vadd(vload(out, o4), a4)); vstore(out, o5, vadd(vload(out, o5), a5))  # noqa: E702
        o6, o7 = o + 6 * n_dim, o + 7 * n_dim
        vstore(out, o6, vadd(vload(out, o6), a6)); vstore(out, o7, vadd(vload(out, o7), a7))  # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _widened(w, fmt, c, c2, d, m):
    """A half-panel's two widened registers of one block row: weights 32 b + j (codes at byte c)
    and 32 b + 16 + j (q4_1: the same bytes' high nibbles; q8_0: the codes at byte c2)."""
    if fmt == Q4_1:     # d and m: 16 d and m - 16 d (block_scales)
        lo, hi = unit_codes(w, c)
        return vfma(lo, d, m), vfma(hi, d, m)
    return vmul(vload_i8(w, c), d), vmul(vload_i8(w, c2), d)


@njit(fastmath=True, inline="always", cache=CACHE)
def wide_block_rows(x, w, fmt, k_dim, rows, out, n_dim, p, m):
    """Rows m.. of x in tiles of WIDE_ROWS times panel p of a q4_1 or q8_0 weight (``fmt``, a
    constant where this is inlined), half a panel at a time, into out's columns [PANEL p,
    PANEL (p + 1)). Returns the first row left for the narrower tiles."""
    size = (20 if fmt == Q4_1 else 34) * PANEL             # bytes of one block of a panel
    blocks = k_dim // GGUF_BLOCK
    base = p * blocks * size
    codes_from = 4 * PANEL if fmt == Q4_1 else 2 * PANEL
    while m + WIDE_ROWS <= rows:
        r = m * k_dim
        for half in range(2):
            o = m * n_dim + p * PANEL + half * LANES
            for b0 in range(0, blocks, BLOCKS_PER_RUN):
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
                e0 = e1 = e2 = e3 = e4 = e5 = e6 = e7 = vzero()
                for b in range(b0, min(b0 + BLOCKS_PER_RUN, blocks)):
                    at = base + b * size
                    d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
                    d, mm = (d_lo, m_lo) if half == 0 else (d_hi, m_hi)
                    c = at + codes_from + half * LANES
                    k = b * GGUF_BLOCK
                    for j in range(16):
                        lo, hi = _widened(w, fmt, c + j * PANEL, c + (j + 16) * PANEL, d, mm)
                        a0, a1, a2, a3, a4, a5, a6, a7 = _eight(x, r, k_dim, k + j, lo, a0, a1, a2, a3, a4, a5, a6, a7)
                        a0, a1, a2, a3, a4, a5, a6, a7 = _eight(x, r, k_dim, k + 16 + j, hi,
                                                                a0, a1, a2, a3, a4, a5, a6, a7)
                        if WIDE_ROWS == 16:
                            e0, e1, e2, e3, e4, e5, e6, e7 = _eight(x, r + 8 * k_dim, k_dim, k + j, lo,
                                                                    e0, e1, e2, e3, e4, e5, e6, e7)
                            e0, e1, e2, e3, e4, e5, e6, e7 = _eight(x, r + 8 * k_dim, k_dim, k + 16 + j, hi,
                                                                    e0, e1, e2, e3, e4, e5, e6, e7)
                _join(out, o, n_dim, b0 == 0, a0, a1, a2, a3, a4, a5, a6, a7)
                if WIDE_ROWS == 16:
                    _join(out, o + 8 * n_dim, n_dim, b0 == 0, e0, e1, e2, e3, e4, e5, e6, e7)
        m += WIDE_ROWS
    return m
