"""Reading safetensors checkpoints, memory-mapped: the program image loaded from disk.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte offsets) and the raw tensor bytes. Mapping the file
and viewing each tensor in place means a float32 checkpoint costs no copy and no
load time until a page is touched, the way ``exec`` maps a binary.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..kernels.weight_formats import A8_FORMATS, QuantizedWeight, bf16_to_float32, quantize   # bf16: a float32's top half
from .errors import ModelFormatError

# safetensors dtype tag -> numpy dtype; BF16 has no numpy dtype and is widened below
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}




def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Map one .safetensors file; returns read-only arrays viewing the file (BF16 widened to float32)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelFormatError(f"{path} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFormatError(f"{path} does not start with a safetensors JSON header") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)  # (file bytes,)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ModelFormatError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        array = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        tensors[name] = bf16_to_float32(array) if info["dtype"] == "BF16" else array
    return tensors


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding a model's weights: those ``model.safetensors.index.json``
    names (a sharded checkpoint); else ``model.safetensors``; else every ``*.safetensors`` but
    Mistral's ``consolidated*`` copy (its own format, the same weights under other names)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ModelFormatError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelFormatError(f"{index} names {', '.join(missing)}, which {model_dir} lacks")
        return [model_dir / f for f in files]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = [f for f in sorted(model_dir.glob("*.safetensors")) if not f.name.startswith("consolidated")]
    if not files:
        raise ModelFormatError(f"{model_dir} holds no *.safetensors file")
    return files


def load_checkpoint(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a model directory (one file or the shards its index names); fp32, fp16, or
    bf16 widened to float32."""
    tensors: dict[str, np.ndarray] = {}
    for file in checkpoint_files(model_dir):
        tensors.update(read_safetensors(file))
    return tensors


LOADED_FORMATS = ("float32", "bfloat16", "int8", "gguf", "gguf_a8")   # a backend's weight_format


def load_weights(model_dir: str | Path, weight_format: str = "float32") -> dict:
    """A model's tensors in ``weight_format``: "gguf", the model's GGUF file's own blocks
    (``gguf_convert.read_gguf_weights``; a registry model fetched before the file was kept gets
    it now); "bfloat16" or "int8", every matrix of the safetensors checkpoint quantized whole,
    here, before any worker takes its slice (an int8 row's scale is the whole row's, whichever
    rank holds which of its columns); "float32", the checkpoint as it is; "gguf_a8", the GGUF's
    blocks with its Q4_1 and Q8_0 matrices as "q4_1_a8" and "q8_0_a8" (their products read x
    rounded to int8)."""
    if weight_format not in LOADED_FORMATS:
        raise ValueError(f"weights are loaded as one of {LOADED_FORMATS}, not {weight_format!r}")
    if weight_format in ("bfloat16", "int8"):
        return quantize_matrices(load_checkpoint(model_dir), weight_format)
    if weight_format not in ("gguf", "gguf_a8"):
        return load_checkpoint(model_dir)
    from .gguf_convert import read_gguf_weights         # noqa: PLC0415 (a GGUF model only)

    tensors = read_gguf_weights(gguf_path_of(model_dir))
    if weight_format == "gguf_a8":
        tensors = {name: QuantizedWeight(A8_FORMATS[t.fmt], t.data) if isinstance(t, QuantizedWeight)
                   and t.fmt in A8_FORMATS else t for name, t in tensors.items()}
    return tensors


def quantize_matrices(tensors: dict, weight_format: str) -> dict:
    """Every matrix of a checkpoint (the embedding and an LM head too) in ``weight_format``,
    each whole; vectors (norms, biases) as they are."""
    return {name: quantize(t, weight_format) if t.ndim == 2 else t for name, t in tensors.items()}


def gguf_path_of(model_dir: str | Path, reader: str | None = None) -> Path:
    """The GGUF file of a model directory (``fetch.gguf_file``: fetched for a registry model, named
    by the marker its fetch left, that lacks it); ``reader``, who needs it (for the error)."""
    from .fetch import GGUF_READER, fetched_name, gguf_file      # noqa: PLC0415

    return gguf_file(model_dir, fetched_name(model_dir), reader=reader or GGUF_READER)
