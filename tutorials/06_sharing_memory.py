"""Tutorial 6: sharing KV blocks: parallel samples, beam search and prefix caching.

Goal: the block tables of tutorial 1 map logical blocks to physical ones, and
nothing says two tables may not map the same block. Here several sequences
hold one copy of what they have in common: n samples of one prompt (computed
once), the beams of a beam search, and requests that open with the same long
system prompt. A ref count says how many tables hold a block; a sequence about
to write into a block others still hold first gets its own copy.

The OS analogy: samples and beams are fork(): the child gets a copy of the
parent's page table, not of its pages, and a page is copied only when one of
them writes to it (copy-on-write). Prefix caching is the page cache and shared
libraries: a block already holding the same tokens at the same positions is
mapped again instead of being computed again, and when its last user exits it
stays cached, counted as free, until the memory is needed.

Run it:  python tutorials/06_sharing_memory.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import dataclasses
import os

from minipaged import LLM, BeamSearchParams, LLMEngine, SamplingParams
from minipaged.block_manager import blocks_for
from minipaged.sampling_params import derive_seed

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK, SEED = 8, 7
STORY = "Once upon a time, in a small village by the sea, there lived"
SYSTEM = ("You are a patient teacher of operating systems for first-year students. Answer every "
          "question in one short, plain sentence. Give one concrete example from everyday computing "
          "when it helps. Never use a technical word without explaining it in simple terms first. "
          "Prefer analogies from a library, a kitchen or a post office. If a question is not about "
          "computers, say so politely and stop. Do not repeat the question, do not greet the student "
          "and do not add a summary at the end.")
QUESTIONS = ["What is a page table?", "Why is swapping slow?", "How does fork() save memory?",
             "Explain a shared library."]


def engine(**kwargs) -> LLMEngine:
    return LLMEngine(MODEL, device="cpu", block_size=BLOCK, num_blocks=128, **kwargs)


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
assert sampler.get_stats()["prompt_tokens"] == L and L % BLOCK  # the last prompt block is partly filled
full, shared = L // BLOCK, tables[0][L // BLOCK]
sampler.step()
copies = plans[-1].blocks_to_copy
print(f"  step 2: each sample writes position {L}, into block {shared} ({L % BLOCK} of {BLOCK} slots "
      f"filled, held by 3): copy-on-write plan blocks_to_copy {copies}")
after = [list(bm.block_table(s)) for s in seqs]
print(f"  tables now {after}: the last writer kept block {shared} (ref count {refs[shared]} by then); "
      f"the {full} full block(s) {tables[0][:full]} stay shared, ref counts {[refs[b] for b in tables[0][:full]]}")
assert [src for src, _ in copies] == [shared, shared] and [t[full] for t in after] == [d for _, d in copies] + [shared]
assert all(t[:full] == tables[0][:full] for t in after) and all(refs[b] == 3 for b in tables[0][:full])
samples = finish(sampler)["story"]
for i in range(3):  # sample i draws what a lone request seeded with derive_seed(SEED, i) draws
    sampler.add_request(f"alone{i}", STORY, dataclasses.replace(params, n=1, seed=derive_seed(SEED, i)))
alone = finish(sampler)
for i, tokens in enumerate(samples):
    same = tokens == alone[f"alone{i}"][0]
    print(f"  sample {i}: {sampler.tokenizer.decode(tokens)!r:42} == n=1 with seed derive_seed({SEED}, {i}): {same}")
    assert same

WIDTH, BEAM_PROMPT = 4, "In my experience, the best way to learn a new language is"
beam = BeamSearchParams(beam_width=WIDTH, max_tokens=8, ignore_eos=True)  # equal lengths: rank by cum_logprob
print(f"\n2. Beam search, beam_width={WIDTH}, max_tokens={beam.max_tokens}: {BEAM_PROMPT!r}")
llm = LLM(MODEL, device="cpu", block_size=BLOCK, num_blocks=128)
beamer = llm.llm_engine
ranked = llm.beam_search(BEAM_PROMPT, beam, use_tqdm=False)[0].sequences
n_prompt = len(beamer.tokenize(BEAM_PROMPT).token_ids)
for rank, s in enumerate(ranked):
    print(f"  {rank}. cum_logprob {s.cum_logprob:7.3f}  ...{beamer.tokenizer.decode(s.tokens[n_prompt:])!r}")
assert len(ranked) == WIDTH and [s.cum_logprob for s in ranked] == sorted([s.cum_logprob for s in ranked])[::-1]
plans, bm = watch(beamer), beamer.block_manager
beamer.add_beam_request("beam", BEAM_PROMPT, beam)
group = beamer.groups["beam"]  # one sequence until the prompt is done, then up to WIDTH
before = {s.seq_id: s.token_ids for s in group.seqs}
print("  stepped by hand (forked: new seq id <- its parent; pruned: gone, its own blocks freed at once;\n"
      "  used: physical blocks, num_used_blocks; mapped: what the tables map, num_mapped_blocks):")
while beamer.has_unfinished_requests():
    outputs = beamer.step()
    now = {s.seq_id: s.token_ids for s in group.seqs}
    forks = {c: next(p for p, t in before.items() if t == now[c][:-1]) for c in now if c not in before}
    pruned = [p for p in before if p not in now]
    used, mapped = bm.num_used_blocks, bm.num_mapped_blocks
    print(f"  step {len(plans)}: beams {list(now)}  forked {forks or '-'}  pruned {pruned or '-'}  "
          f"copied {plans[-1].blocks_to_copy or '-'}  " + (f"used {used}, mapped {mapped}" if mapped else "done"))
    assert len(now) == WIDTH and used <= mapped and set(forks.values()) <= set(before)
    before = now
assert [c.token_ids for c in outputs[0].outputs] == [s.tokens[n_prompt:] for s in ranked]
assert bm.num_used_blocks == bm.num_mapped_blocks == 0
print(f"  finished: all blocks free; the same {WIDTH} ranked beams as LLM.beam_search: True")

print(f"\n3. Prefix caching: {len(QUESTIONS)} chat requests behind one system prompt (greedy)")
tok = sampler.tokenizer
prompts = {f"Q{i}": tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": q}]), add_special_tokens=False)
           for i, q in enumerate(QUESTIONS, start=1)}
common = len(os.path.commonprefix(list(prompts.values())))
greedy = SamplingParams(temperature=0.0, max_tokens=6)
cached, plain = engine(enable_prefix_caching=True), engine()
results = {}  # name -> (outputs, the plan of step 1)
for name, e in (("cached", cached), ("plain", plain)):
    plans = watch(e)
    for rid, ids in prompts.items():
        e.add_request(rid, {"prompt_token_ids": ids}, greedy)
    results[name] = (finish(e), plans[0])
print(f"  the chat template puts the system prompt first: all {len(prompts)} share their first {common} "
      f"tokens, {common // BLOCK} full blocks of {BLOCK}")
seen = []
for x in results["cached"][1].scheduled:  # all are admitted in step 1, and Q1's blocks are named at once
    ids, n = x.seq.prompt_token_ids, x.seq.num_prompt_tokens
    shared = max((len(os.path.commonprefix([ids, e])) for e in seen), default=0)
    print(f"  {x.group.request_id}: {n} prompt tokens, {n - x.num_new_tokens:3} found in the cache, "
          f"{x.num_new_tokens:3} computed")
    assert n - x.num_new_tokens == shared // BLOCK * BLOCK  # whole blocks only
    seen.append(ids)
s = cached.get_stats()
print(f"  prefix_cache_hits / queries = {s['prefix_cache_hits']} / {s['prefix_cache_queries']} tokens "
      f"({s['prefix_cache_hit_rate']:.0%}); prompt tokens computed {s['prompt_tokens']}, "
      f"without caching {plain.get_stats()['prompt_tokens']}")
cache, free = cached.block_manager.cache, cached.block_manager.num_free_blocks
print(f"  all finished: blocks used {s['kv_blocks_used']}, yet {len(cache.evictable)} named blocks are parked "
      f"in the LRU queue (block_manager.cache.evictable) and counted free: {free} of {s['kv_blocks_total']}")
assert s["kv_blocks_used"] == 0 and free == s["kv_blocks_total"] and len(cache.evictable) == len(cache.name_of)
print(f"  outputs identical with caching off: {results['cached'][0] == results['plain'][0]}")
assert results["cached"][0] == results["plain"][0]
k, parked, plans = common // BLOCK, len(cache.evictable), watch(cached)
cached.add_request("again", {"prompt_token_ids": prompts["Q1"][:k * BLOCK]}, greedy)
cached.step()  # admitted: its hits are held again
new, revived = plans[0].scheduled[0].num_new_tokens, parked - len(cache.evictable)
print(f"  Q1's first {k * BLOCK} tokens again, all {k} blocks in the cache: {k * BLOCK - new} tokens hit "
      f"({revived} blocks revived from the LRU), the last block's {new} tokens recomputed: the step "
      "needs the logits of the last prompt token")
assert new == BLOCK and revived == k - 1
finish(cached)

print("\n4. Peak KV blocks with sharing vs every sequence holding its own copy")
N, MAX, many = 4, 16, engine()
many.add_request("n4", {"prompt_token_ids": prompts["Q1"]}, dataclasses.replace(params, n=N, max_tokens=MAX))
finish(many)
print(f"  {'workload':34} {'kv_blocks_peak':>14} {'unshared_peak':>14} {'saved':>6}")
for name, e in ((f"n={N} samples of Q1, {MAX} tokens each", many), (f"beam search, width {WIDTH}", beamer),
                (f"{len(QUESTIONS)} requests, one system prompt", cached)):
    s = e.get_stats()
    used, unshared = s["kv_blocks_peak"], s["kv_blocks_unshared_peak"]
    print(f"  {name:34} {used:14} {unshared:14} {1 - used / unshared:6.0%}")
    assert used < unshared
s, full = many.get_stats(), len(prompts["Q1"]) // BLOCK
each = blocks_for(len(prompts["Q1"]) + MAX - 1, BLOCK)  # a sample's table at the end (last token not cached)
print(f"  n={N}: the prompt's {full} full blocks once + {N} x {each - full} private = {s['kv_blocks_peak']}, "
      f"against {N} x {each} = {s['kv_blocks_unshared_peak']}")
assert s["kv_blocks_peak"] == full + N * (each - full) and s["kv_blocks_unshared_peak"] == N * each
print(f"  with caching off, the {len(QUESTIONS)} requests really peaked at {plain.get_stats()['kv_blocks_peak']} "
      "blocks: the unshared count is what they would cost alone")
assert plain.get_stats()["kv_blocks_peak"] == cached.get_stats()["kv_blocks_unshared_peak"]
print("\nDone: one copy of what is common, a private copy only of what is written.")
