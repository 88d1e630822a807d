"""``python -m minipaged bench structured``: what structured outputs cost, side by side.

One engine runs the same prompts free and under a JSON Schema, alternately (free, constrained,
free, constrained, ... ``--repeats`` times), at each batch size of ``--batch-sizes``. The schema
asks for an array of at least LONG_ARRAY objects (a bounded name, an integer, a boolean and an
enum), so no constrained request can end before ``--output-len`` tokens: both runs generate
exactly the same number of tokens in the same number of steps, and the difference is the cost
of the grammar: computing each step's masks (llguidance, engine/structured_output.py),
applying them (the sampler), advancing the matchers. Reported: output tokens per second of
each, their ratio (medians over the repeats), and the time to compile the schema and make a
matcher. Measured, never asserted in tests (docs/structured_outputs.md has the numbers).
"""

from __future__ import annotations

import statistics
import time

from ..engine.llm_engine import LLMEngine
from ..sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from .workloads import make_prompts

LONG_ARRAY = 64
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                         "member": {"type": "boolean"},
                                         "tier": {"enum": ["gold", "silver", "bronze"]}},
        "required": ["name", "age", "member", "tier"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": LONG_ARRAY}


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, constrained: bool) -> tuple[int, float]:
    """All prompts at once, sampled with a seed: (generated tokens, seconds)."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=OutputKind.FINAL_ONLY,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"so-{i}", ids, params)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.outputs[0].token_ids)
    return generated, time.perf_counter() - start


def compile_seconds(engine: LLMEngine, repeats: int = 20) -> float:
    """Median seconds to compile SCHEMA and make one matcher (the tokenizer already built)."""
    spec = StructuredOutputsParams(json=SCHEMA)
    engine.grammars.compile(spec)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.grammars.matcher(engine.grammars.compile(spec))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_structured_bench(engine_kwargs: dict, cfg: dict) -> dict:
    engine = LLMEngine(**engine_kwargs)
    sizes = [int(b) for b in str(cfg["batch_sizes"]).split(",") if b]
    vocab = engine.model_config.vocab_size
    run_batch(engine, make_prompts(2, 16, 32, vocab, 99), 8, True)          # warm-up: compile, touch weights
    rows = []
    for size in sizes:
        prompts = make_prompts(size, cfg["min_prompt_len"], cfg["max_prompt_len"], vocab, size)
        free, constrained = [], []
        for _ in range(cfg["repeats"]):
            for runs, flag in ((free, False), (constrained, True)):
                tokens, seconds = run_batch(engine, prompts, cfg["output_len"], flag)
                runs.append(tokens / seconds)
        rows.append({"batch": size, "free_tok_s": statistics.median(free),
                     "constrained_tok_s": statistics.median(constrained),
                     "ratio": statistics.median(c / f for c, f in zip(constrained, free))})
    return {"schema": SCHEMA, "compile_ms": compile_seconds(engine) * 1e3, "rows": rows}


def print_structured_bench(report: dict) -> None:
    print(f"\nstructured outputs: a JSON Schema (an array of >= {LONG_ARRAY} objects) against free sampling, "
          f"{report['config']['output_len']} tokens a request")
    print(f"compiling the schema and making a matcher: {report['compile_ms']:.2f} ms (median)")
    print(f"{'batch':>6} {'free tok/s':>11} {'JSON tok/s':>11} {'JSON / free':>12}")
    for r in report["rows"]:
        print(f"{r['batch']:>6} {r['free_tok_s']:>11.1f} {r['constrained_tok_s']:>11.1f} {r['ratio']:>11.3f}x")
