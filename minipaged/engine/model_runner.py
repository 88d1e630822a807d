"""ModelRunner: turns a scheduled step into flat arrays, runs the model, returns logits.

This is where the virtual addresses become physical ones: each new token gets
its slot (``block_table[pos // block_size] * block_size + pos % block_size``)
and each sequence's block table is handed to attention, like a page-table base
register loaded before a process runs.

Logits are computed only for the rows that need them: the last new token of each
sequence that samples, and, for a request that asked for ``prompt_logprobs``,
every prompt position (each predicts the prompt token after it), chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.layout import AttentionMetadata
from ..model.llama import LlamaModel
from ..scheduler.scheduler import ScheduledSeq
from ..sequence import Sequence, SequenceGroup


@dataclass
class PromptLogprobRows:
    """A run of logits rows that score one request's prompt tokens (``prompt_logprobs``)."""

    group: SequenceGroup
    first_token: int            # index in the prompt of the token the first row predicts
    token_ids: np.ndarray       # (M,) int64 the prompt tokens the rows predict, in order


@dataclass(frozen=True)
class ForwardInput:
    """What every worker receives for one forward pass: plain arrays, none of the driver's objects
    (the block tables in ``meta`` are the driver's one set, the same for every worker)."""

    input_ids: np.ndarray       # (T,) int64
    positions: np.ndarray       # (T,) int64
    meta: AttentionMetadata
    logits_indices: np.ndarray  # (R,) int64


@dataclass
class ModelInput:
    input_ids: np.ndarray       # (T,) int64 the tokens computed this step, sequence after sequence
    positions: np.ndarray       # (T,) int64 their positions in their own sequences
    meta: AttentionMetadata
    logits_indices: np.ndarray  # (N + V + M,) int64 batch rows that get logits: first the N sampled
                                #       rows (a row repeats for samples that share one prompt
                                #       computation), then the V rows of the speculating items
                                #       (k + 1 each), then the M rows of prompt_rows, in order
    sampled: list[tuple[ScheduledSeq, Sequence]]  # (N,) the scheduled item and the sample drawing
    prompt_rows: list[PromptLogprobRows]          # the M prompt rows, run by run
    verify: list[ScheduledSeq]  # speculating decodes: the newest token and k drafts, all scored

    def forward_input(self) -> ForwardInput:
        return ForwardInput(self.input_ids, self.positions, self.meta, self.logits_indices)


def build_model_input(scheduled: list[ScheduledSeq], block_tables: list[list[int]],
                      block_size: int, prompt_logprobs_from: dict[str, int] | None = None) -> ModelInput:
    """Flatten the step: every scheduled sequence contributes its next ``num_new_tokens`` tokens.

    ``prompt_logprobs_from``: request id -> the first prompt position whose logits it still
    needs (what it already has is not asked again, e.g. after a preemption by
    recomputation); position p's logits predict prompt token p + 1, so the rows run up to
    the prompt's second-to-last position. Requests not in it get no prompt rows.
    """
    ids, positions, slots, q_lens, seq_lens, logits_rows, sampled = [], [], [], [], [], [], []
    prompt_rows, prompt_logits_rows, verify, verify_rows = [], [], [], []
    wanted = dict(prompt_logprobs_from or {})
    row = 0
    for item, table in zip(scheduled, block_tables):
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens                       # first position computed now
        pos = np.arange(start, start + n, dtype=np.int64)     # (n,)
        table_arr = np.asarray(table, dtype=np.int64)          # (blocks,)
        drafts = item.draft_token_ids                         # speculative: after the newest token
        ids.append(np.asarray(seq.token_ids[start:start + n - len(drafts)] + list(drafts), dtype=np.int64))
        positions.append(pos)
        slots.append(table_arr[pos // block_size] * block_size + pos % block_size)
        q_lens.append(n)
        seq_lens.append(start + n)
        request_id = item.group.request_id
        if request_id in wanted:
            first = max(start, wanted[request_id])
            last = min(start + n, seq.num_prompt_tokens - 1)  # positions [first, last) are scored
            if first < last:
                prompt_logits_rows.append(np.arange(row + first - start, row + last - start, dtype=np.int64))
                prompt_rows.append(PromptLogprobRows(
                    item.group, first + 1, np.asarray(seq.prompt_token_ids[first + 1:last + 1], dtype=np.int64)))
                wanted[request_id] = last                     # (another sample of it: not twice)
        row += n
        if drafts:                                            # every position predicts the next
            verify_rows.append(np.arange(row - n, row, dtype=np.int64))
            verify.append(item)
        elif item.do_sample:
            for sample in [seq, *item.followers]:             # the last new token predicts the next
                logits_rows.append(row - 1)
                sampled.append((item, sample))
    max_blocks = max(len(t) for t in block_tables)
    tables = np.full((len(block_tables), max_blocks), -1, dtype=np.int32)  # (S, max_blocks)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = t
    query_start_loc = np.zeros(len(q_lens) + 1, dtype=np.int32)            # (S+1,)
    query_start_loc[1:] = np.cumsum(q_lens)
    meta = AttentionMetadata(
        slot_mapping=np.concatenate(slots),
        query_start_loc=query_start_loc,
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    logits_indices = np.concatenate([np.asarray(logits_rows, dtype=np.int64), *verify_rows, *prompt_logits_rows])
    return ModelInput(np.concatenate(ids), np.concatenate(positions), meta, logits_indices, sampled,
                      prompt_rows, verify)


class ModelRunner:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.xp = model.ops.xp

    def _device_meta(self, m: AttentionMetadata) -> AttentionMetadata:
        xp = self.xp
        return AttentionMetadata(
            slot_mapping=xp.asarray(m.slot_mapping), query_start_loc=xp.asarray(m.query_start_loc),
            seq_lens=xp.asarray(m.seq_lens), block_tables=xp.asarray(m.block_tables),
            max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            host_query_start_loc=None if xp is np else np.asarray(m.query_start_loc))

    def execute(self, model_input: ModelInput | ForwardInput, kv_cache, layer_quant=None, layer_bounds=None):
        """Run one step of the whole model; returns the logits of ``logits_indices``, (N + M, vocab),
        on the device: the sampled rows, then the prompt rows. ``layer_quant``:
        CacheEngine.layer_quant for a compressed cache; ``layer_bounds``: CacheEngine.layer_bounds
        for block-sparse decode."""
        xp = self.xp
        return self.model.forward(xp.asarray(model_input.input_ids), xp.asarray(model_input.positions),
                                  kv_cache, self._device_meta(model_input.meta),
                                  xp.asarray(model_input.logits_indices), layer_quant, layer_bounds)

    def run(self, model_input: ModelInput | ForwardInput, hidden, kv_cache, layer_quant=None, layer_bounds=None):
        """A shard's part of one step, as ``LlamaModel.run``'s generator. ``hidden``: (T, hidden)
        the previous stage's output, or None on the first stage (which reads the token ids)."""
        xp = self.xp
        inputs = xp.asarray(model_input.input_ids) if hidden is None else xp.asarray(hidden)
        return self.model.run(inputs, xp.asarray(model_input.positions), kv_cache,
                              self._device_meta(model_input.meta), xp.asarray(model_input.logits_indices),
                              layer_quant, layer_bounds)
