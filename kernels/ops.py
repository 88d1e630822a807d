"""The kernel interface: what the model and the engine may ask of any tier of kernels.

The OS idea is the driver interface: the kernel (here, the model and the engine) is written
against one set of calls, and each device driver (a tier) implements them its own way. Three
tiers implement ``KernelOps``:

- ``kernels/simple.py``    the plain tier: one readable function per operation (tutorial 04);
- ``kernels/fast/``        the CPU speed work: registers, panels, oneMKL, one persistent decode kernel;
- ``kernels/cuda.py``      CuPy RawKernel launchers (or the CPU harness that runs their C sources).

``EngineConfig.kernels`` picks the CPU tier ("simple" or "fast"); on a GPU the CUDA tier runs.
The model holds its weights in the checkpoint's layout (``ModelWeights``) and hands them to
``ops.prepare`` once: a tier may add its own copies (panels, oneMKL's packing, huge pages, the
persistent kernel's stack) and gives back a ``ModelWeights`` whose linear weights are whatever
its ``linear`` multiplies by. A step begins with ``ops.plan_step``, whose plan every later call of
the step receives. Nothing above this module names a tier's tricks.

Shapes: T tokens of the step, H query heads, KVH KV heads, D head_dim, N blocks in the pool,
B block size, S sequences, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from .layout import AttentionMetadata, BlockBounds, KVQuant

LayerQuant = Callable[[int], KVQuant]        # layer index -> that layer's scales (a compressed cache)
LayerBounds = Callable[[int], BlockBounds]   # layer index -> that layer's key bounds (block-sparse decode)


@dataclass
class LayerWeights:
    """One decoder layer's weights. Linear weights are (out, in), the checkpoint's layout, until a
    tier's ``prepare`` swaps in what its ``linear`` reads (the same values, maybe a second copy)."""

    input_norm: Any    # (hidden,)
    qkv: Any           # (q_size + 2 * kv_size, hidden)  rows [q | k | v]
    o: Any             # (hidden, q_size)
    post_norm: Any     # (hidden,)
    gate_up: Any       # (2 * ffn, hidden)  rows [gate | up]
    down: Any          # (hidden, ffn)
    # the options of the families (model/config.py), None / 0 where the layer has none
    qkv_bias: Any = None   # (q_size + 2 * kv_size,) Qwen2
    o_bias: Any = None     # (hidden,)
    q_norm: Any = None     # (D,) Qwen3: RMSNorm over each head's q, and k, before RoPE
    k_norm: Any = None     # (D,)
    window: int = 0        # sliding window: a token at p reads positions p - window + 1 .. p; 0 = all

    @property
    def plain_llama(self) -> bool:
        """No family option on: the layer a tier's fused kernels were written for."""
        return (self.qkv_bias is None and self.o_bias is None and self.q_norm is None and self.k_norm is None
                and self.window == 0)


@dataclass
class ModelWeights:
    """Everything a worker's forward pass reads. ``embed`` is None on a pipeline stage that neither
    embeds nor holds a tied head; ``final_norm`` and ``lm_head`` are None off the head's worker."""

    embed: Any                           # (vocab, hidden) or None
    layers: list[LayerWeights]
    final_norm: Any = None               # (hidden,) or None
    lm_head: Any = None                  # (vocab, hidden) or None; tied: the embedding itself
    tier_state: Any = None               # a tier's own per-model state (``prepare`` sets it)

    def arrays(self) -> list:
        """Every weight held, each once (a tied head is the embedding): arrays, or a tier's wrappers."""
        found = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            found += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down,
                      layer.qkv_bias, layer.o_bias, layer.q_norm, layer.k_norm]
        return list({id(a): a for a in found if a is not None}.values())


@dataclass(frozen=True)
class Rope:
    """The rotary tables: cos, sin (max_positions, D // 2) float32, on the tier's device."""

    cos: Any
    sin: Any


@runtime_checkable
class KernelOps(Protocol):
    """The calls a tier provides. Arrays are numpy (CPU tiers) or cupy (the CUDA tier), ``xp``."""

    name: str          # "simple", "fast" or "cuda"
    xp: Any            # the array module: numpy or cupy

    # ---------------------------------------------------------------- weights, once per model
    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """The tier's copy of a model's weights (values unchanged; layouts and copies the tier's)."""

    def weight_bytes(self, weights: ModelWeights) -> int:
        """Bytes the prepared weights hold on the device, second copies included."""

    # ---------------------------------------------------------------- one step
    def plan_step(self, weights: ModelWeights, meta: AttentionMetadata, kv_cache) -> Any:
        """How this step's work splits (attention's tiles, which copy of the weights), decided once
        and passed to every call of the step. kv_cache (L, 2, N, KVH, B, D): the pool it reads;
        a block id or slot outside it is an IndexError here, before any kernel runs."""

    def decode_step(self, weights: ModelWeights, hidden, positions, kv_cache, plan, rope: Rope, scale: float,
                    eps: float, num_heads: int, with_head: bool, layer_quant: LayerQuant | None = None,
                    layer_bounds: LayerBounds | None = None) -> tuple[Any, Any] | None:
        """Every layer of a step in one call, or None: the tier declines and the model goes layer by
        layer. hidden (T, hidden) -> ((T, hidden), (T, vocab) logits with ``with_head``, else None).
        kv_cache (L, 2, N, KVH, B, D); the step's K and V are written at meta.slot_mapping."""

    def linear(self, x, w, plan) -> Any:
        """x (T, in) @ w.T: (T, out); w is a prepared linear weight of (out, in)."""

    def rms_norm(self, x, weight, eps: float) -> Any:
        """x (T, hidden) / rms(x) * weight (hidden,): (T, hidden)."""

    def rotary(self, x, positions, cos, sin) -> Any:
        """Rotate-half RoPE of x (T, heads, D) at positions (T,) -> (T, heads, D). A tier may
        rotate x in place and return it (the CUDA tier does: q and k, views of the fused qkv
        output, are rotated where they lie), so x is not read again after this."""

    def silu_and_mul(self, gate_up) -> Any:
        """gate_up (T, 2 * ffn) = [gate | up] -> silu(gate) * up: (T, ffn)."""

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, quant: KVQuant | None = None,
                 bounds: BlockBounds | None = None) -> None:
        """k, v (T, KVH, D) into k_cache, v_cache (N, KVH, B, D) at slots (T,) (-1: not written);
        ``quant``: as int8 / fp8 codes and their scales; ``bounds``: each block's key min / max."""

    def calibrate_kv_scales(self, k, v, quant: KVQuant) -> None:
        """fp8's layer scales from this step's k, v (T, KVH, D)."""

    def paged_attention(self, q, k_cache, v_cache, plan, scale: float, quant: KVQuant | None = None,
                        bounds: BlockBounds | None = None, window: int = 0) -> Any:
        """Causal attention of q (T, H, D) over each token's context through its block table:
        (T, H, D). ``bounds``: block-sparse decode attention (keep ``bounds.keep`` blocks).
        ``window``: a query at position p reads only positions max(0, p - window + 1) .. p (0: all);
        the table's entries for blocks wholly before that may be -1 (freed)."""

    # ---------------------------------------------------------------- the pool (DMA)
    def swap_blocks(self, src, dst, block_mapping) -> None:
        """Blocks mapping[:, 0] of src to mapping[:, 1] of dst, every layer: (L, 2, N, ...) pools."""

    def copy_blocks(self, kv_cache, block_mapping) -> None:
        """Copy-on-write inside one pool."""


def check_block_ids(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int, num_blocks: int,
                    tier: str, first_read: np.ndarray | None = None) -> None:
    """The blocks each sequence's context reads, (S, max_blocks) tables over (S,) lengths, must lie in
    [0, num_blocks): a clear error at the ops boundary, never a read or write out of the pool.
    ``first_read`` (S,): the first position any layer's window still reads (a sliding-window model),
    whose earlier blocks may be -1, freed as they slid out."""
    if block_tables.size == 0 or seq_lens.size == 0:
        return
    used = -(-np.asarray(seq_lens, np.int64) // block_size)                  # (S,) blocks each context reads
    if int(used.max()) > block_tables.shape[1]:
        raise IndexError(f"the {tier} kernels: a context of {int(seq_lens.max())} tokens needs {int(used.max())} "
                         f"blocks, but the block tables hold {block_tables.shape[1]}")
    index = np.arange(block_tables.shape[1])[None, :]                      # (1, max_blocks)
    live = index < used[:, None]                                           # (S, max_blocks)
    if first_read is not None:
        live &= index >= (np.asarray(first_read, np.int64) // block_size)[:, None]
    ids = block_tables[live]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise IndexError(f"the {tier} kernels: block id {bad} in a block table is outside the pool's "
                         f"{num_blocks} blocks")


def check_slots(slot_mapping: np.ndarray, num_slots: int, tier: str) -> None:
    """Slots (T,) must be -1 (not written) or in [0, num_slots): a clear error, never a stray write."""
    if slot_mapping.size and (int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots):
        bad = int(slot_mapping.min()) if int(slot_mapping.min()) < -1 else int(slot_mapping.max())
        raise IndexError(f"the {tier} kernels: slot {bad} is outside the pool's {num_slots} slots")


def first_read_positions(weights: ModelWeights, meta: AttentionMetadata) -> np.ndarray | None:
    """(S,) the first position any layer still reads for each sequence of the step, when every layer
    slides (blocks before it may have been freed, -1 in the tables); None when some layer reads all."""
    windows = [layer.window for layer in weights.layers]
    if not windows or not all(windows):
        return None
    return window_first_read(meta, max(windows))


def window_first_read(meta: AttentionMetadata, window: int) -> np.ndarray | None:
    """(S,) the first position a layer of sliding window ``window`` reads in each sequence: its first
    query's position - window + 1 (at least 0); None for full attention (window 0)."""
    if not window:
        return None
    first_query = meta.seq_lens.astype(np.int64) - np.diff(meta.query_start_loc).astype(np.int64)   # (S,)
    return np.maximum(first_query - window + 1, 0)
