"""The fast tier's linear layers: which engine multiplies x (T, in) by a weight (out, in).

The OS idea is the buffer cache's read-ahead policy: the same read, served by the engine that
suits its size. A few rows (decodes) stream each weight once (the panels, ``panel_gemm.py``, or
``_skinny_linear`` without them); from ``packed_min_rows`` oneMKL's packed copy
(``packed_gemm.py``) where the model made one; a prefill's many rows, BLAS's gemm.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from ..weight_formats import ROUNDS_ACTIVATIONS, QuantizedWeight
from .huge_pages import Arena
from .panel_gemm import PanelWeight, pack as pack_panels, panel_shape
from .quant_panels import QuantPanelWeight, pack as pack_quant, packed_size
from .quant_widen import widen_transposed
from .tuning import DEFAULT_TUNING, SKINNY_TILE_MIN_ROWS, FastTuning


@njit(fastmath=True, inline="always", cache=True)
def _dot(a, b):
    """sum(a * b) of two (k,) views: indexed from 0, so LLVM vectorises it with no wraparound."""
    total = np.float32(0.0)
    for k in range(a.shape[0]):
        total += a[k] * b[k]
    return total


@njit(fastmath=True, parallel=True, cache=True)
def _skinny_linear(x, w, out, chunks):
    rows, k_dim = x.shape
    n_dim = w.shape[0]
    step = -(-n_dim // chunks)
    step += (-step) % 4                           # whole groups of 4 output features per chunk
    for c in prange(chunks):                      # each thread: a run of output features
        n, stop = c * step, min(n_dim, (c + 1) * step)
        if rows < SKINNY_TILE_MIN_ROWS:           # a few rows: one weight row, one dot per row of x
            for f in range(n, stop):
                weight_row = w[f]                 # (in,) read once from memory, then from L1
                for m in range(rows):
                    out[m, f] = _dot(weight_row, x[m])
            continue
        # A tile of 4 weight rows (output features n..n+3) x 4 rows of x: 16 dot products
        # kept in registers (fastmath lets LLVM vectorise each sum over k). Each weight row
        # comes from memory once and then serves every row of x from the L1/L2 cache; each
        # loaded value serves 4 multiply-adds. w must be C-contiguous (the model's are):
        # another layout still gives the right answer, but walks memory with a stride.
        while n + 4 <= stop:
            m = 0
            while m + 4 <= rows:
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
                for k in range(k_dim):
                    wa, wb, wc, wd = w[n, k], w[n + 1, k], w[n + 2, k], w[n + 3, k]
                    x0, x1, x2, x3 = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
                    a0 += x0 * wa; a1 += x1 * wa; a2 += x2 * wa; a3 += x3 * wa   # noqa: E702
                    b0 += x0 * wb; b1 += x1 * wb; b2 += x2 * wb; b3 += x3 * wb   # noqa: E702
                    c0 += x0 * wc; c1 += x1 * wc; c2 += x2 * wc; c3 += x3 * wc   # noqa: E702
                    d0 += x0 * wd; d1 += x1 * wd; d2 += x2 * wd; d3 += x3 * wd   # noqa: E702
                out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
                out[m, n + 1], out[m + 1, n + 1], out[m + 2, n + 1], out[m + 3, n + 1] = b0, b1, b2, b3
                out[m, n + 2], out[m + 1, n + 2], out[m + 2, n + 2], out[m + 3, n + 2] = c0, c1, c2, c3
                out[m, n + 3], out[m + 1, n + 3], out[m + 2, n + 3], out[m + 3, n + 3] = d0, d1, d2, d3
                m += 4
            while m < rows:                       # the last rows of x, one at a time
                a0 = b0 = c0 = d0 = np.float32(0.0)
                for k in range(k_dim):
                    xk = x[m, k]
                    a0 += xk * w[n, k]
                    b0 += xk * w[n + 1, k]
                    c0 += xk * w[n + 2, k]
                    d0 += xk * w[n + 3, k]
                out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = a0, b0, c0, d0
                m += 1
            n += 4
        while n < stop:                           # the last output features, one at a time
            for m in range(rows):
                a0 = np.float32(0.0)
                for k in range(k_dim):
                    a0 += x[m, k] * w[n, k]
                out[m, n] = a0
            n += 1


def pack_linear(w: np.ndarray, into: np.ndarray | None = None) -> PanelWeight | None:
    """The copy of a linear weight w (out, in) that decode steps multiply by: its panels
    (``kernels/panel_gemm.py``), made once when the model loads, in ``into`` when given (an
    array of ``panel_shape``); None for a weight that is not float32 (the panels are float32
    only)."""
    return pack_panels(w, into) if w.ndim == 2 and w.dtype == np.float32 else None


def pack_linears(weights: list, kinds: list | None = None) -> list[PanelWeight | QuantPanelWeight | None]:
    """``pack_linear`` for every linear weight of a model (a quantized one: its quantized panels,
    ``quant_panels.py``), their panels in one region of huge pages (``kernels/huge_pages.py``):
    a decode step streams them all, and 2 MB pages spare it a TLB miss every 4 KB. Weights of
    one kind (``kinds[i]``, each weight its own where not given) and one layout, every layer's
    qkv say, are rows of one array in the region, in their order: the persistent decode kernel
    reads each kind as one (layers, panel bytes) array (``layer_stack.py``), whatever the number
    of layers. Each such array starts on a cache line; its rows follow one another unpadded."""
    def layout(w):   # (shape, dtype) of w's panels, or None
        if isinstance(w, QuantizedWeight):
            return (packed_size(w),), np.uint8
        return (panel_shape(*w.shape), np.float32) if w.ndim == 2 and w.dtype == np.float32 else None
    layouts = [layout(w) for w in weights]
    groups: dict = {}                                 # (kind, shape, dtype) -> indices of its weights
    for i, spec in enumerate(layouts):
        if spec is not None:
            groups.setdefault((i if kinds is None else kinds[i], spec[0], np.dtype(spec[1]).str), []).append(i)
    if not groups:
        return [None] * len(weights)                 # nothing to pack: no region
    arena = Arena(sum(Arena.footprint((len(rows),) + shape, dtype) for (_, shape, dtype), rows in groups.items()))
    packed: list = [None] * len(weights)
    for (_, shape, dtype), rows in groups.items():
        block = arena.take((len(rows),) + shape, dtype)   # (count,) + one weight's panels
        for row, i in enumerate(rows):
            w = weights[i]
            packed[i] = pack_quant(w, block[row]) if isinstance(w, QuantizedWeight) else pack_linear(w, block[row])
    return packed


def linear(x: np.ndarray, w: np.ndarray, packed=None, tuning: FastTuning = DEFAULT_TUNING) -> np.ndarray:
    """A linear layer: x (T, in) times w (out, in), the checkpoint's layout -> (T, out).

    ``packed`` is w's second copy, made once by the model:
    - w's panels (``pack_linear``, ``kernels/panel_gemm.py``): every float32 product of up to
      PANEL_MAX_ROWS rows (every decode step of up to 128 sequences) multiplies them;
    - oneMKL's packed layout (``kernels/packed_gemm.py``): every float32 product from
      PACKED_MIN_ROWS rows up is MKL's.
    Otherwise, up to SKINNY_MAX_ROWS rows of float32 go to ``_skinny_linear``, which streams
    each weight row once for all of them; more rows (prefill) go to numpy's BLAS gemm, which
    reads w transposed in place.
    """
    if isinstance(w, QuantizedWeight):          # not prepared: widened, the spec
        return w.product(x)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {x.shape} and w {w.shape} do not fit: x must be (T, in) "
                         f"and w (out, in) with the same in")
    rows = x.shape[0]
    if packed is not None and (packed.out_features, packed.in_features) != w.shape:
        raise ValueError(f"linear: the packed copy is ({packed.out_features}, {packed.in_features}), "
                         f"not w's {w.shape}")
    if isinstance(packed, PanelWeight):
        if 1 <= rows <= tuning.panel_max_rows and x.dtype == np.float32:
            return packed.apply(x, get_num_threads())
    elif packed is not None and rows >= tuning.packed_min_rows and x.dtype == np.float32:
        return packed.apply(x)
    if 1 <= rows <= tuning.skinny_max_rows and x.dtype == np.float32 and w.dtype == np.float32:
        x = np.ascontiguousarray(x)
        out = np.empty((rows, w.shape[0]), dtype=np.float32)          # (T, out)
        _skinny_linear(x, w, out, 4 * get_num_threads())
        return out
    return x @ w.T



def quantized_linear(x: np.ndarray, panels: QuantPanelWeight, tuning: FastTuning = DEFAULT_TUNING) -> np.ndarray:
    """x (T, in) times a quantized weight held as its panels only (``quant_panels.py``) -> (T, out):
    up to ``panel_max_rows`` rows (decode steps) widen it as they read it (``quant_rows``); a
    prefill's rows (arithmetic-bound: the widening is a small part) widen it to float32 for
    numpy's BLAS. A "q4_1_a8" or "q8_0_a8" weight's every product, a prefill's too, is its integer one
    (``quant_a8.py``: x rounded, two rows at a time), faster than BLAS on the widened weight."""
    if x.ndim != 2 or x.shape[1] != panels.in_features:
        raise ValueError(f"linear: x {x.shape} does not fit a {panels.shape} weight: x must be (T, in)")
    x = np.asarray(x, np.float32)
    if 1 <= x.shape[0] <= tuning.panel_max_rows or panels.fmt in ROUNDS_ACTIVATIONS:
        return panels.apply(x, get_num_threads())
    return x @ widen_transposed(panels)
