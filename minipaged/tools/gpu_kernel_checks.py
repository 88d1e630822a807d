"""The kernel part of ``python -m minipaged.gpu_check`` (gpu_check.py): every CUDA kernel variant
(float16 and bfloat16 activations; float, int8 and fp8 KV blocks; split-K; block-sparse decode;
sliding windows) checked against its NumPy spec on large random inputs, and timed; then the
forward pass through the kernels against the dense reference, for a Llama in bfloat16 and for a
model with every family option on (q/k/v/o biases, q/k norms, a sliding window on each layer).

A kernel computes in float32 and rounds its output once to its type, so it must lie within half
a unit in the last place of the spec's output (``ROUNDING``: 2^-11 relative for float16, 2^-8 for
bfloat16), plus float32's noise (1e-5): ``within_tolerance`` in each row.
"""

from __future__ import annotations

import numpy as np

from ..kernels import reference as spec
from ..kernels.cuda import BFLOAT16
from ..kernels.layout import AttentionMetadata

# half an ulp of each output type, relative: the most one rounding moves a value (float32's
# row: the spec's summation order)
ROUNDING = {"float32": 1e-4, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# the whole model: each op rounds, ~10 of them a layer; relative to the largest logit
MODEL_TOLERANCE = {"float32": 1e-4, "float16": 2.0**-8, "bfloat16": 2.0**-5}


def compare(got, want, dtype) -> dict:
    """The largest error of a kernel's output ``got`` against the float32 spec's ``want``, and
    whether every element is within one rounding to ``dtype`` of it."""
    err = np.abs(np.asarray(got).astype(np.float32) - want)
    bound = (ROUNDING[np.dtype(dtype).name] + 1e-5) * np.abs(want) + 1e-5
    return {"max_abs_error": float(err.max()) if err.size else 0.0, "within_tolerance": bool((err <= bound).all())}


def bfloat16_skipped(dev, dtype) -> str | None:
    """Why a bfloat16 row cannot run here (CuPy 13, no ml_dtypes), or None."""
    if np.dtype(dtype).name == "bfloat16" and not dev.bfloat16:
        return "skipped: no bfloat16 here (CuPy 14 with ml_dtypes has it)"
    return None


def paged_batch(rng, dev, *, num_seqs, q_len, ctx, heads, kv_heads, head_dim, block_size, dtype, window=0):
    """Host and device copies of q, K, V and the metadata: ``num_seqs`` sequences of ``q_len``
    new tokens and ``ctx`` tokens of context on shuffled blocks. With ``window``, the table entries
    of blocks wholly before every query's window are -1, as the block manager frees them."""
    blocks = -(-ctx // block_size)
    num_blocks = num_seqs * blocks + 1
    k = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim), dtype=np.float32).astype(dtype)
    tables = rng.permutation(num_blocks)[:num_seqs * blocks].reshape(num_seqs, blocks).astype(np.int32)
    qsl = (np.arange(num_seqs + 1) * q_len).astype(np.int32)
    lens = np.full(num_seqs, ctx, np.int32)
    q = rng.standard_normal((num_seqs * q_len, heads, head_dim), dtype=np.float32).astype(dtype)
    host = (q, k, v, AttentionMetadata(np.zeros(len(q), np.int64), qsl, lens, tables, q_len, ctx))
    device_tables = tables.copy()
    if window:                                   # the first query's window starts at ctx - q_len - window + 1
        device_tables[:, :max(ctx - q_len - window + 1, 0) // block_size] = -1
    xp = dev.xp
    meta = AttentionMetadata(xp.asarray(host[3].slot_mapping), xp.asarray(qsl), xp.asarray(lens),
                             xp.asarray(device_tables), q_len, ctx)
    return host, (xp.asarray(q), xp.asarray(k), xp.asarray(v), meta)


def attention_case(dev, rng, name: str, shape: dict, check: bool) -> dict:
    """One attention kernel checked against its spec and timed. ``shape`` may add ``fmt`` (a
    kv_quant format: the cache is compressed first, by the spec), ``budget`` (block-sparse
    decode over the cache's key bounds, this many tokens a head) and ``window`` (a sliding window)."""
    from ..kernels import kv_quant
    from ..kernels.layout import BlockBounds, KVQuant

    skipped = bfloat16_skipped(dev, shape["dtype"])
    if skipped:
        return {"kernel": name, "dtype": "bfloat16", "skipped": skipped}
    shape = dict(shape)
    fmt, budget = shape.pop("fmt", kv_quant.KV_FLOAT), shape.pop("budget", None)
    window = shape.get("window", 0)
    (q, k, v, meta), (dq, dk, dv, dmeta) = paged_batch(rng, dev, **shape)
    xp = dev.xp
    quant = bounds = None
    kd, vd = k.astype(np.float32), v.astype(np.float32)     # what the spec reads
    itemsize, scale_bytes = np.dtype(shape["dtype"]).itemsize, 0
    if fmt != kv_quant.KV_FLOAT:
        storage = kv_quant.STORAGE_DTYPE[fmt]
        per_token = fmt == kv_quant.KV_INT8
        scales = [np.zeros(k.shape[:3], np.float32) if per_token else np.full((1, 1, 1), 0.03, np.float32)
                  for _ in range(2)]
        host = KVQuant(fmt, *scales)
        kc, vc = np.zeros(k.shape, storage), np.zeros(v.shape, storage)
        rows = lambda c: c.transpose(0, 2, 1, 3).reshape(-1, c.shape[1], c.shape[3]).astype(np.float32)  # noqa: E731
        spec.write_kv(kc, vc, rows(k), rows(v), np.arange(k.shape[0] * k.shape[2], dtype=np.int64), host)
        kd, vd = spec.dequantize_kv(kc, fmt, host.k_scale), spec.dequantize_kv(vc, fmt, host.v_scale)
        dk, dv = xp.asarray(kc), xp.asarray(vc)
        quant = KVQuant(fmt, xp.asarray(host.k_scale), xp.asarray(host.v_scale))
        itemsize, scale_bytes = 1, 4 if per_token else 0
    if budget is not None:
        key_min, key_max = spec.key_bounds(kd)
        bounds = BlockBounds(xp.asarray(key_min), xp.asarray(key_max), budget // shape["block_size"])
    plan = dev.ops.plan_attention(dmeta)
    run = lambda: dev.ops.paged_attention(dq, dk, dv, plan, 0.125, quant, bounds, window)   # noqa: E731
    out = run()
    row = {"kernel": name, **{k_: v_ for k_, v_ in shape.items() if k_ != "dtype"},
           "dtype": np.dtype(shape["dtype"]).name, "kv_cache_dtype": {v_: k_ for k_, v_ in
                                                                    kv_quant.KV_CACHE_DTYPES.items()}[fmt],
           "partitions": dev.ops.decode_partitions(plan, window, shape["block_size"]) if plan.decode_only else 1}
    if budget is not None:
        row["sparse_budget"] = budget
    if check:
        if budget is None:
            want = spec.paged_attention(q.astype(np.float32), kd, vd, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, 0.125, window)
        else:
            want = spec.sparse_decode_attention(q.astype(np.float32), kd, vd, key_min, key_max, meta.block_tables,
                                                meta.seq_lens, 0.125, budget)
        row.update(compare(dev.asnumpy(out), want, shape["dtype"]))
    seconds = dev.time(run, repeats=1 if dev.smoke else 50)     # the smoke test's times mean nothing
    tokens_read = shape["ctx"]                                # per sequence and head
    if budget is not None:
        tokens_read = min(shape["ctx"], budget)
    if window:
        tokens_read = min(shape["ctx"], window + shape["q_len"] - 1)
    kv_bytes = 2 * shape["num_seqs"] * tokens_read * shape["kv_heads"] * (shape["head_dim"] * itemsize + scale_bytes)
    row.update(seconds=seconds, kv_gb_per_s=kv_bytes / seconds / 1e9)
    return row


def kernel_report(dev, smoke: bool) -> list[dict]:
    from ..kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8

    rng = np.random.default_rng(0)
    big = not smoke
    f16, bf16 = np.float16, BFLOAT16
    decode = dict(num_seqs=64 if big else 2, q_len=1, ctx=2048 if big else 40, heads=9 if big else 3,
                  kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16)
    # (smoke: the harness's CudaOps splits above 128 positions, in partitions of 64: gpu_check.Device)
    split = dict(num_seqs=4 if big else 1, q_len=1, ctx=16384 if big else 300, heads=9 if big else 2,
                 kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16)
    prefill = dict(num_seqs=8 if big else 1, q_len=512 if big else 20, ctx=512 if big else 20, heads=9 if big else 3,
                   kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16)
    long = dict(num_seqs=4 if big else 1, q_len=1, ctx=8192 if big else 300, heads=9 if big else 2,
                kv_heads=3 if big else 1, head_dim=64, block_size=16, dtype=f16)
    # a sliding window: decodes far past it (split-K over the window's blocks only), a chunk past it
    window = 1024 if big else 100                    # split-K: 16 partitions of 512 (smoke: 5 of 64), the window's 3 (2)
    slide = {**long, "num_seqs": 16 if big else 1, "ctx": 8192 if big else 300, "window": window}
    chunk = {**prefill, "num_seqs": 4 if big else 1, "q_len": 256 if big else 12, "ctx": 2048 if big else 60,
             "window": 512 if big else 24}
    cases = [
        ("decode (batch 64, ctx 2048)", decode, True),
        ("decode split-K (batch 4, ctx 16384)", split, True),
        ("decode fp32 (batch 64, ctx 2048)", {**decode, "dtype": np.float32}, True),
        ("prefill (8 x 512 tokens)", prefill, True),
        # bfloat16 activations (a bf16 checkpoint on a GPU): the same shapes
        ("decode bf16 (batch 64, ctx 2048)", {**decode, "dtype": bf16}, True),
        ("decode split-K bf16 (batch 4, ctx 16384)", {**split, "dtype": bf16}, True),
        ("prefill bf16 (8 x 512 tokens)", {**prefill, "dtype": bf16}, True),
        # the compressed KV cache: the same decode over 1-byte blocks (bytes read counted as stored)
        ("decode int8 KV (batch 64, ctx 2048)", {**decode, "fmt": KV_INT8}, True),
        ("decode fp8 e4m3 KV (batch 64, ctx 2048)", {**decode, "fmt": KV_FP8_E4M3}, True),
        ("decode fp8 e5m2 KV (batch 64, ctx 2048)", {**decode, "fmt": KV_FP8_E5M2}, True),
        ("decode bf16 over fp8 e4m3 KV (batch 64, ctx 2048)", {**decode, "dtype": bf16, "fmt": KV_FP8_E4M3}, True),
        ("prefill int8 KV (8 x 512 tokens)", {**prefill, "fmt": KV_INT8}, True),
        # block-sparse decode against dense on the same long context (bytes read: the budget's)
        ("decode dense (batch 4, ctx 8192)", long, True),
        ("decode sparse, budget 1024 (batch 4, ctx 8192)", {**long, "budget": 1024 if big else 64}, True),
        ("decode sparse bf16, budget 1024 (batch 4, ctx 8192)", {**long, "dtype": bf16, "budget": 1024 if big else 64},
         True),
        # sliding windows (bytes read: the window's)
        (f"decode window {window} (batch 16, ctx 8192)", slide, True),
        (f"decode window {window} bf16 (batch 16, ctx 8192)", {**slide, "dtype": bf16}, True),
        (f"decode window {window} int8 KV (batch 16, ctx 8192)", {**slide, "fmt": KV_INT8}, True),
        ("prefill window 512 (4 x 256 of 2048 tokens)", chunk, True),
        ("prefill window 512 bf16 over fp8 e5m2 KV (4 x 256 of 2048 tokens)",
         {**chunk, "dtype": bf16, "fmt": KV_FP8_E5M2}, True),
    ]
    return [attention_case(dev, rng, name, shape, check) for name, shape, check in cases]


def elementwise_report(dev, smoke: bool) -> list[dict]:
    """rms_norm, silu_and_mul, rotary, write_kv and its key bounds in float16 and bfloat16."""
    rng = np.random.default_rng(1)
    tokens = 16 if smoke else 8192
    rows = []
    for dtype in (np.float16, BFLOAT16):
        skipped = bfloat16_skipped(dev, dtype)
        if skipped:
            rows.append({"kernel": "rms_norm, silu_and_mul, rotary, write_kv", "dtype": "bfloat16", "skipped": skipped})
            continue
        rows += _elementwise_rows(dev, rng, np.dtype(dtype), tokens, smoke)
    return rows


def _elementwise_rows(dev, rng, dtype, tokens: int, smoke: bool) -> list[dict]:
    xp, ops = dev.xp, dev.ops
    repeats = 3 if smoke else 50
    rows = []

    def row(kernel, got, want, seconds, moved, exact=False):
        got = dev.asnumpy(got)
        out = {"kernel": kernel, "dtype": dtype.name, "tokens": tokens, **compare(got, want, dtype),
               "seconds": seconds, "gb_per_s": moved / seconds / 1e9}
        if exact:
            out["bit_exact"] = got.tobytes() == want.astype(got.dtype).tobytes()
        rows.append(out)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    x, w = normal(tokens, 576, scale=8.0), normal(576)
    dx, dw = xp.asarray(x), xp.asarray(w)
    row("rms_norm", ops.rms_norm(dx, dw, 1e-5), spec.rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5),
        dev.time(lambda: ops.rms_norm(dx, dw, 1e-5), repeats), 2 * x.nbytes)
    gu = normal(tokens, 3072, scale=2.0)
    dgu = xp.asarray(gu)
    row("silu_and_mul", ops.silu_and_mul(dgu), spec.silu_and_mul(gu.astype(np.float32)),
        dev.time(lambda: ops.silu_and_mul(dgu), repeats), 1.5 * gu.nbytes)
    heads, positions = normal(tokens, 9, 64), rng.integers(0, 4096, tokens)
    angles = np.outer(np.arange(4096), 1.0 / 10000 ** (np.arange(0, 64, 2) / 64))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    dh, dp, dc, ds = xp.asarray(heads), xp.asarray(positions), xp.asarray(cos), xp.asarray(sin)
    row("rotary", ops.rotary(xp.array(heads), dp, dc, ds),     # a copy: the kernel rotates in place
        spec.rotary(heads.astype(np.float32), positions, cos, sin),
        dev.time(lambda: ops.rotary(dh, dp, dc, ds), repeats), 2 * heads.nbytes)
    # write_kv: K/V to shuffled slots (a copy: bit for bit)
    k = normal(tokens, 3, 64)
    cache = np.zeros((tokens // 16 + 1, 3, 16, 64), dtype)
    slots = rng.permutation(cache.shape[0] * 16)[:tokens].astype(np.int64)
    dk, dcache, dv, dslots = xp.asarray(k), xp.asarray(cache), xp.asarray(cache), xp.asarray(slots)
    ops.write_kv(dcache, dv, dk, dk, dslots)
    want = cache.copy()
    spec.write_kv(want, want.copy(), k, k, slots)
    seconds = dev.time(lambda: ops.write_kv(dcache, dv, dk, dk, dslots), repeats)
    row("write_kv", dcache, want.astype(np.float32), seconds, 4 * k.nbytes, exact=True)
    # ... and with block-sparse attention's key bounds, every slot in order (update_key_bounds)
    from ..kernels.layout import BlockBounds

    blocks = tokens // 16
    key_min, key_max = (xp.zeros((blocks, 3, 64), np.float32) for _ in range(2))
    ops.write_kv(dcache, dv, dk, dk, xp.arange(blocks * 16, dtype=np.int64), None, BlockBounds(key_min, key_max, 0))
    want_min, want_max = spec.key_bounds(k[:blocks * 16].reshape(blocks, 16, 3, 64).transpose(0, 2, 1, 3))
    got = np.concatenate([dev.asnumpy(key_min), dev.asnumpy(key_max)])
    bounds = np.concatenate([want_min, want_max])
    rows.append({"kernel": "update_key_bounds", "dtype": dtype.name, "tokens": blocks * 16,
                 **compare(got, bounds, dtype), "bit_exact": got.tobytes() == bounds.tobytes()})
    return rows


def block_copy_report(dev, smoke: bool) -> list[dict]:
    """The Numba CUDA block copies (copy-on-write, swapping to pinned host memory), bit for bit
    (a step of its own: without Numba CUDA, only it fails)."""
    rng = np.random.default_rng(2)
    ops = dev.ops
    rows = []
    layers, blocks = (2, 8) if smoke else (30, 512)
    pairs = np.stack([np.arange(blocks // 2), np.arange(blocks // 2, blocks)], axis=1)
    for dtype in (np.float16, BFLOAT16):        # bfloat16 blocks travel as 16-bit words (Numba has no bf16)
        if bfloat16_skipped(dev, dtype):
            continue
        pool = dev.xp.asarray(rng.standard_normal((layers, 2, blocks, 3, 16, 64), dtype=np.float32).astype(dtype))
        before = dev.asnumpy(pool)
        ops.copy_blocks(pool, pairs)
        after = dev.asnumpy(pool)
        exact = bool((after[:, :, pairs[:, 1]].view(np.uint16) == before[:, :, pairs[:, 0]].view(np.uint16)).all())
        seconds = dev.time(lambda: ops.copy_blocks(pool, pairs), repeats=3 if smoke else 20)
        moved = 2 * len(pairs) * before[:, :, 0].nbytes
        rows.append({"kernel": "copy_blocks (Numba CUDA)", "dtype": np.dtype(dtype).name, "blocks": int(len(pairs)),
                     "bit_exact": exact, "seconds": seconds, "gb_per_s": moved / seconds / 1e9})
    # swapping: device -> pinned host pool -> other device blocks, bit for bit
    from ..engine.cache_engine import _pinned

    shape = (layers, 2, blocks, 3, 16, 64)
    pool = dev.xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(np.float16))
    host = np.zeros(shape, np.float16) if smoke else _pinned(shape, np.float16)
    out_pairs = np.stack([np.arange(blocks // 2), np.arange(blocks // 2)], axis=1)
    snapshot = dev.asnumpy(pool)
    seconds_out = dev.time(lambda: ops.swap_blocks(pool, host, out_pairs), repeats=3 if smoke else 10)
    back_pairs = np.stack([np.arange(blocks // 2), np.arange(blocks // 2, blocks)], axis=1)
    ops.swap_blocks(host, pool, back_pairs)
    if not smoke:
        dev.xp.cuda.Device().synchronize()
    exact = bool((dev.asnumpy(pool)[:, :, back_pairs[:, 1]] == snapshot[:, :, out_pairs[:, 0]]).all())
    rows.append({"kernel": "swap_blocks to pinned host (Numba CUDA)", "blocks": int(len(out_pairs)),
                 "bit_exact": exact, "seconds": seconds_out,
                 "gb_per_s": len(out_pairs) * snapshot[:, :, 0].nbytes / seconds_out / 1e9})
    return rows


def model_report(dev, smoke: bool) -> list[dict]:
    """The forward pass through the kernels (two prefill chunks, then decodes) against the dense
    reference of the same weights rounded to the run's dtype: a Llama in bfloat16, as a bf16
    checkpoint runs on a GPU; and a model with every family option on (q/k/v/o biases, q/k norms,
    a sliding window on every layer, the blocks before it freed: -1 in the table) in float16 and
    bfloat16. The logits must stay within ``MODEL_TOLERANCE`` of the largest."""
    from ..model.config import LlamaConfig
    from ..model.random_llama import tiny_config

    shapes = (dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=300) if smoke else
              dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                   num_key_value_heads=3, head_dim=64, vocab_size=4096))
    length, block_size, window = (24, 4, 8) if smoke else (200, 16, 64)
    every_option = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=True,
                        use_sliding_window=True, sliding_window=window, max_window_layers=0)
    rows = []
    for name, options, dtype in (("llama", {}, BFLOAT16), ("biases, q/k norms, window", every_option, np.float16),
                                 ("biases, q/k norms, window", every_option, BFLOAT16)):
        if bfloat16_skipped(dev, dtype):
            rows.append({"model": name, "dtype": "bfloat16", "skipped": bfloat16_skipped(dev, dtype)})
            continue
        raw = tiny_config(**shapes, **options)
        config = LlamaConfig.from_dict(raw)
        err, top = _model_error(dev, config, _family_tensors(raw, config), np.dtype(dtype), length, block_size)
        rows.append({"model": name, "dtype": np.dtype(dtype).name, "tokens": length, "window": config.sliding_window,
                     "max_abs_error": err, "largest_logit": top,
                     "within_tolerance": err <= MODEL_TOLERANCE[np.dtype(dtype).name] * top})
    return rows


def _family_tensors(raw: dict, config) -> dict[str, np.ndarray]:
    """random_llama's weights, plus the biases and q/k norms the config asks for."""
    from ..model.random_llama import random_tensors

    tensors = random_tensors(raw, seed=0, embed_scale=0.2)
    rng = np.random.default_rng(1)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        extra = {}
        if config.qkv_bias:
            extra.update({"q_proj.bias": config.q_size, "k_proj.bias": config.kv_size, "v_proj.bias": config.kv_size})
        if config.o_bias:
            extra["o_proj.bias"] = config.hidden_size
        for tensor, n in extra.items():
            tensors[p + tensor] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if config.qk_norm:
            for tensor in ("q_norm.weight", "k_norm.weight"):
                tensors[p + tensor] = (1.0 + 0.1 * rng.standard_normal(config.head_dim)).astype(np.float32)
    return tensors


def _model_error(dev, config, tensors, dtype, length: int, block_size: int) -> tuple[float, float]:
    """(largest logit error, largest logit) of a prompt of ``length`` tokens run in two chunks
    and two decodes through a paged pool on shuffled blocks."""
    from ..kernels.layout import kv_cache_shape
    from ..model.llama import LlamaModel
    from ..model.reference import DenseReference

    xp = dev.xp
    rng = np.random.default_rng(2)
    ids = rng.integers(3, config.vocab_size, length)
    want = DenseReference(config, {k: v.astype(dtype).astype(np.float32) for k, v in tensors.items()}).logits(ids)
    model = LlamaModel(config, tensors, dev.ops, dtype=dtype)
    num_blocks = -(-length // block_size)
    table = rng.permutation(num_blocks).astype(np.int32)[None, :]                  # (1, blocks)
    slots = table[0, np.arange(length) // block_size] * block_size + np.arange(length) % block_size
    kv = xp.zeros(kv_cache_shape(config.num_hidden_layers, num_blocks, config.num_key_value_heads, block_size,
                                 config.head_dim), dtype)
    got = []
    for first, last in ((0, 2 * length // 3), (2 * length // 3, length - 2), (length - 2, length - 1),
                        (length - 1, length)):
        if config.sliding_window:        # every layer slides: the blocks before the window are freed
            table[0, :max(first - config.sliding_window + 1, 0) // block_size] = -1
        n = last - first
        meta = AttentionMetadata(xp.asarray(slots[first:last]), xp.asarray(np.array([0, n], np.int32)),
                                 xp.asarray(np.array([last], np.int32)), xp.asarray(table), n, last)
        logits = model.forward(xp.asarray(ids[first:last]), xp.asarray(np.arange(first, last)), kv, meta,
                               xp.asarray(np.arange(n)))
        got.append(dev.asnumpy(logits).astype(np.float32))
    return float(np.abs(np.concatenate(got) - want).max()), float(np.abs(want).max())
