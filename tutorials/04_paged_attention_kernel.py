"""Tutorial 4: the paged attention kernel, three ways.

Goal: put keys and values for two sequences into a small KV pool at scattered
physical blocks, run minipaged's plain CPU kernel (kernels/simple.py, the plain
tier of kernels/ops.py) on one flattened batch (a prefill and a decode together),
and check it three ways: against the NumPy spec (kernels/reference.py), against
plain dense causal attention on contiguous arrays, and against itself after moving
the data to other blocks. Then read the kernel itself (one Numba function, an
online softmax over blocks), see the fast tier compute the same, read the CUDA C
kernel the GPU runs (kernels/paged_attention.cu), and run that very source on the
CPU through the test harness (kernels/cuda_harness.py), which compiles it with g++
and runs one OS thread per CUDA thread: no GPU needed.

The OS analogy: the kernel is the MMU. A program (attention) reads "token j of
my context"; the hardware walks the page table (the block table) to find the
frame and offset, so the program never knows, or cares, where its memory lives.

Run it:  python tutorials/04_paged_attention_kernel.py   (steps 10-11 need g++)
"""

import inspect
from pathlib import Path

import numpy as np

from minipaged.kernels import cuda, reference, simple
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.layout import KEY, VALUE, AttentionMetadata, kv_cache_shape
from minipaged.kernels.simple import SimpleOps

ops = SimpleOps()                        # the plain tier: what `LLM(..., kernels="simple")` runs

rng = np.random.default_rng(0)
NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 8, 4, 8
NUM_HEADS, NUM_KV_HEADS = 4, 2           # grouped-query attention: 2 query heads per KV head
GROUP = NUM_HEADS // NUM_KV_HEADS
SCALE = HEAD_DIM ** -0.5

print("1. The pool: one array for every layer, keys and values")
kv = np.zeros(kv_cache_shape(1, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM), dtype=np.float32)
k_cache, v_cache = kv[0, KEY], kv[0, VALUE]  # each (num_blocks, num_kv_heads, block_size, head_dim)
print(f"  kv_cache shape {kv.shape} = (layers, K/V, blocks, kv_heads, block_size, head_dim)")
print(f"  one layer's keys: {k_cache.shape}; {NUM_BLOCKS * BLOCK_SIZE} token slots in all")

print("\n2. Two sequences, their blocks taken from a shuffled pool")
# Sequence P is a 6-token prompt (prefill). Sequence D already has 8 tokens in
# the cache and decodes its 9th now.
lens = {"P": 6, "D": 9}
free = [int(b) for b in rng.permutation(NUM_BLOCKS)]
tables = {name: [free.pop() for _ in range(-(-n // BLOCK_SIZE))] for name, n in lens.items()}
k = {name: rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for name, n in lens.items()}
v = {name: rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for name, n in lens.items()}
for name in lens:
    print(f"  {name}: {lens[name]} tokens in physical blocks {tables[name]}")


def slots(name: str, positions) -> np.ndarray:
    """slot = block_table[pos // block_size] * block_size + pos % block_size."""
    table = np.asarray(tables[name])
    pos = np.asarray(positions)
    return (table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).astype(np.int64)


print("\n3. An earlier step cached D's first 8 tokens: write_kv scatters them to their slots")
ops.write_kv(k_cache, v_cache, k["D"][:8], v["D"][:8], slots("D", range(8)))
print(f"  slots written: {slots('D', range(8)).tolist()}")

print("\n4. This step's batch, flattened: P's 6 prompt tokens, then D's 1 new token")
new_tokens = {"P": range(0, 6), "D": range(8, 9)}
slot_mapping = np.concatenate([slots(name, pos) for name, pos in new_tokens.items()])
ops.write_kv(k_cache, v_cache, np.concatenate([k["P"], k["D"][8:]]),
             np.concatenate([v["P"], v["D"][8:]]), slot_mapping)
q_lens = [len(pos) for pos in new_tokens.values()]
block_tables = np.full((2, max(len(t) for t in tables.values())), -1, dtype=np.int32)
for row, name in enumerate(lens):
    block_tables[row, :len(tables[name])] = tables[name]
meta = AttentionMetadata(
    slot_mapping=slot_mapping,
    query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
    seq_lens=np.asarray(list(lens.values()), dtype=np.int32),
    block_tables=block_tables,
    max_query_len=max(q_lens), max_seq_len=max(lens.values()))
print(f"  slot_mapping    {meta.slot_mapping.tolist()}")
print(f"  query_start_loc {meta.query_start_loc.tolist()}  (P owns rows 0..5, D owns row 6)")
print(f"  seq_lens        {meta.seq_lens.tolist()}")
print(f"  block_tables    {meta.block_tables.tolist()}  (-1 = padding)")
# Reading a context back through its block table gives the keys we wrote, in order.
for name, row in (("P", 0), ("D", 1)):
    gathered = reference.gather_context(k_cache, block_tables[row], lens[name])
    assert np.array_equal(gathered, k[name])

print("\n5. Run the plain kernel and the NumPy spec on the same batch")
q = rng.standard_normal((meta.num_tokens, NUM_HEADS, HEAD_DIM)).astype(np.float32)
out = ops.paged_attention(q, k_cache, v_cache, meta, SCALE)
spec = reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, SCALE)
print(f"  output {out.shape}; max |kernel - spec| = {np.abs(out - spec).max():.2e}")
assert np.allclose(out, spec, atol=1e-5)

print("\n6. The same thing without pages: dense causal softmax on contiguous arrays")


def dense_attention(q_rows: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """q_rows (n, H, D) are the LAST n tokens of a context of keys/values (L, Hkv, D)."""
    n, length = q_rows.shape[0], keys.shape[0]
    keys, values = np.repeat(keys, GROUP, axis=1), np.repeat(values, GROUP, axis=1)  # (L, H, D)
    scores = np.einsum("qhd,khd->hqk", q_rows, keys) * SCALE                           # (H, n, L)
    query_pos = np.arange(length - n, length)[:, None]
    scores = np.where(np.arange(length)[None, :] <= query_pos, scores, -np.inf)         # causal
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, values)                                  # (n, H, D)


dense = np.concatenate([dense_attention(q[0:6], k["P"], v["P"]), dense_attention(q[6:7], k["D"], v["D"])])
print(f"  max |kernel - dense| = {np.abs(out - dense).max():.2e}")
assert np.allclose(out, dense, atol=1e-5)

print("\n7. GQA: which KV head each query head reads")
for h in range(NUM_HEADS):
    print(f"  query head {h} -> KV head {h // GROUP}")
# Prove it: change D's values in KV head 1 only; only query heads 2 and 3 of D's row should move.
v_cache[tables["D"], 1] += 1.0
diff = np.abs(ops.paged_attention(q, k_cache, v_cache, meta, SCALE) - out).max(axis=-1)  # (T, H)
v_cache[tables["D"], 1] -= 1.0
changed = [h for h in range(NUM_HEADS) if diff[6, h] > 1e-6]
print(f"  after changing KV head 1 of D's blocks, D's query heads that changed: {changed}")
print(f"  P's rows changed by {diff[:6].max():.1e}: its block table never points at D's blocks")
assert changed == [h for h in range(NUM_HEADS) if h // GROUP == 1] and diff[:6].max() == 0

print("\n8. Physical placement does not matter: move every block and remap the tables")
perm = rng.permutation(NUM_BLOCKS)                  # old block b now lives at perm[b]
moved_kv = np.empty_like(kv)
moved_kv[:, :, perm] = kv
moved_meta = AttentionMetadata(
    slot_mapping=perm[slot_mapping // BLOCK_SIZE] * BLOCK_SIZE + slot_mapping % BLOCK_SIZE,
    query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
    block_tables=np.where(block_tables >= 0, perm[block_tables], -1).astype(np.int32),
    max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
out_moved = ops.paged_attention(q, moved_kv[0, KEY], moved_kv[0, VALUE], moved_meta, SCALE)
print(f"  new block tables {moved_meta.block_tables.tolist()}; "
      f"max |difference| = {np.abs(out_moved - out).max():.2e}")
assert np.allclose(out_moved, out, atol=1e-6)

print("\n9. The kernel itself: one Numba function a head, an online softmax over blocks")
# kernels/simple.py: _paged_attention gives each query token a thread (prange) and, for each head,
# calls _attend, which walks the sequence's block table block by block: the block's scores, a
# running max (the softmax's), the sum so far rescaled when the max grows, then p x v. Read it:
source = inspect.getsource(simple._attend.py_func).splitlines()
walk = [line for line in source if "for j in range" in line or "valid = " in line or "correction = " in line]
print(f"  _attend is {len(source)} lines; its page-table walk:")
for line in walk:
    print("    " + line.strip())
assert len(source) < 60 and len(walk) == 3
# The fast tier (kernels/fast/, tutorial 22) computes the same with registers, tiles of queries and
# split-K slices; the model and the engine never know which tier runs them.
fast = FastOps().paged_attention(q, k_cache, v_cache, meta, SCALE)
print(f"  the fast tier on the same batch: max |fast - plain| = {np.abs(fast - out).max():.2e}")
assert np.allclose(fast, out, atol=1e-5)

print("\n10. The CUDA C kernel: read it")
source = (Path(cuda.__file__).parent / "paged_attention.cu").read_text()
header = [line for line in source.splitlines()[:18] if line.startswith("//")]
print("  kernels/paged_attention.cu opens with its map:")
for line in header:
    print("    " + line)
# CudaOps is the GPU backend's host code; the harness build of it launches the same kernels on the CPU.
cuda_ops = cuda.cpu_harness_ops()   # g++ compiles each .cu once (cached in the temp directory)
gpu_plan = cuda_ops.plan_attention(meta)
decode_meta = AttentionMetadata(meta.slot_mapping[6:], np.array([0, 1], np.int32), meta.seq_lens[1:],
                                block_tables[1:], 1, int(meta.seq_lens[1]))
decode_plan = cuda_ops.plan_attention(decode_meta)
print(f"  our mixed batch is not decode-only ({gpu_plan.decode_only}): paged_prefill, grid = "
      f"({len(gpu_plan.tiles)} tiles, {NUM_HEADS} heads), {cuda.NUM_WARPS * 32} threads per block")
# The decode kernel gives a thread block a KV head and the query heads of its GQA group: each
# K and V row is read once for the whole group (decode_group_width: 1, 4 or 8 heads a block).
width, chunks = cuda.decode_group_width(NUM_HEADS, NUM_KV_HEADS)
print(f"  D alone is decode-only ({decode_plan.decode_only}): paged_decode, grid = ({NUM_KV_HEADS * chunks} "
      f"KV heads, each serving {NUM_HEADS // NUM_KV_HEADS} query heads, 1 sequence, "
      f"{decode_plan.num_partitions} partition)")
assert not gpu_plan.decode_only and decode_plan.decode_only and decode_plan.num_partitions == 1

print("\n11. Run the CUDA C source on the CPU (the harness: one OS thread per CUDA thread)")
cuda_out = cuda_ops.paged_attention(q, k_cache, v_cache, meta, SCALE)
print(f"  paged_prefill on the mixed batch: max |cuda - spec| = {np.abs(cuda_out - spec).max():.2e}")
assert np.allclose(cuda_out, spec, atol=1e-5)
cuda_decode = cuda_ops.paged_attention(q[6:7], k_cache, v_cache, decode_meta, SCALE)
print(f"  paged_decode on D alone:        max |cuda - spec| = {np.abs(cuda_decode - spec[6:7]).max():.2e}")
assert np.allclose(cuda_decode, spec[6:7], atol=1e-5)
# A long context splits into PARTITION_SIZE pieces (split-K): each thread block does one
# piece with its own online softmax, and paged_decode_reduce merges them by their max and sum.
LONG_BLOCK, LONG_LEN = 16, 1100
n_blocks = -(-LONG_LEN // LONG_BLOCK)
pool = rng.standard_normal((2, n_blocks + 3, NUM_KV_HEADS, LONG_BLOCK, HEAD_DIM)).astype(np.float32)
long_meta = AttentionMetadata(np.zeros(1, np.int64), np.array([0, 1], np.int32),
                              np.array([LONG_LEN], np.int32),
                              rng.permutation(n_blocks + 3)[None, :n_blocks].astype(np.int32), 1, LONG_LEN)
long_plan = cuda_ops.plan_attention(long_meta)
q_long = rng.standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(np.float32)
long_out = cuda_ops.paged_attention(q_long, pool[0], pool[1], long_meta, SCALE)
long_spec = reference.paged_attention(q_long, pool[0], pool[1], long_meta.block_tables, long_meta.seq_lens,
                                      long_meta.query_start_loc, SCALE)
print(f"  a {LONG_LEN}-token context: {long_plan.num_partitions} partitions of {cuda.PARTITION_SIZE} "
      f"(split-K) + reduce: max |cuda - spec| = {np.abs(long_out - long_spec).max():.2e}")
assert long_plan.num_partitions == -(-LONG_LEN // cuda.PARTITION_SIZE) and np.allclose(long_out, long_spec, atol=1e-5)
print("\nDone: one kernel call served a prefill and a decode, reading K/V through block tables;")
print("the NumPy spec, the plain kernel, the fast tier and the CUDA C kernel agree.")
print("""
Exercises:
  1. Set NUM_KV_HEADS = 4 (plain multi-head attention, no sharing) and rerun. Which query heads
     does step 7 show changing now, and how much bigger is the pool for the same tokens?
  2. Change the kernel: in kernels/simple.py, _attend, drop the causal cut (make `valid` always
     block_size) and rerun. Which step's check fails, and for which sequence's rows? Put it back,
     then run `python -m minipaged chat --kernels simple`: the whole engine on your kernel.
  3. In kernels/paged_attention.cu, paged_decode hands KV blocks to warps in turn. For a
     100-token context with block_size 16, which blocks does warp 2 read? Check your answer by
     printing `b` for each warp in a small Python loop written from the kernel's for statement.""")
