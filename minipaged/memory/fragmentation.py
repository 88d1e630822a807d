"""Where the KV pool's slots go: the accounting behind PagedAttention's central claim.

Every allocated slot (a token's room in a held block) is one of:
  used         it holds a token's K/V
  reserved     empty now, but a running request will fill it (its reservation)
  internal     empty, and no request will ever fill it (over-provisioned: never used)
and every free slot is free, or external when the request at the head of the queue
waits although there are enough free slots in total, because of how they lie.

utilization = used / allocated. The "future" of a running sequence is known up to
its horizon, min(prompt + max_tokens, max_model_len) - 1 slots (the last sampled
token is never cached). Each step is classified from what is known at that step:
a request that later stops early (EOS, a stop string, an abort) never writes the
rest of its reservation, and the paper would count those slots as internal after
the fact; here they stay "reserved" in the steps already recorded, so the waste
reported is a lower bound on traces that stop early. (The bench's memory trace
ignores EOS, so its requests reach their horizon.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .block_table import SLID_OUT


@dataclass(frozen=True)
class KVBreakdown:
    allocated: int   # slots in held blocks
    used: int
    reserved: int
    internal: int
    free: int
    external: int    # of the free slots, those a waiting request could use but for their layout
    running_requests: int

    @property
    def utilization(self) -> float:
        return self.used / self.allocated if self.allocated else 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "utilization": self.utilization}


def measure(block_manager, scheduler, max_model_len: int) -> KVBreakdown:
    """Classify every slot of the device pool from the real engine state."""
    size = block_manager.block_size
    filled: dict[int, int] = {}   # physical block -> slots holding tokens (shared blocks counted once)
    future: dict[int, int] = {}   # physical block -> slots that will hold tokens by the horizon
    for group in scheduler.running:
        params = group.sampling_params
        for seq in group.unfinished_seqs():
            table = block_manager.tables.get(seq.seq_id)
            if table is None or not table.resident:
                continue
            horizon = max(seq.num_prompt_tokens,
                          min(seq.num_prompt_tokens + params.max_tokens, max_model_len) - 1)
            blocks = table.block_ids + block_manager.reserved_blocks(seq)
            for i, block in enumerate(blocks):
                if block == SLID_OUT:         # slid out of a sliding window: no frame
                    continue
                filled[block] = max(filled.get(block, 0), min(max(seq.num_computed_tokens - i * size, 0), size))
                future[block] = max(future.get(block, 0), min(max(horizon - i * size, 0), size))
    allocated = block_manager.num_used_blocks * size
    used = sum(filled.values())
    reserved = sum(max(future[b] - filled[b], 0) for b in filled)
    free = block_manager.num_free_blocks * size
    head = scheduler.waiting[0] if scheduler.waiting else None
    external = free if head is not None and block_manager.blocked_by_fragmentation(head) else 0
    return KVBreakdown(allocated=allocated, used=used, reserved=reserved,
                       internal=allocated - used - reserved, free=free, external=external,
                       running_requests=len(scheduler.running))


def summarize(history: list[KVBreakdown]) -> dict:
    """Averages over the steps of a run (each step weighted equally) and the peaks."""
    if not history:
        return {}
    busy = [h for h in history if h.allocated]
    n = max(len(busy), 1)
    mean = lambda f: sum(f(h) for h in busy) / n  # noqa: E731
    return {
        "utilization": mean(lambda h: h.utilization),            # used / allocated, step average
        "used_fraction_of_allocated": mean(lambda h: h.used / h.allocated),
        "reserved_fraction_of_allocated": mean(lambda h: h.reserved / h.allocated),
        "internal_fraction_of_allocated": mean(lambda h: h.internal / h.allocated),
        "external_fraction_of_pool": sum(h.external / (h.allocated + h.free) for h in history) / len(history),
        "max_concurrent_requests": max(h.running_requests for h in history),
        "peak_allocated_slots": max(h.allocated for h in history),
        "steps": len(history),
    }
