"""The model families through the CUDA C kernels (on the CPU harness), against transformers' own
logits (tests/data/families, written by scripts/make_family_checkpoints.py):

- qwen2:   q/k/v biases, a window of 16 on layers 1 and 2 (layer 0 reads every token);
- qwen3:   q/k norms (the rms_norm kernel over each head), a bf16 checkpoint: run in bfloat16,
           as a GPU runs it;
- mistral: a window of 16 on every layer, so the blocks wholly before it are freed (-1 in the
           table) while the model goes on.

The first 28 tokens of transformers' 40-token prompt (its logits of each row are causal, so
a prefix's are the same): two chunks (20, then 4 reading past the window: the prefill kernel),
then one token at a time (the decode kernel, split into partitions of 8 positions: split-K with
a window). Every layer's K and V cache has NaN in its block -1, so a freed block followed would
show."""

import json
from pathlib import Path

import numpy as np
import pytest

from minipaged.kernels import cuda
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel
from minipaged.model.weights import load_checkpoint

FAMILIES = Path(__file__).parent / "data" / "families"
CHUNKS = [(0, 20), (20, 24), (24, 25), (25, 26), (26, 27), (27, 28)]   # (first, last) positions


@pytest.fixture(scope="module")
def ops():
    return cuda.cpu_harness_ops()


def guarded_pool(shape, dtype):
    """A zeroed KV pool (layers, 2, blocks, KVH, B, D) whose every layer's K and V cache has NaN in
    its block -1 (one NaN block before the pool, and one after each cache, never used)."""
    layers, _, blocks, *rest = shape
    room = np.full((1 + layers * 2 * (blocks + 1), *rest), np.nan, dtype)
    pool = room[1:].reshape(layers, 2, blocks + 1, *rest)
    pool[:, :, :blocks] = 0
    return pool[:, :, :blocks]           # each kv[i, 0], kv[i, 1] stays C-contiguous


def paged_logits(model, config, ids, chunks, block_size=4):
    """The logits of every row of each chunk (first, last) of ``ids``, run through a paged pool on
    shuffled blocks. Where every layer slides, the blocks wholly before the next step's window are
    -1 in the table, as the block manager frees them."""
    num_blocks = -(-len(ids) // block_size)
    table = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)[None, :]    # (1, blocks)
    kv = guarded_pool(kv_cache_shape(config.num_hidden_layers, num_blocks, config.num_key_value_heads,
                                     block_size, config.head_dim), model.weights.embed.dtype)
    slots = np.array([table[0, p // block_size] * block_size + p % block_size for p in range(len(ids))])
    rows = []
    for first, last in chunks:
        if config.sliding_window:        # every layer slides: the blocks before first's window are freed
            table[0, :max(first - config.sliding_window + 1, 0) // block_size] = -1
        n = last - first
        meta = AttentionMetadata(slots[first:last], np.array([0, n], np.int32), np.array([last], np.int32),
                                 table.copy(), n, last)
        rows.append(model.forward(np.array(ids[first:last]), np.arange(first, last), kv, meta, np.arange(n)))
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("family, dtype", [("qwen2", "float32"), ("qwen3", "bfloat16"), ("mistral", "float32")])
def test_a_family_through_the_cuda_kernels_matches_transformers(ops, family, dtype):
    ops = cuda.cpu_harness_ops(split_k_above=20, partition_size=8)      # the decodes (contexts 25..) in partitions of 8
    config = LlamaConfig.from_dir(FAMILIES / family)
    prompt = json.loads((FAMILIES / family / "expected.json").read_text())["prompts"][1]
    wanted = np.load(FAMILIES / family / "expected_logits.npz")["prompt_logits_1"][:CHUNKS[-1][1]]  # (28, vocab)
    dtype = np.dtype(np.float32) if dtype == "float32" else cuda.BFLOAT16
    model = LlamaModel(config, load_checkpoint(FAMILIES / family), ops, dtype=dtype)
    got = paged_logits(model, config, prompt[:CHUNKS[-1][1]], CHUNKS)   # (28, vocab)
    # float32: transformers' float32 forward summed in another order (the dense reference's rule);
    # bfloat16: every op's output rounded to 8 significant bits, compounded over the layers
    # (tests/test_cuda_kernels.py's whole-model test)
    tolerance = (2e-3 if dtype == np.float32 else 2.0**-5) * np.abs(wanted).max()
    np.testing.assert_allclose(got, wanted, atol=tolerance)
