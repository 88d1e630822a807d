"""The Llama forward pass over a flattened batch of tokens: the "process" the engine runs.

All sequences of a step are concatenated into one batch of T tokens, so every
weight is used in exactly one matrix product per step, whatever the mix of
prompts and decodes. Only attention needs to know which token belongs to which
sequence, and it learns that from the explicit AttentionMetadata.

``ops`` is a tier of kernels (``kernels/ops.py``'s ``KernelOps``: the plain tier, the fast CPU
tier or the CUDA tier); the model knows none of them. It hands the weights, in the checkpoint's
layout, to ``ops.prepare`` once; each step begins with ``ops.plan_step`` and offers the whole
step to ``ops.decode_step`` (a tier may run every layer in one call, or decline), then goes layer
by layer: rms_norm, linear, rotary, write_kv, paged_attention, linear, rms_norm, linear,
silu_and_mul, linear, as the reference forward (``model/reference.py``) does with a paged cache.

The families (model/config.py) are options of this one forward, each a layer field that is None or 0
where the family has none: q/k/v biases (Qwen2), an RMSNorm over each head's q and k before RoPE
(Qwen3), an output bias (``attention_bias``), and a sliding window per layer (Mistral, Qwen2).

A worker of a tensor- or pipeline-parallel engine holds a shard (``model/sharding.py``):
``run`` is then a generator that stops at each all-reduce (twice per layer), hands out its
partial sum and waits for the total, so one code path serves one worker, workers in one
process driven in lock step, and workers that all-reduce over NCCL.
"""

from __future__ import annotations

import numpy as np

from ..kernels.layout import AttentionMetadata
from ..kernels.ops import KernelOps, LayerWeights, ModelWeights, Rope
from ..kernels.weight_formats import QuantizedWeight, concat_rows, lookup
from .config import LlamaConfig
from .errors import ModelFormatError
from .rope import rope_tables
from .sharding import ShardSpec


# Tokens of a long prefill's MLP multiplied at a time. Its activations grow with the batch
# (gate and up for 8,192 tokens: 100 MB), and glibc serves every block over 32 MB with a fresh
# mmap, returned at free: each layer then faulted its activations in afresh, 4 KiB page by zeroed
# page. Chunks of 2,048 tokens (gate and up: 25 MB) are served from the heap and reused, layer
# after layer, and still make products long enough for BLAS's peak (docs/benchmarks.md).
MLP_CHUNK_TOKENS = 2048


def _get(tensors: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise ModelFormatError(f"the checkpoint has no tensor {name!r}")
    array = tensors[name]
    if tuple(array.shape) != shape:
        raise ModelFormatError(f"tensor {name} has shape {tuple(array.shape)}, config implies {shape}")
    return array


def run_to_end(run):
    """The result of a forward pass that needs no all-reduce (one worker holds whole layers)."""
    try:
        next(run)
    except StopIteration as done:
        return done.value
    raise RuntimeError("this model is a tensor-parallel shard: its forward pass needs an all-reduce driver "
                       "(engine/parallel/executor.py)")


class LlamaModel:
    def __init__(self, config: LlamaConfig, tensors: dict[str, np.ndarray], ops: KernelOps,
                 dtype=np.float32, max_positions: int | None = None, shard: ShardSpec | None = None) -> None:
        """``config`` and ``tensors`` are the worker's own (``sharding.shard_config`` /
        ``shard_tensors``) when ``shard`` says it holds a slice of a bigger model. ``ops``: the
        tier of kernels (``kernels/ops.py``), which prepares the weights its own way. A tensor
        in a compact format (``kernels/weight_formats.py``: ``model/weights.py`` ``load_weights``
        quantizes a checkpoint, or a GGUF's blocks) is kept as it comes."""
        self.config = config
        self.shard = shard or ShardSpec()
        self.ops = ops
        xp = ops.xp
        c = config
        h, q, kv, ffn = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size

        if xp is not np and any(isinstance(t, QuantizedWeight) for t in tensors.values()):
            raise ValueError("weights in a compact format (bfloat16, int8, GGUF blocks) run on the CPU tiers only")

        def put(array: np.ndarray) -> np.ndarray:
            return xp.asarray(np.ascontiguousarray(array, dtype=dtype))

        def put_linear(arrays: list):
            """A linear weight (out, in), its parts stacked by rows; a compact one kept so."""
            w = concat_rows(arrays)
            return w if isinstance(w, QuantizedWeight) else put(w)

        tied = c.tie_word_embeddings or "lm_head.weight" not in tensors
        needs_embed = self.shard.is_first_stage or (self.shard.has_lm_head and tied)
        embed = (put_linear([_get(tensors, "model.embed_tokens.weight", (c.vocab_size, h))])
                 if needs_embed else None)                                       # (vocab, hidden)
        # Every linear weight stays (out, in), the checkpoint's layout: ops.linear reads a
        # weight row per output feature. Tied, the head is the embedding itself.
        lm_head = final_norm = None
        if self.shard.has_lm_head:
            # (vocab, hidden)
            lm_head = embed if tied else put_linear([_get(tensors, "lm_head.weight", (c.vocab_size, h))])
            final_norm = put(_get(tensors, "model.norm.weight", (h,)))
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            # HF stores linear weights as (out, in); q/k/v and gate/up are fused by stacking
            # their rows, so each step is one product per fused weight.
            qkv = put_linear([_get(tensors, p + "self_attn.q_proj.weight", (q, h)),
                              _get(tensors, p + "self_attn.k_proj.weight", (kv, h)),
                              _get(tensors, p + "self_attn.v_proj.weight", (kv, h))])
            gate_up = put_linear([_get(tensors, p + "mlp.gate_proj.weight", (ffn, h)),
                                  _get(tensors, p + "mlp.up_proj.weight", (ffn, h))])
            qkv_bias = o_bias = q_norm = k_norm = None
            if c.qkv_bias:                   # Qwen2: (q + 2kv,) rows [q | k | v], as qkv's
                qkv_bias = put(np.concatenate([_get(tensors, p + "self_attn.q_proj.bias", (q,)),
                                               _get(tensors, p + "self_attn.k_proj.bias", (kv,)),
                                               _get(tensors, p + "self_attn.v_proj.bias", (kv,))]))
            if c.o_bias and self.shard.tp_rank == 0:     # a shard's partial sums add it once
                o_bias = put(_get(tensors, p + "self_attn.o_proj.bias", (h,)))    # (hidden,)
            if c.qk_norm:                    # Qwen3: (head_dim,) each, shared by every head
                q_norm = put(_get(tensors, p + "self_attn.q_norm.weight", (c.head_dim,)))
                k_norm = put(_get(tensors, p + "self_attn.k_norm.weight", (c.head_dim,)))
            layers.append(LayerWeights(
                input_norm=put(_get(tensors, p + "input_layernorm.weight", (h,))),
                qkv=qkv,
                o=put_linear([_get(tensors, p + "self_attn.o_proj.weight", (h, q))]),
                post_norm=put(_get(tensors, p + "post_attention_layernorm.weight", (h,))),
                gate_up=gate_up,
                down=put_linear([_get(tensors, p + "mlp.down_proj.weight", (h, ffn))]),
                qkv_bias=qkv_bias, o_bias=o_bias, q_norm=q_norm, k_norm=k_norm, window=c.window(i),
            ))
        # The tier's copy: the same values, in whatever layout its kernels read (kernels/ops.py).
        self.weights = ops.prepare(ModelWeights(embed, layers, final_norm, lm_head))
        cos, sin = rope_tables(c, max_positions or c.max_position_embeddings)
        self.rope = Rope(xp.asarray(cos), xp.asarray(sin))   # (max_positions, head_dim // 2) each
        self.scale = 1.0 / float(np.sqrt(c.head_dim))

    # The weights by name, as a reader of the forward pass expects them (the tier's copies of
    # the linear ones: an (out, in) array, or the tier's wrapper of one).
    @property
    def embed(self):
        return self.weights.embed            # (vocab, hidden) or None

    @property
    def layers(self) -> list[LayerWeights]:
        return self.weights.layers

    @property
    def final_norm(self):
        return self.weights.final_norm       # (hidden,) or None

    @property
    def lm_head(self):
        return self.weights.lm_head          # (vocab, hidden) or None

    @property
    def nbytes(self) -> int:
        """Bytes of every array the model holds on its device: weights (the tier's copies too) and
        rotary tables."""
        return self.ops.weight_bytes(self.weights) + int(self.rope.cos.nbytes) + int(self.rope.sin.nbytes)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, logits_indices,
                layer_quant=None, layer_bounds=None):
        """Run T new tokens through the whole model; return logits only where they are needed.

        input_ids, positions: (T,) int; kv_cache: (layers, 2, blocks, kv_heads, block_size, head_dim)
        logits_indices: (N,) rows of the batch whose next token will be sampled
        layer_quant: for a compressed KV cache, layer_quant(i) -> kernels.layout.KVQuant
        layer_bounds: for block-sparse decode attention, layer_bounds(i) -> kernels.layout.BlockBounds
        returns (N, vocab) float32
        """
        return run_to_end(self.run(input_ids, positions, kv_cache, meta, logits_indices, layer_quant, layer_bounds))

    def run(self, inputs, positions, kv_cache, meta: AttentionMetadata, logits_indices,
            layer_quant=None, layer_bounds=None):
        """This worker's part of the forward pass, as a generator (see the module docstring).

        inputs: (T,) token ids on the first stage, else (T, hidden) the previous stage's output
        kv_cache: this worker's pool: its layers, its KV heads
        yields, at each all-reduce of a tensor-parallel shard: (T, hidden) this worker's partial
            sum; the driver sends back the sum over the group
        returns: (N, vocab) logits on the worker that holds the LM head, (T, hidden) hidden
            states on an earlier stage, None on the last stage's other ranks
        """
        ops, c, w = self.ops, self.config, self.weights
        split = self.shard.tp_size > 1
        hidden = lookup(w.embed, inputs) if self.shard.is_first_stage else inputs   # (T, hidden)
        plan = ops.plan_step(w, meta, kv_cache)        # how this step's work splits, for every layer
        fused = logits = None
        if not split:
            # every layer in one call where the tier has one (it may decline); the LM head in it too
            # when the logits wanted are every row's, in order (prompt chunks want only their last
            # rows', several samples of one prompt its last row more than once: those rows get the
            # head below, the same floats)
            rows = hidden.shape[0]
            with_head = (self.shard.is_last_stage and self.shard.has_lm_head and logits_indices.shape[0] == rows
                         and bool((logits_indices == ops.xp.arange(rows)).all()))
            fused = ops.decode_step(w, hidden, positions, kv_cache, plan, self.rope, self.scale, c.rms_norm_eps,
                                    c.num_attention_heads, with_head, layer_quant, layer_bounds)
        if fused is not None:
            hidden, logits = fused
        else:
            hidden = yield from self._layers(hidden, positions, kv_cache, meta, plan, layer_quant, layer_bounds)
        if not self.shard.is_last_stage:     # the next stage goes on from here
            return hidden
        if not self.shard.has_lm_head:       # the same hidden states as rank 0: nothing to add
            return None
        if logits is not None:               # (T, vocab): every row, as asked
            return logits
        if logits_indices.shape[0] == 0:      # a step of prompt chunks only: nothing to sample
            return ops.xp.empty((0, c.vocab_size), dtype=hidden.dtype)
        last = ops.rms_norm(hidden[logits_indices], w.final_norm, c.rms_norm_eps)    # (N, hidden)
        return ops.linear(last, w.lm_head, plan)                             # (N, vocab)

    def _layers(self, hidden, positions, kv_cache, meta: AttentionMetadata, plan, layer_quant, layer_bounds):
        """Every layer, one kernel call after another (a generator, as ``run``): hidden (T, hidden)
        in, the last layer's output returned. ``plan``: the step's, from ``ops.plan_step``."""
        ops, c = self.ops, self.config
        num_tokens = positions.shape[0]
        q_size, kv_size = c.q_size, c.kv_size
        split = self.shard.tp_size > 1
        cos, sin = self.rope.cos, self.rope.sin
        for i, layer in enumerate(self.weights.layers):
            x = ops.rms_norm(hidden, layer.input_norm, c.rms_norm_eps)          # (T, hidden)
            qkv = ops.linear(x, layer.qkv, plan)                                # (T, q + 2kv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias                                      # (T, q + 2kv)
            q = qkv[:, :q_size].reshape(num_tokens, c.num_attention_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, c.num_key_value_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, c.num_key_value_heads, c.head_dim)
            if layer.q_norm is not None:     # each head's vector (head_dim,) normalised on its own
                q = ops.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, c.rms_norm_eps).reshape(q.shape)
                k = ops.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, c.rms_norm_eps).reshape(k.shape)
            q = ops.rotary(q, positions, cos, sin)                              # (T, heads, head_dim)
            k = ops.rotary(k, positions, cos, sin)                              # (T, kv_heads, head_dim)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            # int8 / fp8 blocks (quantized on write, widened on read); block-sparse decode attention
            quant = layer_quant(i) if layer_quant else None
            bounds = layer_bounds(i) if layer_bounds else None
            if quant is not None and quant.calibrate:   # fp8's calculate_kv_scales, first step
                ops.calibrate_kv_scales(k, v, quant)
            ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, quant, bounds)
            attn = ops.paged_attention(q, k_cache, v_cache, plan, self.scale, quant, bounds,
                                       layer.window)                            # (T, heads, head_dim)
            out = ops.linear(attn.reshape(num_tokens, q_size), layer.o, plan)  # (T, hidden)
            if layer.o_bias is not None:
                out = out + layer.o_bias                                        # (T, hidden)
            if split:                        # all-reduce: every rank's heads' share of the output
                out = yield out
            hidden = hidden + out            # a new array: the MLP adds into its rows in place
            # The MLP a chunk of tokens at a time (a long prefill); a shard's all-reduce takes them all.
            chunk = max(num_tokens, 1) if split else MLP_CHUNK_TOKENS
            for a in range(0, max(num_tokens, 1), chunk):
                part = hidden[a:a + chunk]                                      # (C, hidden), a view
                x = ops.rms_norm(part, layer.post_norm, c.rms_norm_eps)
                gated = ops.silu_and_mul(ops.linear(x, layer.gate_up, plan))    # (C, ffn)
                out = ops.linear(gated, layer.down, plan)                       # (C, hidden)
                if split:                    # all-reduce: every rank's MLP columns' share
                    out = yield out
                part += out                                                     # into hidden's rows
        return hidden
