"""``python -m minipaged bench sparse``: what block-sparse decode attention costs in quality.

One engine with block-sparse attention's page metadata kept and prefix caching on, so each
long context is prefilled once (prompts stay dense) and then decoded under every budget in
turn (``CacheEngine.set_sparse_budget``; budget 0 = dense). For each context length:

- **Passkey retrieval** (Mohtashami and Jaggi, 2023): a five-digit number hidden at a random
  depth in repetitive filler text, asked for at the end; a trial passes when the greedy answer
  contains the number.
- **Greedy agreement**: 32 greedy tokens after the first CONTEXT tokens of Python's own
  documentation (``pydoc_data.topics``): steps equal to dense before the first difference.
- **Teacher-forced log-likelihood** of the real continuation (the next 64 tokens of the same
  text), read through decode steps: after each step the sampled token is replaced by the true
  one, so every position is a decode that attends sparsely, and the true token's
  log-probability is read from the step's full distribution.

Measured, never asserted in tests (docs/sparse_attention.md has the numbers and the rerun line).
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from .quality import reference_text

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def check_sparse_args(cfg: dict, block_size: int = 16) -> tuple[list[int], list[int]]:
    """(context lengths, budgets), after checking every setting (before any model loads)."""
    def ints(name):
        try:
            values = [int(v) for v in str(cfg[name]).split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')} must be comma-separated integers, got {cfg[name]!r}") from None
        if not values or min(values) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must list positive integers, got {cfg[name]!r}")
        return values
    contexts, budgets = ints("context_lens"), ints("budgets")
    if min(budgets) < 2 * block_size:
        raise ValueError(f"--budgets: {min(budgets)} tokens is under two blocks of {block_size} (the first and "
                         f"the last block are always kept); give budgets >= {2 * block_size}")
    if not (isinstance(cfg["trials"], int) and cfg["trials"] >= 1):
        raise ValueError(f"--trials must be an integer >= 1, got {cfg['trials']!r}")
    if max(contexts) > 8192 - 96:
        raise ValueError(f"--context-lens: {max(contexts)} leaves no room for the answers within 8192 tokens")
    return contexts, budgets


def passkey_prompt(tokenizer, context_len: int, rng: np.random.Generator) -> tuple[list[int], str]:
    key = str(int(rng.integers(10000, 100000)))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    filler = tokenizer.encode(FILLER)
    budget = context_len - len(tokenizer.encode(needle)) - len(tokenizer.encode(QUESTION)) - 2
    body = (filler * (budget // len(filler) + 1))[:budget]
    depth = int(rng.integers(0, len(body) // len(filler))) * len(filler)
    ids = body[:depth] + tokenizer.encode(needle) + body[depth:] + tokenizer.encode(" " + QUESTION)
    return ids, key


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def teacher_forced_nll(engine: LLMEngine, context: list[int], continuation: list[int]) -> float:
    """Mean negative log-likelihood of ``continuation`` after ``context``, one decode step a token."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=len(continuation), ignore_eos=True,
                            logprobs=vocab, detokenize=False)
    rid = f"tf{time.monotonic_ns()}"
    engine.add_request(rid, {"prompt_token_ids": context}, params)
    nll, seen = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps = out.outputs[0].logprobs or []
            while seen < len(steps):
                nll -= steps[seen][continuation[seen]]
                seen += 1
        group = engine.groups.get(rid)
        if group is not None and group.seqs[0].output_token_ids:
            # teacher forcing: the next step reads the true token, not the one sampled
            seq = group.seqs[0]
            seq.output_token_ids[-1] = continuation[len(seq.output_token_ids) - 1]
    return nll / len(continuation)


def run_sparse(engine_kwargs: dict, cfg: dict) -> dict:
    block = engine_kwargs.get("block_size") or 16
    contexts, budgets = check_sparse_args(cfg, block)
    engine = LLMEngine(**{**engine_kwargs, "sparse_attention_budget": max(2 * block, min(budgets)),
                          "enable_prefix_caching": True, "max_logprobs": -1, "log_stats_interval": 0})
    text = engine.tokenizer.encode(reference_text())
    settings = [0, *budgets]                               # 0: dense
    rows = []
    rng = np.random.default_rng(cfg.get("seed", 0))
    for context_len in contexts:
        trials = [passkey_prompt(engine.tokenizer, context_len, rng) for _ in range(cfg["trials"])]
        doc_context, continuation = text[:context_len], text[context_len:context_len + 64]
        greedy = {}
        for budget in settings:
            engine.cache.set_sparse_budget(budget)
            start = time.perf_counter()
            hits = 0
            for prompt, key in trials:
                out = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=8))
                hits += key in out.outputs[0].text
            greedy[budget] = _run(engine, doc_context, SamplingParams(temperature=0.0, max_tokens=32,
                                                                        ignore_eos=True)).outputs[0].token_ids
            nll = teacher_forced_nll(engine, doc_context, continuation)
            agree = next((i for i, (a, b) in enumerate(zip(greedy[budget], greedy[0])) if a != b), len(greedy[0]))
            rows.append({"context_len": context_len, "budget": budget or "dense",
                         "passkey_accuracy": hits / len(trials), "passkey_trials": len(trials),
                         "greedy_steps_agreeing": agree, "greedy_steps": len(greedy[0]),
                         "teacher_forced_nll": nll, "teacher_forced_ppl": math.exp(nll),
                         "seconds": time.perf_counter() - start})
    return {"text": "pydoc_data.topics; passkey filler after Mohtashami and Jaggi (2023)", "rows": rows}


def print_sparse(report: dict) -> None:
    print(f"\nsparse attention quality ({report['text']})")
    print(f"{'context':>8} {'budget':>7} {'passkey':>8} {'greedy = dense':>15} {'forced ppl':>11}")
    for r in report["rows"]:
        print(f"{r['context_len']:>8} {str(r['budget']):>7} {r['passkey_accuracy']:>8.0%} "
              f"{r['greedy_steps_agreeing']:>9}/{r['greedy_steps']:<5} {r['teacher_forced_ppl']:>11.3f}")
