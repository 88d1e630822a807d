"""Warm-up: a few dummy forward passes before the first request (the OS paging in its hot code at boot).

A fresh process pays for each kernel variant the first time it runs it: Numba loads it from
its cache on disk (or compiles it, on a first install), oneMKL sets up its buffers, the pool's
first pages are faulted in. A server's first client paid for all of that: on the 2-core CPU,
SmolLM2's first 190-token prompt took 0.89 s against 0.27-0.32 s for the next ones. vLLM runs
a profile pass (and captures CUDA graphs) before it serves; ``python -m minipaged serve`` runs
these passes before it prints its URL:

- one prompt of up to 256 tokens (the prefill's matrix products and its BLAS attention), and
  one of 16 (a chat turn's few tokens: shorter than the prompt path's threshold, they run as a
  chunk of a decode step, in the persistent kernel),
- decode batches of 1, 4, 16 and 64 sequences (the panels' or the packed products, the
  paged-attention kernel's serial and threaded compilations), each then sampled.

Nothing of the engine's state changes. The passes go straight to the executor, with block
tables of their own over the pool's first blocks; at start-up no request holds any block and
none is cached, and a block's slots are always written before attention reads them, so what
the passes leave there is never seen (the block-sparse bounds start afresh at a block's first
slot). Not run when ``calculate_kv_scales`` is set: its scales come from the first real step.
"""

from __future__ import annotations

import time

import numpy as np

from ..kernels.layout import AttentionMetadata
from ..sampling_params import SamplingParams
from .model_runner import ForwardInput
from .sampler import SampleRequest

PREFILL_TOKENS = 256                 # the warm-up prompt's length, at most
SHORT_PROMPT = 16                    # the short warm-up prompt's length
DECODE_BATCHES = (1, 4, 16, 64)      # sequences per warm-up decode step, at most


def dummy_input(num_seqs: int, query_len: int, seq_len: int, block_size: int, vocab: int) -> ForwardInput:
    """``num_seqs`` sequences of ``seq_len`` tokens whose last ``query_len`` are computed now,
    sequence s on blocks s * k .. s * k + k - 1 (k blocks each), each sampling one row."""
    blocks_each = -(-seq_len // block_size)
    tables = np.arange(num_seqs * blocks_each, dtype=np.int32).reshape(num_seqs, blocks_each)  # (S, k)
    positions = np.tile(np.arange(seq_len - query_len, seq_len, dtype=np.int64), num_seqs)    # (T,)
    owner = np.repeat(np.arange(num_seqs), query_len)                                           # (T,)
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    ids = (positions * 7919 + owner) % vocab                                                    # (T,) any tokens
    meta = AttentionMetadata(slot_mapping=slots,
                             query_start_loc=np.arange(num_seqs + 1, dtype=np.int32) * query_len,
                             seq_lens=np.full(num_seqs, seq_len, np.int32), block_tables=tables,
                             max_query_len=query_len, max_seq_len=seq_len)
    last_rows = np.arange(1, num_seqs + 1, dtype=np.int64) * query_len - 1                      # (S,)
    return ForwardInput(ids.astype(np.int64), positions, meta, last_rows)


def warm_up(engine, calculate_kv_scales: bool = False) -> float | None:
    """Run the warm-up passes through ``engine`` (an LLMEngine no request has used yet).

    Returns the seconds they took, or None when they were skipped: the pool already holds
    blocks (a request has run), or ``calculate_kv_scales`` wants the first real step's K/V.
    """
    bm = engine.block_manager
    cached = bm.cache is not None and bool(bm.cache.block_of)
    if calculate_kv_scales or bm.num_used_blocks or cached or engine.has_unfinished_requests():
        return None
    start = time.perf_counter()
    size, vocab = bm.block_size, engine.model_config.vocab_size
    limit = min(engine.max_model_len, engine.scheduler_config.max_num_batched_tokens)
    prompt = min(PREFILL_TOKENS, limit)
    shapes = []
    for length in sorted({prompt, min(SHORT_PROMPT, prompt)}, reverse=True):
        if -(-length // size) <= bm.num_blocks:
            shapes.append((1, length, length))
    context = min(size + 1, engine.max_model_len)              # two blocks each, the second begun
    per_seq = -(-context // size)
    for batch in DECODE_BATCHES:
        sched = engine.scheduler_config
        batch = min(batch, sched.max_num_seqs, sched.max_num_batched_tokens, bm.num_blocks // per_seq)
        if batch >= 1 and (batch, 1, context) not in shapes:
            shapes.append((batch, 1, context))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=0)   # the sampler's general path
    generator = np.random.default_rng(0)
    for num_seqs, query_len, seq_len in shapes:
        logits = engine.executor.execute_model(dummy_input(num_seqs, query_len, seq_len, size, vocab))
        engine.sampler(logits, [SampleRequest(params, generator, []) for _ in range(num_seqs)])
    return time.perf_counter() - start
