"""Tutorial 15: a compressed KV cache and block-sparse attention, or reading less memory.

Goal: store every K and V value in one byte instead of four, and see what it buys and what
it costs. ``kv_cache_dtype`` (vLLM's name) takes ``int8`` (an int8 code a value plus one
float32 scale per token and KV head, kept with the block), ``fp8`` = ``fp8_e4m3`` and
``fp8_e5m2`` (an 8-bit float a value, one scale per layer). We:

1. quantize one token's K by hand and read it back: the rounding each format makes;
2. size the same KV space with each dtype: the blocks gained, counted from the bytes;
3. watch a prefill land in the pool as bytes and scales, and a swap carry the scales;
4. measure the quality paid: perplexity over real English text that ships with Python
   (its reference documentation, ``pydoc_data.topics``), and greedy agreement;
5. time a decode step's attention over float32 and over int8 blocks;
6. read fewer blocks instead of smaller ones: block-sparse decode attention (Quest) keeps each
   block's key min / max, and a decoding head attends only to the blocks whose keys could
   score highest; we draw the blocks one query chose on its page table;
7. run the GPU's CUDA C kernel over the same int8 bytes (on the CPU harness, as CI does).

The OS analogy: compressed memory (Linux's zswap, macOS's memory compressor). When RAM is
short, an OS can compress pages in place rather than evict them: more of the working set
stays resident, and every access pays a small decode. Here the "pages" are KV blocks, the
compression is quantization, and the decode is the widening paged attention does as it
reads each byte, in registers, never by copying the context out first. Sparse attention is
the OS's working set: of all the pages a process has mapped, only the few it touches now need
to be resident, and the page table's accessed bits say which; here each block's key bounds
say which blocks a query could care about.

Run it:  python tutorials/15_compressed_kv_cache.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Give fp8 a layer scale of 1/32 (``engine.cache.kv_scales[:] = 1/32`` before any
     request) and measure the perplexity again. Which values now saturate, which stop
     being subnormal, and does it help?
  2. int8's scale is per (token, head). Make it per block instead (one max over 16 tokens):
     how many bytes does it save, and what does perplexity say?
"""

import os
import time

import numpy as np

from minipaged import LLMEngine, SamplingParams
from minipaged.kernels import kv_quant
from minipaged.kernels.fast import attention, kv_write   # the fast tier's kernels, named
from minipaged.kernels import reference as spec
from minipaged.tools.quality import perplexity, reference_text

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
np.set_printoptions(suppress=True, precision=4, floatmode="fixed", linewidth=110)
DTYPES = ["auto", "int8", "fp8", "fp8_e5m2"]
SPACE_GIB = 0.25

print("1. One token's K, by hand")
rng = np.random.default_rng(0)
k = (rng.standard_normal(8) * [0.005, 0.02, 0.3, 1, 2, 5, 20, 60]).astype(np.float32)   # (head_dim=8,)
codes, scales = spec.quantize_kv(k[None, :], kv_quant.KV_INT8, None)
back = codes.astype(np.float32) * scales[:, None]
print(f"  x          {k}")
print(f"  int8 codes {codes[0]}, scale {scales[0]:.4f} (= max|x| / 127)")
print(f"  int8 back  {back[0]}")
assert np.abs(back[0] - k).max() <= scales[0] / 2 + 1e-7       # at most half a step off
for fmt, name in ((kv_quant.KV_FP8_E4M3, "e4m3"), (kv_quant.KV_FP8_E5M2, "e5m2")):
    byte = kv_quant.to_fp8(k, fmt)
    widened = kv_quant.fp8_table(fmt)[byte]
    print(f"  fp8 {name}   {widened}  (bytes {' '.join(f'{b:02x}' for b in byte)})")
    # a relative step for normal values (2^-4 or 2^-3), a fixed one for tiny (subnormal) ones
    assert np.all(np.abs(widened - k) <= np.abs(k) * (2.0 ** -4 if name == "e4m3" else 2.0 ** -3) + 2.0 ** -9)
print("  int8 spends its 255 codes on this head's own range; fp8 spends them on a fixed, logarithmic")
print("  scale, so small values keep relative precision and large ones lose absolute precision.")

print(f"\n2. The same {SPACE_GIB} GiB of KV space, by dtype")
engines = {}
for dtype in DTYPES:
    engines[dtype] = LLMEngine(MODEL, device="cpu", kv_cache_space=SPACE_GIB, swap_space=0.05,
                               kv_cache_dtype=dtype, log_stats_interval=0)
c = engines["auto"].model_config
base = engines["auto"].cache
for dtype, engine in engines.items():
    cache = engine.cache
    print(f"  {dtype:>9}: {cache.bytes_per_block:>7} bytes a block ({cache.kv_cache.dtype}), "
          f"{cache.num_blocks:>5} blocks, {cache.num_blocks * 16:>6} token slots, "
          f"{cache.num_blocks / base.num_blocks:.2f}x float32")
per_token_head = {"auto": 4 * c.head_dim, "int8": c.head_dim + 4, "fp8": c.head_dim, "fp8_e5m2": c.head_dim}
for dtype, engine in engines.items():
    assert engine.cache.bytes_per_block == 2 * c.num_hidden_layers * c.num_key_value_heads * 16 * per_token_head[dtype]
print(f"  int8 pays 4 bytes of scale per {c.head_dim} one-byte values: {4 * c.head_dim / (c.head_dim + 4):.2f}x, not 4x")
# On a GPU the blocks are float16 (2 bytes a value), so the same bytes buy half the gain;
# block_bytes is what the GPU's pool sizing (profile_gpu_num_blocks) divides its memory by.
from minipaged.config import CacheConfig  # noqa: E402
from minipaged.engine.cache_engine import block_bytes  # noqa: E402

half = block_bytes(c, CacheConfig(), np.float16)
for dtype in ("int8", "fp8"):
    print(f"  on a GPU: {dtype} {half / block_bytes(c, CacheConfig(kv_cache_dtype=dtype), np.float16):.2f}x "
          f"the float16 blocks")

print("\n3. A prefill lands as bytes and scales; a swap carries the scales")
engine = engines["int8"]
prompt = engine.tokenizer.encode("The operating system keeps a page table for every process.")
engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0.0))
engine.step()
table = engine.block_manager.block_table(engine.groups["a"].seqs[0])
block = table[0]
print(f"  request a: {len(prompt)} prompt tokens in blocks {table}")
print(f"  layer 0, K, block {block}, head 0, first token: codes {engine.cache.kv_cache[0, 0, block, 0, 0, :8]} ...")
print(f"    its scale {engine.cache.kv_scales[0, 0, block, 0, 0]:.5f}; the block's 16 scales are part of the block")
group = engine.groups["a"]
before = engine.cache.kv_cache[:, :, table].copy(), engine.cache.kv_scales[:, :, table].copy()
engine.cache.swap_out(engine.block_manager.swap_out(group))
engine.cache.kv_scales[:, :, table] = 0.0          # another request reuses the frames
engine.cache.swap_in(engine.block_manager.swap_in(group))
new_table = engine.block_manager.block_table(group.seqs[0])
assert engine.cache.kv_cache[:, :, new_table].tobytes() == before[0].tobytes()
assert engine.cache.kv_scales[:, :, new_table].tobytes() == before[1].tobytes()
print(f"  swapped out and back into blocks {new_table}: bytes and scales identical")
while engine.has_unfinished_requests():
    engine.step()

print("\n4. The quality paid: perplexity over Python's own documentation")
text_ids = engines["auto"].tokenizer.encode(reference_text())[:2048]
ppl = {}
for dtype, engine in engines.items():
    ppl[dtype] = perplexity(engine, text_ids, window=512)["perplexity"]
for dtype in DTYPES:
    print(f"  {dtype:>9}: perplexity {ppl[dtype]:.3f} ({100 * (ppl[dtype] / ppl['auto'] - 1):+.2f}% against float32)")
assert all(abs(ppl[d] / ppl["auto"] - 1) < 0.1 for d in DTYPES)   # close; the exact costs are in docs/
greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
question = engines["auto"].tokenizer.encode("The three primary colours are")
answers = {}
for dtype, engine in engines.items():
    engine.add_request("q", question, greedy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                answers[dtype] = out.outputs[0]
for dtype in DTYPES:
    same = next((i for i, (a, b) in enumerate(zip(answers[dtype].token_ids, answers["auto"].token_ids)) if a != b),
                len(answers["auto"].token_ids))
    print(f"  {dtype:>9}: {answers[dtype].text!r}  ({same}/24 tokens as float32's)")

print("\n5. A decode step's attention over float32 and int8 blocks (timings: ratios, not asserted)")
num_seqs, context, heads, kv_heads, head_dim, size = 16, 512, c.num_attention_heads, c.num_key_value_heads, c.head_dim, 16
blocks = num_seqs * context // size
keys = rng.standard_normal((blocks, kv_heads, size, head_dim)).astype(np.float32)
values = rng.standard_normal((blocks, kv_heads, size, head_dim)).astype(np.float32)
from minipaged.kernels.layout import AttentionMetadata, KVQuant  # noqa: E402

meta = AttentionMetadata(np.zeros(num_seqs, np.int64), np.arange(num_seqs + 1, dtype=np.int32),
                         np.full(num_seqs, context, np.int32),
                         rng.permutation(blocks).reshape(num_seqs, -1).astype(np.int32), 1, context)
q = rng.standard_normal((num_seqs, heads, head_dim)).astype(np.float32)
k8, v8 = np.zeros(keys.shape, np.int8), np.zeros(keys.shape, np.int8)
quant = KVQuant(kv_quant.KV_INT8, np.zeros(keys.shape[:3], np.float32), np.zeros(keys.shape[:3], np.float32))
as_tokens = lambda cache: cache.transpose(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)   # noqa: E731
kv_write.write_kv(k8, v8, as_tokens(keys), as_tokens(values), np.arange(blocks * size, dtype=np.int64), quant)
plan = attention.plan_attention(meta)
timings = {}
for name, args in (("float32", (keys, values, None)), ("int8", (k8, v8, quant))):
    attention.paged_attention(q, args[0], args[1], plan, 0.125, args[2])     # compile, warm up
    start = time.perf_counter()
    for _ in range(10):
        out = attention.paged_attention(q, args[0], args[1], plan, 0.125, args[2])
    timings[name] = (time.perf_counter() - start) / 10
dense = spec.paged_attention(q, spec.dequantize_kv(k8, 1, quant.k_scale), spec.dequantize_kv(v8, 1, quant.v_scale),
                             meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
np.testing.assert_allclose(out, dense, atol=3e-5, rtol=1e-4)      # int8 kernel = dense over the widened cache
print(f"  {num_seqs} sequences x {context} tokens, one layer: float32 {timings['float32'] * 1e3:.2f} ms, "
      f"int8 {timings['int8'] * 1e3:.2f} ms ({timings['float32'] / timings['int8']:.2f}x), reading "
      f"{keys.nbytes * 2 / 2**20:.0f} MiB against {(k8.nbytes + quant.k_scale.nbytes) * 2 / 2**20:.0f} MiB")
print("  the kernel is bound by its arithmetic more than by its bytes here, so 4x fewer bytes give less than 4x")

print("\n6. Block-sparse decode: the blocks one query chose")
sparse = LLMEngine(MODEL, device="cpu", kv_cache_space=0.05, swap_space=0.01, sparse_attention_budget=64,
                   log_stats_interval=0)
story = sparse.tokenizer.encode(reference_text()[:4000])[:300]
sparse.add_request("s", story, SamplingParams(max_tokens=2, temperature=0.0))
sparse.step()                                        # the prompt, dense
seq = sparse.groups["s"].seqs[0]
table = sparse.block_manager.block_table(seq)
layer, bounds = 10, sparse.cache.layer_bounds(10)
print(f"  {len(story)} prompt tokens in {len(table)} blocks; budget 64 tokens = {bounds.keep} blocks a head")
# The choice needs the decoding token's query at that layer: catch it on its way into the
# kernel: the model calls ops.paged_attention on its tier (kernels/ops.py), here wrapped by a spy.
captured = {}


class Spy:
    """The model's tier of kernels, noting each layer's queries on their way into paged_attention."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def paged_attention(self, q, *args):
        captured.setdefault("layers", []).append(q.copy())
        return self.ops.paged_attention(q, *args)


real_ops = sparse.model.ops
sparse.model.ops = Spy(real_ops)
sparse.step()                                        # one decode: the spy sees each layer's q
sparse.model.ops = real_ops
q_layer = captured["layers"][layer][0]               # (heads, head_dim) of the decoding token
group = c.num_attention_heads // c.num_key_value_heads
for head in range(0, c.num_attention_heads, max(1, group // 2)):   # heads of each KV head
    kv = head // group
    chosen = spec.select_blocks(q_layer[head], bounds.key_min[table, kv], bounds.key_max[table, kv],
                                len(table), bounds.keep)
    row = "".join("#" if j in chosen else "." for j in range(len(table)))
    print(f"  layer {layer} head {head} (KV head {kv}): [{row}]  blocks {[table[j] for j in chosen]}")
    assert chosen[0] == 0 and chosen[-1] == len(table) - 1 and len(chosen) == bounds.keep
print("  '#': read, '.': skipped. The first and last blocks always stay; the middle ones are those")
print("  whose keys' [min, max] box could give this head's query the highest score.")
while sparse.has_unfinished_requests():
    sparse.step()

print("\n7. The GPU's kernels read the same bytes (CUDA C, run here on the CPU harness)")
# kernels/paged_attention.cu widens int8 / fp8 bytes in registers with cuda_fp8.h; CI runs the
# very same source on the CPU (kernels/cuda_harness.py: one OS thread per CUDA thread), through
# the host code a GPU uses. Four of the sequences above, against the Numba kernel's answer.
from minipaged.kernels.cuda import cpu_harness_ops  # noqa: E402

few = AttentionMetadata(meta.slot_mapping[:4], meta.query_start_loc[:5], meta.seq_lens[:4], meta.block_tables[:4], 1,
                        context)
gpu_kernels = cpu_harness_ops()
on_harness = gpu_kernels.paged_attention(q[:4], k8, v8, few, 0.125, quant)
numba = attention.paged_attention(q[:4], k8, v8, few, 0.125, quant)
print(f"  paged_decode_f32 over int8 blocks, 4 sequences x {context} tokens: largest difference from the "
      f"Numba kernel {np.abs(on_harness - numba).max():.1e}")
assert np.allclose(on_harness, numba, atol=3e-5, rtol=1e-4)

print("""
Done: one byte a value, about 4x the blocks (2x on a GPU's float16); int8 costs almost no perplexity, fp8 a little more;
and sparse attention reads a budget of blocks per head instead of all of them.
Exercises:
  1. Give fp8 a layer scale of 1/32 (engine.cache.kv_scales[:] = 1/32 before any request) and
     measure the perplexity again. Which values now saturate, which stop being subnormal?
  2. int8's scale is per (token, head). Make it per block instead (one max over 16 tokens):
     how many bytes does it save, and what does perplexity say?""")
