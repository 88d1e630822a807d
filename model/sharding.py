"""Sharding: the slice of the model one worker holds (tensor and pipeline parallelism).

A multiprocessor runs one program on many processors; here one model runs on many
workers, and this module says which weights each one keeps:

- **tensor parallelism** (Megatron-LM's split) cuts every layer across ``tp_size`` workers.
  Rank r keeps query heads ``[r * H/tp, (r + 1) * H/tp)`` and KV heads ``[r * KV/tp, ...)``
  (so each of its query heads still finds its GQA group's KV head locally), the matching
  rows of q/k/v_proj and columns of o_proj (*column* then *row* parallel), and 1/tp of the
  MLP: rows of gate/up_proj, columns of down_proj. Each rank's o_proj and down_proj then
  produce a *partial* sum of the layer's output; adding the ranks' partials (an all-reduce)
  gives exactly the unsplit product, twice per layer.
- **pipeline parallelism** gives stage s a contiguous run of layers (``stage_layers``).
  The first stage embeds the tokens, the last one applies the final norm and the LM head.

The embedding is replicated on every rank of the first stage (a lookup needs the whole
hidden vector; vLLM splits it by vocabulary and adds one more all-reduce), and the LM head
lives on rank 0 of the last stage only: the driver samples from one copy of the logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import LlamaConfig
from .errors import ModelFormatError


@dataclass(frozen=True)
class ShardSpec:
    """Which worker this is: its rank in its tensor-parallel group and its pipeline stage."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"bad shard: tp rank {self.tp_rank} of {self.tp_size}, "
                             f"pp rank {self.pp_rank} of {self.pp_size}")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def has_lm_head(self) -> bool:
        """Only one worker turns hidden states into logits: rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def name(self) -> str:
        return f"tp{self.tp_rank}/pp{self.pp_rank}"


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Stage ``pp_rank``'s layers: an even split, the first ``num_layers % pp_size`` stages one more."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def shard_config(config: LlamaConfig, spec: ShardSpec) -> LlamaConfig:
    """The shape of the model a worker runs: its heads, its MLP columns, its layers."""
    tp = spec.tp_size
    layers = stage_layers(config.num_hidden_layers, spec.pp_size, spec.pp_rank)
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // tp,
        num_key_value_heads=config.num_key_value_heads // tp, intermediate_size=config.intermediate_size // tp,
        num_hidden_layers=len(layers),
        layer_windows=tuple(config.layer_windows[i] for i in layers) if config.layer_windows else ())


def shard_tensors(tensors: dict[str, np.ndarray], config: LlamaConfig, spec: ShardSpec) -> dict[str, np.ndarray]:
    """A worker's checkpoint: its stage's layers (renumbered from 0), cut to its rank's slices.

    The slices are views of ``tensors`` (nothing is copied here; the model copies what it keeps)."""
    r, tp, d = spec.tp_rank, spec.tp_size, config.head_dim
    q_rows = slice(r * config.q_size // tp, (r + 1) * config.q_size // tp)        # this rank's query heads
    kv_rows = slice(r * config.kv_size // tp, (r + 1) * config.kv_size // tp)     # ... and its KV heads
    ffn = slice(r * config.intermediate_size // tp, (r + 1) * config.intermediate_size // tp)
    assert (q_rows.stop - q_rows.start) % d == 0
    out = {}
    for local, layer in enumerate(stage_layers(config.num_hidden_layers, spec.pp_size, spec.pp_rank)):
        src, dst = f"model.layers.{layer}.", f"model.layers.{local}."

        def take(name: str, rows=None, cols=None) -> None:
            if src + name not in tensors:     # named as the checkpoint names it, not renumbered
                raise ModelFormatError(f"the checkpoint has no tensor {src + name!r}")
            array = tensors[src + name]
            try:
                out[dst + name] = array[rows or slice(None)] if cols is None else array[:, cols]
            except ValueError as err:         # a GGUF block of 32 weights cut between two ranks
                raise ModelFormatError(f"tensor_parallel_size={tp} cuts {src + name} inside its blocks: {err}; "
                                       "choose a size that splits it at multiples of 32, or another "
                                       "weight format") from None

        take("input_layernorm.weight")
        take("post_attention_layernorm.weight")
        take("self_attn.q_proj.weight", rows=q_rows)        # column parallel: (q_size / tp, hidden)
        take("self_attn.k_proj.weight", rows=kv_rows)       # (kv_size / tp, hidden)
        take("self_attn.v_proj.weight", rows=kv_rows)
        take("self_attn.o_proj.weight", cols=q_rows)        # row parallel: (hidden, q_size / tp)
        take("mlp.gate_proj.weight", rows=ffn)              # (ffn / tp, hidden)
        take("mlp.up_proj.weight", rows=ffn)
        take("mlp.down_proj.weight", cols=ffn)              # (hidden, ffn / tp)
        if config.qkv_bias:                                 # Qwen2: each rank its heads' biases
            take("self_attn.q_proj.bias", rows=q_rows)      # (q_size / tp,)
            take("self_attn.k_proj.bias", rows=kv_rows)     # (kv_size / tp,)
            take("self_attn.v_proj.bias", rows=kv_rows)
        if config.o_bias and r == 0:                        # added once: by rank 0's partial sum
            take("self_attn.o_proj.bias")                   # (hidden,)
        if config.qk_norm:                                  # Qwen3: per head_dim, the same on every rank
            take("self_attn.q_norm.weight")                 # (head_dim,)
            take("self_attn.k_norm.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in tensors
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        wanted = {"model.embed_tokens.weight": spec.is_first_stage or (spec.has_lm_head and tied),
                  "model.norm.weight": spec.has_lm_head,
                  "lm_head.weight": spec.has_lm_head and not tied}[name]
        if wanted and name in tensors:
            out[name] = tensors[name]
    return out
