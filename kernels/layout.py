"""The KV cache layout and the attention metadata: the "hardware page table" format.

Everything that touches the KV cache (the kernels, the cache engine, the tests)
takes its shapes from here, so the layout is defined exactly once.

One array holds the whole cache, for every layer, keys and values::

    kv_cache: (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
                           ^ 0 = keys, 1 = values

    one physical block of one layer (keys), head-major:
        head 0: [slot 0: head_dim floats][slot 1]...[slot block_size-1]
        head 1: [slot 0 ...]

With a compressed cache (``kv_cache_dtype`` int8 / fp8, ``kernels/kv_quant.py``) the same
array holds one byte per value, and a second one holds the scales::

    kv_scales: int8: (num_layers, 2, num_blocks, num_kv_heads, block_size)  one per token and head
               fp8:  (num_layers, 2, 1, 1, 1)                               one per layer, K and V

An int8 block's scales are indexed by the same block id, so whatever moves a block (a swap,
a copy-on-write) moves its scales with the same block mapping.

A *slot* is ``block_id * block_size + offset``: the physical address of one
token's K/V, the way a physical address is ``frame * page_size + offset``.

Head-major blocks keep the ``block_size x head_dim`` tile that one attention
head reads contiguous in memory, and a whole block (all heads) is still one
contiguous chunk per layer, so copy-on-write and swapping move plain slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEY, VALUE = 0, 1


def kv_cache_shape(num_layers: int, num_blocks: int, num_kv_heads: int,
                   block_size: int, head_dim: int) -> tuple[int, ...]:
    """Shape of the single array that holds the paged KV cache of a model."""
    return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int,
                       head_dim: int, itemsize: int, scale_bytes: int = 0, key_bounds: bool = False) -> int:
    """Bytes one physical block occupies across all layers, keys and values, with
    ``scale_bytes`` of scale per (token, KV head) for each of K and V (int8: 4), and with
    ``key_bounds`` block-sparse attention's float32 [min | max] of its keys per KV head."""
    bounds = 2 * num_layers * num_kv_heads * head_dim * 4 if key_bounds else 0
    return 2 * num_layers * num_kv_heads * block_size * (head_dim * itemsize + scale_bytes) + bounds


def kv_scales_shape(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                    per_token: bool) -> tuple[int, ...]:
    """Shape of the scales array of a compressed cache (per token and head, or per layer)."""
    if per_token:
        return (num_layers, 2, num_blocks, num_kv_heads, block_size)
    return (num_layers, 2, 1, 1, 1)


def key_bounds_shape(num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Block-sparse attention's page metadata: per layer, [min | max] of each block's keys."""
    return (num_layers, 2, num_blocks, num_kv_heads, head_dim)


@dataclass(frozen=True)
class BlockBounds:
    """One layer's page metadata for block-sparse decode attention (Quest), and its budget."""

    key_min: np.ndarray      # (num_blocks, num_kv_heads, head_dim) element-wise min of the keys written
    key_max: np.ndarray      # (num_blocks, num_kv_heads, head_dim) element-wise max
    keep: int                # blocks a decoding query head attends to (the token budget // block_size)


@dataclass(frozen=True)
class KVQuant:
    """How one layer's K/V blocks are stored when they are not plain floats."""

    fmt: int                 # kv_quant.KV_INT8, KV_FP8_E4M3 or KV_FP8_E5M2
    k_scale: np.ndarray      # int8: (num_blocks, num_kv_heads, block_size); fp8: (1, 1, 1) float32
    v_scale: np.ndarray
    calibrate: bool = False  # fp8 with calculate_kv_scales, first step: set the scales from this K/V


@dataclass(frozen=True)
class AttentionMetadata:
    """What paged attention needs to know about one flattened batch.

    The batch holds the new tokens of S sequences back to back: sequence s owns
    query rows ``query_start_loc[s] : query_start_loc[s+1]``. Those are the
    *last* tokens of its context, so query row i of sequence s sits at position
    ``seq_lens[s] - q_len_s + i`` and attends to positions ``0 .. that``.
    Prefill (q_len = prompt), chunked prefill and prefix-cache hits
    (q_len < seq_len) and decode (q_len = 1) are all the same case.
    """

    slot_mapping: np.ndarray     # (T,) int64  slot each new token's K/V is written to; -1 = skip
    query_start_loc: np.ndarray  # (S+1,) int32 cumulative query counts
    seq_lens: np.ndarray         # (S,) int32  context length of each sequence, new tokens included
    block_tables: np.ndarray     # (S, max_blocks) int32 physical block ids, -1 padded
    max_query_len: int           # longest query run (1 for a batch of decodes)
    max_seq_len: int
    # query_start_loc as a host array, where the others live on a GPU: the CUDA kernels' prefill
    # tiles are planned from it without reading the device copy back (None: read it back)
    host_query_start_loc: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
