"""GGUF -> Hugging Face directory: unpack a llama.cpp model file into plain float32 safetensors.

This mirrors what `convert_hf_to_gguf.py` in llama.cpp does, run backwards: GGUF stores
quantized blocks, llama.cpp tensor names, Q/K rows permuted for its rotary layout, and the
tokenizer as metadata arrays. We dequantize, rename, un-permute, and rebuild a
`tokenizer.json`, so the rest of minipaged only ever reads an ordinary Llama directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from ..kernels.weight_formats import BLOCK_BYTES, QuantizedWeight
from .errors import ModelFormatError

logger = logging.getLogger("minipaged")

# GGUF tensor name (per layer, after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3  # e.g. <|im_start|>: a special token, never split, skippable on decode
TOKEN_TYPE_USER_DEFINED = 4  # an added token matched in raw text, but an ordinary piece of output


def read_field(reader, key: str, default=None):
    """One metadata value of a GGUF file as plain Python (str, int, float, bool or a list)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    # A field is stored as raw parts; `field.data` lists which parts hold values.
    # Strings are utf-8 byte arrays, numbers are one-element arrays.
    is_string = field.types[-1] == GGUFValueType.STRING
    values = [
        bytes(field.parts[i]).decode("utf-8") if is_string else field.parts[i][0].item()
        for i in field.data
    ]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def hf_tensor_name(gguf_name: str) -> str:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)  # e.g. ["blk", "3", "attn_q.weight"]
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS:
        raise ModelFormatError(f"unexpected tensor {gguf_name!r} in GGUF file (not a plain Llama)")
    return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp rotates adjacent pairs (x[2i], x[2i+1]); Hugging Face rotates halves
    (x[i], x[i + d/2]). To make its kernel work on HF weights the converter moved, inside
    every head of size d, HF row i to GGUF row 2i and HF row i + d/2 to GGUF row 2i + 1.
    """
    rows, cols = weight.shape  # (n_heads * d, hidden)
    d = rows // n_heads
    # GGUF rows of one head, read as (d/2 pairs, 2 members): member 0 is the first half.
    paired = weight.reshape(n_heads, d // 2, 2, cols)  # (heads, d/2, 2, hidden)
    return paired.transpose(0, 2, 1, 3).reshape(rows, cols)  # (n_heads * d, hidden)


def read_gguf_weights(gguf_path: str | Path) -> dict:
    """A GGUF file's weights under Hugging Face names, **not** dequantized: each Q4_1 / Q8_0
    matrix a ``QuantizedWeight`` of its own blocks (the bytes llama.cpp reads; q and k rows
    un-permuted, whole blocks moved), each F32 tensor a float32 array. Memory-mapped: nothing is
    copied until a tier packs it."""
    reader = _open(Path(gguf_path))
    arch = read_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelFormatError(f"{gguf_path}: GGUF architecture {arch!r}; quantization='gguf' (or 'gguf_a8') reads 'llama' files "
                               "(use the model's safetensors: no quantization, dtype='bfloat16' or quantization='int8')")
    heads = read_field(reader, "llama.attention.head_count")
    kv_heads = read_field(reader, "llama.attention.head_count_kv", heads)
    out = {}
    widened = []                                              # float16 matrices, kept in float32
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        shape = tuple(int(n) for n in reversed(t.shape))      # (out, in) or (features,)
        if kind in ("f32", "f16"):                            # norms (and any float matrix): float32
            array = np.asarray(t.data).astype(np.float32).reshape(shape)        # (out, in) or (features,)
            if kind == "f16" and len(shape) == 2:
                widened.append(t.name)
        elif kind in BLOCK_BYTES:
            array = np.asarray(t.data).reshape(shape[0], -1, BLOCK_BYTES[kind])   # (out, in / 32, bytes)
        else:
            raise ModelFormatError(f"{gguf_path}: tensor {t.name} is {t.tensor_type.name}; minipaged computes on "
                                   f"F32, F16, Q4_1 and Q8_0 only (use the float32 directory: no quantization)")
        if t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            array = unpermute_rows(array.reshape(shape[0], -1), heads if ".attn_q." in t.name else kv_heads)
            array = array.reshape(shape[0], -1, BLOCK_BYTES[kind]) if kind in BLOCK_BYTES else array
        out[hf_tensor_name(t.name)] = QuantizedWeight(kind, array) if kind in BLOCK_BYTES else array
    if widened:   # no kernel multiplies float16 weights on the CPU: they take float32's bytes
        logger.warning("%s: %d F16 %s widened to float32 (%s%s), 4 bytes a weight; for fewer bytes use a "
                       "GGUF of Q4_1 / Q8_0 blocks, or the safetensors with dtype='bfloat16'",
                       Path(gguf_path).name, len(widened), "matrix is" if len(widened) == 1 else "matrices are",
                       widened[0], "" if len(widened) == 1 else ", ...")
    return out


def _open(gguf_path: Path):
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError) as err:
        raise ModelFormatError(f"{gguf_path} is not a readable GGUF file: {err}") from err


def _hf_config(reader, has_output: bool) -> dict:
    arch = read_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelFormatError(f"GGUF architecture is {arch!r}; minipaged converts only 'llama'")
    hidden = read_field(reader, "llama.embedding_length")
    n_heads = read_field(reader, "llama.attention.head_count")
    head_dim = read_field(reader, "llama.attention.key_length", hidden // n_heads)
    rope_dim = read_field(reader, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelFormatError(f"partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    if read_field(reader, "llama.rope.scaling.type", "none") != "none":
        raise ModelFormatError("RoPE scaling (long-context Llama variants) is not supported by minipaged")
    tokens = read_field(reader, "tokenizer.ggml.tokens")

    # GGUF stores floats as float32; print them the shortest way (9.99999974e-06 -> 1e-05).
    def f32(v):
        return float(str(np.float32(v)))

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": read_field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": read_field(reader, "llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": read_field(reader, "llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32(read_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": f32(read_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": read_field(reader, "llama.vocab_size", len(tokens)),
        "max_position_embeddings": read_field(reader, "llama.context_length"),
        "tie_word_embeddings": not has_output,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": read_field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _hf_tensors(reader, config: dict, progress: bool) -> dict[str, np.ndarray]:
    out = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        # GGUF lists dims innermost first; numpy (and HF's [out_features, in_features]) is the reverse.
        shape = tuple(int(n) for n in reversed(t.shape))
        # (out_features, in_features) float32 for matrices, (features,) for norms
        array = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if t.name.endswith(".attn_q.weight"):
            array = unpermute_rows(array, config["num_attention_heads"])
        elif t.name.endswith(".attn_k.weight"):
            array = unpermute_rows(array, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(array)

    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        expected += [f"model.layers.{i}.{name}" for name in LAYER_TENSORS.values()]
    missing = [name for name in expected if name not in out]
    if missing:
        raise ModelFormatError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return out


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` equal to the one GGUF metadata describes (byte-level BPE)."""
    kind = read_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFormatError(f"tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    types = read_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in read_field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    pre = read_field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's own tokenizer isolates every numeric character ("12" -> "1","2", "½" alone)
        # before the GPT-2 split; without this, '½' and numbers encode differently.
        digits = pre_tokenizers.Digits(individual_digits=True)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in ("default", "gpt2"):
        tokenizer.pre_tokenizer = byte_level
    else:
        raise ModelFormatError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt2)")
    tokenizer.decoder = decoders.ByteLevel()

    # Added tokens are matched in raw text before BPE runs, so "<|im_start|>" is one id.
    for token, kind in zip(tokens, types):
        if kind == TOKEN_TYPE_CONTROL:
            tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        elif kind == TOKEN_TYPE_USER_DEFINED:
            tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)])
    bos_id = read_field(reader, "tokenizer.ggml.bos_token_id")
    if read_field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        # Only used when encode(..., add_special_tokens=True); chat templates write BOS themselves.
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def _tokenizer_config(reader) -> dict:
    tokens = read_field(reader, "tokenizer.ggml.tokens")

    def token(key):
        i = read_field(reader, key)
        return None if i is None else tokens[i]

    return {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(read_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(read_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": read_field(reader, "llama.context_length"),
        "chat_template": read_field(reader, "tokenizer.chat_template"),
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert a llama GGUF file into a Hugging Face style directory at `out_dir`; return it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)

    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _hf_config(reader, has_output)
    tensors = _hf_tensors(reader, config, progress)
    tokenizer = build_tokenizer(reader)

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, content in [("config.json", config), ("tokenizer_config.json", _tokenizer_config(reader)),
                          ("generation_config.json", generation)]:
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return out_dir
