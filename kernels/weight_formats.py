"""Weights in fewer bytes: a linear weight kept in a compact format and widened where it is read.

The OS idea is compressed memory (zram, a compressed file system such as squashfs): pages are
kept in fewer bytes and expanded by the CPU on access, because reading the small form and
expanding it beats reading the large one. A single decode step reads every weight of the
model once (538 MB of float32 for SmolLM2), so on a CPU the bytes per weight are the roofline
of decode: half the bytes, up to twice the tokens a second.

Formats, and the bytes one weight costs:

=========== ====== ===================================================================
"float32"   4      the checkpoint as loaded
"bfloat16"  2      the top 16 bits of each float32, rounded to nearest even; widened by a shift
"int8"      1      symmetric, one scale per output row: w[n, k] = scale[n] * q[n, k],
                   q in [-127, 127], scale[n] = max_k |w[n, k]| / 127 (+4 bytes a row)
"q4_1"      0.625  GGUF's blocks of 32 weights along a row: d, m float16 and 32 4-bit codes,
                   w = d * q + m; byte j of a block's codes holds weight j (low nibble) and
                   weight j + 16 (high nibble)
"q8_0"      1.0625 GGUF's blocks of 32: d float16 and 32 int8 codes, w = d * q
"q4_1_a8"   0.625  "q4_1"'s bytes and meaning, multiplied by x rounded to int8 a block of 32
                   (``round_activations``), as llama.cpp multiplies Q4_1 (``--quantization gguf_a8``)
"q8_0_a8"   1.0625 "q8_0"'s bytes and meaning, multiplied by x rounded the same way, as llama.cpp
                   multiplies Q8_0 (``--quantization gguf_a8``'s embedding and LM head)
=========== ====== ===================================================================

``QuantizedWeight`` holds a weight (out, in) in one of the compact formats, with
``dequantize()`` and ``product(x)``, the NumPy spec every tier's kernels are tested against (the
plain tier computes exactly this). Activations and sums stay float32 in every tier, but for
"q4_1_a8" and "q8_0_a8", whose products read x rounded to int8 codes with a float32 scale a block
of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "q4_1", "q8_0", "q4_1_a8", "q8_0_a8")
QUANTIZED_FORMATS = WEIGHT_FORMATS[1:]
GGUF_BLOCK = 32                                       # weights in one GGUF block
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q4_1_a8": 20, "q8_0_a8": 34}   # bytes of a block: scales and codes
BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "q4_1": 20 / 32, "q8_0": 34 / 32,
                    "q4_1_a8": 20 / 32, "q8_0_a8": 34 / 32}
ROUNDS_ACTIVATIONS = ("q4_1_a8", "q8_0_a8")           # formats whose products read x rounded to int8
A8_FORMATS = {"q4_1": "q4_1_a8", "q8_0": "q8_0_a8"}   # a GGUF format -> the same bytes, x rounded


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight (out, in) in a compact format (the module docstring's table)."""

    fmt: str
    data: np.ndarray                 # bfloat16: (out, in) uint16; int8: (out, in) int8;
                                     # q4_1(_a8) / q8_0(_a8): (out, in // 32, 20 or 34) uint8, GGUF's bytes
    scales: np.ndarray | None = None  # int8: (out,) float32; else None

    def __post_init__(self) -> None:
        if self.fmt not in QUANTIZED_FORMATS:
            raise ValueError(f"a quantized weight's format is one of {QUANTIZED_FORMATS}, got {self.fmt!r}")
        expected = {"bfloat16": (np.uint16, 2), "int8": (np.int8, 2), "q4_1": (np.uint8, 3), "q8_0": (np.uint8, 3),
                    "q4_1_a8": (np.uint8, 3), "q8_0_a8": (np.uint8, 3)}
        dtype, ndim = expected[self.fmt]
        if self.data.dtype != dtype or self.data.ndim != ndim:
            raise ValueError(f"a {self.fmt} weight's data is a {ndim}-D {np.dtype(dtype)} array, "
                             f"got {self.data.ndim}-D {self.data.dtype}")
        if self.fmt in BLOCK_BYTES and self.data.shape[2] != BLOCK_BYTES[self.fmt]:
            raise ValueError(f"a {self.fmt} block is {BLOCK_BYTES[self.fmt]} bytes, got {self.data.shape[2]}")
        if (self.fmt == "int8") != (self.scales is not None):
            raise ValueError("an int8 weight has one scale per output row, and only int8 has scales")
        if self.scales is not None and self.scales.shape != (self.data.shape[0],):
            raise ValueError(f"int8 scales are ({self.data.shape[0]},), got {self.scales.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in): the float weight's shape."""
        rows = self.data.shape[0]
        return (rows, self.data.shape[1] * GGUF_BLOCK) if self.fmt in BLOCK_BYTES else (rows, self.data.shape[1])

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (int(self.scales.nbytes) if self.scales is not None else 0)

    @property
    def ndim(self) -> int:
        return 2

    def dequantize(self) -> np.ndarray:
        """The float32 weight (out, in): the spec of every tier's products with this weight."""
        if self.fmt == "bfloat16":
            return bf16_to_float32(self.data)
        if self.fmt == "int8":
            return self.data.astype(np.float32) * self.scales[:, None]
        blocks = self.data                                            # (out, in / 32, bytes)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (out, in / 32, 1)
        if self.fmt in ("q8_0", "q8_0_a8"):
            q = blocks[..., 2:].view(np.int8).astype(np.float32)        # (out, in / 32, 32)
            return (d * q).reshape(self.shape)
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)  # (out, in / 32, 1)
        codes = blocks[..., 4:]                                        # (out, in / 32, 16)
        q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(np.float32)   # (out, in / 32, 32)
        return (d * q + m).reshape(self.shape)

    def product(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) @ w.T, (T, out) float32, as every tier computes it: the dequantized weight's
        plain product, with x rounded first for a format that rounds it (``round_activations``)."""
        x = np.asarray(x, np.float32)
        return (round_activations(x) if self.fmt in ROUNDS_ACTIVATIONS else x) @ self.dequantize().T

    def rows(self, ids) -> np.ndarray:
        """Rows ``ids`` (T,) dequantized: (T, in) float32 (an embedding lookup)."""
        ids = np.asarray(ids)
        return QuantizedWeight(self.fmt, self.data[ids],
                               None if self.scales is None else self.scales[ids]).dequantize()

    def __getitem__(self, key) -> QuantizedWeight:
        """A slice of rows, ``w[a:b]``, or of columns, ``w[:, a:b]`` (a shard's; for the GGUF
        formats the columns must fall on block boundaries, multiples of 32)."""
        if isinstance(key, slice):
            return QuantizedWeight(self.fmt, self.data[key], None if self.scales is None else self.scales[key])
        if isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice):
            start, stop, step = key[1].indices(self.shape[1])
            if step != 1:
                raise IndexError("a quantized weight's columns are sliced in one contiguous run")
            if self.fmt in BLOCK_BYTES:
                if start % GGUF_BLOCK or stop % GGUF_BLOCK:
                    raise ValueError(f"a {self.fmt} weight is split into columns at multiples of {GGUF_BLOCK} "
                                     f"(its blocks), not at {start}:{stop}")
                start, stop = start // GGUF_BLOCK, stop // GGUF_BLOCK
            return QuantizedWeight(self.fmt, self.data[:, start:stop], self.scales)
        raise IndexError(f"a quantized weight takes a slice of rows or of columns, not {key!r}")


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: the 16 bits shifted into the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as uint16 bits; NaN stays NaN."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)     # w's shape, the float's bits
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16       # w's shape, the top 16 bits
    rounded = np.where(np.isnan(w), (bits >> 16) | 0x40, rounded)  # keep a NaN a NaN (a quiet one)
    return rounded.astype(np.uint16)


def quantize(w: np.ndarray, fmt: str) -> np.ndarray | QuantizedWeight:
    """A float weight (out, in) in format ``fmt``: float32 returns the array itself."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    w = np.asarray(w, dtype=np.float32)
    if fmt == "float32":
        return w
    if w.ndim != 2:
        raise ValueError(f"only matrices (out, in) are quantized, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError(f"a weight of shape {w.shape} holds nan or inf values: it cannot be quantized to {fmt}")
    if fmt == "bfloat16":
        return QuantizedWeight(fmt, float32_to_bf16(w))
    if fmt == "int8":
        scales = (np.abs(w).max(axis=1) / 127.0).astype(np.float32)       # (out,)
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)           # (out,) an all-zero row: 1
        codes = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)   # (out, in)
        return QuantizedWeight(fmt, codes, scales)
    if w.shape[1] % GGUF_BLOCK:
        raise ValueError(f"{fmt} needs rows of a multiple of {GGUF_BLOCK} weights, got {w.shape[1]}")
    from gguf import GGMLQuantizationType                     # noqa: PLC0415 (llama.cpp's own quantizers)
    from gguf.quants import quantize as gguf_quantize        # noqa: PLC0415

    kind = GGMLQuantizationType.Q8_0 if fmt in ("q8_0", "q8_0_a8") else GGMLQuantizationType.Q4_1
    raw = gguf_quantize(w, kind)                                          # (out, in / 32 * bytes) uint8
    return QuantizedWeight(fmt, raw.reshape(w.shape[0], -1, BLOCK_BYTES[fmt]))


def round_activations(x: np.ndarray) -> np.ndarray:
    """x (..., in) float32 as a "q4_1_a8" or "q8_0_a8" product reads it: each row's blocks of 32 rounded to
    int8 codes q = rint(x / d) with d = max |x| / 127 of the block (llama.cpp's q8_1, its d
    kept float32), and returned as q * d. In float32 throughout: the fast tier's codes are these
    (``kernels/fast/quant_a8.py``). A block with a nan or an inf comes back non-finite."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % GGUF_BLOCK:
        raise ValueError(f"x is rounded in blocks of {GGUF_BLOCK}: its rows of {x.shape[-1]} are not")
    blocks = x.reshape(x.shape[:-1] + (-1, GGUF_BLOCK))                     # (..., in / 32, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)        # (..., in / 32, 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # non-finite blocks: named above
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))   # (..., in / 32, 1)
        scaled = blocks * inv.astype(np.float32)                            # (..., in / 32, 32)
        q = np.rint(np.where(np.isfinite(scaled), scaled, np.float32(0)))  # (..., in / 32, 32) the codes
        return (q * d).astype(np.float32).reshape(x.shape)


def concat_rows(weights: list) -> np.ndarray | QuantizedWeight:
    """Weights of one format stacked by rows (q | k | v, gate | up): float arrays or QuantizedWeights.
    One weight is returned as it is (a memory-mapped checkpoint's view stays a view)."""
    if len(weights) == 1:
        return weights[0]
    if not any(isinstance(w, QuantizedWeight) for w in weights):
        return np.concatenate(weights)
    fmts = {w.fmt if isinstance(w, QuantizedWeight) else "float32" for w in weights}
    if len(fmts) != 1:
        raise ValueError(f"weights fused into one product must share a format, got {sorted(fmts)}")
    scales = None if weights[0].scales is None else np.concatenate([w.scales for w in weights])
    return QuantizedWeight(weights[0].fmt, np.concatenate([w.data for w in weights]), scales)


def lookup(table, ids):
    """Rows ``ids`` (T,) of an embedding table (vocab, hidden), float: (T, hidden)."""
    return table.rows(ids) if isinstance(table, QuantizedWeight) else table[ids]


def product(x: np.ndarray, w) -> np.ndarray:
    """x (T, in) @ w.T for a float weight or a QuantizedWeight (its spec, ``QuantizedWeight.product``)."""
    return w.product(x) if isinstance(w, QuantizedWeight) else x @ w.T
