"""Quantized panels: a compact weight (``kernels/weight_formats.py``) laid out for the decode
step's product and widened back to float32 as it is read (compressed pages, expanded by the CPU).

The float32 panels (``panel_gemm.py``) hold PANEL output features side by side for each k, so
one k is two registers of weights. A quantized panel keeps the same order in fewer bytes, one
flat uint8 array per weight, panel after panel, each ``panel_bytes`` long:

- "bfloat16": for each k, PANEL bfloat16s (2 PANEL bytes);
- "int8": for each k, PANEL int8 codes; after the last k, the PANEL float32 scales;
- "q4_1": for each block of 32 k (GGUF's): PANEL float16 d, PANEL float16 m, then 16 rows of
  PANEL bytes, row j holding weight 32 b + j (low nibble) and 32 b + 16 + j (high nibble) of
  each feature: GGUF's own bytes (20 per 32 weights), regrouped by panel;
- "q8_0": for each block of 32 k: PANEL float16 d, then 32 rows of PANEL int8 codes;
- "q4_1_a8", "q8_0_a8": Q4_1's and Q8_0's bytes regrouped for integer dot products, x rounded
  to int8 first: their own layout and loops, for every number of rows (``quant_a8.py``).

A single row (a one-sequence step, bound by reading the weight) multiplies the codes as it
loads them, widened in registers (``simd.py``'s byte loads), and asks for the stream's lines
``tuning.ROW_AHEAD`` bytes ahead (the CPU's own prefetcher falls behind a loop that widens):
here for bfloat16 and int8 (``dense_row``: its sums over at most K_RUN k, an int8 row's total
then scaled), in ``quant_blocks.py`` for GGUF's blocks. Up to ``tuning.REGISTER_ROWS`` rows
(a step of two to eight sequences) do the same, two rows two at a time, 3-8 (padded to 4 or 8)
four at a time (``dense_four_rows``, ``quant_blocks.block_four_rows``): each k widened once
for all of them. More rows widen each run of a panel once into a page on the stack and run
the float32 panels' tiles over it (``quant_widen.py``), so only the compact bytes cross the
memory bus either way. (A prefill
widens the whole weight for BLAS: ``quant_widen.widen_transposed``; not the "_a8" formats.)
``QuantizedWeight.product(x)`` (``dequantize()`` followed by ``x @ w.T``, x rounded first for
the "_a8" formats) is the spec (``tests/test_weight_formats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange, types as nb_types
from numba.extending import overload

from ..weight_formats import BLOCK_BYTES, GGUF_BLOCK, ROUNDS_ACTIVATIONS, QuantizedWeight
from .borrowed import borrowed
from .panel_gemm import K_RUN, PANEL, _add_four_rows, _four_rows, _two_rows, padded_rows, panel_rows
from .quant_a8 import Q4_1_A8, Q8_0_A8, a8_rows, bounce, pack_a8, rounded_size, rounds_x, unpack_a8
from .quant_blocks import Q4_1, Q8_0, block_four_rows, block_row
from .quant_widen import BF16, INT8, RUN_FLOATS, dense_at, dense_scales, panel_size, widened_rows
from .simd import LANES, SIMD_CACHE, prefetch, stack_floats, vadd, vbroadcast, vfma, vmul, vstore, vzero
from .tuning import REGISTER_ROWS, ROW_AHEAD

FORMAT_CODES = {"bfloat16": BF16, "int8": INT8, "q4_1": Q4_1, "q8_0": Q8_0,   # a panel's format, as the kernels name it
                "q4_1_a8": Q4_1_A8, "q8_0_a8": Q8_0_A8}
CACHE = SIMD_CACHE


def panel_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one panel of a weight with ``in_features`` columns in format ``fmt`` (the
    kernels' ``quant_widen.panel_size``)."""
    return int(panel_size(FORMAT_CODES[fmt], in_features))


@dataclass(frozen=True)
class QuantPanelWeight:
    """A QuantizedWeight (out, in) as panels: ``data`` (panels * panel_bytes,) uint8."""

    data: np.ndarray
    fmt: str
    out_features: int
    in_features: int

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.fmt]

    @property
    def panels(self) -> int:
        return -(-self.out_features // PANEL)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def apply(self, x: np.ndarray, num_threads: int) -> np.ndarray:
        """x (T, in) float32 -> x @ w.T, (T, out) float32, over ``num_threads`` threads."""
        return quant_panel_linear(x, self, num_threads)

    def unpack(self) -> QuantizedWeight:
        """The QuantizedWeight these panels were packed from (``pack``'s inverse): the panels are
        the only copy the fast tier keeps, and a prefill widens them for BLAS (not the "_a8" formats)."""
        panels, k_dim = self.panels, self.in_features
        per_panel = self.data.reshape(panels, -1)                                # (panels, panel_bytes)
        if self.fmt in ("bfloat16", "int8"):
            dtype = np.uint16 if self.fmt == "bfloat16" else np.int8
            width = k_dim * PANEL * np.dtype(dtype).itemsize
            codes = per_panel[:, :width].copy().view(dtype).reshape(panels, k_dim, PANEL)
            codes = codes.transpose(0, 2, 1).reshape(panels * PANEL, k_dim)[:self.out_features]   # (out, in)
            scales = (per_panel[:, width:].copy().view(np.float32).reshape(-1)[:self.out_features]
                      if self.fmt == "int8" else None)
            return QuantizedWeight(self.fmt, np.ascontiguousarray(codes), scales)
        nb, size = k_dim // GGUF_BLOCK, BLOCK_BYTES[self.fmt]
        if self.fmt in ROUNDS_ACTIVATIONS:
            return QuantizedWeight(self.fmt, unpack_a8(self.data, panels, nb, size)[:self.out_features])
        blocks = per_panel.reshape(panels, nb, size * PANEL)                     # (panels, nb, block bytes)
        scales = 2 if self.fmt == "q4_1" else 1                                  # float16 rows: d (and m)
        f16 = [blocks[:, :, 2 * PANEL * i:2 * PANEL * (i + 1)].reshape(panels, nb, PANEL, 2) for i in range(scales)]
        codes = blocks[:, :, 2 * PANEL * scales:].reshape(panels, nb, -1, PANEL).transpose(0, 1, 3, 2)
        raw = np.concatenate(f16 + [codes], axis=3).transpose(0, 2, 1, 3)        # (panels, PANEL, nb, bytes)
        return QuantizedWeight(self.fmt, np.ascontiguousarray(raw.reshape(panels * PANEL, nb, size)[:self.out_features]))


def packed_size(w: QuantizedWeight) -> int:
    """Bytes of ``w``'s panels."""
    return -(-w.shape[0] // PANEL) * panel_bytes(w.fmt, w.shape[1])


def pack(w: QuantizedWeight, into: np.ndarray | None = None) -> QuantPanelWeight:
    """w's panels, made once at load: written into ``into`` (a (packed_size(w),) uint8 array, a
    view of one region holding every panel of a model) or a new array."""
    out_features, in_features = w.shape
    panels = -(-out_features // PANEL)
    rows = panels * PANEL
    data = np.zeros((rows,) + w.data.shape[1:], w.data.dtype)     # (panels * PANEL, ...) w's rows, then zero rows
    data[:out_features] = w.data
    if w.fmt in ("bfloat16", "int8"):
        codes = data.reshape(panels, PANEL, in_features).transpose(0, 2, 1)      # (panels, in, PANEL)
        parts = [np.ascontiguousarray(codes).view(np.uint8).reshape(panels, -1)]
        if w.fmt == "int8":
            scales = np.zeros(rows, np.float32)                                 # (panels * PANEL,)
            scales[:out_features] = w.scales
            parts.append(scales.reshape(panels, PANEL).view(np.uint8))          # (panels, 4 PANEL)
    elif w.fmt in ROUNDS_ACTIVATIONS:
        parts = [pack_a8(data)]                                                 # (panels, panel_bytes)
    else:
        blocks = data.reshape(panels, PANEL, -1, BLOCK_BYTES[w.fmt]).transpose(0, 2, 3, 1)  # (panels, nb, bytes, PANEL)

        def f16_row(first: int) -> np.ndarray:           # (panels, nb, 2 PANEL): a float16 of each feature
            pair = np.ascontiguousarray(blocks[:, :, first:first + 2].transpose(0, 1, 3, 2))   # (panels, nb, PANEL, 2)
            return pair.reshape(panels, blocks.shape[1], 2 * PANEL)
        codes_from = 4 if w.fmt == "q4_1" else 2
        scales = [f16_row(0)] + ([f16_row(2)] if w.fmt == "q4_1" else [])
        codes = np.ascontiguousarray(blocks[:, :, codes_from:]).reshape(panels, blocks.shape[1], -1)
        parts = [np.concatenate(scales + [codes], axis=2).reshape(panels, -1)]
    flat = np.concatenate(parts, axis=1).reshape(-1)                           # (panels * panel_bytes,)
    if into is None:
        into = np.empty(flat.shape, np.uint8)                                 # (panels * panel_bytes,)
    elif into.shape != flat.shape or into.dtype != np.uint8:
        raise ValueError(f"pack: into must be a ({flat.size},) uint8 array, got {into.dtype} {into.shape}")
    into[...] = flat
    return QuantPanelWeight(into, w.fmt, out_features, in_features)


def quant_panel_linear(x: np.ndarray, w: QuantPanelWeight, num_threads: int) -> np.ndarray:
    """x (T, in) @ w.T -> (T, out) float32, with ``w`` packed by ``pack``."""
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"quant_panel_linear: x {x.shape} does not fit a ({w.out_features}, {w.in_features}) weight")
    rows = x.shape[0]
    padded = padded_rows(rows, True)
    xs = np.zeros((padded, w.in_features), np.float32)                    # (T', in): zero rows added
    xs[:rows] = x
    out = np.empty((padded, w.panels * PANEL), np.float32)                # (T', panels * PANEL)
    if rows:
        _quant_product(xs.reshape(-1), w.data, w.code, w.in_features, w.panels, out.reshape(-1),
                       max(1, min(num_threads, w.panels)))
    return np.ascontiguousarray(out[:rows, :w.out_features])


# --------------------------------------------------------------------------- the kernels

@njit(fastmath=True, inline="always", cache=CACHE)
def dense_row(x, w, fmt, k_dim, out, p):
    """The one row of x times panel p of a bfloat16 or int8 weight (``fmt``, a constant where
    this is inlined), into out[PANEL p : PANEL (p + 1)]: a multiply-add a weight as it is
    widened, sums over K_RUN k joining the total, an int8 row's total scaled once; the lines
    ROW_AHEAD bytes on are asked for as it goes. Two k at a time, in four chains of sums: in one
    chain a lane each multiply-add waited for the one before it, and a core's int8 products in
    its caches ran at two thirds of the speed (docs/weights.md, "Four chains of sums")."""
    width = 2 * PANEL if fmt == BF16 else PANEL            # bytes of one k
    base = p * panel_size(fmt, k_dim)
    s_lo, s_hi = dense_scales(w, fmt, base, k_dim)
    t0 = u0 = vzero()
    for k0 in range(0, k_dim, K_RUN):
        k_end = min(k0 + K_RUN, k_dim)
        a0 = a1 = b0 = b1 = vzero()                      # two k at a time: four chains of sums
        for k in range(k0, k_end - 1, 2):
            for line in range(0, 2 * width, 64):          # the lines ROW_AHEAD bytes on
                prefetch(w, base + k * width + ROW_AHEAD + line)
            lo, hi = dense_at(w, fmt, base + k * width)
            lo1, hi1 = dense_at(w, fmt, base + (k + 1) * width)
            x0, x1 = vbroadcast(x, k), vbroadcast(x, k + 1)
            a0, b0, a1, b1 = vfma(x0, lo, a0), vfma(x0, hi, b0), vfma(x1, lo1, a1), vfma(x1, hi1, b1)
        if (k_end - k0) % 2:                              # an odd run's last k
            lo, hi = dense_at(w, fmt, base + (k_end - 1) * width)
            x0 = vbroadcast(x, k_end - 1)
            a0, b0 = vfma(x0, lo, a0), vfma(x0, hi, b0)
        t0, u0 = vadd(t0, vadd(a0, a1)), vadd(u0, vadd(b0, b1))
    vstore(out, p * PANEL, vmul(t0, s_lo)); vstore(out, p * PANEL + LANES, vmul(u0, s_hi))  # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def dense_four_rows(x, w, fmt, k_dim, out, n_dim, p, n):
    """n = 4 (or 2, a constant where this is inlined) rows of x (flat, n x k_dim) times panel p
    of a bfloat16 or int8 weight, into out (flat, rows of n_dim) at columns [PANEL p, PANEL (p +
    1)): each k widened in registers once for the rows (``block_four_rows``'s way for the dense
    formats), sums over K_RUN k joining the totals, int8's scaled once at the end."""
    width = 2 * PANEL if fmt == BF16 else PANEL
    base = p * panel_size(fmt, k_dim)
    s_lo, s_hi = dense_scales(w, fmt, base, k_dim)
    t0 = u0 = t1 = u1 = t2 = u2 = t3 = u3 = vzero()
    for k0 in range(0, k_dim, K_RUN):
        a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = vzero()
        for k in range(k0, min(k0 + K_RUN, k_dim)):
            prefetch(w, base + k * width + ROW_AHEAD)
            lo, hi = dense_at(w, fmt, base + k * width)
            if n == 4:
                a0, b0, a1, b1, a2, b2, a3, b3 = _four_rows(x, 0, k_dim, k, lo, hi, a0, b0, a1, b1, a2, b2, a3, b3)
            elif (k - k0) % 2 == 0:                        # two rows: even and odd k's sums apart
                a0, b0, a1, b1 = _two_rows(x, 0, k_dim, k, lo, hi, a0, b0, a1, b1)
            else:
                a2, b2, a3, b3 = _two_rows(x, 0, k_dim, k, lo, hi, a2, b2, a3, b3)
        if n == 2:
            a0, b0, a1, b1 = vadd(a0, a2), vadd(b0, b2), vadd(a1, a3), vadd(b1, b3)
        t0, u0, t1, u1, t2, u2, t3, u3 = _add_four_rows(t0, u0, t1, u1, t2, u2, t3, u3,
                                                        a0, b0, a1, b1, a2, b2, a3, b3)
    o = p * PANEL
    vstore(out, o, vmul(t0, s_lo)); vstore(out, o + LANES, vmul(u0, s_hi))                     # noqa: E702
    vstore(out, o + n_dim, vmul(t1, s_lo)); vstore(out, o + n_dim + LANES, vmul(u1, s_hi))     # noqa: E702
    if n == 4:
        vstore(out, o + 2 * n_dim, vmul(t2, s_lo)); vstore(out, o + 2 * n_dim + LANES, vmul(u2, s_hi))  # noqa: E702
        vstore(out, o + 3 * n_dim, vmul(t3, s_lo)); vstore(out, o + 3 * n_dim + LANES, vmul(u3, s_hi))  # noqa: E702


@njit(fastmath=True, inline="always", cache=CACHE)
def _rows_in_registers(x, w, fmt, k_dim, out, n_dim, p, n):
    """n = 2 or 4 rows (a constant where this is inlined) times panel p, by format: each
    format's loop compiled apart (``dense_four_rows``, ``block_four_rows``)."""
    if fmt == BF16:
        dense_four_rows(x, w, BF16, k_dim, out, n_dim, p, n)
    elif fmt == INT8:
        dense_four_rows(x, w, INT8, k_dim, out, n_dim, p, n)
    elif fmt == Q4_1:
        block_four_rows(x, w, Q4_1, k_dim, out, n_dim, p, n)
    else:
        block_four_rows(x, w, Q8_0, k_dim, out, n_dim, p, n)


@njit(fastmath=True, cache=CACHE)
def quant_rows(x, w, fmt, k_dim, rows, out, n_dim, p):
    """Every row of x (flat, rows x k_dim; rows 1, 2 or a multiple of 4) times panel p of a
    quantized weight w (flat uint8 panels, format code ``fmt``), into out (flat, rows x n_dim)
    at columns [PANEL p, PANEL (p + 1)): one branch a panel, each format's loops compiled apart.
    Up to REGISTER_ROWS rows multiply the codes in registers (one, two, or four at a time); more
    widen each run of the panel once, for the float32 tiles (``quant_widen.widened_rows``).
    Callers pad rows as ``panel_gemm.padded_rows(rows, True)`` does: 3, 5, 6 or 7 never come."""
    x, w, out = borrowed(x), borrowed(w), borrowed(out)   # no reference counts in the loops
    if rounds_x(fmt):                                     # x: its bounce buffer (quant_a8.bounce)
        a8_rows(x, w, fmt, k_dim, rows, out, n_dim, p)
        return
    if rows == 1:
        if fmt == BF16:
            dense_row(x, w, BF16, k_dim, out, p)
        elif fmt == INT8:
            dense_row(x, w, INT8, k_dim, out, p)
        elif fmt == Q4_1:
            block_row(x, w, Q4_1, k_dim, out, p)
        else:
            block_row(x, w, Q8_0, k_dim, out, p)
        return
    if rows == 2:
        _rows_in_registers(x, w, fmt, k_dim, out, n_dim, p, 2)
        return
    if rows <= REGISTER_ROWS:
        for g in range(0, rows, 4):                      # (rows: 4 or 8)
            _rows_in_registers(x[g * k_dim:], w, fmt, k_dim, out[g * n_dim:], n_dim, p, 4)
        return
    page = stack_floats(RUN_FLOATS)       # (K_RUN, PANEL) float32: one slot of this frame, in L1
    if fmt == BF16:
        widened_rows(x, w, BF16, k_dim, rows, out, n_dim, p, page)
    elif fmt == INT8:
        widened_rows(x, w, INT8, k_dim, rows, out, n_dim, p, page)
    elif fmt == Q4_1:
        widened_rows(x, w, Q4_1, k_dim, rows, out, n_dim, p, page)
    else:
        widened_rows(x, w, Q8_0, k_dim, rows, out, n_dim, p, page)


@njit(fastmath=True, parallel=True, cache=CACHE)
def _quant_product(x, w, fmt, k_dim, panels, out, chunks):
    """x (rows * k_dim,), w (panels * panel_bytes,) uint8, out (rows * panels * PANEL,): thread c
    takes panels [c P / chunks, (c + 1) P / chunks)."""
    rows = x.shape[0] // k_dim
    blob = np.empty(rounded_size(rows, k_dim) if rounds_x(fmt) else 0, np.float32)   # (rounded_size,)
    x = bounce(x, fmt, k_dim, rows, blob)               # the "_a8" formats: x rounded, once for every panel
    for c in prange(chunks):
        for p in range(c * panels // chunks, (c + 1) * panels // chunks):
            quant_rows(x, w, fmt, k_dim, rows, out, panels * PANEL, p)


def any_panel_rows(x, w, fmt, k_dim, rows, out, n_dim, p, first):
    """``panel_gemm.panel_rows`` for a float32 weight's panels, ``quant_rows`` for a quantized
    one's (flat uint8, format code ``fmt``): chosen when a kernel is compiled, by w's dtype (the
    persistent decode kernel's product tasks call this)."""
    raise NotImplementedError("any_panel_rows is called from compiled kernels only")


@overload(any_panel_rows, inline="always")
def _any_panel_rows(x, w, fmt, k_dim, rows, out, n_dim, p, first):
    if isinstance(w, nb_types.Array) and w.dtype == nb_types.float32:
        def float_panels(x, w, fmt, k_dim, rows, out, n_dim, p, first):
            panel_rows(x, w, k_dim, rows, out, n_dim, p, first)
        return float_panels
    if isinstance(w, nb_types.Array) and w.dtype == nb_types.uint8:
        def quant_panels(x, w, fmt, k_dim, rows, out, n_dim, p, first):
            quant_rows(x, w, fmt, k_dim, rows, out, n_dim, p)
        return quant_panels
    return None
