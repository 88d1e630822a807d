"""Tutorial 3: blocks and block tables.

Goal: drive minipaged's memory manager yourself, with no model, and watch a
request's tokens get physical addresses; then run the real engine on the
classic walk-through ("Four score and seven years ago our", block size 4) and
draw its pool and page tables from the engine's own state.

The OS analogy: the KV pool is physical memory cut into frames (KV blocks of
``block_size`` token slots). Each sequence is a process with a page table
(BlockTable) mapping its logical blocks to whichever frames were free. The
BlockManager is the virtual-memory manager: it admits a process only if its
pages fit, hands out one more frame when the last page fills up, and takes every
frame back when the process exits. Because frames can be anywhere, nothing has
to be reserved in advance, and at most one partly filled block per sequence is
wasted.

Run it:  python tutorials/03_blocks_and_block_tables.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model for step 11.)
"""

import os

from minipaged import LLMEngine, SamplingParams
from minipaged.memory.block_allocator import BlockAllocator
from minipaged.memory.block_manager import AllocStatus, BlockManager, blocks_for
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.tools import viz

BLOCK_SIZE = 4
NUM_BLOCKS = 8

# Words stand in for token ids, so the tables below read like text.
VOCAB: dict[str, int] = {}


def tokens(text: str) -> list[int]:
    return [VOCAB.setdefault(word, len(VOCAB)) for word in text.split()]


def request(request_id: str, seq_id: int, text: str) -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(seq_id, tokens(text))], SamplingParams(max_tokens=16))


def show(bm: BlockManager, group: SequenceGroup) -> None:
    seq = group.seqs[0]
    table = bm.tables[seq.seq_id]
    print(f"  request {group.request_id}: {seq.num_tokens} tokens -> "
          f"logical blocks 0..{len(table) - 1} live in physical blocks {table.block_ids}, "
          f"fills {table.fills}")


print("1. The frame allocator: a hot-first free list and a ref count per block")
# Frames come from the front of the list, and a freed frame goes back to the front:
# the block freed a moment ago is the next one handed out. Like Linux's per-CPU page
# lists, this reuses memory that is still in the cache (and, on the CPU, already
# mapped: the first write to a never-touched block costs a page fault).
frames = BlockAllocator(4)
a, b = frames.allocate(), frames.allocate()
print(f"  allocated blocks {a} and {b}; free list {list(frames.free_list)}, ref counts {frames.ref_counts}")
frames.free(a)
print(f"  freed block {a}: free list {list(frames.free_list)}, ref counts {frames.ref_counts}")
assert list(frames.free_list) == [a, 2, 3] and frames.ref_counts[b] == 1
frames.check_invariants()

print(f"\n2. A prompt gets a page table (block_size={BLOCK_SIZE}, pool of {NUM_BLOCKS} blocks)")
bm = BlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
req_a = request("A", 0, "Four score and seven years ago our")
seq_a = req_a.seqs[0]
print(f"  can_allocate(A) = {bm.can_allocate(req_a).name}")
bm.allocate(req_a)
show(bm, req_a)
# 7 tokens need ceil(7 / 4) = 2 blocks; the last one has one slot to spare.
assert bm.tables[0].fills == [4, 3] and len(bm.block_table(seq_a)) == blocks_for(7, BLOCK_SIZE)

print("\n3. A second request arrives and takes the next free blocks")
req_b = request("B", 1, "It was the best of times it was the worst of times")
bm.allocate(req_b)
show(bm, req_b)

print("\n4. Decoding: A grows one token at a time")
# The next token goes into the last block's spare slot; only when that block is
# full does the manager take a new frame, from wherever the free list points.
for word in ["fathers", "brought", "forth"]:
    table = bm.tables[seq_a.seq_id]
    needs_block = table.needs_new_block()
    seq_a.append_token(tokens(word)[0], logprob=0.0)
    assert bm.can_append_slots(req_a.seqs)
    bm.append_slots(seq_a)
    print(f"  + {word!r:10} new block needed: {str(needs_block):5} "
          f"-> blocks {table.block_ids}, fills {table.fills}")
    bm.check_invariants([seq_a, req_b.seqs[0]])
table_a = bm.block_table(seq_a)
# A's third block was taken after B's, so A's memory is no longer contiguous.
assert table_a[2] != table_a[1] + 1, table_a
print(f"  A's logical blocks 0,1,2 are physical blocks {table_a}: not contiguous, and that is fine")

print("\n5. Address translation: slot = physical block * block_size + offset")
words = {v: k for k, v in VOCAB.items()}
for pos, token in enumerate(seq_a.token_ids):
    logical, offset = divmod(pos, BLOCK_SIZE)
    physical = table_a[logical]
    slot = physical * BLOCK_SIZE + offset
    assert slot == bm.slot(seq_a, pos)
    print(f"  pos {pos:2} {words[token]!r:10} logical block {logical}, offset {offset} "
          f"-> physical block {physical} -> slot {slot}")

print("\n6. Internal fragmentation: only the last block of each sequence can have empty slots")
MAX_MODEL_LEN = 32  # what a reserve-the-maximum allocator sets aside per request
live = [req_a, req_b]
used = sum(g.seqs[0].num_tokens for g in live)
paged_slots = sum(len(bm.tables[g.seqs[0].seq_id]) * BLOCK_SIZE for g in live)
reserved_slots = MAX_MODEL_LEN * len(live)
print(f"  tokens stored: {used}")
print(f"  paged:          {paged_slots} slots mapped, {paged_slots - used} unused "
      f"({(paged_slots - used) / paged_slots:.0%})")
print(f"  reserve {MAX_MODEL_LEN}/req: {reserved_slots} slots reserved, {reserved_slots - used} unused "
      f"({(reserved_slots - used) / reserved_slots:.0%})")
assert paged_slots - used < BLOCK_SIZE * len(live)      # under one block per sequence
assert paged_slots - used < reserved_slots - used

print("\n7. Admission control: a request that cannot fit is told so")
big = request("C", 2, " ".join(["word"] * (NUM_BLOCKS * BLOCK_SIZE + 1)))
later = request("D", 3, "that nation might live " * 3)
print(f"  free blocks: {bm.num_free_blocks}")
print(f"  C ({big.seqs[0].num_tokens} tokens, more than the whole pool): {bm.can_allocate(big).name}")
print(f"  D ({later.seqs[0].num_tokens} tokens, needs {blocks_for(later.seqs[0].num_tokens, BLOCK_SIZE)} "
      f"blocks): {bm.can_allocate(later).name}")
assert bm.can_allocate(big) == AllocStatus.NEVER and bm.can_allocate(later) == AllocStatus.LATER

print("\n8. A finishes: its frames go back to the FRONT of the free list, in table order")
before = list(bm.allocator.free_list)
bm.free(seq_a)       # releases the last block first, so the list's front reads like A's table
after = list(bm.allocator.free_list)
print(f"  free list before {before}, after {after}")
assert after == table_a + before
print(f"  now D fits: can_allocate(D) = {bm.can_allocate(later).name}")
bm.allocate(later)
show(bm, later)
table_d = bm.block_table(later.seqs[0])
# D gets the frames at the front of the list: A's, freed a moment ago (still hot).
assert table_d == after[:len(table_d)] and set(table_d) & set(table_a)
reused = sorted(set(table_d) & set(table_a))
print(f"  D reuses A's old frame(s) {reused}, in A's order: {table_d}, still not one contiguous run")
bm.check_invariants([req_b.seqs[0], later.seqs[0]])

print("\n9. check_invariants() is the safety net: break the books on purpose")
bm.allocator.ref_counts[bm.block_table(later.seqs[0])[0]] += 1   # a leak: nobody holds this ref
try:
    bm.check_invariants()
    raise SystemExit("the corrupted ref count went unnoticed")
except AssertionError as err:
    print(f"  caught: {err}")
bm.allocator.ref_counts[bm.block_table(later.seqs[0])[0]] -= 1

print("\n10. Everyone exits: every block is free again")
for group in (req_b, later):
    bm.free(group.seqs[0])
bm.check_invariants()
print(f"  used {bm.num_used_blocks}, free {bm.num_free_blocks} of {bm.num_blocks}")
assert bm.num_free_blocks == NUM_BLOCKS and not bm.tables

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
print(f"\n11. The same walk-through on the real engine ({MODEL}), drawn from its state")
# minipaged.tools.viz reads the block manager and the running sequences; nothing is drawn by hand.
ENGINE_BLOCK = BLOCK_SIZE                  # the engine's block size here (exercise 1 changes it)
engine = LLMEngine(MODEL, device="cpu", block_size=ENGINE_BLOCK, num_blocks=NUM_BLOCKS * BLOCK_SIZE // ENGINE_BLOCK)
greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
engine.add_request("A", "Four score and seven years ago our", greedy)
for step in range(1, 4):
    if step == 2:
        engine.add_request("B", "It was the best of times", greedy)
    engine.step()
    view = viz.engine_snapshot(engine)
    print(f"  --- after step {step} ---")
    print("  " + viz.render_text(view).replace("\n", "\n  "))
    bm = engine.block_manager
    for table in view.tables:  # the picture is the block manager's own page tables
        seq = engine.groups[table.name].seqs[0]
        assert [physical for _, physical, _ in table.entries] == bm.block_table(seq)
        assert sum(filled for _, _, filled in table.entries) == seq.num_computed_tokens
a_seq = engine.groups["A"].seqs[0]
a_text = [engine.tokenizer.decode([t]) for t in a_seq.token_ids[:ENGINE_BLOCK]]
first = next(b for b in view.blocks if b.block_id == bm.block_table(a_seq)[0])
print(f"  A's first block holds the K/V of {a_text}; its table {bm.block_table(a_seq)}")
assert first.slots == a_text
while engine.has_unfinished_requests():
    engine.step()
print(f"  both finished: {engine.get_stats()['kv_blocks_used']} blocks in use")
print("\nDone: page tables, slots and fragmentation, all from the real block manager.")
print("""
Exercises:
  1. Set ENGINE_BLOCK = 8, then 1 (the pool keeps the same number of token slots). How many
     blocks does each request map, and how many slots sit empty in its last block? What does
     block_size 1 cost the page table?
  2. In step 4, add the words "upon this continent" to the list A decodes. At which word does A
     need a fourth block, and which frame does it get? Predict it from the free list first.""")
