"""e^x with additions and multiplications only, so that a loop of it vectorises (the kernels'
own math library, as an OS carries its own small libc routines rather than call out).

Used by the CPU kernels' softmaxes and SiLU (``attention_loop.py``, ``elementwise.py``) and by the prompt attention
kernel (``kernels/prompt_attention.py``). Spec: ``kernels/reference.py`` ``exp``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..kv_quant import _float_from_bits

# Numba calls the C library's expf one value at a time (~2.3 ns here: LLVM has no vector
# exp to put in its place), which made exp the slowest part of the softmax and of SiLU.
# ``fast_exp`` is written with + and * only, so LLVM vectorises a loop of it (~0.33 ns a
# value on the 2-core Xeon), the way vector math libraries compute it:
#   e^x = 2^n * e^r,  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2]
# e^r from its Taylor series to r^7 (error below 1e-7 of the value), and 2^n by writing
# n + 127 into a float's exponent bits (``kv_quant._float_from_bits``).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)            # ln 2 split in two (Cody and Waite), so that
_LN2_LO = np.float32(-2.12194440e-4)         # n * _LN2_HI is exact for every n used here
EXP_MIN, EXP_MAX = np.float32(-87.0), np.float32(88.0)   # e^x stays a normal float32


@njit(fastmath=True, inline="always", cache=True)
def fast_exp(x):
    """e^x for a float32 x: 0 below EXP_MIN, e^EXP_MAX above EXP_MAX, relative error < 1e-6."""
    clamped = min(max(x, EXP_MIN), EXP_MAX)
    n = np.floor(clamped * _LOG2E + np.float32(0.5))
    r = clamped - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):   # Horner
        p = p * r + np.float32(c)
    power = _float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))     # 2^n
    return p * power if x >= EXP_MIN else np.float32(0.0)
