"""The fast CPU tier behind ``KernelOps`` (``kernels/ops.py``): ``FastOps``.

The OS idea is a device driver tuned for one machine, behind the same driver interface as the
plain one (``kernels/simple.py``): the model calls ``ops.linear``, ``ops.paged_attention``, ...
and never learns that a decode step ran as one persistent kernel, that a weight was multiplied by
its panels in huge pages, or that oneMKL took a prefill. ``FastOps`` holds its choices as
constructor arguments: ``tuning`` (every switch and threshold, ``tuning.py``), ``gemm`` (oneMKL,
``packed_gemm.py``, or None) and ``linear_paths`` (which engine each kind of step multiplies
with, ``linear_paths.py``).

``prepare`` wraps each linear weight in a ``FastLinear``: the (out, in) array and its second
copies (the panels for "numba", oneMKL's packing for "mkl"), and makes the persistent kernel's
view of the layers (``FastState.persistent``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from numba import get_num_threads

from ..layout import AttentionMetadata, BlockBounds, KVQuant
from ..ops import LayerWeights, ModelWeights, Rope, check_block_ids, check_slots, first_read_positions, window_first_read
from ..weight_formats import QuantizedWeight
from . import layer_stack, persistent_decode
from .attention import AttentionPlan, paged_attention, plan_attention
from .attention_registers import _vector_attention, vector_heads
from .attention_loop import _merge_partials
from .compile import never_raising
from .elementwise import _rms_norm, _rotary_inplace, _silu_and_mul, logsumexp, rms_norm, rotary, silu_and_mul
from .kv_write import _write_kv, calibrate_kv_scales, copy_blocks, swap_blocks, write_kv
from .linear import linear, pack_linears, quantized_linear
from .linear_paths import LinearPaths, step_kind
from .simd import SIMD_CACHE
from .tuning import DEFAULT_TUNING, QUERY_TILE, FastTuning


@dataclass(frozen=True)
class FastLinear:
    """A linear weight as the fast tier holds it: ``weight`` (out, in), the checkpoint's layout (a
    prefill's BLAS reads it), and its second copies: ``numba``, its panels (``panel_gemm.py``);
    ``mkl``, oneMKL's packed layout (``packed_gemm.py``); None where that path is not used."""

    weight: np.ndarray | None   # (out, in) float32; None for a quantized weight, whose panels are its only copy
    numba: object = None     # PanelWeight (a QuantPanelWeight for a quantized weight) or None
    mkl: object = None       # PackedWeight or None

    # the (out, in) weight's, so that a reader counting a model's weights need not know the tier
    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape if self.weight is not None else self.numba.shape

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as stored: float32's, or the quantized panels'."""
        return int((self.weight if self.weight is not None else self.numba).nbytes)

    @property
    def dtype(self):
        """float32: what its products give (and, but for "q4_1_a8"'s integer products, compute in)."""
        return np.dtype(np.float32)

    @property
    def fmt(self) -> str:
        """The weight's format (kernels/weight_formats.py): "float32", or its quantized panels'."""
        return "float32" if self.weight is not None else self.numba.fmt


@dataclass
class FastState:
    """The fast tier's per-model state, kept in ``ModelWeights.tier_state``."""

    persistent: object = None                       # layer_stack.LayerStack, or None
    quantized: bool = False                         # compact weights: their panels are the only copy
    paths_made: tuple[str, ...] = ()                # the copies prepare made: "numba", "mkl"
    steps_by_path: Counter = field(default_factory=Counter)   # (kind, path): the steps each took


@dataclass(frozen=True)
class FastPlan:
    """One step's plan: how attention splits, and which engine (``path``) multiplies its linears."""

    attention: AttentionPlan
    path: str                # "numba" or "mkl"
    num_blocks: int          # the pool's blocks its block tables were checked against


def persistent_kernel(heads: int, cache: bool = True, **replaced):
    """The persistent decode kernel bound to this tier's serial kernels (rotary and the float KV
    write never divide; SiLU already uses NumPy's error model) for ``heads`` query heads scored
    together; ``replaced``: other kernels in their place (a test's, uncached)."""
    kernels = dict(ATTENTION=never_raising(_vector_attention[heads].serial, SIMD_CACHE),
                   RMS_NORM=never_raising(_rms_norm.serial), ROTARY=_rotary_inplace.serial,
                   WRITE_KV=_write_kv.serial, SILU_AND_MUL=_silu_and_mul.serial, MERGE=never_raising(_merge_partials))
    return persistent_decode.compile_kernel(heads, cache and SIMD_CACHE, **{**kernels, **replaced})


# one copy for each number of heads scored together, compiled on first use
_PERSISTENT = {heads: persistent_kernel(heads) for heads in (1, 2, 3)}


def decode_layers(stack, hidden: np.ndarray, positions: np.ndarray, kv_cache: np.ndarray, plan: AttentionPlan,
                  scale: float, eps: float, cos: np.ndarray, sin: np.ndarray, num_heads: int,
                  with_head: bool = False, num_threads: int | None = None,
                  tuning: FastTuning = DEFAULT_TUNING) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A decode step (up to ``tuning.panel_max_rows`` tokens, decodes or short prompt chunks) through
    every layer in one persistent kernel (``persistent_decode.py``): hidden (T, h) -> ((T, h) the
    last layer's output, and with ``with_head`` the (T, vocab) logits after the final norm and the
    LM head, else None), the same floats as the layer-by-layer path; None when the step is not
    one it can run (more tokens, a prompt, a compressed or unusual pool, the persistent or the
    register kernel turned off in ``tuning``). ``num_threads``: the region's iterations."""
    if not (tuning.persistent_decode and tuning.vector_attention
            and persistent_decode.usable(stack, positions.shape[0], plan, kv_cache, tuning.panel_max_rows)):
        return None
    kernel = _PERSISTENT[vector_heads(num_heads // kv_cache.shape[3])]
    return persistent_decode.run(kernel, stack, hidden, positions, kv_cache, plan, scale, eps, cos, sin, num_heads,
                                 QUERY_TILE, get_num_threads() if num_threads is None else num_threads, with_head)


class FastOps:
    """The fast CPU tier: ``KernelOps`` with registers, panels, oneMKL and one persistent decode kernel."""

    name = "fast"
    xp = np

    def __init__(self, tuning: FastTuning = DEFAULT_TUNING, gemm=None,
                 linear_paths: LinearPaths | None = None) -> None:
        """``gemm``: a ``packed_gemm.PackedGemm`` (oneMKL), needed where ``linear_paths`` names "mkl";
        ``linear_paths`` default: our own kernels for every kind of step."""
        if not isinstance(tuning, FastTuning):
            raise TypeError(f"FastOps: tuning must be a FastTuning, got {type(tuning).__name__}")
        self.tuning = tuning
        self.linear_paths = linear_paths or LinearPaths.every("numba")
        if "mkl" in self.linear_paths.used() and gemm is None:
            raise ValueError(f"linear_paths ({self.linear_paths.describe()}) take oneMKL, but no gemm was given")
        self.gemm = gemm

    def with_paths(self, linear_paths: LinearPaths, gemm) -> FastOps:
        """The same tuning, with each kind of step's engine taken from ``linear_paths`` (and oneMKL,
        ``gemm``, where they name it)."""
        return FastOps(self.tuning, gemm, linear_paths)

    # ---------------------------------------------------------------- weights
    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """Every linear weight as a ``FastLinear`` with the copies its paths multiply: the panels,
        back to back in one region of huge pages (a decode step streams them all), and oneMKL's
        packing; and the persistent kernel's view of the layers (no weight copied)."""
        plain = [w for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        plain += [weights.lm_head] if weights.lm_head is not None else []
        kinds = [i % 4 for i in range(4 * len(weights.layers))] + ["head"] * (weights.lm_head is not None)
        copies = {}
        quantized = any(isinstance(w, QuantizedWeight) for w in plain)
        # compact weights: their panels serve every decode step, whichever engine the paths name
        # (oneMKL multiplies float32 only), and are their only copy: a prefill widens them (linear.py)
        for path in ("numba",) if quantized else self.linear_paths.used():
            copies[path] = pack_linears(plain, kinds) if path == "numba" else [self.gemm.pack_if_worth_it(w, self.tuning.min_packed_elements)
                                                                      for w in plain]
        wrapped = [FastLinear(None if isinstance(w, QuantizedWeight) else w, copies.get("numba", [None] * len(plain))[i],
                              copies.get("mkl", [None] * len(plain))[i]) for i, w in enumerate(plain)]
        layers = [dataclasses.replace(layer, qkv=wrapped[4 * i], o=wrapped[4 * i + 1], gate_up=wrapped[4 * i + 2],
                                      down=wrapped[4 * i + 3]) for i, layer in enumerate(weights.layers)]
        head = wrapped[-1] if weights.lm_head is not None else None
        state = FastState(paths_made=tuple(copies), quantized=quantized)
        # the persistent kernel runs the plain Llama layer only (no family options: docs/models.md)
        if "numba" in copies and all(layer.plain_llama for layer in weights.layers):
            panels = [LayerWeights(layer.input_norm, layer.qkv.numba, layer.o.numba, layer.post_norm,
                                   layer.gate_up.numba, layer.down.numba) for layer in layers]
            state.persistent = layer_stack.stack(panels, panels, weights.final_norm,
                                                 head.numba if head is not None else None, get_num_threads())
        return dataclasses.replace(weights, layers=layers, lm_head=head, tier_state=state)

    def weight_bytes(self, weights: ModelWeights) -> int:
        found = []
        for a in weights.arrays():
            found += [a.weight, a.numba, a.mkl] if isinstance(a, FastLinear) else [a]
        return sum(int(a.nbytes) for a in {id(a): a for a in found if a is not None}.values())

    # ---------------------------------------------------------------- one step
    def plan_step(self, weights: ModelWeights, meta: AttentionMetadata, kv_cache) -> FastPlan:
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[4]
        first_read = first_read_positions(weights, meta)     # (S,) with sliding windows, else None
        check_block_ids(meta.block_tables, meta.seq_lens, block_size, num_blocks, self.name, first_read)
        check_slots(meta.slot_mapping, num_blocks * block_size, self.name)
        kind = step_kind(meta.num_tokens)
        path = self.linear_paths.for_kind(kind)
        if isinstance(weights.tier_state, FastState):
            weights.tier_state.steps_by_path[kind, path] += 1
        persistent = self._persistent_may_run(weights.tier_state, path, meta, kv_cache)
        return FastPlan(plan_attention(meta, self.gemm if path == "mkl" else None, self.tuning, first_read,
                                       persistent, block_size), path, num_blocks)

    def _persistent_may_run(self, state, path: str, meta: AttentionMetadata, kv_cache) -> bool:
        """Whether this step may run in the persistent kernel, as far as the plan can tell (then
        ``decode_step`` and ``persistent_decode.usable`` decide: a block-sparse step or a
        tensor-parallel shard's still goes layer by layer, its attention split as planned)."""
        t = self.tuning
        return (t.persistent_decode and t.vector_attention and isinstance(state, FastState)
                and state.persistent is not None and (path == "numba" or state.quantized)
                and kv_cache.dtype == np.float32 and meta.num_tokens <= t.panel_max_rows)

    def decode_step(self, weights: ModelWeights, hidden, positions, kv_cache, plan: FastPlan, rope: Rope,
                    scale: float, eps: float, num_heads: int, with_head: bool, layer_quant=None, layer_bounds=None):
        state = weights.tier_state
        if (layer_quant is not None or layer_bounds is not None
                or not self._persistent_may_run(state, plan.path, plan.attention.meta, kv_cache)):
            return None
        return decode_layers(state.persistent, hidden, positions, kv_cache, plan.attention, scale, eps, rope.cos,
                             rope.sin, num_heads, with_head, tuning=self.tuning)

    def linear(self, x, w, plan: FastPlan | None = None):
        if isinstance(w, FastLinear):
            if w.weight is None:
                return quantized_linear(x, w.numba, self.tuning)
            packed = w.mkl if plan is not None and plan.path == "mkl" and w.mkl is not None else w.numba
            return linear(x, w.weight, packed, self.tuning)
        return linear(x, w, None, self.tuning)

    def rms_norm(self, x, weight, eps: float):
        return rms_norm(x, weight, eps, self.tuning)

    def rotary(self, x, positions, cos, sin):
        return rotary(x, positions, cos, sin, self.tuning)

    def silu_and_mul(self, gate_up):
        return silu_and_mul(gate_up, self.tuning)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, quant: KVQuant | None = None,
                 bounds: BlockBounds | None = None) -> None:
        check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[2], self.name)   # a few us: every call
        write_kv(k_cache, v_cache, k, v, slot_mapping, quant, bounds, self.tuning)

    def calibrate_kv_scales(self, k, v, quant: KVQuant) -> None:
        calibrate_kv_scales(k, v, quant)

    def paged_attention(self, q, k_cache, v_cache, plan, scale: float, quant: KVQuant | None = None,
                        bounds: BlockBounds | None = None, window: int = 0):
        if isinstance(plan, AttentionMetadata):      # a bare batch, outside a model's step
            check_block_ids(plan.block_tables, plan.seq_lens, k_cache.shape[2], k_cache.shape[0], self.name,
                            window_first_read(plan, window))
            plan = plan_attention(plan, None, self.tuning)
        elif isinstance(plan, FastPlan) and k_cache.shape[0] < plan.num_blocks:
            raise IndexError(f"the fast kernels: the step was planned over {plan.num_blocks} blocks, "
                             f"this pool has {k_cache.shape[0]}")
        return paged_attention(q, k_cache, v_cache, plan.attention if isinstance(plan, FastPlan) else plan,
                               scale, quant, bounds, window)

    def logsumexp(self, x):
        return logsumexp(x, self.tuning)

    # ---------------------------------------------------------------- the pool
    def swap_blocks(self, src, dst, block_mapping) -> None:
        swap_blocks(src, dst, block_mapping)

    def copy_blocks(self, kv_cache, block_mapping) -> None:
        copy_blocks(kv_cache, block_mapping)
