"""LlamaConfig: the architecture numbers of a Llama-style model, read from config.json;
and the sampling settings its generation_config.json recommends."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelFormatError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# The sampling keys vLLM reads from generation_config.json (ModelConfig.get_diff_sampling_param),
# and the SamplingParams field each becomes; the integers must be integers.
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
INTEGER_GENERATION_KEYS = ("top_k", "max_new_tokens")


def read_generation_defaults(model_dir: str | Path) -> dict:
    """The sampling settings the model's generation_config.json sets, under SamplingParams'
    names (``max_new_tokens`` becomes ``max_tokens``); only the keys the file sets.

    The keys are vLLM's. Unlike vLLM (which reads the file through transformers'
    ``to_diff_dict`` and so drops a value equal to transformers' own default, such as
    ``top_k: 50`` or ``temperature: 1.0``), a value the file states is kept: it is what the
    model's authors wrote. ``do_sample`` is ignored, as vLLM ignores it. Types are checked
    here (ModelFormatError naming the key); ranges are SamplingParams' to check.
    No file: {}.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    defaults = {}
    for key, field in GENERATION_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        integer = key in INTEGER_GENERATION_KEYS
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ModelFormatError(f"{path}: {key} must be {'an integer' if integer else 'a number'}, "
                                   f"got {value!r}")
        defaults[field] = value if integer else float(value)
    return defaults


def read_config_json(model_dir: str | Path) -> dict:
    """config.json of a model directory, checked to describe a Llama-style model."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{model_dir} is not a model directory: config.json is missing")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{path} is not valid JSON: {err}") from None
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != "llama" and "LlamaForCausalLM" not in architectures:
        raise ModelFormatError(
            f"{model_dir} is not a Llama model: config.json has model_type={raw.get('model_type')!r}, "
            f"architectures={architectures!r} (expected 'llama' / 'LlamaForCausalLM')")
    return raw


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ModelFormatError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelFormatError(f"rope_scaling type {rope_type!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "LlamaConfig":
        return cls.from_dict(read_config_json(model_dir), source=str(Path(model_dir) / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "LlamaConfig":
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ModelFormatError(f"{source} lacks {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )
