"""A step's bound: the machine's limits, probed, and the bytes and arithmetic a step must do.

The analogy is the machine's data sheet: what the hardware can do at all, measured (a large
square matrix product for the float32 arithmetic peak, the "q4_1_a8" products' inner step for
the integer peak, a streaming sum over more memory than the last-level cache for the read
bandwidth), and what a step of the model must do, counted from its shapes: the bytes it must
read and the FLOPs it must do. ``bench roofline`` (``roofline.py``) sets each timed step
against the bound they give,

    bound = max(bytes / bandwidth, float32 FLOPs / matmul peak + integer ops / integer peak),

and ``workload_floor`` a whole workload (``bench throughput``, ``single-stream``, ``prefill``).
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..engine.llm_engine import LLMEngine

# --------------------------------------------------------------------------- the machine


def last_level_cache_bytes() -> int:
    """The largest CPU cache, from sysfs (64 MiB when it cannot be read)."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=64 << 20)


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square float32 product through numpy's BLAS (best of ``repeats``)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)   # (n, n)
    b = rng.standard_normal((n, n), dtype=np.float32)   # (n, n)
    out = np.empty((n, n), dtype=np.float32)            # (n, n)
    np.matmul(a, b, out=out)
    best = min(_timed(lambda: np.matmul(a, b, out=out)) for _ in range(repeats))
    return 2.0 * n ** 3 / best


def integer_peak(repeats: int = 3, reps: int = 1_000_000) -> float:
    """Integer ops/s (a multiply-add two) of the "q4_1_a8" products' inner step, every operand in
    L1, on all the kernels' threads (``quant_a8.dot_peak_probe``; best of ``repeats``)."""
    from numba import get_num_threads  # noqa: PLC0415

    from ..kernels.fast.quant_a8 import LANES, dot_peak_probe  # noqa: PLC0415 (compiles on first use)

    codes, x = np.arange(16 * 32 * LANES, dtype=np.uint8), np.ones(16, np.float32)   # (16 x 32 LANES,), (16,)
    threads = get_num_threads()
    dot_peak_probe(codes, x, 1, threads)
    best = min(_timed(lambda: dot_peak_probe(codes, x, reps, threads)) for _ in range(repeats))
    return 2.0 * 128 * LANES * reps * threads / best


def read_bandwidth(nbytes: int | None = None, repeats: int = 3) -> float:
    """Bytes/s of a streaming sum over ``nbytes`` (default: 4x the last-level cache, at least
    1 GiB), on all the cores the kernels use (best of ``repeats``)."""
    from ..kernels.fast.elementwise import stream_sum  # noqa: PLC0415  (Numba compiles on first use)

    nbytes = nbytes or max(4 * last_level_cache_bytes(), 1 << 30)
    data = np.ones(nbytes // 4, dtype=np.float32)       # (nbytes / 4,)
    stream_sum(data)
    best = min(_timed(lambda: stream_sum(data)) for _ in range(repeats))
    return data.nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --------------------------------------------------------------------------- a step's cost


def step_cost(engine: LLMEngine, query_lens: list[int], context_lens: list[int], num_logits: int) -> dict:
    """Bytes a step must move and FLOPs it must do, counted from the model's shapes.

    query_lens[i] new tokens of sequence i attend to context_lens[i] tokens (the new ones
    included, causally); num_logits rows go through the LM head.
    """
    c = engine.model_config
    layer_params = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                    + 3 * c.hidden_size * c.intermediate_size)
    head_params = c.hidden_size * c.vocab_size
    weight_bytes = stored_weight_bytes(engine)      # every weight read once, in the bytes it is stored in
    kv_item = engine.cache.kv_cache.dtype.itemsize
    kv_token = c.num_hidden_layers * 2 * c.kv_size * kv_item                # K and V, all layers
    tokens = sum(query_lens)
    kv_read = sum(context_lens) * kv_token
    kv_written = tokens * kv_token
    logits_bytes = 4 * num_logits * c.vocab_size
    # attention: q.k and p.v for every (query, visible key) pair, every head and layer
    pairs = sum(sum(ctx - q + i + 1 for i in range(q)) for q, ctx in zip(query_lens, context_lens))
    attn_flops = 4 * pairs * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    matmul_flops = 2 * tokens * c.num_hidden_layers * layer_params + 2 * num_logits * head_params
    layer_int, head_int = integer_params(engine)
    return {"bytes": weight_bytes + kv_read + kv_written + logits_bytes, "weight_bytes": weight_bytes,
            "kv_bytes": kv_read + kv_written, "flops": matmul_flops + attn_flops,
            "matmul_flops": matmul_flops, "attention_flops": attn_flops,
            "integer_ops": 2 * tokens * c.num_hidden_layers * layer_int + 2 * num_logits * head_int}


def integer_params(engine: LLMEngine) -> tuple[int, int]:
    """(a layer's, the head's) weights whose products are integer ones, x rounded to int8
    ("q4_1_a8"): their arithmetic is set against ``integer_peak``, the rest against the matmul peak."""
    from ..kernels.weight_formats import ROUNDS_ACTIVATIONS  # noqa: PLC0415

    model = engine.model
    if model is None or engine.parallel_config.world_size > 1 or model.lm_head is None:
        return 0, 0

    def integer(w) -> bool:
        return getattr(w, "fmt", "float32") in ROUNDS_ACTIVATIONS

    layer = model.layers[0]
    return (sum(w.size for w in (layer.qkv, layer.o, layer.gate_up, layer.down) if integer(w)),
            model.lm_head.size if integer(model.lm_head) else 0)


def compute_seconds(flops: float, integer_ops: float, machine: dict) -> float:
    """``flops`` (integer_ops of them integer) at the machine's peaks."""
    peak = machine.get("integer_peak") or machine["matmul_peak"]
    return (flops - integer_ops) / machine["matmul_peak"] + integer_ops / peak


def stored_weight_bytes(engine: LLMEngine) -> int:
    """Bytes a step reads to multiply every linear weight and the LM head once: each weight as
    the tier stores it (one copy: float32, bfloat16, int8 or GGUF blocks, docs/weights.md)."""
    model = engine.model
    if model is None or engine.parallel_config.world_size > 1 or model.lm_head is None:
        # workers elsewhere, or this one holding a shard: float32, counted from the shapes
        c = engine.model_config
        layer_params = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                        + 3 * c.hidden_size * c.intermediate_size)
        return 4 * (c.num_hidden_layers * layer_params + c.hidden_size * c.vocab_size)
    linears = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return int(sum(w.nbytes for w in linears + [model.lm_head]))


def bound(cost: dict, machine: dict) -> float:
    return max(cost["bytes"] / machine["read_bandwidth"],
               compute_seconds(cost["flops"], cost.get("integer_ops", 0), machine))


def serial_bound(cost: dict, machine: dict) -> float:
    """The step's bound when attention cannot run in the shadow of the matrix products: the
    products' own bound (their weights and logits read, or their FLOPs), plus attention's
    (its K/V, read and written, at the bandwidth, or its FLOPs at the peak). On a machine
    with few cores every core runs either a product or attention at any moment, and a
    product of many rows keeps its core's arithmetic busy, not the memory: there the two add
    up (a product's loop could ask for attention's K/V as it runs; measured on two cores, no
    clear gain, docs/benchmarks.md). ``bound`` assumes they overlap perfectly."""
    bandwidth, peak = machine["read_bandwidth"], machine["matmul_peak"]
    product_bytes = cost["bytes"] - cost["kv_bytes"]                    # weights and logits
    products = max(product_bytes / bandwidth,
                   compute_seconds(cost["matmul_flops"], cost.get("integer_ops", 0), machine))
    attention = max(cost["kv_bytes"] / bandwidth, cost["attention_flops"] / peak)
    return products + attention


def _set_bounds(row: dict, machine: dict) -> None:
    """A timed row's bound, its serial bound and the step's ratio to each."""
    row["bound_s"] = bound(row, machine)
    row["ratio"] = row["step_s"] / row["bound_s"]
    row["serial_bound_s"] = serial_bound(row, machine)
    row["serial_ratio"] = row["step_s"] / row["serial_bound_s"]


def workload_floor(engine: LLMEngine, prompt_lens: list[int], output_len: int, machine: dict) -> dict:
    """The least time any engine could take for a whole workload on this machine, in the
    model's precision: its FLOPs at the matmul peak, or, if longer, the bytes it must read at
    the read bandwidth, whichever is larger (a lower bound: a real run also pays for the
    phases in which one limit idles while the other works).

    Each prompt is prefilled once (its last position through the LM head: the first output
    token), then each later token is one query over the prompt and the tokens before it. The
    bytes: the weights once for each of output_len steps (no token can be made before the one
    it follows), and every K and V read and written. That is the floor of an engine that makes
    one token per sequence a step; speculative decoding, which checks several drafted tokens
    with one read of the weights, can go under its bytes (not its FLOPs).
    """
    query_lens, context_lens = [], []
    for prompt_len in prompt_lens:
        query_lens.append(prompt_len)                 # the prefill
        context_lens.append(prompt_len)
        for t in range(1, output_len):                # token t + 1 sees the prompt and t tokens
            query_lens.append(1)
            context_lens.append(prompt_len + t)
    cost = step_cost(engine, query_lens, context_lens, num_logits=len(prompt_lens) * output_len)
    nbytes = cost["bytes"] + (max(output_len, 1) - 1) * cost["weight_bytes"]
    compute_s = compute_seconds(cost["flops"], cost["integer_ops"], machine)
    memory_s = nbytes / machine["read_bandwidth"]
    return {"flops": cost["flops"], "bytes": nbytes, "compute_s": compute_s, "memory_s": memory_s,
            "floor_s": max(compute_s, memory_s), "bound": "compute" if compute_s >= memory_s else "memory"}
