"""The fast tier's elementwise kernels: RMSNorm, rotary, SiLU·up, e^x, a row's log-sum-exp, and the
streaming read the roofline probes with.

The OS idea is the C library's tuned string routines: the same contract as the plain loops
(``kernels/simple.py``), written for the machine (vectorised e^x, registers for a row's max, the
thread pool only where it pays). Each has a NumPy spec in ``kernels/reference.py``.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numba import get_num_threads, njit, prange

from .compile import two_ways
from .fast_math import fast_exp
from .simd import LANES, SIMD_CACHE, vload, vmax, vmax_lanes
from .tuning import DEFAULT_TUNING, FastTuning


@njit(fastmath=True, cache=True)
def _exp_into(x, out):
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])


def exp(x: np.ndarray) -> np.ndarray:
    """e^x elementwise with ``fast_exp``, for a float32 array (the kernel, callable from Python)."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(flat)
    _exp_into(flat, out)
    return out.reshape(np.shape(x))


@njit(fastmath=True, inline="always", cache=SIMD_CACHE)
def vector_max(row, n):
    """max(row[:n]) (-inf for n = 0), row a 1-D float32 array: four registers of running
    maxima (``vmax``), 4 x LANES values a step, then the last few one by one. LLVM does not
    vectorise a loop of ``max`` itself: one chain of scalar compares ran at ~1 ns a value,
    eight scalar chains at ~0.16 (a 256-value row on a Zen 3 core); four registers of eight
    at ~0.03 (docs/benchmarks.md)."""
    top = np.float32(-np.inf)
    j = 0
    if n >= 4 * LANES:
        m0, m1 = vload(row, 0), vload(row, LANES)
        m2, m3 = vload(row, 2 * LANES), vload(row, 3 * LANES)
        j = 4 * LANES
        while j + 4 * LANES <= n:
            m0, m1 = vmax(m0, vload(row, j)), vmax(m1, vload(row, j + LANES))
            m2, m3 = vmax(m2, vload(row, j + 2 * LANES)), vmax(m3, vload(row, j + 3 * LANES))
            j += 4 * LANES
        top = vmax_lanes(vmax(vmax(m0, m1), vmax(m2, m3)))
    while j < n:
        top = max(top, row[j])
        j += 1
    return top



@njit(fastmath=True, parallel=True, cache=True)
def _stream_sum(data, partial):
    chunk = -(-data.shape[0] // partial.shape[0])
    for t in prange(partial.shape[0]):
        # A view of the chunk, indexed from 0: Numba proves i >= 0 and drops the negative-index
        # wraparound that ``range(start, stop)`` over ``data`` itself would keep, which stopped
        # LLVM vectorising the sum on an AMD EPYC (3.5 GB/s a thread against 25).
        part = data[t * chunk: min((t + 1) * chunk, data.shape[0])]
        total = np.float32(0.0)
        for i in range(part.shape[0]):
            total += part[i]
        partial[t] = total


def stream_sum(data: np.ndarray) -> float:
    """Sum of data (n,) float32, read once by every thread's share: the read-bandwidth probe
    of ``bench roofline`` (what the machine can stream, with the threads the kernels use)."""
    partial = np.zeros(get_num_threads() * 16, dtype=np.float32)   # (chunks,)
    _stream_sum(data, partial)
    return float(partial.astype(np.float64).sum())



@partial(two_ways, cache=SIMD_CACHE)   # vector_max: registers of this machine's width
def _logsumexp_rows(x, out):
    for r in prange(x.shape[0]):
        row = x[r]
        top = vector_max(row, row.shape[0])
        total = np.float32(0.0)
        for j in range(row.shape[0]):
            total += fast_exp(row[j] - top)
        out[r] = top + np.log(total)


def logsumexp(x: np.ndarray, tuning: FastTuning = DEFAULT_TUNING) -> np.ndarray:
    """log(sum(exp(x))) of each row of x (N, V) float32 -> (N,): the log-softmax's normaliser,
    so a sampled token's log-probability is x[row, token] - logsumexp(x)[row] without the
    (N, V) log-softmax (a max and one vectorised exp pass a row, threads over rows)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape[0], np.float32)
    if x.shape[0] and x.shape[1]:
        _logsumexp_rows(x.size, tuning.parallel_min_elements)(x, out)
    return out



@two_ways
def _rms_norm(x, weight, eps, out):
    hidden = x.shape[1]
    for t in prange(x.shape[0]):
        total = np.float32(0.0)
        for i in range(hidden):
            total += x[t, i] * x[t, i]
        inv_rms = np.float32(1.0) / np.sqrt(total / hidden + eps)
        for i in range(hidden):
            out[t, i] = x[t, i] * inv_rms * weight[i]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, tuning: FastTuning = DEFAULT_TUNING) -> np.ndarray:
    """x (T, hidden) / rms(x) * weight (hidden,) -> (T, hidden)."""
    out = np.empty_like(x)
    _rms_norm(x.size, tuning.light_parallel_min_elements)(x, weight, np.float32(eps), out)
    return out


# IEEE arithmetic (no fastmath): with it LLVM may fuse a * cos - b * sin into a multiply-add
# or not, and did so differently in the threaded copy loaded from Numba's disk cache than in the
# one compiled afresh (numba#10617), so the layer path's floats differed from the persistent
# kernel's on a second run. The loop is a rotation: exact arithmetic costs it nothing measurable.
@partial(two_ways, fastmath=False)
def _rotary_inplace(x, positions, cos, sin):
    half = x.shape[2] // 2
    for t in prange(x.shape[0]):
        pos = positions[t]
        for h in range(x.shape[1]):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                x[t, h, i] = a * cos[pos, i] - b * sin[pos, i]
                x[t, h, i + half] = b * cos[pos, i] + a * sin[pos, i]


def rotary(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
           tuning: FastTuning = DEFAULT_TUNING) -> np.ndarray:
    """Rotate-half RoPE of x (T, heads, head_dim) at positions (T,); returns a new array."""
    out = np.ascontiguousarray(x)
    if out is x:
        out = x.copy()
    _rotary_inplace(out.size, tuning.light_parallel_min_elements)(out, positions, cos, sin)
    return out


@partial(two_ways, fastmath=False, error_model="numpy")
def _silu_and_mul(gate_up, out):
    # Two passes over a row: e^-g first, into out, then g / (1 + e^-g) * up. In one loop LLVM
    # left the serial copy's exp unvectorised: 4 ns a value against 1.5 (16 rows of SmolLM2's
    # 1536: 100 against 38 us; 30 layers of it were 3 ms of a 50 ms step at B = 16). The
    # division vectorises only without Python's zero test (error_model="numpy"): with it, the
    # second pass ran one value at a time, 0.9 of the 1.5 ns a value on a Zen 3 core.
    # IEEE arithmetic (fastmath=False): LLVM cannot prove out and gate_up apart, so each loop
    # checks their addresses at run time and takes a vector or a scalar copy of itself; with
    # fastmath the two copies rounded differently (1 ulp), so a step's floats hung on where
    # np.empty put out (the serial copy, on a Zen 3 EPYC: 65 of 67 placements after gate_up).
    # Strict, both copies compute the same floats: 2.6 against 2.0 us for a row of 1536.
    ffn = out.shape[1]
    for t in prange(gate_up.shape[0]):
        for i in range(ffn):
            out[t, i] = fast_exp(-gate_up[t, i])
        for i in range(ffn):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + out[t, i]) * gate_up[t, ffn + i]


def silu_and_mul(gate_up: np.ndarray, tuning: FastTuning = DEFAULT_TUNING) -> np.ndarray:
    """gate_up (T, 2*ffn) = [gate | up] -> silu(gate) * up, (T, ffn)."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    _silu_and_mul(gate_up.size, tuning.silu_parallel_min_elements)(gate_up, out)
    return out
