"""Widening a quantized weight's panels back to float32: a run of k at a time into a page on the
stack for a decode step's rows, or whole for a prefill's BLAS.

The OS idea is decompressing a compressed page into a page of its own (zram's swap-in):

- **Runs, for the decode step's tiles of rows** (``widened_rows``). K_RUN k of a panel (16 KB
  of float32 with AVX-512) are widened once into a scratch page on the kernel's stack, which
  stays in L1, and the float32 panels' own tiles (``panel_gemm.py``: 8 rows, or 6 with AVX2's
  16 registers, then 4) multiply every row of x by it. Widening once per run instead of once
  per tile shares it among all the rows; the first tile over each run asks for the same run of
  the *next* panel (``prefetch``), so that its bytes stream in while the multiply-adds run, as
  the float32 panels' passes do. Measured on a 2-core Zen 5 (docs/weights.md), against
  widening in every tile's registers with no prefetch: 30 layers' products at 32 rows went from
  1.19-1.38x float32's time to 0.97-1.09x, and at 8 rows from 0.63-0.88x to 0.48-0.62x.
- **Whole, for a prefill** (``widen_transposed``): a prefill multiplies each weight by hundreds
  of rows, so BLAS's gemm on a float32 copy made for that one product, in parallel straight
  from the panels and dropped after it, beats any widening in registers.

A step of up to ``tuning.REGISTER_ROWS`` rows never widens: it multiplies the codes in registers
(``quant_panels.py``, ``quant_blocks.py``). ``QuantizedWeight.dequantize()`` is the spec.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..weight_formats import GGUF_BLOCK
from .panel_gemm import K_RUN, PANEL, TILE_ROWS, _add_four_rows, _four_rows, _store_four_rows, _two_rows
from .quant_a8 import Q8_0_A8
from .quant_blocks import Q4_1, Q8_0, block_at, block_scales
from .simd import (LANES, SIMD_CACHE, prefetch, vadd, vload, vload_bf16, vload_f32b, vload_i8,
                   vmul, vsplat, vstore, vzero)

BF16, INT8 = 1, 2                      # (GGUF's: quant_blocks.Q4_1, Q8_0): a panel's format code
CACHE = SIMD_CACHE
RUN_FLOATS = K_RUN * PANEL             # the scratch page: one run of k of a panel, (K_RUN, PANEL)


@njit(fastmath=True, inline="always", cache=CACHE)
def panel_size(fmt, k_dim):
    """Bytes of one panel of format code ``fmt`` with ``k_dim`` columns (``quant_panels.panel_bytes``)."""
    if fmt == BF16:
        return 2 * PANEL * k_dim
    if fmt == INT8:
        return PANEL * k_dim + 4 * PANEL
    return k_dim // GGUF_BLOCK * (34 if fmt == Q8_0 or fmt == Q8_0_A8 else 20) * PANEL   # Q4_1 and Q4_1_A8: 20


@njit(fastmath=True, inline="always", cache=CACHE)
def dense_at(w, fmt, at):
    """The two registers of weights of one k of a bfloat16 or int8 panel (row at byte ``at``),
    int8's still unscaled."""
    if fmt == BF16:
        return vload_bf16(w, at), vload_bf16(w, at + 2 * LANES)
    return vload_i8(w, at), vload_i8(w, at + LANES)


@njit(fastmath=True, inline="always", cache=CACHE)
def dense_scales(w, fmt, base, k_dim):
    """The scales of a bfloat16 or int8 panel (bytes from ``base``) for its two registers of
    features: int8's, stored after its codes; ones for bfloat16."""
    if fmt == INT8:
        at = base + k_dim * PANEL
        return vload_f32b(w, at), vload_f32b(w, at + 4 * LANES)
    one = vsplat(np.float32(1.0))
    return one, one


@njit(fastmath=True, inline="always", cache=CACHE)
def widen_run(w, fmt, k_dim, p, k0, kn, scratch):
    """k in [k0, k0 + kn) of panel p of a quantized weight (``fmt``, a constant where this is
    inlined), widened: scratch[(k - k0) PANEL :][:PANEL] holds what ``panel_gemm.pack`` makes of
    the dequantized weight's panel p at k (int8 codes times their row's scale). k0 and kn are
    multiples of GGUF's 32 for its formats."""
    base = p * panel_size(fmt, k_dim)
    if fmt == BF16 or fmt == INT8:
        width = 2 * PANEL if fmt == BF16 else PANEL                 # bytes of one k
        s_lo, s_hi = dense_scales(w, fmt, base, k_dim)
        for k in range(k0, k0 + kn):
            lo, hi = dense_at(w, fmt, base + k * width)
            vstore(scratch, (k - k0) * PANEL, vmul(lo, s_lo))
            vstore(scratch, (k - k0) * PANEL + LANES, vmul(hi, s_hi))
        return
    size = (20 if fmt == Q4_1 else 34) * PANEL                      # bytes of one block of a panel
    codes_from = 4 * PANEL if fmt == Q4_1 else 2 * PANEL
    for b in range(k0 // GGUF_BLOCK, (k0 + kn) // GGUF_BLOCK):
        at = base + b * size
        d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
        for j in range(16):
            lo, hi, lo2, hi2 = block_at(w, fmt, at + codes_from, j, d_lo, d_hi, m_lo, m_hi)
            k = b * GGUF_BLOCK + j - k0
            vstore(scratch, k * PANEL, lo); vstore(scratch, k * PANEL + LANES, hi)                        # noqa: E702
            vstore(scratch, (k + 16) * PANEL, lo2); vstore(scratch, (k + 16) * PANEL + LANES, hi2)      # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _join_four_rows(out, o, n_dim, first, a0, b0, a1, b1, a2, b2, a3, b3):
    """Four rows' sums over one run into their totals in out (row 0's at o): stored by the first
    run, added by the later ones (the float32 tiles' order: a total is 0 + run + run ...)."""
    if not first:
        a0, b0, a1, b1, a2, b2, a3, b3 = _add_four_rows(
            vload(out, o), vload(out, o + LANES), vload(out, o + n_dim), vload(out, o + n_dim + LANES),
            vload(out, o + 2 * n_dim), vload(out, o + 2 * n_dim + LANES), vload(out, o + 3 * n_dim),
            vload(out, o + 3 * n_dim + LANES), a0, b0, a1, b1, a2, b2, a3, b3)
    _store_four_rows(out, o, n_dim, a0, b0, a1, b1, a2, b2, a3, b3)


@njit(fastmath=True, inline="always", cache=CACHE)
def _join_two_rows(out, o, n_dim, first, a0, b0, a1, b1):
    """Two rows' run sums into their totals (``_join_four_rows`` for the rest of a tile of 6)."""
    if not first:
        a0, b0 = vadd(vload(out, o), a0), vadd(vload(out, o + LANES), b0)
        a1, b1 = vadd(vload(out, o + n_dim), a1), vadd(vload(out, o + n_dim + LANES), b1)
    vstore(out, o, a0); vstore(out, o + LANES, b0)                              # noqa: E702
    vstore(out, o + n_dim, a1); vstore(out, o + n_dim + LANES, b1)              # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _run_k(s, i, w, ahead, step, asks):
    """The page's two registers at its row i (the panel's k0 + i: w[PANEL p :][:PANEL, k0 + i]);
    ``asks``: also ask for byte ahead + i step of w (the first tile's share of the next panel)."""
    if asks:
        prefetch(w, ahead + i * step)
    return vload(s, i * PANEL), vload(s, i * PANEL + LANES)


@njit(fastmath=True, inline="always", cache=CACHE)
def run_tiles(x, s, k0, kn, k_dim, rows, out, n_dim, col, first, w, ahead, step):
    """Every row of x (flat, rows x k_dim; rows a multiple of 4) times one run of a widened panel
    (s: kn rows of PANEL float32s, k in [k0, k0 + kn)), joined into out's columns [col, col +
    PANEL): the float32 panels' tiles of 8 rows (pairs of 6 with AVX2), then of 4. The first
    tile asks for the bytes at w[ahead + i * step], one i a k: the next panel's run."""
    six_rows_end = 12 * (rows // 12) if TILE_ROWS == 6 else 0   # rows [0, end) in tiles of 6
    m = 0
    while TILE_ROWS == 8 and m + 8 <= rows:    # 16 registers of sums
        a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
        a4 = b4 = a5 = b5 = a6 = b6 = a7 = b7 = vzero()
        r = m * k_dim
        asks = m == 0
        for i in range(kn):
            lo, hi = _run_k(s, i, w, ahead, step, asks)
            a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k0 + i, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3)
            a4, b4, a5, b5, a6, b6, a7, b7 = _four_rows(x, r + 4 * k_dim, k_dim, k0 + i, lo, hi,
                                                        a4, b4, a5, b5, a6, b6, a7, b7)
        _join_four_rows(out, m * n_dim + col, n_dim, first, a0, b0, a1, b1, a2, b2, a3, b3)
        _join_four_rows(out, (m + 4) * n_dim + col, n_dim, first, a4, b4, a5, b5, a6, b6, a7, b7)
        m += 8
    while m < six_rows_end:                    # 12 registers of sums
        a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = a4 = b4 = a5 = b5 = vzero()
        r = m * k_dim
        asks = m == 0
        for i in range(kn):
            lo, hi = _run_k(s, i, w, ahead, step, asks)
            a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k0 + i, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3)
            a4, b4, a5, b5 = _two_rows(x, r + 4 * k_dim, k_dim, k0 + i, lo, hi, a4, b4, a5, b5)
        _join_four_rows(out, m * n_dim + col, n_dim, first, a0, b0, a1, b1, a2, b2, a3, b3)
        _join_two_rows(out, (m + 4) * n_dim + col, n_dim, first, a4, b4, a5, b5)
        m += 6
    while m + 4 <= rows:                       # 8 registers of sums
        a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
        r = m * k_dim
        asks = m == 0
        for i in range(kn):
            lo, hi = _run_k(s, i, w, ahead, step, asks)
            a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k0 + i, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3)
        _join_four_rows(out, m * n_dim + col, n_dim, first, a0, b0, a1, b1, a2, b2, a3, b3)
        m += 4


@njit(fastmath=True, inline="always", cache=CACHE)
def widened_rows(x, w, fmt, k_dim, rows, out, n_dim, p, scratch):
    """Every row of x (rows a multiple of 4) times panel p of a quantized weight (``fmt``, a
    constant where this is inlined), into out's columns [PANEL p, PANEL (p + 1)): each run of
    K_RUN k widened once into ``scratch``, a (RUN_FLOATS,) page on the caller's stack
    (``stack_floats``), then the float32 tiles over it, whose first asks for the next panel's
    same run."""
    size = panel_size(fmt, k_dim)
    codes = size - 4 * PANEL if fmt == INT8 else size               # int8's scales come last
    for k0 in range(0, k_dim, K_RUN):
        kn = min(K_RUN, k_dim - k0)
        widen_run(w, fmt, k_dim, p, k0, kn, scratch)
        ahead = (p + 1) * size + codes * k0 // k_dim                # the next panel's run, in bytes
        run_tiles(x, scratch, k0, kn, k_dim, rows, out, n_dim, p * PANEL, k0 == 0, w, ahead,
                  max(1, codes // k_dim))


def widen_transposed(w) -> np.ndarray:
    """A quantized weight's panels (a ``quant_panels.QuantPanelWeight``) widened to float32 and
    transposed, (in, out): what a prefill's BLAS multiplies (``x @ widen_transposed(w)``), made
    in parallel, each panel's columns at once. ("q4_1_a8"'s and "q8_0_a8"'s panels are laid out for
    the integer products, which every one of their products runs: ``quant_a8.py``.)"""
    if w.code not in (BF16, INT8, Q4_1, Q8_0):
        raise ValueError(f"widen_transposed widens bfloat16, int8, q4_1 and q8_0 panels, not {w.fmt!r}")
    n_dim = w.panels * PANEL
    wide = np.empty((w.in_features, n_dim), np.float32)                      # (in, panels * PANEL)
    _widen_all(w.data, w.code, w.in_features, w.panels, wide.reshape(-1))
    return wide[:, :w.out_features]


@njit(fastmath=True, cache=CACHE)
def _widen_panel(w, fmt, k_dim, p, scratch):
    """Panel p whole, into scratch (k_dim, PANEL): one compilation a format."""
    if fmt == BF16:
        widen_run(w, BF16, k_dim, p, 0, k_dim, scratch)
    elif fmt == INT8:
        widen_run(w, INT8, k_dim, p, 0, k_dim, scratch)
    elif fmt == Q4_1:
        widen_run(w, Q4_1, k_dim, p, 0, k_dim, scratch)
    else:
        widen_run(w, Q8_0, k_dim, p, 0, k_dim, scratch)


@njit(fastmath=True, parallel=True, cache=CACHE)
def _widen_all(w, fmt, k_dim, panels, out):
    """Every panel of w widened into out, (k_dim, panels * PANEL) flat: row k, columns of panel p."""
    n_dim = panels * PANEL
    for p in prange(panels):
        scratch = np.empty(k_dim * PANEL, np.float32)                 # (k_dim, PANEL), from L1 / L2
        _widen_panel(w, fmt, k_dim, p, scratch)
        for k in range(k_dim):
            vstore(out, k * n_dim + p * PANEL, vload(scratch, k * PANEL))
            vstore(out, k * n_dim + p * PANEL + LANES, vload(scratch, k * PANEL + LANES))
