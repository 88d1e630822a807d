"""The draft model of speculative decoding: one page table, two physical pools.

``speculative_config = {"method": "draft_model", "model": ..., "num_speculative_tokens": k}``: a
second, smaller Llama with the target's tokenizer drafts the k tokens. It keeps its own KV
cache in a pool of its own (its layers, its heads), indexed by the same block ids: every
sequence's block table maps a logical block to one physical block number, which names a
frame in both pools, as one page table entry could name a frame in two memories. So the
block manager plans once, and each plan acts on both pools: a swap moves the block in both,
a copy-on-write copies it in both, a free frees it for both.

Each sequence records how many of its positions have K/V in the draft's pool
(``Sequence.draft_num_computed_tokens``); before drafting, the draft catches up on the rest
(the prompt, after a prefix-cache hit or a recomputation, or what the target produced since).
A block shared by prefix caching may be written again by another sequence's catch-up: the
K/V of a position are a function of the tokens up to it, the same for every sharer.

Drafting runs k passes of the draft over the speculating sequences: the first over each
one's catch-up tokens through its newest token, then one per draft token. Each pass samples
the next draft token as the request asks (greedy; or its temperature, top-k, top-p, min-p and
penalties), and keeps that distribution: the rejection rule needs q (engine/rejection_sampler.py).
After the target's verdict the draft's valid positions are cut back to what stood.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...config import CacheConfig, ConfigError
from ...kernels.layout import AttentionMetadata
from ...kernels.fast.linear_paths import LinearPaths
from ...model.config import LlamaConfig
from ...model.fetch import resolve_model
from ...model.llama import LlamaModel
from ...model.tokenizer import Tokenizer
from ...model.weights import load_checkpoint
from ...scheduler.scheduler import ScheduledSeq
from ..cache_engine import CacheEngine, block_bytes
from ..linear_calibration import packs_anything
from .rejection_sampler import draw
from ..sampler import SampleRequest, shaped_probs, to_host


def load_draft_config(model: str, target_config, target_tokenizer, max_model_len: int):
    """(directory, LlamaConfig) of the draft model, refused before loading if it cannot draft
    for this target: another vocabulary, or fewer positions than max_model_len."""
    model_dir = resolve_model(model)
    config = LlamaConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    if config.vocab_size != target_config.vocab_size:
        raise ConfigError(f"the draft model {model!r} has a vocabulary of {config.vocab_size} tokens, the "
                          f"target {target_config.vocab_size}: a draft must share the target's tokenizer")
    ours, theirs = target_tokenizer.backend.get_vocab(with_added_tokens=True), tokenizer.backend.get_vocab(with_added_tokens=True)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:1]
        raise ConfigError(f"the draft model {model!r} has another tokenizer than the target's (e.g. "
                          f"token {differ[0][1]} is {differ[0][0]!r} in only one of them): a draft must "
                          "share the target's tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ConfigError(f"the draft model {model!r} handles {config.max_position_embeddings} positions, "
                          f"fewer than max_model_len={max_model_len}")
    return model_dir, config


def draft_cache_config(cache_config: CacheConfig) -> CacheConfig:
    """The draft's pool stores plain floats: compression and sparse attention are the target's."""
    return dataclasses.replace(cache_config, kv_cache_dtype="auto", calculate_kv_scales=False,
                               sparse_attention_budget=None, num_blocks=None)


class DraftModel:
    def __init__(self, model_dir, config, backend, max_model_len: int, max_tokens_per_pass: int) -> None:
        """The draft's weights, on the target's ``backend`` (its device, kernels and linear
        layers' engines); its pool comes once the target's is sized (``attach_pool``).
        ``max_tokens_per_pass``: a catch-up pass computes at most this many tokens (the step's
        token budget, which the GPU's pool sizing measured a pass of)."""
        self.config = config
        ops, dtype = backend.ops, backend.dtype
        # the target's engines, timed on the target's shape; a draft of which oneMKL would pack
        # no weight runs ours throughout (its "mkl" steps would multiply nothing packed)
        paths = backend.linear_paths if packs_anything(config) else LinearPaths.every("numba")
        if paths != backend.linear_paths:    # the fast tier's, with the draft's own engines
            ops = ops.with_paths(paths, backend.gemm if "mkl" in paths.used() else None)
        self.model = LlamaModel(config, load_checkpoint(model_dir), ops, dtype, max_positions=max_model_len)
        self.ops, self.dtype = ops, dtype
        self.max_tokens_per_pass = max_tokens_per_pass
        self.cache: CacheEngine | None = None
        self.xp = ops.xp

    def attach_pool(self, cache_config: CacheConfig, num_blocks: int, num_cpu_blocks: int) -> None:
        """The draft's KV pool: as many blocks (and swap blocks) as the target's, the same ids."""
        self.cache = CacheEngine(self.config, dataclasses.replace(draft_cache_config(cache_config),
                                                                  num_blocks=num_blocks),
                                 self.ops, self.dtype, num_cpu_blocks=num_cpu_blocks)

    @staticmethod
    def bytes_per_block(config, cache_config: CacheConfig, dtype) -> int:
        return block_bytes(config, draft_cache_config(cache_config), dtype)

    def propose(self, items: list[ScheduledSeq], tables: list[list[int]], block_size: int, sampler,
                generators: dict, banned) -> dict[int, np.ndarray]:
        """Write each item's draft tokens into its ``draft_token_ids`` (whose length the scheduler
        fixed) and return, per sequence id, the draft's distributions (k, V) for sampled requests.
        ``banned(item, ahead)`` gives the request's banned tokens that many tokens further on."""
        drafted = {item.seq.seq_id: [] for item in items}
        q_rows = {item.seq.seq_id: [] for item in items}
        # Catch up: every position before the newest token, in passes of at most
        # max_tokens_per_pass tokens (a long prompt is read in chunks, as chunked prefill does).
        while True:
            room, runs, caught_up = self.max_tokens_per_pass, [], []
            for item, table in zip(items, tables):
                seq = item.seq
                start, end = seq.draft_num_computed_tokens, seq.num_tokens - 1
                if end > start and room > 0:
                    end = min(end, start + room)
                    runs.append((table, seq.token_ids, start, end))
                    caught_up.append((seq, end))
                    room -= end - start
            if not runs:
                break
            self._forward(runs, block_size, want_logits=False)
            for seq, end in caught_up:
                seq.draft_num_computed_tokens = end
        longest = max(len(item.draft_token_ids) for item in items)
        for j in range(longest):   # one pass per draft token: the newest token, then each draft
            batch = [(item, table) for item, table in zip(items, tables) if len(item.draft_token_ids) > j]
            runs = []
            for item, table in batch:
                seq = item.seq
                newest = seq.num_tokens - 1 + j                     # the position this pass computes
                runs.append((table, seq.token_ids + drafted[seq.seq_id], newest, newest + 1))
            logits = self._forward(runs, block_size, want_logits=True)         # (S, vocab)
            for row, (item, _) in enumerate(batch):
                seq, params = item.seq, item.group.sampling_params
                request = SampleRequest(params, generators[seq.seq_id], banned(item, j), seq.prompt_token_ids,
                                        seq.output_token_ids + drafted[seq.seq_id])
                adjusted = sampler.adjust(logits[row:row + 1], [request])            # (1, V)
                if params.greedy:
                    token = int(to_host(adjusted.argmax(axis=-1))[0])
                else:
                    probs = to_host(shaped_probs(adjusted[0], params, self.xp))           # (V,) the draft's q
                    q_rows[seq.seq_id].append(probs)
                    token = draw(probs, request.generator)
                drafted[seq.seq_id].append(token)
        out = {}
        for item in items:
            seq = item.seq
            k = len(item.draft_token_ids)
            item.draft_token_ids[:] = drafted[seq.seq_id]
            # the draft's pool now holds the newest token and drafts 1 .. k-1 (not the k-th)
            seq.draft_num_computed_tokens = seq.num_tokens - 1 + k
            if q_rows[seq.seq_id]:
                out[seq.seq_id] = np.stack(q_rows[seq.seq_id])
        return out

    def _forward(self, runs: list[tuple], block_size: int, want_logits: bool):
        """One pass of the draft over runs of (block table, token ids, first position, end
        position): each computes positions [first, end) and writes their K/V into the draft's
        pool at the table's slots. Returns the logits of each run's last position (S, vocab)."""
        xp = self.xp
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for table, text, start, end in runs:
            pos = np.arange(start, end, dtype=np.int64)                    # (n,)
            table_arr = np.asarray(table, dtype=np.int64)                  # (blocks,)
            ids.append(np.asarray(text[start:end], dtype=np.int64))
            positions.append(pos)
            slots.append(table_arr[pos // block_size] * block_size + pos % block_size)
            q_lens.append(end - start)
            seq_lens.append(end)
        block_tables = np.full((len(runs), max(len(r[0]) for r in runs)), -1, np.int32)   # (S, max_blocks)
        for i, run in enumerate(runs):
            block_tables[i, :len(run[0])] = run[0]
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)                  # (S + 1,)
        meta = AttentionMetadata(xp.asarray(np.concatenate(slots)), xp.asarray(qsl),
                                 xp.asarray(np.asarray(seq_lens, np.int32)), xp.asarray(block_tables),
                                 max(q_lens), max(seq_lens))
        rows = qsl[1:] - 1 if want_logits else np.zeros(0, np.int64)
        return self.model.forward(xp.asarray(np.concatenate(ids)), xp.asarray(np.concatenate(positions)),
                                  self.cache.kv_cache, meta, xp.asarray(rows))
