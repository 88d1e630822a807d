"""LlamaConfig: the architecture numbers of a Llama-style model, read from config.json;
and the sampling settings its generation_config.json recommends.

Four families share the one Llama forward (docs/models.md); each is the Llama with options on:

- ``llama``:   the base (rope scaling "linear" / "llama3", an optional ``head_dim``);
- ``qwen2``:   biases on the q, k and v projections; a sliding window on the layers from
               ``max_window_layers`` on when ``use_sliding_window`` is true;
- ``qwen3``:   an RMSNorm over each head's q and k before RoPE, ``head_dim`` set explicitly;
- ``mistral``: a sliding window on every layer (``sliding_window``, null for none).

A window of w means the token at position p attends to positions max(0, p - w + 1) .. p, as
transformers' sliding-window mask does; it is kept per layer (``layer_windows``, 0 = full).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelFormatError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# model_type -> the architecture name its checkpoints carry
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}

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
    """config.json of a model directory, checked to describe a model of a supported family."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{model_dir} is not a model directory: config.json is missing")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    model_family(raw, str(model_dir))
    return raw


def model_family(raw: dict, source: str = "config") -> str:
    """The family (a key of FAMILIES) config.json describes: its ``model_type``, or, when that is
    missing, its ``architectures``; anything else is refused, naming what is supported."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type is None:
        model_type = next((f for f, arch in FAMILIES.items() if arch in architectures), None)
    if model_type not in FAMILIES:
        supported = ", ".join(f"{f!r} ({arch})" for f, arch in FAMILIES.items())
        raise ModelFormatError(
            f"{source}: model_type={raw.get('model_type')!r}, architectures={architectures!r} is not a "
            f"supported model family; minipaged runs {supported}")
    return model_type


def layer_windows(raw: dict, family: str, num_layers: int, source: str = "config") -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers builds its layer types:
    ``layer_types`` when config.json lists them; else Mistral slides every layer when
    ``sliding_window`` is set, Qwen2 / Qwen3 the layers from ``max_window_layers`` on when
    ``use_sliding_window`` is true; a Llama never."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
        window = None        # transformers keeps Qwen's sliding_window only with use_sliding_window
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ModelFormatError(f"{source}: layer_types must list one type per layer ({num_layers})")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ModelFormatError(f"{source}: layer type(s) {unknown} are not supported "
                                   "(supported: full_attention, sliding_attention)")
        sliding = [t == "sliding_attention" and window is not None for t in types]   # no window: full
    elif family == "mistral":
        sliding = [window is not None] * num_layers
    elif family in ("qwen2", "qwen3") and window is not None:
        first = raw.get("max_window_layers", num_layers)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ModelFormatError(f"{source}: max_window_layers must be an integer, got {first!r}")
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [False] * num_layers
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelFormatError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    return tuple(window if s else 0 for s in sliding)


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
    model_type: str = "llama"
    qkv_bias: bool = False                  # Qwen2 (and attention_bias): q, k and v projections add a bias
    o_bias: bool = False                    # attention_bias (Llama, Qwen3): the output projection too
    qk_norm: bool = False                   # Qwen3: RMSNorm over each head's q and k before RoPE
    layer_windows: tuple[int, ...] = ()     # (layers,) sliding window of each layer, 0 = full; () = all full
    torch_dtype: str = "float32"            # the checkpoint's dtype: float32, float16 or bfloat16

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ModelFormatError(f"layer_windows lists {len(self.layer_windows)} layers, the model has "
                                   f"{self.num_hidden_layers}")
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

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int:
        """The window past which no layer reads a token again, 0 if some layer reads them all:
        the KV blocks wholly before it may go back to the pool (docs/models.md)."""
        if not self.layer_windows or not all(self.layer_windows):
            return 0
        return max(self.layer_windows)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "LlamaConfig":
        return cls.from_dict(read_config_json(model_dir), source=str(Path(model_dir) / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "LlamaConfig":
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ModelFormatError(f"{source} lacks {', '.join(missing)}")
        family = model_family(raw, source)
        if raw.get("mlp_bias"):
            raise ModelFormatError(f"{source}: mlp_bias is not supported (no supported family has MLP biases)")
        heads = raw["num_attention_heads"]
        # transformers 5 writes rope_theta and the scaling inside rope_parameters
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling = rope
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            model_type=family,
            # Qwen2 always has q/k/v biases; ``attention_bias`` puts them on q, k, v and o
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias")),
            o_bias=family != "qwen2" and bool(raw.get("attention_bias")),
            qk_norm=family == "qwen3",
            layer_windows=layer_windows(raw, family, raw["num_hidden_layers"], source),
            # transformers 5 writes "dtype", earlier versions "torch_dtype"
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )
