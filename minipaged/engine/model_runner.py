"""ModelRunner: turns a scheduled step into flat arrays, runs the model, returns logits.

This is where the virtual addresses become physical ones: each new token gets
its slot (``block_table[pos // block_size] * block_size + pos % block_size``)
and each sequence's block table is handed to attention, like a page-table base
register loaded before a process runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.layout import AttentionMetadata
from ..model.llama import LlamaModel
from ..scheduler.scheduler import ScheduledSeq
from ..sequence import Sequence


@dataclass
class ModelInput:
    input_ids: np.ndarray       # (T,) int64 the tokens computed this step, sequence after sequence
    positions: np.ndarray       # (T,) int64 their positions in their own sequences
    meta: AttentionMetadata
    logits_indices: np.ndarray  # (N,) int64 batch rows whose next token is sampled (a row
                                #       repeats for samples that share one prompt computation)
    sampled: list[tuple[ScheduledSeq, Sequence]]  # (N,) the scheduled item and the sample drawing


def build_model_input(scheduled: list[ScheduledSeq], block_tables: list[list[int]],
                      block_size: int) -> ModelInput:
    """Flatten the step: every scheduled sequence contributes its next ``num_new_tokens`` tokens."""
    ids, positions, slots, q_lens, seq_lens, logits_rows, sampled = [], [], [], [], [], [], []
    row = 0
    for item, table in zip(scheduled, block_tables):
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens                       # first position computed now
        pos = np.arange(start, start + n, dtype=np.int64)     # (n,)
        table_arr = np.asarray(table, dtype=np.int64)          # (blocks,)
        ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
        positions.append(pos)
        slots.append(table_arr[pos // block_size] * block_size + pos % block_size)
        q_lens.append(n)
        seq_lens.append(start + n)
        row += n
        if item.do_sample:
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
    return ModelInput(np.concatenate(ids), np.concatenate(positions), meta,
                      np.asarray(logits_rows, dtype=np.int64), sampled)


class ModelRunner:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.xp = model.ops.xp

    def execute(self, model_input: ModelInput, kv_cache):
        """Run one step; returns the logits of the sampled rows, (N, vocab), on the device."""
        xp = self.xp
        m = model_input.meta
        meta = AttentionMetadata(
            slot_mapping=xp.asarray(m.slot_mapping), query_start_loc=xp.asarray(m.query_start_loc),
            seq_lens=xp.asarray(m.seq_lens), block_tables=xp.asarray(m.block_tables),
            max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
        logits = self.model.forward(xp.asarray(model_input.input_ids), xp.asarray(model_input.positions),
                                    kv_cache, meta, xp.asarray(model_input.logits_indices))
        return logits
