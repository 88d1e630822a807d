"""The benchmark's workloads: seeded synthetic traces, the same work on every run.

Prompts are random token ids (seeded), outputs have a fixed length with EOS
ignored, so every run does exactly the same work and runs compare across
commits and machines. The peer workloads (throughput, single-stream, prefill) take a
text instead (``--prompt``): every request's prompt is its tokens. Each workload is a name, a description and its defaults;
``make_requests`` turns one into a list of requests with arrival steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = {
    # name: (description, defaults)
    "throughput": ("N requests, prompt lengths uniform in [min, max] (or each PROMPT), fixed output length",
                   dict(num_prompts=64, min_prompt_len=32, max_prompt_len=256, output_len=128, prompt=None)),
    "single-stream": ("one request decoding alone (a prompt of random ids, or PROMPT): time per output token",
                      dict(num_prompts=1, min_prompt_len=16, max_prompt_len=16, output_len=128, prompt=None)),
    "prefill": ("one long prompt (or PROMPT), one output token: prompt processing speed",
                dict(num_prompts=1, min_prompt_len=256, max_prompt_len=256, output_len=1, prompt=None)),
    "long-prompts": ("N short requests decoding while LONG_PROMPTS long prompts arrive one by one "
                     "(every ARRIVAL_GAP steps), with chunked prefill off and on (a CHUNK_BUDGET-token "
                     "budget): the stall decodes suffer (TTFT, TPOT, inter-token latency)",
                     dict(num_prompts=16, min_prompt_len=32, max_prompt_len=32, output_len=96,
                          long_prompts=4, long_prompt_len=1024, arrival_gap=8, chunk_budget=256)),
    "parallel-sampling": ("N prompts, each sampled n=4 times (temperature 1, seeded): the samples "
                          "share the prompt's blocks", dict(num_prompts=16, min_prompt_len=128,
                                                            max_prompt_len=256, output_len=64)),
    "beam": ("N prompts, beam search of width 4: beams share their common prefix",
             dict(num_prompts=8, min_prompt_len=128, max_prompt_len=256, output_len=32)),
    "shared-prefix": ("N requests behind one shared system prompt of PREFIX_LEN tokens, run with "
                      "prefix caching off and on", dict(num_prompts=32, min_prompt_len=16, max_prompt_len=64,
                                                        output_len=32, prefix_len=512)),
    "memory": ("one trace (prompts and outputs of uniform random lengths) under one fixed KV budget, "
               "with the paged allocator and the contiguous baseline (reserving max_model_len, then "
               "prompt + max_tokens): utilization, fragmentation, concurrency, throughput",
               dict(num_prompts=64, min_prompt_len=32, max_prompt_len=256, output_len=256, min_output_len=32,
                    num_blocks=512, max_model_len=1024)),
    "serve": ("N streaming clients against the HTTP server (one it starts, or --base-url), arriving as a "
              "Poisson process at REQUEST_RATE per second (inf: all at once), at most MAX_CONCURRENCY in "
              "flight: request throughput, output tokens/s, TTFT / TPOT / ITL (with --compare-idle, the same "
              "prompts one at a time too; with --compare-offline, through LLMEngine too; --repeats N times, "
              "the median ratios)",
              dict(num_prompts=32, min_prompt_len=32, max_prompt_len=256, output_len=128, request_rate=math.inf,
                   max_concurrency=None, base_url=None, compare_offline=None, compare_idle=None, repeats=1)),
    "roofline": ("this machine's matmul peak, read bandwidth and integer peak, then decode steps at each of "
                 "BATCH_SIZES (context CONTEXT_LEN) and prefills of PREFILL_LENS tokens, each against its bound "
                 "max(bytes / bandwidth, FLOPs / peak; gguf_a8's integer products at the integer peak), with a "
                 "breakdown of where the time goes",
                 dict(batch_sizes="1,2,4,8,16,32,64", context_len=256, prefill_lens="256,2048", steps=8,
                      prefill_repeats=2)),
    "quality": ("what each KV_CACHE_DTYPES and each WEIGHT_FORMATS costs: perplexity over NUM_TOKENS tokens "
                "of Python's own documentation (pydoc_data.topics), or of TEXT_FILE, in windows of WINDOW, and "
                "greedy agreement with the golden outputs (the default model's)",
                dict(kv_cache_dtypes="auto,int8,fp8,fp8_e5m2", weight_formats="float32", num_tokens=8192,
                     window=1024, text_file=None)),
    "sparse": ("what block-sparse decode attention costs at each of BUDGETS tokens against dense, at "
               "each of CONTEXT_LENS: passkey retrieval (TRIALS a length), greedy agreement and "
               "teacher-forced log-likelihood of real text through decode steps",
               dict(context_lens="2048,4096,8000", budgets="256,512,1024", trials=5)),
    "spec-decode": ("speculative decoding off, n-gram (fixed k) and adaptive side by side: a single "
                    "stream repeating passages of real text (input-grounded), a single stream of free "
                    "chat, and the throughput trace (NUM_PROMPTS requests, OUTPUT_LEN tokens); "
                    "--speculative-config sets k and the lookup lengths",
                    dict(num_prompts=64, min_prompt_len=32, max_prompt_len=256, output_len=128)),
    "parallel": ("one worker, two pipeline stages and three tensor-parallel ranks in this process, and two "
                 "stages as Ray actors, side by side: seconds per step on a single stream and on the first "
                 "NUM_PROMPTS requests of the throughput trace, and where a Ray step's time goes",
                 dict(num_prompts=16, min_prompt_len=32, max_prompt_len=256, output_len=64)),
    "structured": ("the same prompts free and under a JSON Schema, alternately, at each of BATCH_SIZES: "
                   "output tokens per second of each and their ratio (medians over REPEATS), and the "
                   "time to compile the schema",
                   dict(batch_sizes="1,32", min_prompt_len=32, max_prompt_len=128, output_len=64, repeats=3)),
}

# Engine settings a workload fixes unless the command line sets them.
WORKLOAD_ENGINE = {"memory": ("num_blocks", "max_model_len")}


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]      # token ids
    output_len: int
    arrival_step: int = 0  # engine steps after the start at which the request arrives
    measured: bool = True  # counts in the latency figures (the long intruders do not)
    n: int = 1             # parallel samples
    beam_width: int = 0    # > 0: a beam search instead of sampling


def make_requests(workload: str, cfg: dict, vocab: int, seed: int,
                  prompt_ids: list[int] | None = None) -> list[BenchRequest]:
    """The workload's requests; ``prompt_ids`` (``--prompt``'s tokens), when given, is every prompt."""
    if prompt_ids is not None:
        return [BenchRequest(list(prompt_ids), cfg["output_len"]) for _ in range(cfg["num_prompts"])]
    requests = [BenchRequest(p, cfg["output_len"]) for p in
                make_prompts(cfg["num_prompts"], cfg["min_prompt_len"], cfg["max_prompt_len"], vocab, seed)]
    if workload == "parallel-sampling":
        requests = [dataclasses.replace(r, n=4) for r in requests]
    if workload == "beam":
        requests = [dataclasses.replace(r, beam_width=4) for r in requests]
    if workload == "shared-prefix":
        prefix = make_prompts(1, cfg["prefix_len"], cfg["prefix_len"], vocab, seed + 2)[0]
        requests = [dataclasses.replace(r, prompt=prefix + r.prompt) for r in requests]
    if workload == "memory":  # outputs of varied length: what a reservation cannot foresee
        rng = np.random.default_rng(seed + 3)
        lengths = rng.integers(cfg["min_output_len"], cfg["output_len"] + 1, size=len(requests))
        requests = [dataclasses.replace(r, output_len=int(n)) for r, n in zip(requests, lengths)]
    if workload == "long-prompts":
        longs = make_prompts(cfg["long_prompts"], cfg["long_prompt_len"], cfg["long_prompt_len"], vocab, seed + 1)
        requests += [BenchRequest(p, 8, arrival_step=(i + 1) * cfg["arrival_gap"], measured=False)
                     for i, p in enumerate(longs)]
    return requests


PEER_WORKLOADS = ("throughput", "single-stream", "prefill")   # one padded batch, greedy, fits a peer


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths]
