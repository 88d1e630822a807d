"""The layers as the persistent decode kernel reads them: a ``LayerStack``, made once per model.

The OS idea is a driver's descriptor table: the device is handed one table of its buffers at
setup (the layers' norms stacked, each product's panels as one (layers, panel bytes) array,
how many panels make one task), not a list of objects to walk each step. No weight is copied
where the layers' panels lie back to back, as ``linear.pack_linears`` lays them: the arrays are
views. The kernel's compiled code depends on the arrays' types only, not on how many layers
they hold: one compilation serves every model, and every pipeline stage, of one format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import get_num_threads

from .panel_gemm import PANEL, PanelWeight
from .quant_panels import QuantPanelWeight

# Bytes of a weight's panels in one product task, at most: small enough that the threads end a
# product together, large enough that claiming one (an atomic add) is rare: with AVX2's 16-wide
# float32 panels, 1 of a 576-wide weight or of a 1536-wide one (one panel, whatever its size).
# ``task_panels`` evens them out over the threads. 64 KB against 128: gguf_a8's steps of 1-8
# sequences 0.1-0.5 ms faster, gguf's no slower (docs/weights.md).
TASK_BYTES = 64 << 10


def task_panels(panels: int, panel_bytes: int, threads: int) -> int:
    """Panels in one task of a product over ``panels`` panels of ``panel_bytes`` each: each task
    at most TASK_BYTES (or one panel), the panels cut into about a multiple of ``threads`` tasks
    of as even a size as whole panels allow, so that the threads' own ranges of tasks
    (``persistent_decode._claim``) differ by at most a task. (Cut by a 128 KB TASK_BYTES alone,
    gguf_a8's 30-panel qkv was tasks of 11, 11 and 8 panels: 19 for one thread and 11 for the
    other, which then waited a third of the phase.)"""
    threads = max(1, threads)
    most = max(1, TASK_BYTES // panel_bytes)                  # panels a task may hold
    tasks = threads * -(-panels // (threads * most))           # enough of them, a multiple of threads
    return max(1, -(-panels // tasks))


@dataclass(frozen=True)
class LayerStack:
    """The layers' weights as the kernel reads them, made once per model (``stack``)."""

    input_norms: np.ndarray   # (L, hidden) float32
    post_norms: np.ndarray    # (L, hidden) float32
    qkv: np.ndarray           # (L, panels * hidden * PANEL) float32: each layer's flat panels of qkv
                              # (quantized: (L, panels * panel_bytes) uint8, ``quant_panels.py``)
    o: np.ndarray             # (L, panels * q_size * PANEL) the layers' flat panels of o_proj
    gate_up: np.ndarray       # (L, panels * hidden * PANEL) the layers' flat panels of gate/up
    down: np.ndarray          # (L, panels * ffn * PANEL) the layers' flat panels of down
    widths: np.ndarray        # (5,) int64 padded output features: qkv, o, gate_up, down, the LM head
    per_task: np.ndarray      # (5,) int64 panels in one task of each
    formats: np.ndarray       # (5,) int64 each one's format code (quant_panels.FORMAT_CODES; 0: float32)
    q_size: int
    kv_size: int
    ffn: int
    final_norm: np.ndarray    # (hidden,) float32 the model's last norm (zeros without a head)
    head: np.ndarray          # flat panels of the LM head, (panels * hidden * PANEL,); without one, (0,) of
                              # the qkv panels' dtype (a stage and a whole model whose head has that
                              # dtype, as every format's has: one compiled kernel)
    vocab_size: int           # the head's output features (0 without a head)

    @property
    def has_head(self) -> bool:
        return self.vocab_size > 0


def stack(layers, packed, final_norm: np.ndarray | None = None, head: PanelWeight | None = None,
          threads: int | None = None) -> LayerStack | None:
    """The LayerStack of a model's ``layers`` (LayerWeights) and ``packed`` (PackedLayer), with
    its ``final_norm`` and LM head's panels ``head`` where this worker holds them, its product
    tasks cut for ``threads`` threads (``task_panels``; None: Numba's); None where a layer's
    products have no float32 panels (oneMKL's packing, a GPU)."""
    kinds = ("qkv", "o", "gate_up", "down")
    panel_types = (PanelWeight, QuantPanelWeight)
    if not layers or not all(isinstance(getattr(p, kind), panel_types) for p in packed for kind in kinds):
        return None
    panels = [[getattr(p, kind) for p in packed] for kind in kinds]
    if any(len({(w.out_features, w.in_features, _format(w)) for w in ws}) != 1 for ws in panels):
        return None   # layers of different shapes or formats: not one (layers, bytes) array each
    first = [ws[0] for ws in panels]
    hidden = first[0].in_features
    if not isinstance(head, panel_types) or final_norm is None or head.in_features != hidden:
        head, final_norm = None, None
    weights = first + ([head] if head is not None else [])
    widths = np.array([_panels(w) * PANEL for w in weights] + [0] * (head is None), np.int64)
    threads = get_num_threads() if threads is None else threads
    per_task = np.array([task_panels(_panels(w), w.nbytes // _panels(w), threads) for w in weights]
                        + [1] * (head is None), np.int64)
    formats = np.array([_format(w) for w in weights] + [0] * (head is None), np.int64)
    qkv, o, _, down = first
    kv_size = (qkv.out_features - o.in_features) // 2
    return LayerStack(np.stack([layer.input_norm for layer in layers]).astype(np.float32),
                      np.stack([layer.post_norm for layer in layers]).astype(np.float32),
                      *(_rows([w.data.reshape(-1) for w in ws]) for ws in panels),
                      widths, per_task, formats, o.in_features, kv_size, down.in_features,
                      np.zeros(hidden, np.float32) if final_norm is None else np.array(final_norm, np.float32),
                      np.zeros(0, first[0].data.dtype) if head is None else head.data.reshape(-1),
                      0 if head is None else head.out_features)


def _rows(flat: list[np.ndarray]) -> np.ndarray:
    """The layers' flat panels (each (n,), one dtype) as one (L, n) C-contiguous array: a view
    where they lie back to back in memory (``pack_linears``' region), else a copy."""
    first, n = flat[0], flat[0].shape[0]
    step = n * first.itemsize
    if all(a.flags.c_contiguous and a.ctypes.data == first.ctypes.data + i * step for i, a in enumerate(flat)):
        return np.lib.stride_tricks.as_strided(first, (len(flat), n), (step, first.itemsize))
    return np.stack(flat)                               # (L, n) panels made one by one (tests): a copy


def _panels(w) -> int:
    return w.panels if isinstance(w, QuantPanelWeight) else w.data.shape[0]


def _format(w) -> int:
    return w.code if isinstance(w, QuantPanelWeight) else 0
