"""Tutorial 16: speculative decoding, or guessing ahead and rolling the page table back.

Goal: make one stream faster without changing a single token it produces. A decode step
reads every weight to produce one token per sequence; if we could guess the next few tokens,
the model could check all the guesses in that same pass (a query of k + 1 rows costs little
more than one on a memory-bound step) and keep the ones it agrees with. We:

1. guess by prompt lookup (``speculative_config`` method ``ngram``): the tokens that followed
   the last earlier occurrence of the sequence's final n-gram;
2. watch one step up close: the draft tokens, the slots mapped ahead for them in the block
   table, the verdict, and the rollback that unmaps the rejected ones;
3. check the rejection rule that keeps sampling exact, on numbers small enough to read;
4. time a copying task with speculation off and on (a ratio, not asserted), and see the
   adaptive rule give up on free text and pick up again when the text repeats;
5. draft with a model instead (method ``draft_model``): two KV pools under one page table.

The OS analogy: speculative execution with rollback. A CPU predicts a branch and runs ahead;
the instructions on the right path retire, the rest are squashed and their effects undone.
Here the guesses are tokens, running ahead writes their K/V into slots mapped in advance
(like pages touched by a speculative load), and the squash is a page-table rollback: the fill
count drops, and a block that held only rejected tokens goes back to the free list at once.
Prompt lookup itself is readahead: a file read sequentially gets its next pages fetched early.

Run it:  python tutorials/16_speculative_decoding.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)

Exercises (also printed at the end):
  1. Set prompt_lookup_min to 3. Which drafts disappear on the chat prompt, and does the
     copying task slow down?
  2. With "adaptive": false and num_speculative_tokens 8, time the free-chat prompt against
     speculation off and against the adaptive rule. Where do the failed drafts' rows go?
"""

import os
import time

from minipaged import LLM, LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np
from minipaged.engine.spec_decode.ngram_proposer import propose_ngram
from minipaged.engine.spec_decode.rejection_sampler import verify_sampled
from minipaged.tools.spec_bench import passages

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK = 4
PASSAGE = " ".join(passages()[1].split()[:60])   # Python's own documentation (pydoc_data.topics), ~80 tokens
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def chat_ids(engine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered)


def draw_table(table, drafts_from: int | None = None, size: int = BLOCK, last: int = 3) -> str:
    """The last blocks of a block table as text: physical block[....], '#' a slot holding a
    token, 'd' a slot mapped for a draft token (from position ``drafts_from``), '.' a free slot."""
    cells, position = [], 0
    for block, fill in zip(table.block_ids, table.fills):
        slots = ""
        for offset in range(size):
            if offset >= fill:
                slots += "."
            else:
                slots += "d" if drafts_from is not None and position >= drafts_from else "#"
                position += 1
        cells.append(f"{block}[{slots}]")
    return ("... " if len(cells) > last else "") + " ".join(cells[-last:])


print("1. Prompt lookup: guessing from the text itself")
engine = LLMEngine(MODEL, device="cpu", kv_cache_space=0.05, swap_space=0.01, block_size=BLOCK,
                   speculative_config=NGRAM, log_stats_interval=0)
copy_prompt = chat_ids(engine, "Repeat this text exactly:\n\n" + PASSAGE)
passage_ids = engine.tokenizer.encode(PASSAGE)
written_so_far = copy_prompt + passage_ids[:5]      # the answer has begun copying the passage
guess = propose_ngram(written_so_far, 4, 1, 4)
print(f"  the answer so far ends with {engine.tokenizer.decode(written_so_far[-4:])!r}")
print(f"  those tokens appeared earlier, in the prompt; what followed them there: "
      f"{engine.tokenizer.decode(guess)!r}  <- the draft")
assert guess == passage_ids[5:9]
print(f"  for a question with nothing to copy: {propose_ngram(chat_ids(engine, 'Why is the sky blue?'), 4, 3, 4)}"
      " (no 3- or 4-gram repeats: no draft)")

print("\n2. One step up close: drafts, slots mapped ahead, verdict, rollback")
engine.add_request("copy", copy_prompt, SamplingParams(temperature=0.0, max_tokens=48))
# and one that only partly copies: some drafts fall
engine.add_request("summary", chat_ids(engine, "Explain this text in your own words:\n\n" + PASSAGE),
                   SamplingParams(temperature=0.0, max_tokens=48))
bm = engine.block_manager
schedule = engine.scheduler.schedule
pending = []       # what a speculating step looked like before its pass, until its verdict is in


def schedule_and_look():     # the plan, seen before the model runs
    plan = schedule()
    for item in plan.scheduled:
        if item.draft_token_ids:
            seq, table = item.seq, bm.tables[item.seq.seq_id]
            pending.append((seq, list(item.draft_token_ids), seq.num_output_tokens, [
                f"  newest token {engine.tokenizer.decode(seq.token_ids[-1:])!r} at position {seq.num_tokens - 1}, "
                f"drafts {engine.tokenizer.decode(item.draft_token_ids)!r}",
                f"    table before the pass: {draw_table(table, drafts_from=seq.num_tokens)}  ({table.num_tokens} "
                f"slots: {seq.num_computed_tokens} cached, the newest token, {len(item.draft_token_ids)} drafts; "
                f"{bm.num_used_blocks} blocks in use)"]))
    return plan


engine.scheduler.schedule = schedule_and_look
shown = {"all stood": False, "some fell": False}
while engine.has_unfinished_requests():
    engine.step()
    while pending:
        seq, drafts, before, lines = pending.pop()
        stood = seq.num_output_tokens - before - 1 if not seq.is_finished() else None
        kind = "all stood" if stood == len(drafts) else "some fell"
        if stood is None or shown[kind]:
            continue
        shown[kind] = True
        table = bm.tables[seq.seq_id]
        print("\n".join(lines))
        print(f"    verdict: {stood} of {len(drafts)} drafts stood, then the model's own next token: "
              f"{engine.tokenizer.decode(seq.output_token_ids[before:])!r}")
        print(f"    table after the rollback:  {draw_table(table)}  ({table.num_tokens} slots, "
              f"{bm.num_used_blocks} blocks in use)")
        assert table.num_tokens == seq.num_computed_tokens == seq.num_tokens - 1
        bm.check_invariants([seq])
engine.scheduler.schedule = schedule
stats = engine.get_stats()["spec_decode"]
print(f"  both answers: {stats['num_accepted_tokens']} of {stats['num_draft_tokens']} drafts stood "
      f"({stats['acceptance_rate']:.0%}), {stats['mean_accepted_length']:.2f} tokens a verifying step; "
      f"{bm.num_used_blocks} blocks held at the end")
assert bm.num_used_blocks == 0

print("\n3. The rule that keeps sampling exact (Leviathan et al. 2023; Chen et al. 2023)")
p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])      # the target's distribution at 2 positions
rng = np.random.default_rng(0)
counts = np.zeros(3)
for _ in range(30_000):        # the draft always guesses token 1 first (a one-hot q, as n-gram lookup)
    counts[verify_sampled(p, [1], rng).token_ids[0]] += 1
print(f"  draft 1 stands with probability p(1) = {p[0, 1]}; when it falls, the token is drawn from p")
print(f"  without token 1. The first token's frequencies: {np.round(counts / counts.sum(), 3)} against p = {p[0]}")
assert np.abs(counts / counts.sum() - p[0]).max() < 0.01

print("\n4. Faster where the text repeats; on free text the adaptive rule holds back (timings: ratios, not asserted)")
params = SamplingParams(temperature=0.0, max_tokens=96)
prompts = {"copying": [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}],
           "free chat": [{"role": "user", "content": "Write a short poem about autumn leaves."}]}
answers, seconds = {}, {}
for label, config in (("off", None), ("ngram k=4", NGRAM), ("adaptive", {**NGRAM, "adaptive": True})):
    llm = LLM(MODEL, device="cpu", kv_cache_space=0.1, swap_space=0.01, speculative_config=config)
    llm.chat(prompts["free chat"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm-up
    for task, messages in prompts.items():
        start = time.perf_counter()
        out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        seconds[label, task] = time.perf_counter() - start
        answers[label, task] = out.token_ids
    del llm
for task in prompts:
    same = all(answers[label, task] == answers["off", task] for label in ("ngram k=4", "adaptive"))
    assert same, task
    print(f"  {task:>9}: off {seconds['off', task]:.2f} s, ngram {seconds['off', task] / seconds['ngram k=4', task]:.2f}x,"
          f" adaptive {seconds['off', task] / seconds['adaptive', task]:.2f}x faster; identical tokens: {same}")
print("  A wrong draft still costs its query rows; the adaptive rule stops drafting where drafts keep")
print("  failing (python -m minipaged bench spec-decode measures all three side by side).")

print("\n5. A draft model: two KV pools, one page table")
llm = LLM(MODEL, device="cpu", kv_cache_space=0.1, swap_space=0.01,
          speculative_config={"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3,
                              "adaptive": False})
engine = llm.llm_engine
out = llm.chat(prompts["copying"], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
stats = engine.get_stats()["spec_decode"]
print(f"  the target as its own draft (the pipes test): {stats['acceptance_rate']:.0%} of "
      f"{stats['num_draft_tokens']} drafts stood")
print(f"  target pool {engine.cache.kv_cache.shape}, draft pool {engine.draft.cache.kv_cache.shape}: "
      f"{engine.cache.num_blocks} blocks each, one block id naming a frame in both")
assert engine.draft.cache.num_blocks == engine.cache.num_blocks and stats["acceptance_rate"] > 0.9
assert out.token_ids == answers["off", "copying"][:24]

print("""
Done: drafts cost a few query rows, verification keeps exactly the model's own tokens, and the
rollback gives their slots back at once.
Exercises:
  1. Set prompt_lookup_min to 3. Which drafts disappear on the chat prompt, and does the
     copying task slow down?
  2. With "adaptive": false and num_speculative_tokens 8, time the free-chat prompt against
     speculation off and against the adaptive rule. Where do the failed drafts' rows go?""")
