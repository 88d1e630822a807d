"""Tutorial 7: beam search, forking and freeing pruned beams.

Goal: run a beam search (LLM.beam_search with BeamSearchParams(beam_width=4)),
then the same search stepped by hand with add_beam_request, and watch the block
tables each step: every surviving candidate forks from its parent beam (its
table is a copy of the parent's, its blocks shared), beams that fall out of the
top width are pruned and their private blocks freed at once, and a block is
copied only when two beams would write into the same one.

The OS analogy: fork() and exit(). Each beam is a process; a promising beam
forks children that share its pages copy-on-write, and a pruned beam exits and
returns its frames right away, so a search of width 4 holds far fewer blocks
than 4 independent sequences would.

Run it:  python tutorials/07_beam_search.py
(MINIPAGED_TUTORIAL_MODEL=/path/to/a/llama/dir picks another model.)
"""

import os

from minipaged import LLM, BeamSearchParams, LLMEngine
from minipaged.engine.beam_search import beam_score

MODEL = os.environ.get("MINIPAGED_TUTORIAL_MODEL", "smollm2-135m-instruct")
BLOCK = 8


def watch(e: LLMEngine) -> list:
    """Keep every plan the scheduler makes (it sees blocks_to_copy before the engine copies)."""
    plans, schedule = [], e.scheduler.schedule

    def schedule_and_keep():
        plans.append(schedule())
        return plans[-1]

    e.scheduler.schedule = schedule_and_keep
    return plans


WIDTH, BEAM_PROMPT = 4, "In my experience, the best way to learn a new language is"
beam = BeamSearchParams(beam_width=WIDTH, max_tokens=8, ignore_eos=True)
print(f"1. Beam search, beam_width={WIDTH}, max_tokens={beam.max_tokens}: {BEAM_PROMPT!r}")
llm = LLM(MODEL, device="cpu", block_size=BLOCK, num_blocks=128)
beamer = llm.llm_engine
ranked = llm.beam_search(BEAM_PROMPT, beam, use_tqdm=False)[0].sequences
n_prompt = len(beamer.tokenize(BEAM_PROMPT).token_ids)
# ranked by cum_logprob / length ** length_penalty (the length counts the prompt, not a final EOS)
scores = [beam_score(len(s.tokens), s.cum_logprob, s.finish_reason == "stop", beam.length_penalty) for s in ranked]
for rank, (s, score) in enumerate(zip(ranked, scores)):
    print(f"  {rank}. cum_logprob {s.cum_logprob:7.3f}  score {score:7.4f}  "
          f"...{beamer.tokenizer.decode(s.tokens[n_prompt:])!r}")
assert len(ranked) == WIDTH and scores == sorted(scores, reverse=True)
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


s = beamer.get_stats()
print(f"  peak blocks: {s['kv_blocks_peak']} held, against {s['kv_blocks_unshared_peak']} if every beam "
      f"had its own copy of its table's blocks ({1 - s['kv_blocks_peak'] / s['kv_blocks_unshared_peak']:.0%} saved)")
assert s["kv_blocks_peak"] < s["kv_blocks_unshared_peak"]
print("\nDone: beams fork by sharing blocks, and a pruned beam gives its blocks back at once.")
print("""
Exercises:
  1. Set length_penalty=0.0 and then 2.0 with ignore_eos=False and max_tokens=24. Does the
     ranking change? Which hypotheses does a large penalty favour, and why?
  2. Set BLOCK = 1. How do `used` and `mapped` compare now, and why is there never a
     copy-on-write?""")
