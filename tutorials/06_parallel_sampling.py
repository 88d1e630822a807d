"""Tutorial 6: parallel sampling and copy-on-write.

Goal: ask for n samples of one prompt (SamplingParams(n=3)) and watch the
block tables: the prompt is computed once, all n sequences map the very same
blocks (ref count n), and a sample gets a private copy of a block only when it
is about to write into one the others still hold. Full prompt blocks stay
shared to the end. Then check that sample i draws exactly what a lone request
seeded derive_seed(seed, i) draws, and count the blocks saved.

The OS analogy: fork(). The child gets a copy of the parent's page table, not
of its pages; the pages are shared and a page is copied only when one of the
processes writes to it (copy-on-write). Here the n samples are the children
and the "write" is appending the next token's K/V.

Run it:  python tutorials/06_parallel_sampling.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import dataclasses
import os

from minipaged import LLMEngine, SamplingParams
from minipaged.memory.block_manager import blocks_for
from minipaged.sampling_params import derive_seed

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK, SEED = 8, 7
STORY = "Once upon a time, in a small village by the sea, there lived"


def engine(num_blocks: int = 128, **kwargs) -> LLMEngine:
    return LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=num_blocks, **kwargs)


def watch(e: LLMEngine) -> list:
    """Keep every plan the scheduler makes (it sees blocks_to_copy before the engine copies)."""
    plans, schedule = [], e.scheduler.schedule

    def schedule_and_keep():
        plans.append(schedule())
        return plans[-1]

    e.scheduler.schedule = schedule_and_keep
    return plans


def finish(e: LLMEngine) -> dict:
    """Step until idle; return {request id: [token ids of each sample]}."""
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: [c.token_ids for c in o.outputs] for o in e.step() if o.finished})
        e.block_manager.check_invariants([s for g in e.groups.values() for s in g.seqs])
    return done


sampler = engine()
plans, bm, refs = watch(sampler), sampler.block_manager, sampler.block_manager.allocator.ref_counts
params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=SEED, max_tokens=8, ignore_eos=True)
sampler.add_request("story", STORY, params)
seqs = sampler.groups["story"].seqs  # the n samples: one Sequence (and block table) each
L = seqs[0].num_prompt_tokens
print(f"1. Parallel sampling ({MODEL}): n=3 samples of a {L}-token prompt, block_size {BLOCK}")
sampler.step()
tables = [list(bm.block_table(s)) for s in seqs]
print(f"  after step 1 (the prefill): seq ids {[s.seq_id for s in seqs]}, block tables {tables}, ref counts "
      f"{[refs[b] for b in tables[0]]}; prompt tokens computed: {sampler.get_stats()['prompt_tokens']}, not 3 x {L}")
assert tables == [tables[0]] * 3 and all(refs[b] == 3 for b in tables[0])
assert sampler.get_stats()["prompt_tokens"] == L
full = L // BLOCK                        # prompt blocks filled to the brim
sampler.step()
copies = plans[-1].blocks_to_copy
after = [list(bm.block_table(s)) for s in seqs]
if L % BLOCK:  # the last prompt block has room: all three samples want to write into it
    shared = tables[0][full]
    print(f"  step 2: each sample writes position {L}, into block {shared} ({L % BLOCK} of {BLOCK} slots "
          f"filled, held by 3): copy-on-write plan blocks_to_copy {copies}")
    print(f"  tables now {after}: the last writer kept block {shared} (ref count {refs[shared]} by then); "
          f"the {full} full block(s) {tables[0][:full]} stay shared, ref counts {[refs[b] for b in tables[0][:full]]}")
    assert [src for src, _ in copies] == [shared, shared]
    assert [t[full] for t in after] == [d for _, d in copies] + [shared]
else:          # the prompt ends exactly at a block boundary: position L starts a new block anyway
    print(f"  step 2: the prompt fills its {full} blocks exactly, so each sample writes position {L} into "
          f"a new block of its own: blocks_to_copy {copies}, tables now {after}")
    assert not copies and len({t[full] for t in after}) == 3
assert all(t[:full] == tables[0][:full] for t in after) and all(refs[b] == 3 for b in tables[0][:full])
samples = finish(sampler)["story"]
for i in range(3):  # sample i draws what a lone request seeded with derive_seed(SEED, i) draws
    sampler.add_request(f"alone{i}", STORY, dataclasses.replace(params, n=1, seed=derive_seed(SEED, i)))
alone = finish(sampler)
for i, tokens in enumerate(samples):
    same = tokens == alone[f"alone{i}"][0]
    print(f"  sample {i}: {sampler.tokenizer.decode(tokens)!r:42} == n=1 with seed derive_seed({SEED}, {i}): {same}")
    assert same


N, MAX = 4, 16
LONG_STORY = " ".join([STORY] * 4)
print(f"\n2. Peak KV blocks: n={N} samples of a longer prompt sharing it, against {N} private copies")
many = engine()
many.add_request("n4", LONG_STORY, dataclasses.replace(params, n=N, max_tokens=MAX))
finish(many)
s, n_prompt = many.get_stats(), len(many.tokenize(LONG_STORY).token_ids)
full = n_prompt // BLOCK
each = blocks_for(n_prompt + MAX - 1, BLOCK)  # a sample's table at the end (its last token is never cached)
print(f"  a {n_prompt}-token prompt: its {full} full blocks once + {N} x {each - full} private = "
      f"{s['kv_blocks_peak']} blocks (kv_blocks_peak), against {N} x {each} = {s['kv_blocks_unshared_peak']} "
      f"(kv_blocks_unshared_peak): {1 - s['kv_blocks_peak'] / s['kv_blocks_unshared_peak']:.0%} saved")
assert s["kv_blocks_peak"] == full + N * (each - full) and s["kv_blocks_unshared_peak"] == N * each
print("\nDone: one copy of the prompt, a private copy only of the block each sample writes.")
print("""
Exercises:
  1. Make the prompt a whole number of blocks long (pad it with words until its token count is a
     multiple of BLOCK). Is there still a copy-on-write in step 2? Why not?
  2. Raise N to 16 in part 2, and give `many` a bigger pool (engine(num_blocks=256)): admission
     counts what the n samples could need if none of them shared, to be safe. How does the
     saving grow with n, and what limits it?""")
