"""Tutorial 1: the two phases of generation, and why the KV cache is the bottleneck.

Goal: see, on the real engine, that generating text has two very different
phases. Prefill pushes a whole prompt through the model in one step: many
tokens share one pass over the weights, so the arithmetic units are the limit
(compute-bound). Decode then produces one token per sequence per step: every
step reads all the weights again to do a little arithmetic for each sequence,
so memory bandwidth is the limit (memory-bound). The way out is to decode many
sequences in the same step, and each of them keeps its keys and values (the KV
cache) in memory while it runs. So the KV cache decides how many sequences can
run together, and sizing it is the first calculation of any inference engine:
we do it for LLaMA-13B on a 40 GB A100 and for SmolLM2-135M, whose numbers we
check against the pool the engine really allocates.

The OS analogy: the weights are the program's code, shared by every process and
read on each step; the KV cache is each process's private data (its stack),
which grows by one entry per generated token and must stay resident while the
process runs. A machine can hold only as many processes as their resident data
allows, whatever its CPU could do: memory, not the processor, caps the degree
of multiprogramming. The next tutorials manage that memory like an OS.

Timings depend on the machine and on what else it runs, so they are printed,
not checked, except one: that a prompt token costs less than a generated one.
The gap is usually about an order of magnitude, but only that it exists (more
than 1x) is asserted. Everything else is computed and asserted, except the
split of the A100's memory in step 4, which is assumed (the PagedAttention
paper's setting), not computed.

Run it:  python tutorials/01_two_phases_and_the_kv_cache.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. LLaMA-2-70B has 80 layers, 64 query heads but only 8 KV heads (grouped-query
     attention), head_dim 128. Compute its KV bytes per token in fp16 with kv_bytes_per_token,
     and how many 4096-token sequences fit in 40 GB of KV space. How much did GQA save?
  2. Set DECODE_BATCH to 1, 2, 4, 16 and 32 and watch decode tokens/s. Where does it stop
     growing on your machine, and what does that say about your CPU's ridge point? (With 1 or 2
     sequences the batch's FLOP/byte in step 3 is at most about 1; the script allows for it.)
"""

import os
import time

from minipaged import LLMEngine, SamplingParams
from minipaged.kernels.layout import kv_bytes_per_block, kv_cache_shape

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
PROMPT_LEN = 256     # tokens in the prompt we prefill
DECODE_STEPS = 5     # decode steps timed after each prefill
REPEATS = 3          # the best of a few runs: background work only ever slows a step down
DECODE_BATCH = 8     # sequences decoding together in the batched measurement
BATCH_PROMPT_LEN = 32
BLOCK_SIZE = 16

# Datasheet numbers of an NVIDIA A100 40 GB (SXM): dense fp16 tensor-core math and HBM2 bandwidth.
A100_MEMORY = 40e9            # bytes (decimal GB, as the card is sold)
A100_FP16_FLOPS = 312e12      # FLOP/s
A100_BANDWIDTH = 1.555e12     # bytes/s
# LLaMA-13B: 40 layers, hidden 5120 = 40 heads x 128, no grouped-query attention, FFN 13824.
LLAMA_13B = dict(layers=40, hidden=5120, heads=40, kv_heads=40, head_dim=128, ffn=13824,
                 vocab=32000, tied=False)
FP16, FP32 = 2, 4             # bytes per element

TEXT = ("The lighthouse keeper climbed the stairs every evening, one hundred and twelve steps, "
        "counting them aloud so that the silence would not feel so large. At the top he trimmed "
        "the wick, polished the lens with a soft cloth, and wrote the weather in a thick book: "
        "wind from the west, a grey sea, three fishing boats coming home before dark. Nobody had "
        "read the book in years, but he liked to think that somebody would, one day, and that "
        "they would learn from it how patient the sea could be, and how sudden. ")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Each layer stores one key and one value vector per KV head for every token."""
    return 2 * layers * kv_heads * head_dim * itemsize


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                 vocab: int, tied: bool) -> int:
    """Parameters of a Llama-style model, from its shape alone."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * ffn + 2 * hidden  # attn, MLP, 2 norms
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden        # + embed (+ head), norm


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


engine = LLMEngine(MODEL, device="cpu", block_size=BLOCK_SIZE, num_blocks=128, max_model_len=512)
c = engine.model_config
model = engine.model

print(f"1. The model ({MODEL}), read from the engine's config")
print(f"  {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} query heads, "
      f"{c.num_key_value_heads} KV heads, head_dim {c.head_dim}, FFN {c.intermediate_size}, "
      f"vocab {c.vocab_size}, tied embeddings: {c.tie_word_embeddings}")
params = llama_params(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                      c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings)
layer_arrays = [a for layer in model.layers for a in vars(layer).values() if hasattr(a, "size")]   # no window, no bias
held = (model.embed.size + model.final_norm.size + sum(a.size for a in layer_arrays)
        + (0 if c.tie_word_embeddings else model.lm_head.size))
itemsize = engine.backend.dtype.itemsize          # weights and KV cache share the engine's dtype
weight_bytes = params * itemsize
print(f"  {params:,} parameters (computed from the shape; the engine holds exactly that many), "
      f"{fmt_bytes(weight_bytes)} in {engine.backend.dtype}")
assert params == held
# What one step must read: every layer's matrices and the output head. The embedding is only
# looked up for the step's tokens, a few rows. (Tied, the head is the embedding matrix itself.)
read_per_step = sum(a.nbytes for a in layer_arrays) + model.lm_head.nbytes + model.final_norm.nbytes
body = c.num_hidden_layers * (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                              + 3 * c.hidden_size * c.intermediate_size)   # matmul weights of the layers
head = c.vocab_size * c.hidden_size
print(f"  a forward step reads {fmt_bytes(read_per_step)} of weights: {body:,} layer matmul weights "
      f"+ {head:,} in the output head (+ norms)")
assert read_per_step == (body + head + (2 * c.num_hidden_layers + 1) * c.hidden_size) * itemsize

print(f"\n2. Prefill and decode, stepped by hand (prompt of {PROMPT_LEN} tokens, block_size {BLOCK_SIZE})")
ids = engine.tokenize(TEXT).token_ids
prompt = (ids * (PROMPT_LEN // len(ids) + 1))[:PROMPT_LEN]
greedy = SamplingParams(temperature=0.0, max_tokens=1 + DECODE_STEPS, ignore_eos=True)


def timed_step() -> tuple[float, int, int]:
    """One engine step: seconds, prompt tokens it processed, tokens it sampled (from get_stats)."""
    before = engine.get_stats()
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    after = engine.get_stats()
    return (seconds, after["prompt_tokens"] - before["prompt_tokens"],
            after["generation_tokens"] - before["generation_tokens"])


engine.add_request("warm-up", prompt, SamplingParams(max_tokens=2, ignore_eos=True))  # compile, touch weights
while engine.has_unfinished_requests():
    engine.step()
prefill_times, decode_times = [], []
for r in range(REPEATS):
    engine.add_request(f"solo-{r}", prompt, greedy)
    seconds, prompt_tokens, sampled = timed_step()
    assert (prompt_tokens, sampled) == (PROMPT_LEN, 1)   # the whole prompt in one pass, one token out
    prefill_times.append(seconds)
    for _ in range(DECODE_STEPS):
        seconds, prompt_tokens, sampled = timed_step()
        assert (prompt_tokens, sampled) == (0, 1)        # one new token for the one sequence
        decode_times.append(seconds)
    assert not engine.has_unfinished_requests()
prefill_s, decode_s = min(prefill_times), min(decode_times)
print(f"  prefill step: {PROMPT_LEN} prompt tokens in, 1 token sampled")
print("  decode step:  1 token in, 1 token sampled")
print(f"  prefill: {prefill_s * 1e3:7.1f} ms a step = {prefill_s / PROMPT_LEN * 1e3:6.2f} ms a token "
      f"({PROMPT_LEN / prefill_s:7.0f} tokens/s)")
print(f"  decode:  {decode_s * 1e3:7.1f} ms a step = {decode_s * 1e3:6.2f} ms a token "
      f"({1 / decode_s:7.0f} tokens/s)")
print(f"  a prompt token costs {decode_s / (prefill_s / PROMPT_LEN):.0f}x less than a generated one")
# The gap is usually an order of magnitude, so even a busy machine keeps it; the one timing we
# assert, and only that the gap exists: a prompt token is cheaper than a generated one.
assert prefill_s / PROMPT_LEN < decode_s

for i in range(DECODE_BATCH):
    engine.add_request(f"batch-{i}", prompt[i:i + BATCH_PROMPT_LEN], greedy)
seconds, prompt_tokens, sampled = timed_step()                   # their prefills, together
assert (prompt_tokens, sampled) == (BATCH_PROMPT_LEN * DECODE_BATCH, DECODE_BATCH)
batch_times = []
for _ in range(DECODE_STEPS):
    seconds, prompt_tokens, sampled = timed_step()
    assert (prompt_tokens, sampled) == (0, DECODE_BATCH)         # one token for every sequence
    batch_times.append(seconds)
batch_s = min(batch_times)
print(f"  decode of {DECODE_BATCH} sequences in one step: {DECODE_BATCH} tokens sampled a step")
print(f"  batched decode: {batch_s * 1e3:7.1f} ms a step for {DECODE_BATCH} tokens "
      f"({DECODE_BATCH / batch_s:7.0f} tokens/s, {batch_s / decode_s:.1f}x the time of one sequence's step)")
assert not engine.has_unfinished_requests()

print("\n3. Why: arithmetic intensity, FLOPs done per byte read")
# A matmul weight does one multiply and one add (2 FLOPs) per token that goes through it;
# the weights are read once per step however many tokens share it. Attention adds
# 2 x 2 x q_size FLOPs per layer per (query, context token) pair, and a decode step also
# reads the K and V of every context token of every sequence.
kv_token = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, itemsize)


def intensity(new_tokens: int, sequences: int, context: int) -> tuple[float, float]:
    """FLOPs and bytes of one step: ``sequences`` each add ``new_tokens`` after ``context`` cached ones."""
    pairs = sequences * sum(context + i + 1 for i in range(new_tokens))   # (query, key) pairs
    flops = 2 * sequences * new_tokens * body + 2 * sequences * head \
        + 4 * c.q_size * c.num_hidden_layers * pairs
    moved = read_per_step + sequences * (context + new_tokens) * kv_token  # weights, KV read + written
    return flops, moved


# the three steps timed above
PREFILL, DECODE, BATCH = "prefill", "decode, 1 sequence", f"decode, {DECODE_BATCH} sequences"
phases = {PREFILL: intensity(PROMPT_LEN, 1, 0), DECODE: intensity(1, 1, PROMPT_LEN),
          BATCH: intensity(1, DECODE_BATCH, BATCH_PROMPT_LEN)}
for name, (flops, moved) in phases.items():
    print(f"  {name:20} {flops / 1e9:7.2f} GFLOP over {fmt_bytes(moved):>10}: "
          f"{flops / moved:6.2f} FLOP/byte")
ratio = {name: flops / moved for name, (flops, moved) in phases.items()}
assert ratio[PREFILL] > 50 * ratio[DECODE]
assert ratio[DECODE] < 1
# Each sequence adds about 2 FLOPs per weight, 2 / itemsize FLOP per byte (0.5 in float32): a
# batch of 2 sits at about 1, so the batch is asserted above 1 only from 3 sequences on.
if DECODE_BATCH * 2 > itemsize:
    assert ratio[BATCH] > 1
print(f"  measured here: prefill computed {phases[PREFILL][0] / prefill_s / 1e9:.0f} GFLOP/s, "
      f"decode {phases[DECODE][0] / decode_s / 1e9:.0f} GFLOP/s while streaming "
      f"{phases[DECODE][1] / decode_s / 1e9:.1f} GB/s from memory")
ridge = A100_FP16_FLOPS / A100_BANDWIDTH
# In fp16 a decode step of B sequences does ~2 x B FLOPs per 2-byte weight: B FLOP/byte.
batch_for_ridge = round(ridge)
print(f"  an A100 computes {A100_FP16_FLOPS / 1e12:.0f} TFLOP/s but reads {A100_BANDWIDTH / 1e12:.3f} TB/s: "
      f"below {ridge:.0f} FLOP/byte (its ridge point) it waits for memory")
print(f"  in fp16, decode does about 1 FLOP/byte per sequence in the batch: it takes about "
      f"{batch_for_ridge} sequences decoding together to keep the A100's math units busy")
assert 190 < ridge < 210
print("  every one of those sequences keeps its KV cache in memory while it runs: how big is it?")

print("\n4. KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element")
m = LLAMA_13B
kv_13b = kv_bytes_per_token(m["layers"], m["kv_heads"], m["head_dim"], FP16)
weights_13b = llama_params(**m) * FP16
# Assumed, not computed: the PagedAttention paper's split of a 40 GB A100 serving LLaMA-13B,
# weights ~65% (checked below), KV cache ~30%, the rest for activations.
kv_space = 0.30 * A100_MEMORY
tokens_13b = int(kv_space // kv_13b)
seq_len = 2048
print(f"  LLaMA-13B in fp16: 2 x {m['layers']} x {m['kv_heads']} x {m['head_dim']} x {FP16} = "
      f"{kv_13b:,} bytes per token ({kv_13b // 1024} KiB)")
print(f"  weights: {llama_params(**m) / 1e9:.2f} B parameters = {fmt_bytes(weights_13b)}, "
      f"{weights_13b / A100_MEMORY:.0%} of a {A100_MEMORY / 1e9:.0f} GB A100")
print("  assumed split (the PagedAttention paper's setting): weights ~65%, KV cache ~30%, "
      "activations and the rest ~5%")
print(f"  KV space, 30% of the card: {fmt_bytes(kv_space)} -> {tokens_13b:,} tokens "
      f"-> {tokens_13b // seq_len} sequences of {seq_len} tokens ({fmt_bytes(seq_len * kv_13b)} each)")
assert kv_13b == 819_200 and kv_13b // 1024 == 800
assert 0.64 < weights_13b / A100_MEMORY < 0.66
assert tokens_13b == 14_648 and tokens_13b // seq_len == 7
print(f"  {tokens_13b // seq_len} sequences, where the arithmetic wanted about {batch_for_ridge}: "
      "every wasted KV slot costs batch size")

print(f"\n5. The same formula for {MODEL}, checked against the pool the engine allocated")
kv_fp32 = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, FP32)
kv_fp16 = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, FP16)
pool = engine.cache.kv_cache
shape = kv_cache_shape(c.num_hidden_layers, engine.cache.num_blocks, c.num_key_value_heads,
                       BLOCK_SIZE, c.head_dim)
print(f"  formula: 2 x {c.num_hidden_layers} x {c.num_key_value_heads} x {c.head_dim} x {FP32} = "
      f"{kv_fp32:,} bytes per token in float32 ({kv_fp32 / 1024:g} KiB)")
print(f"  the engine's pool: shape {pool.shape} (layers, K/V, blocks, kv_heads, block_size, head_dim), "
      f"{pool.dtype}")
print(f"  {pool.nbytes:,} bytes / ({engine.cache.num_blocks} blocks x {BLOCK_SIZE} slots) = "
      f"{pool.nbytes // (engine.cache.num_blocks * BLOCK_SIZE):,} bytes per token")
assert pool.dtype.itemsize == FP32 and pool.shape == shape
assert pool.nbytes == engine.cache.num_blocks * BLOCK_SIZE * kv_fp32
assert engine.cache.bytes_per_block == BLOCK_SIZE * kv_fp32
fp16_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, BLOCK_SIZE, c.head_dim, FP16)
print(f"  in float16 (the GPU default): {kv_fp16:,} bytes per token ({kv_fp16 / 1024:g} KiB)")
assert fp16_block == BLOCK_SIZE * kv_fp16 and 2 * kv_fp16 == kv_fp32
no_gqa = kv_bytes_per_token(c.num_hidden_layers, c.num_attention_heads, c.head_dim, FP32)
print(f"  grouped-query attention: {c.num_attention_heads} query heads share {c.num_key_value_heads} KV heads; "
      f"one KV head per query head would cost {no_gqa:,} bytes per token ({no_gqa // kv_fp32}x)")
full = c.max_position_embeddings
print(f"  one sequence of the full {full:,} tokens: {fmt_bytes(full * kv_fp32)} of KV, "
      f"{full * kv_fp32 / weight_bytes:.0%} of the {fmt_bytes(weight_bytes)} of weights (same ratio in fp16)")
crossover = read_per_step / kv_fp32
print(f"  a decode step reads all the weights once, plus the KV of every context token of every "
      f"sequence: past {crossover:,.0f} context tokens in the batch, the KV reads outweigh the weights")
print("\nDone: prefill is limited by arithmetic, decode by memory; batching fixes decode, and the "
      "KV cache limits the batch.")
print("\nExercises:\n" + __doc__.split("Exercises (also printed at the end):\n")[1].split("\n\n")[0].rstrip())
