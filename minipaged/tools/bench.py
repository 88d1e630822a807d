"""``python -m minipaged bench``: run a workload, side by side where it compares settings.

The command: its flags (``add_bench_parser``), the flags a workload would silently
ignore refused before any model loads (``check_bench_args``), and the runs: one
engine per setting compared (prefix caching off/on, chunked prefill off/on, paged
against contiguous), each warmed up and then measured on the same trace. The
traces are in workloads.py, the timing in measure.py, the tables and the plot in
report.py, the Hugging Face peer in bench_peers.py, the HTTP clients of ``bench serve`` in
bench_serve.py, the machine's limits and the steps against them (``bench roofline``) in
roofline.py, the compressed KV cache's quality (``bench quality``) in quality.py, block-sparse
attention's (``bench sparse``) in sparse_quality.py, speculative decoding's (``bench spec-decode``)
in spec_bench.py, the parallel workers' (``bench parallel``) in parallel_bench.py, structured
outputs' cost (``bench structured``) in structured_bench.py.
"""

from __future__ import annotations

import argparse
import json

from ..engine.backend import cuda_available, release_device_memory
from ..engine.llm_engine import LLMEngine
from ..engine.metrics import Metrics
from ..engine.warm_up import warm_up as warm_up_passes
from ..model.config import LlamaConfig
from ..model.fetch import resolve_model
from ..model.tokenizer import Tokenizer
from .bench_peers import check_peer_installed, run_peer
from .bench_serve import bench_serve
from .measure import run_workload, steps_by_path
from .report import memory_figures, plot_memory, print_result, print_roofline, print_table
from .quality import check_quality_args, print_quality, run_quality
from .roofline import check_roofline_args, integer_peak, matmul_peak, read_bandwidth, run_roofline, workload_floor
from .sparse_quality import check_sparse_args, print_sparse, run_sparse
from .parallel_bench import print_parallel_bench, run_parallel_bench
from .spec_bench import print_spec_bench, run_spec_bench
from .structured_bench import print_structured_bench, run_structured_bench
from .workloads import PEER_WORKLOADS, WORKLOAD_ENGINE, WORKLOADS, BenchRequest, make_prompts, make_requests


def add_bench_parser(sub, add_engine_flags) -> None:
    p = sub.add_parser("bench", help="run a benchmark workload",
                       description="Seeded synthetic workloads: " + "; ".join(
                           f"{name}: {desc}" for name, (desc, _) in WORKLOADS.items()))
    p.add_argument("workload", choices=list(WORKLOADS), nargs="?", default="throughput")
    p.add_argument("--num-prompts", type=int, default=None, help="requests in the workload")
    p.add_argument("--min-prompt-len", type=int, default=None, help="shortest prompt, in tokens")
    p.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt, in tokens")
    p.add_argument("--output-len", type=int, default=None, help="tokens generated per request")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="throughput, single-stream, prefill: every request's prompt is this text (tokenized "
                        "as `generate` does, no chat template) instead of random token ids; with --peer the "
                        "peer gets the same tokens")
    p.add_argument("--long-prompts", type=int, default=None, help="long-prompts: how many long prompts")
    p.add_argument("--long-prompt-len", type=int, default=None, help="long-prompts: their length")
    p.add_argument("--arrival-gap", type=int, default=None, help="long-prompts: steps between arrivals")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: system prompt length")
    p.add_argument("--chunk-budget", type=int, default=None,
                   help="long-prompts: token budget of the chunked-prefill run")
    p.add_argument("--min-output-len", type=int, default=None, help="memory: shortest output")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="memory: draw KV usage and its breakdown over time for each allocator "
                        "(needs matplotlib: pip install -e '.[plot]')")
    p.add_argument("--request-rate", type=float, default=None,
                   help="serve: requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="serve: most requests in flight")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="serve: benchmark the server at this URL (e.g. http://127.0.0.1:8000) instead of "
                        "starting one")
    p.add_argument("--compare-offline", action="store_true", default=None,
                   help="serve: also run the same prompts through LLMEngine in this process")
    p.add_argument("--compare-idle", action="store_true", default=None,
                   help="serve: also send the same prompts one at a time, for the TTFT against an idle server")
    p.add_argument("--repeats", type=int, default=None,
                   help="serve, structured: make the whole measurement this many times; ratios are the medians")
    p.add_argument("--batch-sizes", default=None, metavar="B,B,...",
                   help="roofline: decode batch sizes (default 1,2,4,8,16,32,64); structured: 1,32")
    p.add_argument("--context-len", type=int, default=None, help="roofline: decode context, in tokens")
    p.add_argument("--prefill-lens", default=None, metavar="N,N,...",
                   help="roofline: prompt lengths of the prefill rows (default 256,2048; empty: none)")
    p.add_argument("--steps", type=int, default=None, help="roofline: decode steps timed per batch size")
    p.add_argument("--prefill-repeats", type=int, default=None, help="roofline: timed runs per prefill")
    p.add_argument("--kv-cache-dtypes", default=None, metavar="D,D,...",
                   help="quality: the kv_cache_dtype of each engine compared (default auto,int8,fp8,fp8_e5m2)")
    p.add_argument("--weight-formats", default=None, metavar="F,F,...",
                   help="quality: how each engine stores its weights: float32, bfloat16, int8, gguf, gguf_a8 "
                        "(default float32; docs/weights.md)")
    p.add_argument("--num-tokens", type=int, default=None,
                   help="quality: tokens of text scored (all of the text when it has fewer)")
    p.add_argument("--text-file", default=None, metavar="PATH",
                   help="quality: score this UTF-8 text instead of Python's own documentation")
    p.add_argument("--window", type=int, default=None, help="quality: tokens per perplexity window")
    p.add_argument("--context-lens", default=None, metavar="N,N,...", help="sparse: context lengths")
    p.add_argument("--budgets", default=None, metavar="N,N,...", help="sparse: token budgets against dense")
    p.add_argument("--trials", type=int, default=None, help="sparse: passkey prompts per context length")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the prompt lengths and ids")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--peer", choices=["hf", "llamacpp"], default=None,
                   help="also run the same prompts through a peer in a subprocess and print the ratio: hf, "
                        "Hugging Face transformers generate (padded batch, float32); llamacpp, llama.cpp on the "
                        "model's GGUF file (every prompt a sequence of one batch); needs the 'peers' extra")
    add_engine_flags(p)


def check_bench_args(args: argparse.Namespace, defaults: dict) -> None:
    """Refuse flags this workload would silently ignore, before any model is loaded."""
    for name, (_, other) in WORKLOADS.items():
        for key in other:
            engine_flag = key in WORKLOAD_ENGINE.get(name, ())   # an engine flag, valid everywhere
            if not engine_flag and key not in defaults and getattr(args, key, None) is not None:
                users = [w for w, (_, d) in WORKLOADS.items() if key in d]
                raise ValueError(f"--{key.replace('_', '-')} does not apply to the {args.workload} workload "
                                 f"(it applies to: {', '.join(users)})")
    if args.plot and args.workload != "memory":
        raise ValueError("--plot draws the memory workload's KV pool; use it with `bench memory`")
    if args.peer and args.workload not in PEER_WORKLOADS:
        raise ValueError(f"--peer runs one padded greedy batch, which fits only the "
                         f"{', '.join(PEER_WORKLOADS)} workloads, not {args.workload}")
    if args.peer:
        check_peer_installed(args.peer)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise ValueError("--prompt is empty; give the text every request starts from")
        for key in ("min_prompt_len", "max_prompt_len"):
            if getattr(args, key) is not None:
                raise ValueError(f"--prompt sets the prompt, and its length; drop --{key.replace('_', '-')}")
    if args.workload == "roofline":
        check_roofline_args({k: getattr(args, k) if getattr(args, k) is not None else v
                             for k, v in defaults.items()})
    if args.workload in ("serve", "structured"):
        for key in ("repeats", "num_prompts"):
            value = getattr(args, key)
            if value is not None and value < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be an integer >= 1, got {value}")
    if args.workload == "quality":
        check_quality_args({k: getattr(args, k) if getattr(args, k) is not None else v
                            for k, v in defaults.items()})
    if args.workload == "sparse":
        check_sparse_args({k: getattr(args, k) if getattr(args, k) is not None else v
                           for k, v in defaults.items()}, args.block_size or 16)
    split = getattr(args, "tensor_parallel_size", 1) > 1 or getattr(args, "pipeline_parallel_size", 1) > 1
    if split and args.workload == "parallel":
        raise ValueError("the parallel workload compares the splits itself; run it without -tp / -pp")
    if split and args.workload in ("roofline", "quality", "sparse"):
        raise ValueError(f"the {args.workload} workload reaches into one worker's model and pool; "
                         "run it without -tp / -pp")
    if args.workload == "memory" and args.enable_prefix_caching:
        raise ValueError("the memory workload compares paging with the contiguous baseline, which "
                         "has no prefix caching; run it without --enable-prefix-caching")


def runs_to_compare(workload: str, base: dict, cfg: dict) -> dict[str, dict]:
    """The engine settings to run the trace under, by label ("" when there is one run)."""
    if workload == "shared-prefix":  # the same trace with the page cache off, then on
        return {f"caching {'on' if on else 'off'}": {**base, "enable_prefix_caching": on} for on in (False, True)}
    if workload == "long-prompts":  # the same arrivals without and with chunked prefill
        chunk = base["max_num_batched_tokens"] or cfg["chunk_budget"]
        return {"chunked off": {**base, "enable_chunked_prefill": False, "max_num_batched_tokens": None},
                "chunked on": {**base, "enable_chunked_prefill": True, "max_num_batched_tokens": chunk,
                               "max_num_seqs": min(base["max_num_seqs"], chunk)}}
    if workload == "memory":  # the same trace and budget, paging against reservation
        return {"paged": {**base, "kv_allocator": "paged", "track_fragmentation": True},
                "contiguous": {**base, "kv_allocator": "contiguous", "contiguous_reserve": "max_model_len",
                               "track_fragmentation": True},
                "contiguous_max_tokens": {**base, "kv_allocator": "contiguous", "contiguous_reserve": "max_tokens",
                                          "track_fragmentation": True}}
    return {"": base}


def library_versions(cpu_gemm: str = "auto", kernels: str | None = None) -> dict:
    """What ran the engine: the CPU, the libraries and the thread counts, and the ``cpu_gemm``
    asked for (the engine each kind of step took is in the result: ``linear_paths``), for the
    JSON report."""
    import os  # noqa: PLC0415

    import importlib.metadata  # noqa: PLC0415

    import numba  # noqa: PLC0415
    import numpy  # noqa: PLC0415

    from ..config import default_kernels  # noqa: PLC0415
    from ..kernels.fast.packed_gemm import cpuinfo_field  # noqa: PLC0415

    try:                                 # the CPU's linear layers use it when installed (--cpu-gemm)
        mkl = importlib.metadata.version("mkl")
    except importlib.metadata.PackageNotFoundError:
        mkl = None
    return {"cpu_vendor": cpuinfo_field("vendor_id"), "cpu_model": cpuinfo_field("model name"),
            "cpu_count": os.cpu_count(), "cpu_gemm": cpu_gemm, "kernels": kernels or default_kernels(),
            "numpy": numpy.__version__, "numba": numba.__version__, "numba_threads": numba.get_num_threads(),
            "mkl": mkl, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}


def probe_machine() -> dict:
    """This CPU's matmul peak, read bandwidth and integer peak, now (``bench roofline``'s probes)."""
    return {"matmul_peak": matmul_peak(), "read_bandwidth": read_bandwidth(), "integer_peak": integer_peak()}


def floor_applies(engine: LLMEngine) -> bool:
    """Whether the CPU probes describe the engine's machine: not on a GPU, and not with the
    layers split over workers."""
    return engine.backend.device == "cpu" and engine.cache is not None and engine.parallel_config.world_size == 1


def machine_floor(engine: LLMEngine, requests: list[BenchRequest], cfg: dict, probes: list[dict]) -> dict:
    """The workload's floor on this CPU (``roofline.workload_floor``). The machine is probed
    before the run and after it, and each limit takes the better reading: on a host shared
    with other guests one probe in a slow spell would make the floor look longer than the
    machine's."""
    machine = {key: max(probe[key] for probe in probes) for key in probes[0]}
    floor = workload_floor(engine, [len(r.prompt) for r in requests], cfg["output_len"], machine)
    return {**floor, "machine": {**machine, "probes": probes}}


def warm_up(engine: LLMEngine, calculate_kv_scales: bool = False) -> None:
    """Compile the kernels and touch the weights, then start every counter afresh: the server's
    warm-up passes (``engine/warm_up.py``: prompts alone, decode batches of 1 to 64; not with
    ``calculate_kv_scales``, whose scales come from real K/V), then two prompts through the
    whole engine. (With a cold kernel cache, two prompts alone left a
    single stream's first token 0.25 s to compile, and a 256-token prefill 5.2 s: inside the
    measured run.)"""
    warm_up_passes(engine, calculate_kv_scales)
    vocab = engine.model_config.vocab_size
    n = max(1, min(40, engine.max_model_len - 3))    # prompts that fit a short context, with their 2 tokens
    run_workload(engine, [BenchRequest(p, 2) for p in make_prompts(2, n, n, vocab, 1)], progress=False)
    engine.metrics = Metrics()
    if engine.model is not None:
        steps_by_path(engine.model).clear()
    engine.scheduler.reset_counters()
    if engine.block_manager.cache is not None:
        engine.block_manager.cache.queries = engine.block_manager.cache.hits = 0
    engine.kv_history = []


def given_prompt(cfg: dict, model: str) -> list[int] | None:
    """``--prompt``'s token ids under the model's tokenizer (as ``generate`` tokenizes a text), or None."""
    if cfg.get("prompt") is None:
        return None
    try:
        ids = Tokenizer.from_dir(resolve_model(model)).encode(cfg["prompt"], add_special_tokens=True)
    except ValueError as err:
        raise ValueError(f"--prompt: {err}") from None
    if not ids:
        raise ValueError("--prompt makes no tokens")
    return ids


def shown(cfg: dict) -> dict:
    """The settings as printed: a long --prompt cut to its start (the JSON keeps it whole)."""
    text = cfg.get("prompt")
    return cfg if text is None or len(text) <= 60 else {**cfg, "prompt": text[:57] + "..."}


def cmd_bench(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """Run ``args.workload`` with the engine built from ``engine_kwargs`` (the shared engine
    flags, as entrypoints/args.py turns them into keyword arguments)."""
    _, defaults = WORKLOADS[args.workload]
    check_bench_args(args, defaults)
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    # the workloads that run their own engines and print their own table
    own = {"roofline": (run_roofline, print_roofline), "quality": (run_quality, print_quality),
           "sparse": (run_sparse, print_sparse), "spec-decode": (run_spec_bench, print_spec_bench),
           "parallel": (run_parallel_bench, print_parallel_bench),
           "structured": (run_structured_bench, print_structured_bench)}
    if args.workload in own:
        run, show = own[args.workload]
        report = {"workload": args.workload, "config": cfg, "engine": engine_kwargs,
                  "versions": library_versions(engine_kwargs["cpu_gemm"], engine_kwargs.get("kernels")),
                  **run(engine_kwargs, cfg)}
        show(report)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    if args.workload == "serve":
        report = {"workload": "serve", "config": {k: v for k, v in cfg.items() if k != "base_url"},
                  "engine": engine_kwargs if args.base_url is None else None,
                  "result": bench_serve(args, cfg, engine_kwargs)}
        print_result("serve", report["config"], report["result"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2, default=str)
        return 1 if report["result"]["failed"] else 0
    base = dict(engine_kwargs)
    for key in WORKLOAD_ENGINE.get(args.workload, ()):
        if base[key] is None:
            base[key] = cfg[key]
    histories = {}
    results = {}
    peer = None
    prompt_ids = given_prompt(cfg, base["model"])      # --prompt's tokens, or None: random ids
    if prompt_ids is not None:                          # the lengths the report shows are the text's
        cfg = {**cfg, "min_prompt_len": len(prompt_ids), "max_prompt_len": len(prompt_ids)}
    if args.peer:
        # The peer runs first, while no engine of ours is alive: an idle engine's thread
        # pools on the same cores slowed it by up to 17% when it ran second.
        model_dir = resolve_model(base["model"])
        vocab = LlamaConfig.from_dir(model_dir).vocab_size
        peer_requests = make_requests(args.workload, cfg, vocab, args.workload_seed, prompt_ids)
        peer = run_peer(args.peer, str(model_dir), [r.prompt for r in peer_requests], cfg["output_len"])
    # The machine's limits, probed before any engine of ours holds memory, and again after the run
    # (the workload's floor; on the CPU only)
    on_cpu = base.get("device") == "cpu" or (base.get("device", "auto") == "auto" and not cuda_available())
    floor_probes = [probe_machine()] if args.workload in PEER_WORKLOADS and on_cpu else None
    engine = None
    for label, kwargs in runs_to_compare(args.workload, base, cfg).items():
        # Drop the previous run's engine first: on a GPU its KV pool (most of the device)
        # would otherwise leave the next engine's profiling pass nothing to give.
        engine = None
        release_device_memory()
        engine = LLMEngine(**kwargs)
        requests = make_requests(args.workload, cfg, engine.model_config.vocab_size, args.workload_seed, prompt_ids)
        warm_up(engine, bool(kwargs.get("calculate_kv_scales")))
        results[label] = run_workload(engine, requests)
        if args.workload == "memory":
            results[label] = {**memory_figures(engine, results[label]), **results[label]}
            histories[label] = engine.kv_history
    if args.plot:
        plot_memory(histories, args.plot)
    report = {"workload": args.workload, "config": cfg, "engine": engine_kwargs,
              "versions": library_versions(engine_kwargs["cpu_gemm"], engine_kwargs.get("kernels"))}
    if len(results) > 1:
        # one section per configuration: "paged" / "contiguous" (memory), "caching on" / "caching off"
        report.update(results)
        print_table(args.workload, shown(cfg), results)
    else:
        result = results[""]
        floor = None
        if floor_probes is not None and floor_applies(engine):
            floor = machine_floor(engine, requests, cfg, [*floor_probes, probe_machine()])
        if floor is not None:
            report["floor"] = floor
            result = {**result, "floor_s": floor["floor_s"], "floor_bound": floor["bound"],
                      "of_floor": floor["floor_s"] / result["elapsed_s"]}
        if peer is not None:
            report["peer"] = peer
            result = {**result, f"{args.peer}_generation_tok_s": peer["generation_tok_s"],
                      f"speedup_vs_{args.peer}": result["generation_tok_s"] / peer["generation_tok_s"]}
            if "decode_tok_s" in peer and result.get("decode_tok_s_single"):   # a single stream, after its first token
                result = {**result, f"{args.peer}_decode_tok_s": peer["decode_tok_s"],
                          f"decode_speedup_vs_{args.peer}": result["decode_tok_s_single"] / peer["decode_tok_s"]}
            if floor is not None:
                # no engine on this machine, in this precision, could beat the peer by more
                result[f"max_speedup_vs_{args.peer}"] = (result["generated_tokens"] / floor["floor_s"]
                                                         / peer["generation_tok_s"])
        report["result"] = result             # the JSON holds what was printed
        print_result(args.workload, shown(cfg), result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
