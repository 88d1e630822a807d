"""A random Llama written as a Hugging Face directory: the tests' tiny model, and the
GPU check's stand-in for SmolLM2 where its weights cannot be fetched.

Byte-level tokenizer (three ChatML specials, then the 256 bytes), ChatML
template, random float32 weights in safetensors. The default shapes are tiny
(GQA, several layers, real rotary positions, milliseconds a step); any Llama
shape can be asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 3 + 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def random_tensors(config: dict, seed: int, embed_scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    embed = w(config["vocab_size"], h, scale=embed_scale)
    embed[config["eos_token_id"]] *= 2.0  # make EOS a likely argmax, so stop rules get exercised
    # Strong attention/MLP outputs keep a random model from just repeating its last token.
    mix = 4.0 / np.sqrt(h)
    tensors = {"model.embed_tokens.weight": embed,
               "model.norm.weight": norm(h)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q, scale=mix),
            p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f, scale=mix),
        })
    return tensors


def byte_symbols() -> list[str]:
    """The byte-level alphabet in byte order: symbol of byte b at index b (GPT-2's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    return [symbols[b] for b in range(256)]


def byte_level_backend(specials: list[str]) -> Backend:
    """A byte-level BPE with no merges: the specials (ids 0, 1, ...), then the 256 bytes in byte
    order (id len(specials) + b is byte b)."""
    vocab = {t: i for i, t in enumerate(specials + byte_symbols())}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def write_tokenizer(path: Path) -> None:
    # token id 3 + b is byte b, so ids 35..129 are printable ASCII
    byte_level_backend(SPECIALS).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))


def write_tiny_llama(path: Path, seed: int = 0, embed_scale: float = 1.0, gguf: bool = False,
                     **config_overrides) -> Path:
    """embed_scale < 1 gives smaller logits (a flatter distribution, smaller float32 error).
    ``gguf``: the model as the default one ships, a GGUF file of Q4_1 blocks (Q8_0 for the
    embedding) beside float32 safetensors that hold those blocks dequantized."""
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**config_overrides)
    (path / "config.json").write_text(json.dumps(config))
    tensors = random_tensors(config, seed, embed_scale)
    if gguf:
        blocks = write_gguf(path / "model.gguf", config, tensors)
        tensors = {name: blocks[name].dequantize() if name in blocks else t for name, t in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"))
    write_tokenizer(path)
    return path


def write_gguf(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> dict:
    """A GGUF file of a Llama's tensors as llama.cpp's converter lays them out (its names; q and k
    rows permuted for its rotary; matrices in Q4_1 blocks, the embedding in Q8_0, norms F32).
    Returns the quantized weights by Hugging Face name."""
    from gguf import GGMLQuantizationType, GGUFWriter   # noqa: PLC0415

    from ..kernels.weight_formats import quantize         # noqa: PLC0415
    from .gguf_convert import GLOBAL_TENSORS, LAYER_TENSORS   # noqa: PLC0415

    names = {hf: gg for gg, hf in GLOBAL_TENSORS.items()}
    for i in range(config["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for gg, hf in LAYER_TENSORS.items()})
    writer = GGUFWriter(path, "llama")
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    quantized = {}
    for name, array in tensors.items():
        if array.ndim == 1:
            writer.add_tensor(names[name], np.asarray(array, np.float32))
            continue
        fmt = "q8_0" if name == "model.embed_tokens.weight" else "q4_1"
        quantized[name] = w = quantize(array, fmt)
        data = w.data.reshape(w.shape[0], -1)                       # (out, in / 32 * bytes)
        if name.endswith(("q_proj.weight", "k_proj.weight")):       # HF row i -> 2i, i + d/2 -> 2i + 1
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            data = data.reshape(heads, 2, -1, data.shape[1]).transpose(0, 2, 1, 3).reshape(data.shape)
        kind = GGMLQuantizationType.Q8_0 if fmt == "q8_0" else GGMLQuantizationType.Q4_1
        writer.add_tensor(names[name], np.ascontiguousarray(data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized
