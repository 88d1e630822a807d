"""``python -m minipaged bench quality``: what a compressed KV cache, or weights in fewer bytes,
cost in quality.

For each ``kv_cache_dtype`` asked for (default auto, int8, fp8, fp8_e5m2) and each weight format
(``--weight-formats``, default float32; bfloat16, int8, gguf and gguf_a8: docs/weights.md), one engine:

- **Perplexity** over real English text: by default the one that ships with Python, the
  reference documentation of ``pydoc_data.topics`` (the text ``help()`` shows), topics in sorted
  order; or any UTF-8 file, ``--text-file PATH``. Its first NUM_TOKENS tokens (all of them when it
  has fewer) in windows of WINDOW tokens. Each window is one prompt with
  ``prompt_logprobs=0``: the log-probability the model gives each of its tokens after the
  ones before (the first of each window has no context and is not counted).
  ppl = exp(mean negative log-likelihood). The window's own K/V are written to the cache
  and read back by its attention, so the compression is in every prediction.
- **Golden agreement**: greedy continuations of the golden prompts (``tests/golden``, from an
  independent implementation) against its tokens: how many of the 48 steps agree before the
  first difference, summed, and the prompts that agree all the way. Only for the model the
  golden outputs come from, the default one (another model's row shows "-").

Measured, never asserted in tests (docs/kv_cache_dtype.md has the numbers and the rerun lines).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..engine.backend import release_device_memory
from ..engine.llm_engine import LLMEngine
from ..model.fetch import DEFAULT_MODEL, fetched_name, model_dir
from ..sampling_params import SamplingParams

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden" / "smollm2_135m_instruct.json"
TEXT_SOURCE = "pydoc_data.topics (Python's reference documentation, as help() shows it)"


def reference_text() -> str:
    """The English text: every topic of Python's own pydoc_data.topics, in sorted order."""
    from pydoc_data.topics import topics  # noqa: PLC0415 (ships with CPython)

    return "\n\n".join(topics[name] for name in sorted(topics))


def read_text_file(path: str) -> str:
    """``--text-file``'s text, or a ValueError saying why it cannot be scored."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(f"--text-file {path}: a directory, not a text file")
    if not file.is_file():
        raise ValueError(f"--text-file {path}: " + ("not a regular file" if file.exists() else "no such file"))
    try:
        text = file.read_text(encoding="utf-8-sig")      # a byte-order mark is not text
    except UnicodeDecodeError as e:
        raise ValueError(f"--text-file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ValueError(f"--text-file {path}: cannot be read ({e.strerror})") from None
    if not text.strip():
        raise ValueError(f"--text-file {path}: the file holds no text")
    return text


def is_golden_model(directory: Path) -> bool:
    """The golden outputs are the default model's: another model's greedy tokens say nothing. A
    directory the registry's fetch made says whose it is (its marker); any other, where it is."""
    name = fetched_name(directory)
    return name == DEFAULT_MODEL if name is not None else directory.resolve() == model_dir(DEFAULT_MODEL).resolve()


# a weight format of --weight-formats -> the engine settings that store the weights so
WEIGHT_FORMAT_SETTINGS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
                          "int8": dict(quantization="int8"), "gguf": dict(quantization="gguf"),
                          "gguf_a8": dict(quantization="gguf_a8")}


def check_weight_formats(cfg: dict) -> list[str]:
    formats = [f.strip() for f in str(cfg.get("weight_formats") or "float32").split(",") if f.strip()]
    if not formats:
        raise ValueError("--weight-formats is empty; give e.g. float32,bfloat16,int8,gguf")
    for f in formats:
        if f not in WEIGHT_FORMAT_SETTINGS:
            raise ValueError(f"--weight-formats: {f!r} is not one of {', '.join(WEIGHT_FORMAT_SETTINGS)}")
    return formats


def check_quality_args(cfg: dict) -> list[str]:
    """The dtypes to compare, after checking every setting (before any model loads)."""
    from ..config import KV_CACHE_DTYPE_NAMES  # noqa: PLC0415

    check_weight_formats(cfg)
    dtypes = [d.strip() for d in str(cfg["kv_cache_dtypes"]).split(",") if d.strip()]
    if not dtypes:
        raise ValueError("--kv-cache-dtypes is empty; give e.g. auto,int8,fp8")
    for d in dtypes:
        if d not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"--kv-cache-dtypes: {d!r} is not one of {', '.join(KV_CACHE_DTYPE_NAMES)}")
    if cfg.get("text_file") is not None:
        read_text_file(cfg["text_file"])
    for key in ("num_tokens", "window"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 2):
            raise ValueError(f"--{key.replace('_', '-')} must be an integer >= 2, got {cfg[key]!r}")
    if cfg["window"] > cfg["num_tokens"]:
        raise ValueError(f"--window {cfg['window']} is longer than --num-tokens {cfg['num_tokens']}")
    return dtypes


def perplexity(engine: LLMEngine, token_ids: list[int], window: int) -> dict:
    """exp(mean NLL) of ``token_ids`` read in windows of ``window`` tokens (see the module)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    windows = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    for i, w in enumerate(windows):
        engine.add_request(f"ppl-{i}", {"prompt_token_ids": w}, params)
    if not windows:
        raise ValueError(f"no window of {window} tokens holds two tokens to score")
    nll, counted = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                nll -= entry[out.prompt_token_ids[pos]]
                counted += 1
    return {"perplexity": math.exp(nll / counted), "tokens_scored": counted, "windows": len(windows),
            "window": window}


def golden_agreement(engine: LLMEngine, golden: dict) -> dict:
    cases = golden["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=len(cases[0]["new_ids"]), ignore_eos=True)
    for i, case in enumerate(cases):
        engine.add_request(f"golden-{i}", {"prompt_token_ids": case["prompt_ids"]}, params)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    agreed, whole = 0, 0
    for i, case in enumerate(cases):
        tokens = got[f"golden-{i}"]
        steps = next((j for j, (a, b) in enumerate(zip(tokens, case["new_ids"])) if a != b), len(case["new_ids"]))
        agreed += steps
        whole += steps == len(case["new_ids"])
    total = sum(len(c["new_ids"]) for c in cases)
    return {"golden_steps_agreed": agreed, "golden_steps": total, "golden_agreement": agreed / total,
            "golden_prompts_identical": whole, "golden_prompts": len(cases)}


def run_quality(engine_kwargs: dict, cfg: dict) -> dict:
    """One engine per weight format and KV dtype, the same text and prompts for each; a row each,
    named by its KV dtype (one weight format) or "format / dtype"."""
    dtypes = check_quality_args(cfg)
    formats = check_weight_formats(cfg)
    if len(formats) > 1 or formats != ["float32"]:
        taken = [k for k in ("dtype", "quantization") if engine_kwargs.get(k) not in (None, "auto")]
        if taken:
            raise ValueError(f"--weight-formats sets each engine's weights; drop --{taken[0]}")
    if engine_kwargs.get("cpu_gemm") == "mkl" and formats != ["float32"]:
        raise ValueError(f"--cpu-gemm mkl multiplies float32 weights only; --weight-formats {','.join(formats)} "
                         "asks for others (leave --cpu-gemm at auto)")
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else None
    text_file = cfg.get("text_file")
    text = read_text_file(text_file) if text_file is not None else reference_text()
    rows = {}
    token_ids = text_tokens = None
    for fmt, dtype in [(f, d) for f in formats for d in dtypes]:
        release_device_memory()
        settings = WEIGHT_FORMAT_SETTINGS[fmt] if formats != ["float32"] else {}
        engine = LLMEngine(**{**engine_kwargs, **settings, "kv_cache_dtype": dtype, "log_stats_interval": 0})
        if token_ids is None:
            all_ids = engine.tokenizer.encode(text)
            token_ids, text_tokens = all_ids[: cfg["num_tokens"]], len(all_ids)
            if len(token_ids) < 2:
                raise ValueError(f"the text makes {len(token_ids)} token(s); perplexity needs at least 2")
        if engine.max_model_len - 1 < 2:
            raise ValueError(f"--max-model-len {engine.max_model_len} leaves a window of "
                             f"{engine.max_model_len - 1} prompt token(s); perplexity needs at least 2")
        start = time.perf_counter()
        fmt = engine.backend.weight_format     # as stored, whichever flag chose it
        row = {"kv_cache_dtype": dtype, "weight_format": fmt,
               "weight_bytes": engine.model.nbytes if engine.model is not None else 0,
               "num_blocks": engine.cache.num_blocks,
               "bytes_per_block": engine.cache.bytes_per_block,
               # a window is a prompt, and a prompt leaves room for the one token it generates
               **perplexity(engine, token_ids, min(cfg["window"], engine.max_model_len - 1))}
        if golden is not None and is_golden_model(engine.model_dir):
            row.update(golden_agreement(engine, golden))
        row["seconds"] = time.perf_counter() - start
        rows[dtype if len(formats) == 1 and fmt == "float32" else f"{fmt} / {dtype}"] = row
        engine = None
    first = next(iter(rows.values()))
    if first["kv_cache_dtype"] == "auto":
        for row in rows.values():   # against the first row: the first format's weights, the KV cache as they are
            row["perplexity_vs_auto"] = row["perplexity"] / first["perplexity"] - 1.0
    source = f"{text_file} (--text-file)" if text_file is not None else TEXT_SOURCE
    return {"text": source, "text_tokens": text_tokens, "rows": rows}


def print_quality(report: dict) -> None:
    print(f"\nquality: {report['text']}")
    head = (f"{'weights / kv_cache_dtype':>24} {'weight MB':>9} {'blocks':>8} {'perplexity':>11} {'vs first':>8} "
            f"{'golden steps':>13} {'identical':>10}")
    print(head)
    for dtype, r in report["rows"].items():
        vs = f"{100 * r['perplexity_vs_auto']:+.2f}%" if "perplexity_vs_auto" in r else "-"
        gold = f"{r['golden_steps_agreed']}/{r['golden_steps']}" if "golden_steps" in r else "-"
        same = f"{r['golden_prompts_identical']}/{r['golden_prompts']}" if "golden_prompts" in r else "-"
        print(f"{dtype:>24} {r['weight_bytes'] / 1e6:>9.1f} {r['num_blocks']:>8} {r['perplexity']:>11.4f} {vs:>8} "
              f"{gold:>13} {same:>10}")
    rows = list(report["rows"].values())
    if rows:
        r = rows[0]
        print(f"  ({_count(r['tokens_scored'], 'token')} scored in {_count(r['windows'], 'window')} of up to "
              f"{r['window']} per row, of the text's {_count(report['text_tokens'], 'token')})")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
