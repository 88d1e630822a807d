"""Panel GEMM: each linear weight laid out once for the decode step's product (a page's layout
chosen for its reader, as a driver lays out a frame buffer for the display engine).

A decode step multiplies a few rows x (M = 1..128 sequences, (M, in)) by every weight w
(out, in). Read in the checkpoint's layout, the product is M dot products per weight row,
each summed over ``in`` within one register and then reduced across its lanes; at 8-32 rows
that reduction and the register pressure kept a whole step's products at 40-80 GFLOP/s, while
the machine's multiply-adds reach ~200 (docs/benchmarks.md).

``pack`` copies w once, at load, into **panels** of PANEL = 2 x LANES output features (32
with AVX-512, 16 with AVX2: ``kernels/simd.py``): panel p is a (in, PANEL) array whose row k
holds w[PANEL p : PANEL (p + 1), k], so the kernel reads a weight once, front to back, one
register-pair per k. For a tile of TILE_ROWS rows of x it keeps TILE_ROWS x 2 registers of
partial sums (8 rows in 16 of AVX-512's 32 registers, 6 rows in 12 of AVX2's 16), and for
each k loads two registers of weights, broadcasts each row's x[m, k] into a register, and
does 2 x TILE_ROWS fused multiply-adds: no lane ever needs reducing, the sums come out as
whole rows of the result (each over at most K_RUN values of k, then added to its row's total,
for BLAS's accuracy). Each thread takes a run of panels; a panel (72 KB at in = 576 with
AVX-512, 36 KB with AVX2) stays in the core's L2 while every tile of rows passes over it.

Rows are padded with zeros to a multiple of 4 (tiles of 8 with AVX-512, or pairs of tiles of
6 with AVX2, then tiles of 4; a single row has its own loop): at 2-3 rows the product is
bound by reading the weight, and four rows read it no slower than one (two rows, each through
the single row's loop, made a whole step at B=2 ~6% slower). A quantized weight's two rows
stay two (``padded_rows``): its loops widen every code in registers, once for all the rows,
where half the multiply-adds of four would be on zero rows (``quant_panels.py``). The NumPy
product ``x @ w.T`` (``kernels/reference.py`` ``linear``) is the spec (``tests/test_panel_gemm.py``).
Prefills (more than ``FastTuning.panel_max_rows`` rows) stay with BLAS's gemm on the
checkpoint's layout, which reuses x across panels in its caches; the panels are a second
copy of every weight, resident beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .simd import LANES, REGISTERS, SIMD_CACHE, prefetch, vadd, vbroadcast, vfma, vload, vstore, vzero

PANEL = 2 * LANES        # output features per panel: two registers
ROW_TILE = 4             # rows of x are padded to a multiple of this (1 row excepted: padded_rows)
# Rows of the widest tile, whose 2 x TILE_ROWS registers of sums stay in registers beside the two
# of weights and a broadcast: 8 with AVX-512 (16 of 32 registers: the products at the peak), 6 with
# AVX2 (12 of 16, the shape of AVX2's classic 6 x 16 sgemm kernel: 84 against 77 GFLOP/s a Zen 3
# core for tiles of 4, whole steps of 64 rows 1.07x; 8 rows need 16 sums and spill there).
TILE_ROWS = 8 if REGISTERS == 32 else 6
# A width other than this machine's (MINIPAGED_SIMD_LANES, for tests) is compiled afresh each
# time: Numba's on-disk cache is keyed by the CPU, not by the LANES a kernel was built for.
CACHE = SIMD_CACHE
# Each register's sum runs over at most this many k, then joins its row's total: one chain of
# 1536 float32 products (SmolLM2's down projection) was off by up to ~5x more than runs of 128,
# which are as close as BLAS's sums (tests/test_panel_gemm.py).
K_RUN = 128
# Left to the CPU's own prefetcher, a tile's multiply-adds and its panel's reading take turns
# instead of overlapping: one product of 4 rows cost the reading of its weight plus its
# arithmetic. So every pass of a tile of rows over a panel asks for its rows' share of the *next*
# panel, spread evenly over its k (``_pass_plan``, ``_prefetch_next``): the next panel streams in
# while each pass multiplies, not only while the first one does. On a Zen 3 EPYC a whole step's
# products were 12-14% faster at 8 and 16 rows than when the first pass streamed its own panel
# and the later ones asked for the next (docs/benchmarks.md). A lone pass (4 rows, or 8 with
# AVX-512), and the first pass over a thread's first panel, which no pass before asked for,
# read their own panel and ask for its lines this many k ahead instead. A single row only
# streams, which the CPU's prefetcher does alone: asked there too, whole one-sequence steps were
# ~10% slower (23.8-25.7 against 21.6-22.7 ms), so its loop asks for nothing.
PREFETCH_K = 32


@dataclass(frozen=True)
class PanelWeight:
    """A weight (out, in) as panels: ``data`` (panels, in, PANEL), out padded with zero rows."""

    data: np.ndarray     # (panels, in, PANEL) float32
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def apply(self, x: np.ndarray, num_threads: int) -> np.ndarray:
        """x (T, in) float32 -> x @ w.T, (T, out) float32, over ``num_threads`` threads."""
        return panel_linear(x, self, num_threads)


def panel_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape of an (out, in) weight's panels: (panels, in, PANEL), out padded to PANEL."""
    return -(-out_features // PANEL), in_features, PANEL


def pack(w: np.ndarray, into: np.ndarray | None = None) -> PanelWeight:
    """w (out, in) float32 -> its panels (``PanelWeight``), made once: written into ``into``
    (a C-contiguous float32 array of ``panel_shape``, such as a view of one region that holds
    every panel of a model, ``kernels/huge_pages.py``), or a new array."""
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"pack: w must be a (out, in) float32 matrix, got {w.dtype} {w.shape}")
    out_features, in_features = w.shape
    shape = panel_shape(out_features, in_features)
    if into is None:
        into = np.empty(shape, np.float32)
    elif into.shape != shape or into.dtype != np.float32 or not into.flags.c_contiguous:
        raise ValueError(f"pack: into must be a C-contiguous float32 array of shape {shape}, "
                         f"got {into.dtype} {into.shape}")
    panels = shape[0]
    padded = np.zeros((panels * PANEL, in_features), np.float32)         # (panels * PANEL, in)
    padded[:out_features] = w
    into[...] = padded.reshape(panels, PANEL, in_features).transpose(0, 2, 1)
    return PanelWeight(into, out_features, in_features)                 # data: (panels, in, PANEL)


def panel_linear(x: np.ndarray, w: PanelWeight, num_threads: int) -> np.ndarray:
    """x (T, in) @ w.T -> (T, out) float32, with ``w`` packed by ``pack``."""
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"panel_linear: x {x.shape} does not fit a ({w.out_features}, {w.in_features}) weight")
    rows = x.shape[0]
    padded = padded_rows(rows, False)
    if padded == rows:
        xs = np.ascontiguousarray(x, dtype=np.float32)                 # (T, in)
    else:
        xs = np.zeros((padded, w.in_features), np.float32)              # (T', in): zero rows added
        xs[:rows] = x
    panels = w.data.shape[0]
    out = np.empty((padded, panels * PANEL), np.float32)                # (T', panels * PANEL)
    if rows:
        _panel_product(xs.reshape(-1), w.data.reshape(-1), w.in_features, panels,
                       out.reshape(-1), max(1, min(num_threads, panels)))
    if panels * PANEL != w.out_features:
        return np.ascontiguousarray(out[:rows, :w.out_features])
    return out[:rows]                                                  # (T, out): the first rows


@njit(fastmath=True, inline="always", cache=CACHE)
def _prefetch_row(w, row):
    """Ask for the cache lines of the panel row that starts at w[row] (PANEL floats: 1 or 2 lines)."""
    for line in range(0, 4 * PANEL, 64):
        prefetch(w, 4 * row + line)


@njit(fastmath=True, inline="always", cache=CACHE)
def _pass_plan(m, tile, rows, k_dim, thread_first):
    """What the pass of rows [m, m + tile) over a panel asks for: (own, row, share, due), see
    ``_prefetch_next``. Each pass asks for its rows' share of the next panel, so that the next
    panel streams in while every pass multiplies, not only the first. A lone pass (the panel's
    only one) streams its own panel instead: measured, 6% faster at 4 rows on a Zen 3 core."""
    row = k_dim * m // rows                            # the next panel's rows [row, row + share)
    share = k_dim * (m + tile) // rows - row
    if share == k_dim:                                 # the lone pass
        return True, 0, 0, 0
    return m == 0 and thread_first, row, share, 0


@njit(fastmath=True, inline="always", cache=CACHE)
def _prefetch_next(w, panel, k, k_dim, own, due, row, share):
    """The prefetches of one k of a tile's pass over a panel; returns (due, row) for the next k.

    The pass asks for ``share`` rows of the next panel, starting at ``row``, spread evenly over
    its k_dim steps (``due`` counts up by share a step and a row is asked each time it passes
    k_dim: a division-free even spread). ``own`` (a lone pass, or the first pass over a thread's
    first panel, which no pass before asked for): the pass asks for its own panel instead,
    PREFETCH_K rows ahead of the one it reads. A hint: the values are unchanged, and past w's
    end it is dropped.
    """
    if own:
        _prefetch_row(w, panel + (k + PREFETCH_K) * PANEL)
        return due, row
    due += share
    if due >= k_dim:
        due -= k_dim
        _prefetch_row(w, panel + (k_dim + row) * PANEL)
        row += 1
    return due, row


@njit(fastmath=True, inline="always", cache=CACHE)
def _four_rows(x, r, k_dim, k, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3):
    """One k of four rows' sums: x's rows r / k_dim .. + 3 times the panel's two registers at k
    (lo: its first LANES features, hi: the next LANES); a_i, b_i: row i's two registers of sums."""
    a0, b0, a1, b1 = _two_rows(x, r, k_dim, k, lo, hi, a0, b0, a1, b1)
    a2, b2, a3, b3 = _two_rows(x, r + 2 * k_dim, k_dim, k, lo, hi, a2, b2, a3, b3)
    return a0, b0, a1, b1, a2, b2, a3, b3


@njit(fastmath=True, inline="always", cache=CACHE)
def _two_rows(x, r, k_dim, k, lo, hi, a0, b0, a1, b1):
    """One k of two rows' sums: x's rows r / k_dim and the next times the panel's two registers."""
    x0 = vbroadcast(x, r + k); x1 = vbroadcast(x, r + k_dim + k)                  # noqa: E702
    return vfma(x0, lo, a0), vfma(x0, hi, b0), vfma(x1, lo, a1), vfma(x1, hi, b1)


@njit(fastmath=True, inline="always", cache=CACHE)
def _store_four_rows(out, o, n_dim, a0, b0, a1, b1, a2, b2, a3, b3):
    """Four rows' sums into out (flat, rows of n_dim), row 0's at o."""
    vstore(out, o, a0); vstore(out, o + LANES, b0)                              # noqa: E702
    vstore(out, o + n_dim, a1); vstore(out, o + n_dim + LANES, b1)              # noqa: E702
    vstore(out, o + 2 * n_dim, a2); vstore(out, o + 2 * n_dim + LANES, b2)      # noqa: E702
    vstore(out, o + 3 * n_dim, a3); vstore(out, o + 3 * n_dim + LANES, b3)      # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _add_four_rows(a0, b0, a1, b1, a2, b2, a3, b3, c0, d0, c1, d1, c2, d2, c3, d3):
    """Four rows' totals (a, b) plus a run's sums (c, d)."""
    return (vadd(a0, c0), vadd(b0, d0), vadd(a1, c1), vadd(b1, d1),
            vadd(a2, c2), vadd(b2, d2), vadd(a3, c3), vadd(b3, d3))


def padded_rows(rows: int, quantized: bool) -> int:
    """The rows a product runs for ``rows`` rows of x: one as it is, and for a quantized weight
    two as well; more padded with zero rows to a multiple of ROW_TILE."""
    return rows if rows <= (2 if quantized else 1) else -(-rows // ROW_TILE) * ROW_TILE


@njit(fastmath=True, inline="always", cache=CACHE)
def one_row(x, r, w, panel, k_dim, out, o):
    """One row of x (flat, from x[r]) times the panel that starts at w[panel]: its PANEL sums
    into out[o : o + PANEL], two registers, each over runs of K_RUN values of k: the single
    rows' loop of ``panel_rows``."""
    t0 = u0 = vzero()
    for k0 in range(0, k_dim, K_RUN):
        a0 = b0 = vzero()
        for k in range(k0, min(k0 + K_RUN, k_dim)):
            x0 = vbroadcast(x, r + k)
            a0 = vfma(x0, vload(w, panel + k * PANEL), a0)
            b0 = vfma(x0, vload(w, panel + k * PANEL + LANES), b0)
        t0, u0 = vadd(t0, a0), vadd(u0, b0)
    vstore(out, o, t0); vstore(out, o + LANES, u0)   # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def panel_rows(x, w, k_dim, rows, out, n_dim, p, first):
    """Every row of x (flat, rows x k_dim; rows 1 or a multiple of 4, or 2 as two single rows)
    times panel p of w (flat panels), into out (flat, rows x n_dim) at columns [PANEL p, PANEL
    (p + 1)): the tiles of TILE_ROWS, then of 4, then single rows; ``first``: the pass over the
    first panel of a run, which no earlier pass asked ahead for (``_pass_plan``). The body of
    ``_panel_product``'s panel loop, and of the persistent decode kernel's product tasks
    (``kernels/persistent_decode.py``): the same sums, in the same order, in both."""
    six_rows_end = 12 * (rows // 12) if TILE_ROWS == 6 else 0   # rows [0, end) in tiles of 6
    panel = p * k_dim * PANEL                 # where panel p starts in w
    m = 0
    while TILE_ROWS == 8 and m + 8 <= rows:   # a tile of 8 rows: 16 registers of sums
        t0 = u0 = t1 = u1 = t2 = u2 = t3 = u3 = vzero()   # the rows' totals
        t4 = u4 = t5 = u5 = t6 = u6 = t7 = u7 = vzero()
        r = m * k_dim                         # row m of x
        own, row, share, due = _pass_plan(m, 8, rows, k_dim, first)
        for k0 in range(0, k_dim, K_RUN):
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
            a4 = b4 = a5 = b5 = a6 = b6 = a7 = b7 = vzero()
            for k in range(k0, min(k0 + K_RUN, k_dim)):
                due, row = _prefetch_next(w, panel, k, k_dim, own, due, row, share)
                lo = vload(w, panel + k * PANEL)             # w[PANEL p : PANEL p + LANES, k]
                hi = vload(w, panel + k * PANEL + LANES)     # the next LANES features
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k, lo, hi,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
                a4, b4, a5, b5, a6, b6, a7, b7 = _four_rows(x, r + 4 * k_dim, k_dim, k, lo, hi,
                                                            a4, b4, a5, b5, a6, b6, a7, b7)
            t0, u0, t1, u1, t2, u2, t3, u3 = _add_four_rows(t0, u0, t1, u1, t2, u2, t3, u3,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
            t4, u4, t5, u5, t6, u6, t7, u7 = _add_four_rows(t4, u4, t5, u5, t6, u6, t7, u7,
                                                            a4, b4, a5, b5, a6, b6, a7, b7)
        o = m * n_dim + p * PANEL             # out[m, PANEL p]
        _store_four_rows(out, o, n_dim, t0, u0, t1, u1, t2, u2, t3, u3)
        _store_four_rows(out, o + 4 * n_dim, n_dim, t4, u4, t5, u5, t6, u6, t7, u7)
        m += 8
    while m < six_rows_end:                   # a tile of 6 rows: 12 registers of sums
        t0 = u0 = t1 = u1 = t2 = u2 = t3 = u3 = t4 = u4 = t5 = u5 = vzero()
        r = m * k_dim
        own, row, share, due = _pass_plan(m, 6, rows, k_dim, first)
        for k0 in range(0, k_dim, K_RUN):
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = a4 = b4 = a5 = b5 = vzero()
            for k in range(k0, min(k0 + K_RUN, k_dim)):
                due, row = _prefetch_next(w, panel, k, k_dim, own, due, row, share)
                lo = vload(w, panel + k * PANEL)
                hi = vload(w, panel + k * PANEL + LANES)
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k, lo, hi,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
                a4, b4, a5, b5 = _two_rows(x, r + 4 * k_dim, k_dim, k, lo, hi, a4, b4, a5, b5)
            t0, u0, t1, u1, t2, u2, t3, u3 = _add_four_rows(t0, u0, t1, u1, t2, u2, t3, u3,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
            t4, u4, t5, u5 = vadd(t4, a4), vadd(u4, b4), vadd(t5, a5), vadd(u5, b5)
        o = m * n_dim + p * PANEL
        _store_four_rows(out, o, n_dim, t0, u0, t1, u1, t2, u2, t3, u3)
        vstore(out, o + 4 * n_dim, t4); vstore(out, o + 4 * n_dim + LANES, u4)   # noqa: E702
        vstore(out, o + 5 * n_dim, t5); vstore(out, o + 5 * n_dim + LANES, u5)   # noqa: E702
        m += 6
    while m + 4 <= rows:                      # a tile of 4 rows: 8 registers of sums
        t0 = u0 = t1 = u1 = t2 = u2 = t3 = u3 = vzero()
        r = m * k_dim
        own, row, share, due = _pass_plan(m, 4, rows, k_dim, first)
        for k0 in range(0, k_dim, K_RUN):
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
            for k in range(k0, min(k0 + K_RUN, k_dim)):
                due, row = _prefetch_next(w, panel, k, k_dim, own, due, row, share)
                lo = vload(w, panel + k * PANEL)
                hi = vload(w, panel + k * PANEL + LANES)
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, r, k_dim, k, lo, hi,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
            t0, u0, t1, u1, t2, u2, t3, u3 = _add_four_rows(t0, u0, t1, u1, t2, u2, t3, u3,
                                                            a0, b0, a1, b1, a2, b2, a3, b3)
        _store_four_rows(out, m * n_dim + p * PANEL, n_dim, t0, u0, t1, u1, t2, u2, t3, u3)
        m += 4
    while m < rows:                           # one row (a single sequence's step)
        one_row(x, m * k_dim, w, panel, k_dim, out, m * n_dim + p * PANEL)
        m += 1


@njit(fastmath=True, parallel=True, cache=CACHE)
def _panel_product(x, w, k_dim, panels, out, chunks):
    """x (rows * k_dim,) rows of x; w (panels * k_dim * PANEL,) panels; out (rows * n,).

    rows is 1 or a multiple of 4. Thread c takes panels [c P / chunks, (c + 1) P / chunks),
    each through ``panel_rows``. Each sum runs over K_RUN values of k at most, then joins its
    row's total. With tiles of 6 rows (AVX2) they come in pairs, so that the rows after them
    stay a multiple of 4.
    """
    rows = x.shape[0] // k_dim
    n_dim = panels * PANEL
    for c in prange(chunks):
        first_panel = c * panels // chunks
        for p in range(first_panel, (c + 1) * panels // chunks):
            panel_rows(x, w, k_dim, rows, out, n_dim, p, p == first_panel)
