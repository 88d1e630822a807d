"""The Llama forward pass over a flattened batch of tokens: the "process" the engine runs.

All sequences of a step are concatenated into one batch of T tokens, so every
weight is used in exactly one matrix product per step, whatever the mix of
prompts and decodes. Only attention needs to know which token belongs to which
sequence, and it learns that from the explicit AttentionMetadata.

``ops`` is the backend's kernel namespace (``kernels.cpu``, or ``kernels.cuda.CudaOps`` on a GPU):
it provides ``xp`` (numpy or cupy), ``linear``, ``rms_norm``, ``rotary``, ``silu_and_mul``,
``write_kv``, ``plan_attention`` and ``paged_attention``.

A worker of a tensor- or pipeline-parallel engine holds a shard (``model/sharding.py``):
``run`` is then a generator that stops at each all-reduce (twice per layer), hands out its
partial sum and waits for the total, so one code path serves one worker, workers in one
process driven in lock step, and workers that all-reduce over NCCL.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..kernels.layout import AttentionMetadata
from ..kernels.linear_paths import LinearPaths, step_kind
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


@dataclass
class LayerWeights:
    input_norm: np.ndarray  # (hidden,)
    qkv: np.ndarray         # (q_size + 2 * kv_size, hidden)  rows [q | k | v], (out, in) as stored
    o: np.ndarray           # (hidden, q_size)
    post_norm: np.ndarray   # (hidden,)
    gate_up: np.ndarray     # (2 * ffn, hidden)  rows [gate | up]
    down: np.ndarray        # (hidden, ffn)


@dataclass(frozen=True)
class PackedLayer:
    """A layer's linear weights in a layout made for their products (``kernels/packed_gemm.py``,
    ``kernels/panel_gemm.py``), or None each."""
    qkv: object = None
    o: object = None
    gate_up: object = None
    down: object = None


@dataclass(frozen=True)
class LinearCopies:
    """Every linear weight's second copy for one engine of ``kernels/linear_paths.py``: the
    panels ("numba") or oneMKL's packed layout ("mkl"), a PackedLayer a layer and the LM head's;
    and what multiplies a prompt's attention on that engine (oneMKL's sgemm, or None: ours)."""
    layers: tuple[PackedLayer, ...]
    lm_head: object = None
    gemm: object = None


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
                       "(engine/executor.py)")


class LlamaModel:
    def __init__(self, config: LlamaConfig, tensors: dict[str, np.ndarray], ops,
                 dtype=np.float32, max_positions: int | None = None, shard: ShardSpec | None = None,
                 gemm=None, linear_paths: LinearPaths | None = None) -> None:
        """``config`` and ``tensors`` are the worker's own (``sharding.shard_config`` /
        ``shard_tensors``) when ``shard`` says it holds a slice of a bigger model.
        ``linear_paths`` (``kernels/linear_paths.py``): which engine multiplies each kind of
        step; default: our own kernels for every step. ``gemm``: a
        ``kernels.packed_gemm.PackedGemm`` (CPU, oneMKL installed), needed where a path is
        "mkl": every linear weight and the LM head get its packed copy, packed once here. Where
        a path is "numba" they get ``ops.pack_linears``' copy (the CPU's panels, or None on the
        GPU). A plan that mixes the two holds both copies."""
        self.config = config
        self.shard = shard or ShardSpec()
        self.ops = ops
        xp = ops.xp
        c = config
        h, q, kv, ffn = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size

        def put(array: np.ndarray) -> np.ndarray:
            return xp.asarray(np.ascontiguousarray(array, dtype=dtype))

        tied = c.tie_word_embeddings or "lm_head.weight" not in tensors
        needs_embed = self.shard.is_first_stage or (self.shard.has_lm_head and tied)
        self.embed = put(_get(tensors, "model.embed_tokens.weight", (c.vocab_size, h))) if needs_embed else None  # (vocab, hidden)
        # Every linear weight stays (out, in), the checkpoint's layout: ops.linear reads a
        # weight row per output feature. Tied, the head is the embedding itself.
        self.lm_head = self.final_norm = None
        if self.shard.has_lm_head:
            self.lm_head = self.embed if tied else put(_get(tensors, "lm_head.weight", (c.vocab_size, h)))  # (vocab, hidden)
            self.final_norm = put(_get(tensors, "model.norm.weight", (h,)))
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            # HF stores linear weights as (out, in); q/k/v and gate/up are fused by stacking
            # their rows, so each step is one product per fused weight.
            qkv = np.concatenate([_get(tensors, p + "self_attn.q_proj.weight", (q, h)),
                                  _get(tensors, p + "self_attn.k_proj.weight", (kv, h)),
                                  _get(tensors, p + "self_attn.v_proj.weight", (kv, h))])
            gate_up = np.concatenate([_get(tensors, p + "mlp.gate_proj.weight", (ffn, h)),
                                      _get(tensors, p + "mlp.up_proj.weight", (ffn, h))])
            self.layers.append(LayerWeights(
                input_norm=put(_get(tensors, p + "input_layernorm.weight", (h,))),
                qkv=put(qkv),
                o=put(_get(tensors, p + "self_attn.o_proj.weight", (h, q))),
                post_norm=put(_get(tensors, p + "post_attention_layernorm.weight", (h,))),
                gate_up=put(gate_up),
                down=put(_get(tensors, p + "mlp.down_proj.weight", (h, ffn))),
            ))
        # A second copy of each linear weight, laid out for its products, sits beside the
        # (out, in) arrays, which stay what prefill's BLAS, the tutorials, the sharding and
        # the GPU read: for the "mkl" path oneMKL's packed layout (~1.5x the weights' size more
        # resident memory, docs/kernels.md); for the "numba" path the CPU's panels for decode
        # steps (``ops.pack_linears``, kernels/panel_gemm.py: the weights' size again; the GPU
        # makes none), every weight's back to back in one region of huge pages
        # (kernels/huge_pages.py), which a decode step streams through.
        if gemm is not None and linear_paths is None:
            raise ValueError("a gemm was given without linear_paths: say which kinds of step take it "
                             "(kernels/linear_paths.py)")
        self.linear_paths = linear_paths or LinearPaths.every("numba")
        if "mkl" in self.linear_paths.used() and gemm is None:
            raise ValueError(f"linear_paths ({self.linear_paths.describe()}) take oneMKL, but no gemm was given")
        self.gemm = gemm                     # also multiplies a prompt's attention on the "mkl" path
        weights = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        weights += [self.lm_head] if self.lm_head is not None else []
        self.copies: dict[str, LinearCopies] = {}
        self.steps_by_path: Counter[tuple[str, str]] = Counter()   # (kind, engine): the steps each took
        for path in self.linear_paths.used():
            packed = ops.pack_linears(weights) if path == "numba" else [gemm.pack_if_worth_it(w) for w in weights]
            layers = tuple(PackedLayer(*packed[4 * i:4 * i + 4]) for i in range(len(self.layers)))
            head = packed[-1] if self.lm_head is not None else None
            self.copies[path] = LinearCopies(layers, head, gemm if path == "mkl" else None)
        # A decode step on the "numba" path runs every layer in one persistent kernel where the
        # ops have one (the CPU's, on the panels: kernels/persistent_decode.py); views, no weight copied.
        make_stack = getattr(ops, "persistent_layers", None)
        panels = self.copies.get("numba")
        self.persistent = (make_stack(self.layers, panels.layers, self.final_norm, panels.lm_head)
                           if make_stack and panels is not None else None)
        cos, sin = rope_tables(c, max_positions or c.max_position_embeddings)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)  # (max_positions, head_dim // 2)
        self.scale = 1.0 / float(np.sqrt(c.head_dim))

    @property
    def nbytes(self) -> int:
        """Bytes of every array the model holds on its device: weights and rotary tables."""
        arrays = [self.embed, self.lm_head, self.final_norm, self.cos, self.sin]
        for layer in self.layers:
            arrays += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        for copies in self.copies.values():
            arrays += [copies.lm_head] + [p for packed in copies.layers for p in (packed.qkv, packed.o,
                                                                                  packed.gate_up, packed.down)]
        return sum(int(a.nbytes) for a in {id(a): a for a in arrays if a is not None}.values())   # a tied head once

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
        ops, c = self.ops, self.config
        split = self.shard.tp_size > 1
        hidden = self.embed[inputs] if self.shard.is_first_stage else inputs   # (T, hidden)
        kind = step_kind(positions.shape[0])
        path = self.linear_paths.for_kind(kind)      # this kind of step's engine, and its copies
        self.steps_by_path[kind, path] += 1
        copies = self.copies[path]
        plan = ops.plan_attention(meta, copies.gemm)   # how attention splits this batch, for every layer
        fused = logits = None
        if (copies is self.copies.get("numba") and self.persistent is not None and not split
                and layer_quant is None and layer_bounds is None):
            # a decode step (a long prompt, or more tokens than the panels take, and ops declines);
            # the LM head in the kernel too when the logits wanted are every row's, in order (prompt
            # chunks want only their last rows', several samples of one prompt its last row more
            # than once: those rows get the head below, as layer by layer, the same floats)
            rows = hidden.shape[0]
            with_head = (self.shard.is_last_stage and self.shard.has_lm_head and logits_indices.shape[0] == rows
                         and bool((logits_indices == np.arange(rows)).all()))
            fused = ops.decode_layers(self.persistent, hidden, positions, kv_cache, plan, self.scale,
                                      c.rms_norm_eps, self.cos, self.sin, c.num_attention_heads, with_head)
        if fused is not None:                # every layer in one kernel: the same floats
            hidden, logits = fused
        else:
            hidden = yield from self._layers(hidden, positions, kv_cache, meta, plan, copies.layers, layer_quant,
                                             layer_bounds)
        if not self.shard.is_last_stage:     # the next stage goes on from here
            return hidden
        if not self.shard.has_lm_head:       # the same hidden states as rank 0: nothing to add
            return None
        if logits is not None:               # (T, vocab): every row, as asked
            return logits
        if logits_indices.shape[0] == 0:      # a step of prompt chunks only: nothing to sample
            return ops.xp.empty((0, c.vocab_size), dtype=self.lm_head.dtype)
        last = ops.rms_norm(hidden[logits_indices], self.final_norm, c.rms_norm_eps)  # (N, hidden)
        return ops.linear(last, self.lm_head, copies.lm_head)                 # (N, vocab)

    def _layers(self, hidden, positions, kv_cache, meta: AttentionMetadata, plan, packed_layers, layer_quant,
                layer_bounds):
        """Every layer, one kernel call after another (a generator, as ``run``): hidden (T, hidden)
        in, the last layer's output returned. ``packed_layers``: the step's path's copies."""
        ops, c = self.ops, self.config
        num_tokens = positions.shape[0]
        q_size, kv_size = c.q_size, c.kv_size
        split = self.shard.tp_size > 1
        for i, (layer, packed) in enumerate(zip(self.layers, packed_layers)):
            x = ops.rms_norm(hidden, layer.input_norm, c.rms_norm_eps)          # (T, hidden)
            qkv = ops.linear(x, layer.qkv, packed.qkv)                          # (T, q + 2kv)
            q = qkv[:, :q_size].reshape(num_tokens, c.num_attention_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, c.num_key_value_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, c.num_key_value_heads, c.head_dim)
            q = ops.rotary(q, positions, self.cos, self.sin)                    # (T, heads, head_dim)
            k = ops.rotary(k, positions, self.cos, self.sin)                    # (T, kv_heads, head_dim)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            if layer_quant is None and layer_bounds is None:
                ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
                attn = ops.paged_attention(q, k_cache, v_cache, plan, self.scale)   # (T, heads, head_dim)
            else:   # int8 / fp8 blocks (quantized on write, widened on read), block-sparse decode
                quant = layer_quant(i) if layer_quant else None
                bounds = layer_bounds(i) if layer_bounds else None
                if quant is not None and quant.calibrate:   # fp8's calculate_kv_scales, first step
                    ops.calibrate_kv_scales(k, v, quant)
                ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, quant, bounds)
                attn = ops.paged_attention(q, k_cache, v_cache, plan, self.scale, quant, bounds)
            out = ops.linear(attn.reshape(num_tokens, q_size), layer.o, packed.o)   # (T, hidden)
            if split:                        # all-reduce: every rank's heads' share of the output
                out = yield out
            hidden = hidden + out            # a new array: the MLP adds into its rows in place
            # The MLP a chunk of tokens at a time (a long prefill); a shard's all-reduce takes them all.
            chunk = max(num_tokens, 1) if split else MLP_CHUNK_TOKENS
            for a in range(0, max(num_tokens, 1), chunk):
                part = hidden[a:a + chunk]                                      # (C, hidden), a view
                x = ops.rms_norm(part, layer.post_norm, c.rms_norm_eps)
                gated = ops.silu_and_mul(ops.linear(x, layer.gate_up, packed.gate_up))   # (C, ffn)
                out = ops.linear(gated, layer.down, packed.down)                # (C, hidden)
                if split:                    # all-reduce: every rank's MLP columns' share
                    out = yield out
                part += out                                                     # into hidden's rows
        return hidden
