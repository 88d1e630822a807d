"""KV cache quantization: a block's keys and values stored in one byte each (compressed memory).

An OS that runs short of memory can compress pages instead of evicting them (Linux's zswap,
macOS's compressed memory): more of the working set fits, at the price of a decode on every
read. A compressed KV cache is the same trade: one byte per K/V value instead of four
(float32, the CPU's cache) or two (float16, the GPU's), so the same pool holds ~4x (~2x) the
tokens, and paged attention widens each value back to a float as it reads it, in registers,
never by copying the context out first.

vLLM's names (``kv_cache_dtype``):

- ``int8``: an int8 code per value and one float32 scale per (token, KV head), stored beside
  the block: ``x = code * scale``, ``scale = max|x| / 127`` over that token's head_dim values.
- ``fp8`` = ``fp8_e4m3``: the float8 e4m3fn format (1 sign, 4 exponent, 3 mantissa bits;
  largest value 448), with one scale per layer for K and one for V, as vLLM does:
  ``x = fp8(x / scale) * scale``. The scale is 1.0, as vLLM's default.
- ``fp8_e5m2``: float8 e5m2 (5 exponent, 2 mantissa bits; largest value 57344), the top
  byte of a float16: more range, less precision.

The fp8 conversions below are written with integer and float operations only (no table),
rounding to nearest even and saturating at the largest finite value, as vLLM's kernels do;
``kernels/reference.py`` checks them against ``ml_dtypes``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, types as nb_types
from numba.extending import intrinsic, overload

# The storage formats, as the kernels see them (an int, so a kernel branches on it cheaply).
KV_FLOAT, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2, 3
KV_CACHE_DTYPES = {"auto": KV_FLOAT, "int8": KV_INT8, "fp8": KV_FP8_E4M3,
                   "fp8_e4m3": KV_FP8_E4M3, "fp8_e5m2": KV_FP8_E5M2}
STORAGE_DTYPE = {KV_INT8: np.int8, KV_FP8_E4M3: np.uint8, KV_FP8_E5M2: np.uint8}
# calculate_kv_scales: a layer's fp8 scale is max|x| of the first step's K (V) over these,
# vLLM's defaults (K_SCALE_CONSTANT, V_SCALE_CONSTANT): the largest value seen lands well
# inside e4m3's 448, leaving room for larger ones later
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0
FP8_MAX = {KV_FP8_E4M3: 448.0, KV_FP8_E5M2: 57344.0}   # largest finite values


def kv_format(kv_cache_dtype: str) -> int:
    """The format number of a ``kv_cache_dtype`` name; a clear error for an unknown one."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def scale_bytes_per_token_head(fmt: int) -> int:
    """Bytes of scale stored per (token, KV head) for K or V: int8's float32 scale, else none."""
    return 4 if fmt == KV_INT8 else 0


@intrinsic
def _float_from_bits(typingctx, bits):
    """Reinterpret an int32's bits as a float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return nb_types.float32(nb_types.int32), codegen


@intrinsic
def _bits_from_float(typingctx, value):
    """Reinterpret a float32's bits as an int32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return nb_types.int32(nb_types.float32), codegen


@njit(inline="always", cache=True)
def _fp8_layout(fmt):
    """An fp8 format's mantissa bits, exponent bias, largest code and value, and the step
    of its subnormals, 2^(1 - bias - mantissa bits) (the smallest normal is 2^mbits steps)."""
    if fmt == KV_FP8_E5M2:
        return 2, 15, 0x7B, np.float32(57344.0), np.float32(2.0 ** -16)
    return 3, 7, 0x7E, np.float32(448.0), np.float32(2.0 ** -9)


@intrinsic
def _float_from_half_bits(typingctx, bits):
    """Reinterpret an int16's bits as an IEEE half and widen it to float32 (one instruction,
    vcvtph2ps, on x86 CPUs with F16C; LLVM vectorises it)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return nb_types.float32(nb_types.int16), codegen


@njit(cache=True)
def fp8_to_scaled_float(byte, fmt):
    """The float16 step of ``fp8_to_float`` alone: the fp8 value times ``fp8_widen_scale(fmt)``'s
    inverse (e4m3: 2^-8, e5m2: 1). Kernels fold the missing factor into the layer scale, which
    saves a multiply per value in their innermost loop."""
    b = np.int32(byte)
    if fmt == KV_FP8_E5M2:
        return _float_from_half_bits(np.int16(b << 8))
    return _float_from_half_bits(np.int16(((b & 0x80) << 8) | ((b & 0x7F) << 7)))


@njit(inline="always", cache=True)
def fp8_widen_scale(fmt):
    """What ``fp8_to_scaled_float`` leaves out: 2^8 for e4m3 (the biases differ by 15 - 7), else 1."""
    return np.float32(256.0) if fmt == KV_FP8_E4M3 else np.float32(1.0)


@njit(cache=True)
def fp8_to_float(byte, fmt):
    """Widen one fp8 byte (a uint8) to float32 through a float16, which the CPU converts in
    hardware. e5m2 is the top byte of a float16, so its bits are the half's as they are.
    e4m3's 4 exponent and 3 mantissa bits, placed at the half's exponent and mantissa fields
    (shifted left by 7), make a half worth the fp8 value / 2^8 (the biases differ by 15 - 7 = 8),
    subnormal codes included (they land on half subnormals); one multiply by 256 restores it.
    (Building the float32's bits directly takes about eight operations, with a fix-up for
    subnormal codes: the fp8 cache then decoded 1.6x slower than float32.)"""
    return fp8_to_scaled_float(byte, fmt) * fp8_widen_scale(fmt)


@njit(inline="always", cache=True)
def float_to_fp8(x, fmt):
    """Narrow a float32 to an fp8 byte: round to nearest even, saturate at the largest value."""
    man_bits, bias, max_code, max_value, step = _fp8_layout(fmt)
    sign = (_bits_from_float(np.float32(x)) >> 24) & 0x80     # the sign bit: -0.0 stays negative
    if x != x:                                                 # NaN: 0x7F in both formats
        return np.uint8(sign | 0x7F)
    a = np.float32(min(abs(x), max_value))
    if a < step * np.float32(1 << man_bits):       # below the smallest normal: a subnormal code
        return np.uint8(sign | np.int32(np.rint(a / step)))
    bits = _bits_from_float(a)
    shift = 23 - man_bits                          # float32 mantissa bits that do not fit
    bits = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)    # round half to even
    code = (bits >> shift) - ((127 - bias) << man_bits)               # re-bias the exponent
    return np.uint8(sign | min(code, max_code))


def widen(value, fmt):
    """A stored K/V value as float32, inside Numba kernels (see the overload below); an fp8
    value comes out divided by ``fp8_widen_scale(fmt)``, which the caller folds into its scale.
    ``fmt`` should be a compile-time constant (a global), so that the decoding folds."""
    raise NotImplementedError("widen is only callable inside Numba kernels")


@overload(widen)
def _widen(value, fmt):
    # Chosen when the kernel is compiled, from the cache array's element type: plain floats
    # pass through, int8 codes are cast, fp8 bytes are decoded by the format in ``fmt``.
    if isinstance(value, nb_types.Float):
        return lambda value, fmt: value
    if value == nb_types.int8:
        return lambda value, fmt: np.float32(value)
    if value == nb_types.uint8:
        # without its 2^8 for e4m3: the kernels multiply their layer scales by fp8_widen_scale
        if isinstance(fmt, nb_types.IntegerLiteral):      # known now: decode with constants
            known = fmt.literal_value
            return lambda value, fmt: fp8_to_scaled_float(value, known)
        return lambda value, fmt: fp8_to_scaled_float(value, fmt)
    return None


@njit(cache=True)
def _fp8_decode_table(fmt, out):
    for code in range(256):
        out[code] = fp8_to_float(np.uint8(code), fmt)


@lru_cache(maxsize=None)
def fp8_table(fmt: int) -> np.ndarray:
    """(256,) float32, read-only: the value of every fp8 byte (for NumPy code that widens many
    at once), computed once per format."""
    out = np.empty(256, np.float32)
    _fp8_decode_table(fmt, out)
    out.flags.writeable = False
    return out


@njit(cache=True)
def _fp8_encode(x, fmt, out):
    for i in range(x.shape[0]):
        out[i] = float_to_fp8(x[i], fmt)


def to_fp8(x: np.ndarray, fmt: int) -> np.ndarray:
    """fp8 bytes (uint8, x's shape) of a float array, with the kernels' rounding."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, np.uint8)
    _fp8_encode(flat, fmt, out)
    return out.reshape(np.shape(x))


def dequantize(codes: np.ndarray, fmt: int, scale) -> np.ndarray:
    """Stored K/V back to float32: codes of any shape; ``scale`` broadcasts against them
    (int8: the per (token, head) scales with a trailing axis; fp8: the layer's scale)."""
    if fmt == KV_FLOAT:
        return codes.astype(np.float32, copy=False)
    values = codes.astype(np.float32) if fmt == KV_INT8 else fp8_table(fmt)[codes]
    return values * scale
