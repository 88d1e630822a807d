"""``python -m minipaged bench spec-decode``: speculative decoding off, n-gram and adaptive, side by side.

Three engines, identical but for ``speculative_config``: none; ``ngram`` with a fixed draft
length (``adaptive: false``); ``ngram`` with the adaptive rule (engine/spec_decode.py); both
with up to BENCH_DRAFT_TOKENS drafts a step unless ``--speculative-config`` says otherwise. With
``--speculative-config '{"method": "draft_model", "model": ...}'`` the last two draft with
that model instead. Each
runs, after a warm-up, the same three tasks, greedy, one engine at a time:

- **grounded** (input-grounded, single stream): the chat model is asked to repeat a passage
  of real English text word for word (each of GROUNDED_PASSAGES passages of Python's own
  reference documentation, ``pydoc_data.topics``, about 200 tokens). Copying its input is
  where prompt lookup shines.
- **chat** (free chat, single stream): CHAT_PROMPTS open questions, answered freely.
- **throughput**: the ``throughput`` workload's trace (NUM_PROMPTS random prompts, OUTPUT_LEN
  tokens each), all at once.

Reported per task and engine: output tokens per second (generated tokens over wall time),
the ratio to the engine without speculation, the acceptance rate and mean accepted length,
and whether the greedy tokens equal the engine without speculation's. Measured, never
asserted in tests (docs/spec_decode.md has the numbers and the rerun line).
"""

from __future__ import annotations

import time

from ..engine.backend import release_device_memory
from ..engine.llm_engine import LLMEngine
from ..engine.metrics import Metrics
from ..sampling_params import OutputKind, SamplingParams
from .quality import TEXT_SOURCE, reference_text
from .workloads import make_requests

GROUNDED_PASSAGES = 3
GROUNDED_CHARS = 900            # about 200 tokens of the documentation's English
CHAT_PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "Explain how a refrigerator keeps food cold.",
                "Give me three tips for learning a new language, with an example for each.",
                "What is the difference between a virus and a bacterium?"]
SINGLE_STREAM_MAX_TOKENS = 320
# drafts a step at most, without --speculative-config: at 4, copying ran 1.84x (fixed) and
# 1.96x (adaptive) faster, at 8 2.17x and 2.29x, and free chat 1.04x and 1.24x
BENCH_DRAFT_TOKENS = 8


def passages() -> list[str]:
    """GROUNDED_PASSAGES stretches of the reference text, cut at paragraph starts."""
    text = reference_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200 and not p.strip().startswith("*")]
    step = len(paragraphs) // GROUNDED_PASSAGES
    return [(paragraphs[i * step] + "\n\n" + paragraphs[i * step + 1])[:GROUNDED_CHARS].rsplit(" ", 1)[0]
            for i in range(GROUNDED_PASSAGES)]


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def run_one(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> dict:
    """All prompts at once (one per request), greedy: generated tokens, seconds, the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False,
                            output_kind=OutputKind.FINAL_ONLY)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"spec-{i}", ids, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    tokens = [outputs[f"spec-{i}"] for i in range(len(prompts))]
    return {"tokens": tokens, "generated": sum(len(t) for t in tokens), "seconds": seconds}


def run_spec_bench(engine_kwargs: dict, cfg: dict) -> dict:
    base = {**engine_kwargs, "speculative_config": None}
    given = engine_kwargs.get("speculative_config")
    from ..config import SpeculativeConfig  # noqa: PLC0415

    spec = SpeculativeConfig.from_value(given) or SpeculativeConfig(num_speculative_tokens=BENCH_DRAFT_TOKENS)
    fields = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        fields.update(prompt_lookup_max=spec.prompt_lookup_max, prompt_lookup_min=spec.prompt_lookup_min)
    else:
        fields["model"] = spec.model
    fixed = "ngram" if spec.method == "ngram" else "draft"
    variants = {"off": None, fixed: {**fields, "adaptive": False}, "adaptive": {**fields, "adaptive": True}}
    rows, reference = [], {}
    for name, speculative in variants.items():
        release_device_memory()
        engine = LLMEngine(**{**base, "speculative_config": speculative})
        tasks = {"grounded": ([chat_ids(engine, "Repeat the following text exactly, word for word, and "
                                                "nothing else:\n\n" + p) for p in passages()],
                              SINGLE_STREAM_MAX_TOKENS, False, True),
                 "chat": ([chat_ids(engine, p) for p in CHAT_PROMPTS], SINGLE_STREAM_MAX_TOKENS, False, True),
                 "throughput": ([r.prompt for r in make_requests("throughput", cfg, engine.model_config.vocab_size,
                                                                 cfg.get("workload_seed", 0))],
                                cfg["output_len"], True, False)}
        run_one(engine, [chat_ids(engine, "Hello")], 8, False)          # warm-up: compile, touch weights
        for task, (prompts, max_tokens, ignore_eos, one_at_a_time) in tasks.items():
            engine.metrics = Metrics()
            if engine.spec is not None:
                engine.spec.stats = type(engine.spec.stats)()
            if one_at_a_time:   # a single stream: each prompt alone
                parts = [run_one(engine, [p], max_tokens, ignore_eos) for p in prompts]
                result = {"tokens": [t for r in parts for t in r["tokens"]],
                          "generated": sum(r["generated"] for r in parts), "seconds": sum(r["seconds"] for r in parts)}
            else:
                result = run_one(engine, prompts, max_tokens, ignore_eos)
            stats = engine.spec.stats.as_dict() if engine.spec is not None else {}
            if name == "off":
                reference[task] = result
            off = reference[task]
            rows.append({"task": task, "variant": name, "generated_tokens": result["generated"],
                         "seconds": round(result["seconds"], 3),
                         "tok_s": result["generated"] / result["seconds"],
                         "speedup": (result["generated"] / result["seconds"]) / (off["generated"] / off["seconds"]),
                         "acceptance_rate": stats.get("acceptance_rate"),
                         "mean_accepted_length": stats.get("mean_accepted_length"),
                         "same_tokens_as_off": result["tokens"] == off["tokens"]})
        del engine
    return {"text": TEXT_SOURCE, "variants": variants, "rows": rows}


def print_spec_bench(report: dict) -> None:
    print(f"\nspeculative decoding (grounded: repeating passages of {report['text']})")
    print(f"{'task':>10} {'variant':>9} {'tokens':>7} {'tok/s':>8} {'vs off':>7} {'accepted':>9} "
          f"{'mean len':>9} {'same tokens':>12}")
    for r in report["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        length = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{r['task']:>10} {r['variant']:>9} {r['generated_tokens']:>7} {r['tok_s']:>8.1f} "
              f"{r['speedup']:>6.2f}x {rate:>9} {length:>9} {str(r['same_tokens_as_off']):>12}")
