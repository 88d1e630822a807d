"""Tutorial 9: prefix caching.

Goal: four chat requests open with the same long system prompt. With
enable_prefix_caching=True the engine names every full KV block by a chain
hash of the tokens in it and all those before it; a new request whose prompt
starts with the same tokens maps those blocks instead of computing them again.
Watch which tokens are found in the cache (whole blocks only), what the hit
rate is, where finished requests' blocks go (an LRU queue of cached blocks that
still count as free) and how a later request revives them; then check that the
outputs are exactly those of an engine without caching.

The OS analogy: the page cache and shared libraries. A page holding the same
file contents is mapped again instead of being read again, and when its last
user exits it stays in memory, counted as free, until the memory is needed for
something else (least recently used first).

Run it:  python tutorials/09_prefix_caching.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import os

from minipaged import LLMEngine, SamplingParams

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK = 8
SYSTEM = ("You are a patient teacher of operating systems for first-year students. Answer every "
          "question in one short, plain sentence. Give one concrete example from everyday computing "
          "when it helps. Never use a technical word without explaining it in simple terms first. "
          "Prefer analogies from a library, a kitchen or a post office. If a question is not about "
          "computers, say so politely and stop. Do not repeat the question, do not greet the student "
          "and do not add a summary at the end.")
QUESTIONS = ["What is a page table?", "Why is swapping slow?", "How does fork() save memory?",
             "Explain a shared library."]


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


print(f"1. Prefix caching: {len(QUESTIONS)} chat requests behind one system prompt (greedy)")
cached, plain = engine(enable_prefix_caching=True), engine()
tok = cached.tokenizer
prompts = {f"Q{i}": tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": q}]), add_special_tokens=False)
           for i, q in enumerate(QUESTIONS, start=1)}
common = len(os.path.commonprefix(list(prompts.values())))
greedy = SamplingParams(temperature=0.0, max_tokens=6)
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


s = cached.get_stats()
print(f"\n2. Peak KV blocks: {s['kv_blocks_peak']} with caching, against {s['kv_blocks_unshared_peak']} if every "
      f"request held its own copy; the engine without caching really peaked at {plain.get_stats()['kv_blocks_peak']}")
assert plain.get_stats()["kv_blocks_peak"] == s["kv_blocks_unshared_peak"] > s["kv_blocks_peak"]
print("\nDone: the system prompt is computed once and kept, and outputs do not change.")
print("""
Exercises:
  1. Rerun with BLOCK = 32 and then 4. How many tokens hit, and how many of the shared tokens
     are lost to the last partial block? (Tutorial 11 measures this.)
  2. Submit the four requests one at a time, each after the previous one finished, with a pool
     so small that the LRU must evict. Which blocks go first, and does the hit rate drop?""")
