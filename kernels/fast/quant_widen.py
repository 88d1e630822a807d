"""Widening a quantized weight whole: its panels (``quant_panels.py``) back to float32, for the
products that are bound by arithmetic, not by reading the weight.

The OS idea is decompressing a compressed page into a page of its own (zram's swap-in): a
prefill multiplies each weight by hundreds of rows, so BLAS's gemm on a float32 copy made for
that one product beats widening every weight in registers once per tile of rows, and the
copy, made in parallel straight from the panels and dropped after the product, costs a
small part of the product's time. Decode steps never make one: they widen in registers.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .panel_gemm import PANEL
from ..weight_formats import GGUF_BLOCK
from .quant_blocks import Q4_1, Q8_0, block_at, block_scales
from .quant_panels import BF16, CACHE, INT8, QuantPanelWeight, dense_at
from .simd import LANES, vload, vload_f32b, vmul, vsplat, vstore


def widen_transposed(w: QuantPanelWeight) -> np.ndarray:
    """The weight widened to float32 and transposed, (in, out): what a prefill's BLAS multiplies
    (``x @ widen_transposed(w)``), made from the panels in parallel, each panel's columns at once."""
    n_dim = w.panels * PANEL
    wide = np.empty((w.in_features, n_dim), np.float32)                      # (in, panels * PANEL)
    _widen_all(w.data, w.code, w.in_features, w.panels, wide.reshape(-1))
    return wide[:, :w.out_features]


@njit(fastmath=True, inline="always", cache=CACHE)
def _widen_dense(w, fmt, k_dim, p, scratch):
    width = 2 * PANEL if fmt == BF16 else PANEL
    base = p * (k_dim * width + (4 * PANEL if fmt == INT8 else 0))
    s_lo = s_hi = vsplat(np.float32(1.0))
    if fmt == INT8:
        s_lo, s_hi = vload_f32b(w, base + k_dim * width), vload_f32b(w, base + k_dim * width + 4 * LANES)
    for k in range(k_dim):
        lo, hi = dense_at(w, fmt, base + k * width)
        vstore(scratch, k * PANEL, vmul(lo, s_lo)); vstore(scratch, k * PANEL + LANES, vmul(hi, s_hi))  # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _widen_blocks(w, fmt, k_dim, p, scratch):
    size = (20 if fmt == Q4_1 else 34) * PANEL
    blocks = k_dim // GGUF_BLOCK
    codes_from = 4 * PANEL if fmt == Q4_1 else 2 * PANEL
    for b in range(blocks):
        at = p * blocks * size + b * size
        d_lo, d_hi, m_lo, m_hi = block_scales(w, at, fmt)
        for j in range(16):
            lo, hi, lo2, hi2 = block_at(w, fmt, at + codes_from, j, d_lo, d_hi, m_lo, m_hi)
            k = b * GGUF_BLOCK + j
            vstore(scratch, k * PANEL, lo); vstore(scratch, k * PANEL + LANES, hi)                        # noqa: E702
            vstore(scratch, (k + 16) * PANEL, lo2); vstore(scratch, (k + 16) * PANEL + LANES, hi2)      # noqa: E702


@njit(fastmath=True, cache=CACHE)
def widen_panel(w, fmt, k_dim, p, scratch):
    """Panel p of a quantized weight widened to float32 panel layout: scratch[:k_dim * PANEL] is
    then what ``panel_gemm.pack`` makes of the dequantized weight's panel p."""
    if fmt == BF16:
        _widen_dense(w, BF16, k_dim, p, scratch)
    elif fmt == INT8:
        _widen_dense(w, INT8, k_dim, p, scratch)
    elif fmt == Q4_1:
        _widen_blocks(w, Q4_1, k_dim, p, scratch)
    else:
        _widen_blocks(w, Q8_0, k_dim, p, scratch)


@njit(fastmath=True, parallel=True, cache=CACHE)
def _widen_all(w, fmt, k_dim, panels, out):
    """Every panel of w widened into out, (k_dim, panels * PANEL) flat: row k, columns of panel p."""
    n_dim = panels * PANEL
    for p in prange(panels):
        scratch = np.empty(k_dim * PANEL, np.float32)                 # (k_dim, PANEL), from L1 / L2
        widen_panel(w, fmt, k_dim, p, scratch)
        for k in range(k_dim):
            vstore(out, k * n_dim + p * PANEL, vload(scratch, k * PANEL))
            vstore(out, k * n_dim + p * PANEL + LANES, vload(scratch, k * PANEL + LANES))
