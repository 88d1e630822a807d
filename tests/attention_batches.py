"""A random batch for the attention tests: shuffled physical blocks, partial last blocks."""

import numpy as np

from minipaged.kernels.layout import AttentionMetadata


def random_batch(rng, *, block_size, num_heads, num_kv_heads, head_dim, seqs, dtype=np.float32):
    """q (T, heads, head_dim), the K and V pools, and their AttentionMetadata for ``seqs``:
    (query_len, seq_len) pairs, each sequence on scattered blocks of the pool."""
    blocks_per_seq = [-(-n // block_size) for _, n in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = rng.standard_normal(shape).astype(dtype)
    v_cache = rng.standard_normal(shape).astype(dtype)
    physical = rng.permutation(num_blocks)
    tables = np.full((len(seqs), max(blocks_per_seq)), -1, dtype=np.int32)   # (S, max_blocks)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = physical[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)   # (S+1,)
    seq_lens = np.array([n for _, n in seqs], dtype=np.int32)                      # (S,)
    q = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(dtype)
    meta = AttentionMetadata(np.zeros(int(qsl[-1]), np.int64), qsl, seq_lens, tables,
                             max(q for q, _ in seqs), int(seq_lens.max()))
    return q, k_cache, v_cache, meta
