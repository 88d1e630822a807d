"""GGUF's blocks in registers: the decode step's products on Q4_1 and Q8_0 panels.

The OS analogy is a compressed page expanded by the CPU as it is read (zram): only the
compact bytes cross the memory bus, and the widening is paid in registers.

A block holds 32 weights along a row and its scales (``quant_panels.py`` lays the blocks out
by panel): q4_1 ``w = d q + m`` with 4-bit codes, q8_0 ``w = d q`` with int8 codes. Here are
the pieces the products use:

- ``block_scales`` and ``block_at``: a block's scales, and a pair of its k widened to
  ``d q + m``, which ``quant_widen.py`` writes into a page for the tiles of more than
  ``tuning.REGISTER_ROWS`` rows;
- ``block_row``: a single row (a one-sequence step, bound by the weights' bytes) sums ``x q``
  over each block and scales the block's sum once, ``d sum(x q) + m sum(x)``: one multiply-add
  a weight, asking for the lines ``tuning.ROW_AHEAD`` bytes on as it goes;
- ``block_four_rows``: the same for two or four rows at once, each row of codes widened once.

A q4_1 code is widened with integer operations only (``unit_codes``): 1 + q / 16, the code
moved into a float32's mantissa, scaled by 16 d and offset by m - 16 d (``block_scales``).
``QuantizedWeight.dequantize()`` then ``x @ w.T`` is the spec (``tests/test_weight_formats.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..weight_formats import GGUF_BLOCK
from .panel_gemm import PANEL
from .simd import (LANES, SIMD_CACHE, prefetch, vadd, vbroadcast, vfma, vload, vload_f16, vload_high4_unit, vload_i8,
                   vload_low4_unit, vmul, vsplat, vstore, vsum, vzero)
from .tuning import ROW_AHEAD

Q4_1, Q8_0 = 3, 4            # quant_panels.FORMAT_CODES of GGUF's two block formats
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
    made whole batched products ~5% slower, 2-core Zen 4)."""
    return vload_low4_unit(w, c), vload_high4_unit(w, c)


@njit(fastmath=True, inline="always", cache=CACHE)
def block_at(w, fmt, codes, j, d_lo, d_hi, m_lo, m_hi):
    """Weights 32 b + j of a GGUF block (codes row at byte ``codes``), widened: (lo, hi) of the
    first row of the pair, then weight 32 b + 16 + j's (q4_1: the same bytes' high nibbles;
    q8_0: codes row j + 16)."""
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
def block_row(x, w, fmt, k_dim, out, p):
    """The one row of x times panel p of a q4_1 or q8_0 weight, into out[PANEL p : PANEL (p + 1)]:
    the codes' sums first, sum_k x q, scaled once a block (d sum x q + m sum x), a multiply-add a
    weight fewer than widening each one. (Two to eight rows: ``block_four_rows``; more widen a
    run of the panel once for all of them: ``quant_widen.py``.)

    The sums run in four chains, weights j and 16 + j of each register apart, and join once a
    block: with two, each multiply-add waited for the one before it in its chain, and a core's
    products in its caches ran 12-20% slower in q4_1, 27% in q8_0 compiled for AVX2
    (docs/weights.md, "Four chains of sums")."""
    size = (20 if fmt == Q4_1 else 34) * PANEL             # bytes of one block of a panel
    blocks = k_dim // GGUF_BLOCK
    base = p * blocks * size
    codes_from = 4 * PANEL if fmt == Q4_1 else 2 * PANEL
    t0 = u0 = vzero()
    for b in range(blocks):
        at = base + b * size
        for line in range(0, size, 64):                     # the lines ROW_AHEAD bytes on in this stream
            prefetch(w, at + ROW_AHEAD + line)
        d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
        a0 = a1 = b0 = b1 = vzero()
        k = b * GGUF_BLOCK
        c = at + codes_from
        for j in range(16):
            x0, x1 = vbroadcast(x, k + j), vbroadcast(x, k + 16 + j)
            if fmt == Q4_1:
                lo, lo2 = unit_codes(w, c)
                hi, hi2 = unit_codes(w, c + LANES)
            else:
                c2 = c + 16 * PANEL
                lo, hi = vload_i8(w, c), vload_i8(w, c + LANES)
                lo2, hi2 = vload_i8(w, c2), vload_i8(w, c2 + LANES)
            a0, a1, b0, b1 = vfma(x0, lo, a0), vfma(x1, lo2, a1), vfma(x0, hi, b0), vfma(x1, hi2, b1)
            c += PANEL
        t0, u0 = vfma(d_lo, vadd(a0, a1), t0), vfma(d_hi, vadd(b0, b1), u0)
        if fmt == Q4_1:                                     # + m times the block's sum of x
            xsum = vsplat(_block_sum(x, k))
            t0, u0 = vfma(m_lo, xsum, t0), vfma(m_hi, xsum, u0)
    vstore(out, p * PANEL, t0); vstore(out, p * PANEL + LANES, u0)   # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _codes_times_row(x, xk, lo, hi, lo2, hi2, a, b):
    """One row's sums (a, b: the panel's two registers) plus x[xk] times one row of a block's
    codes (lo, hi) and x[xk + 16] times the row 16 on (lo2, hi2)."""
    x0, x1 = vbroadcast(x, xk), vbroadcast(x, xk + 16)
    return vfma(x1, lo2, vfma(x0, lo, a)), vfma(x1, hi2, vfma(x0, hi, b))


@njit(fastmath=True, inline="always", cache=CACHE)
def _codes_times_row_apart(x, xk, lo, hi, lo2, hi2, a, b, a2, b2):
    """``_codes_times_row`` with x[xk]'s sums (a, b) and x[xk + 16]'s (a2, b2) apart: four
    chains a row, for two rows at a time."""
    x0, x1 = vbroadcast(x, xk), vbroadcast(x, xk + 16)
    return vfma(x0, lo, a), vfma(x0, hi, b), vfma(x1, lo2, a2), vfma(x1, hi2, b2)


@njit(fastmath=True, inline="always", cache=CACHE)
def _join_block(x, xk, fmt, out, o, d_lo, d_hi, m_lo, m_hi, a, b):
    """A row's block sums (a, b), scaled, into its totals at out[o : o + PANEL]: d sum x q, and
    for q4_1 + m sum x over the block (whose x starts at xk)."""
    t, u = vfma(d_lo, a, vload(out, o)), vfma(d_hi, b, vload(out, o + LANES))
    if fmt == Q4_1:
        xsum = vsplat(_block_sum(x, xk))
        t, u = vfma(m_lo, xsum, t), vfma(m_hi, xsum, u)
    vstore(out, o, t); vstore(out, o + LANES, u)   # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def block_four_rows(x, w, fmt, k_dim, out, n_dim, p, n):
    """n = 4 (or 2, a constant where this is inlined) rows of x (flat, n x k_dim) times panel p
    of a q4_1 or q8_0 weight, into out (flat, rows of n_dim) at columns [PANEL p, PANEL (p + 1)):
    ``block_row``'s sums for four rows at once, each row of codes widened in registers once for
    all of them, each block's sums scaled into the totals in out. Two to four sequences read the
    weight once and widen it once, as one does, with no page to write: eight registers of sums,
    which AVX2's sixteen hold beside the codes."""
    size = (20 if fmt == Q4_1 else 34) * PANEL
    blocks = k_dim // GGUF_BLOCK
    base = p * blocks * size
    codes_from = 4 * PANEL if fmt == Q4_1 else 2 * PANEL
    o = p * PANEL
    for r in range(n):
        vstore(out, r * n_dim + o, vzero()); vstore(out, r * n_dim + o + LANES, vzero())   # noqa: E702
    for b in range(blocks):
        at = base + b * size
        for line in range(0, size, 64):
            prefetch(w, at + ROW_AHEAD + line)
        a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
        k = b * GGUF_BLOCK
        c = at + codes_from
        for j in range(16):
            if fmt == Q4_1:
                lo, lo2 = unit_codes(w, c)
                hi, hi2 = unit_codes(w, c + LANES)
            else:
                lo, hi = vload_i8(w, c), vload_i8(w, c + LANES)
                lo2, hi2 = vload_i8(w, c + 16 * PANEL), vload_i8(w, c + 16 * PANEL + LANES)
            if n == 4:                                      # two chains a row: eight
                a0, b0 = _codes_times_row(x, k + j, lo, hi, lo2, hi2, a0, b0)
                a1, b1 = _codes_times_row(x, k_dim + k + j, lo, hi, lo2, hi2, a1, b1)
                a2, b2 = _codes_times_row(x, 2 * k_dim + k + j, lo, hi, lo2, hi2, a2, b2)
                a3, b3 = _codes_times_row(x, 3 * k_dim + k + j, lo, hi, lo2, hi2, a3, b3)
            else:                                           # two rows: four chains a row
                a0, b0, a2, b2 = _codes_times_row_apart(x, k + j, lo, hi, lo2, hi2, a0, b0, a2, b2)
                a1, b1, a3, b3 = _codes_times_row_apart(x, k_dim + k + j, lo, hi, lo2, hi2, a1, b1, a3, b3)
            c += PANEL
        if n == 2:
            a0, b0, a1, b1 = vadd(a0, a2), vadd(b0, b2), vadd(a1, a3), vadd(b1, b3)
        d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
        _join_block(x, k, fmt, out, o, d_lo, d_hi, m_lo, m_hi, a0, b0)
        _join_block(x, k_dim + k, fmt, out, n_dim + o, d_lo, d_hi, m_lo, m_hi, a1, b1)
        if n == 4:
            _join_block(x, 2 * k_dim + k, fmt, out, 2 * n_dim + o, d_lo, d_hi, m_lo, m_hi, a2, b2)
            _join_block(x, 3 * k_dim + k, fmt, out, 3 * n_dim + o, d_lo, d_hi, m_lo, m_hi, a3, b3)
