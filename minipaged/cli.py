"""The command line: ``python -m minipaged chat | generate | fetch | bench``.

Engine flags carry vLLM's names (``--block-size``, ``--max-num-seqs``, ...), so a
command line moves between the two projects unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys

from .model.errors import ModelFetchError, ModelFormatError
from .model.fetch import DEFAULT_MODEL, KNOWN_MODELS

# --------------------------------------------------------------------------- flags

def add_engine_flags(p: argparse.ArgumentParser, log_stats_interval: float = 5.0,
                     prefix_caching: bool = False) -> None:
    """Engine flags. ``prefix_caching=True`` (chat) turns the page cache on unless the
    contiguous allocator, which has none, is chosen."""
    g = p.add_argument_group("engine")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None if prefix_caching else False,   # None: on, unless contiguous
                   help="reuse the KV blocks of prompt prefixes seen before (default: "
                        f"{'on with the paged allocator' if prefix_caching else 'off'})")
    g.add_argument("--log-stats-interval", type=float, default=log_stats_interval, metavar="SECONDS",
                   help="print a stats line (throughput, queues, KV usage, preemptions) this often "
                        f"on stderr; 0 turns it off (default {log_stats_interval:g})")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a known model name ({', '.join(KNOWN_MODELS)}) or a Hugging Face "
                        "Llama directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run: 'auto' picks a CUDA GPU if CuPy sees one, else the CPU")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="weight and KV cache dtype ('auto': float32 on the CPU)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (a power of two); the page size of the KV cache")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="number of KV blocks in the pool (overrides --kv-cache-space)")
    g.add_argument("--kv-cache-space", type=float, default=None,
                   help="KV pool size in GiB on the CPU (default 4)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences running in one batch")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: max(2048, max_num_seqs, max_model_len); "
                        "with chunked prefill max(2048, max_num_seqs))")
    g.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of CPU memory for KV blocks swapped out by preemption")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
                   help="how a preempted request gives its blocks back: swap them to CPU memory, "
                        "drop them and recompute later, or auto (swap unless short or the swap "
                        "space is full)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=False,
                   help="split long prompts into chunks that share steps with running decodes")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps run per scheduling decision (multi-step scheduling)")
    g.add_argument("--kv-allocator", default="paged", choices=["paged", "contiguous"],
                   help="paged (PagedAttention) or the contiguous baseline: one run of blocks reserved "
                        "per request at admission, as systems before vLLM did")
    g.add_argument("--contiguous-reserve", default="max_model_len", choices=["max_model_len", "max_tokens"],
                   help="what the contiguous baseline reserves: max_model_len slots, or prompt + max_tokens")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU: share of the device's memory for weights, activations and the KV cache")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                num_blocks=args.num_blocks, kv_cache_space=args.kv_cache_space,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, swap_space=args.swap_space,
                preemption_mode=args.preemption_mode,
                enable_chunked_prefill=args.enable_chunked_prefill,
                num_scheduler_steps=args.num_scheduler_steps, seed=args.seed,
                log_stats_interval=args.log_stats_interval,
                enable_prefix_caching=(args.kv_allocator == "paged" if args.enable_prefix_caching is None
                                       else args.enable_prefix_caching),
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_allocator=args.kv_allocator, contiguous_reserve=args.contiguous_reserve)


def add_sampling_flags(p: argparse.ArgumentParser, *, max_tokens: int, temperature: float,
                       top_p: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most new tokens per answer")
    g.add_argument("--temperature", type=float, default=temperature, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=top_p, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely (-1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of each request's sampler")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def sampling_params(args: argparse.Namespace, **extra):
    from .sampling_params import SamplingParams  # noqa: PLC0415

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                          ignore_eos=args.ignore_eos, **extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipaged",
                                     description="minipaged: PagedAttention inference, from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="talk to the model (streams; /reset, /stats, /exit)",
                          description="Interactive chat. Reads one message per line from a pipe too. "
                                      "Ctrl-C stops the current answer, Ctrl-D or /exit quits.")
    # each turn resubmits the whole conversation: the cache makes it prefill only the new part
    add_engine_flags(chat, log_stats_interval=0.0, prefix_caching=True)
    add_sampling_flags(chat, max_tokens=512, temperature=0.2, top_p=0.9)
    chat.add_argument("--system", default=None, help="a system prompt (else the template's default)")
    chat.add_argument("--show-blocks", action="store_true",
                      help="print the KV pool (and what the prefix cache keeps) after every answer")

    gen = sub.add_parser("generate", help="complete prompts in one batch",
                         description="Complete each PROMPT (all in one batch) and print the results.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_engine_flags(gen)
    add_sampling_flags(gen, max_tokens=64, temperature=0.0, top_p=1.0)
    gen.add_argument("--json", action="store_true", help="print the outputs as JSON")
    gen.add_argument("--n", type=int, default=1,
                     help="samples per prompt (parallel sampling; they share the prompt's KV blocks)")
    gen.add_argument("--beam-width", type=int, default=None,
                     help="beam search with this many beams instead of sampling")
    gen.add_argument("--length-penalty", type=float, default=1.0, help="beam search length penalty")
    gen.add_argument("--show-blocks", action="store_true",
                     help="print the KV pool and the page tables after every engine step")


    fetch = sub.add_parser("fetch", help="download and convert a known model",
                           description="Fetch a known model into the cache (~/.cache/minipaged, or "
                                       "$MINIPAGED_HOME) and convert it to safetensors. Idempotent.")
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list(KNOWN_MODELS))
    fetch.add_argument("--gguf", default=None, metavar="PATH",
                       help="convert this local GGUF file instead of downloading (offline)")
    fetch.add_argument("--force", action="store_true", help="rebuild even if already converted")

    from .bench import add_bench_parser  # noqa: PLC0415

    add_bench_parser(sub, add_engine_flags)
    return parser


# --------------------------------------------------------------------------- commands

def cmd_fetch(args: argparse.Namespace) -> int:
    from .model.fetch import fetch_model  # noqa: PLC0415

    path = fetch_model(args.name, gguf_path=args.gguf, force=args.force)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .beam_search import BeamSearchParams  # noqa: PLC0415
    from .llm import LLM  # noqa: PLC0415

    llm = LLM(**engine_kwargs(args))
    if args.show_blocks:
        if args.beam_width is not None:
            raise ValueError("--show-blocks steps the engine by hand; use it without --beam-width")
        return _generate_showing_blocks(llm.llm_engine, args)
    if args.beam_width is not None:
        beams = llm.beam_search(args.prompts, BeamSearchParams(
            beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
            length_penalty=args.length_penalty), use_tqdm=False)
        rows = [{"prompt": p, "outputs": [{"text": s.text, "token_ids": s.tokens,
                                             "cumulative_logprob": s.cum_logprob,
                                             "finish_reason": s.finish_reason} for s in b.sequences]}
                for p, b in zip(args.prompts, beams)]
    else:
        outputs = llm.generate(args.prompts, sampling_params(args, n=args.n), use_tqdm=False)
        rows = [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids,
                 "outputs": [{"text": o.prompt + c.text, "token_ids": c.token_ids,
                              "cumulative_logprob": c.cumulative_logprob,
                              "finish_reason": c.finish_reason} for c in o.outputs]}
                for o in outputs]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            for i, c in enumerate(row["outputs"]):
                label = f" #{i}" if len(row["outputs"]) > 1 else ""
                print(c["text"])
                print(f"---{label} [{c['finish_reason']}, logprob {c['cumulative_logprob']:.3f}]")
    stats = llm.get_stats()
    if stats["kv_blocks_unshared_peak"] > stats["kv_blocks_peak"]:
        print(f"[minipaged] KV blocks at peak: {stats['kv_blocks_peak']} shared, "
              f"{stats['kv_blocks_unshared_peak']} if every sequence had its own copy", file=sys.stderr)
    return 0


def _generate_showing_blocks(engine, args: argparse.Namespace) -> int:
    """generate, one step at a time, printing the pool and the page tables after each."""
    from .sampling_params import OutputKind  # noqa: PLC0415
    from .viz import engine_snapshot, render_text  # noqa: PLC0415

    params = sampling_params(args, n=args.n, output_kind=OutputKind.FINAL_ONLY)
    for i, prompt in enumerate(args.prompts):
        engine.add_request(str(i), prompt, params)
    step, finished = 0, {}
    while engine.has_unfinished_requests():
        plan_outputs = engine.step()
        step += 1
        print(f"=== step {step}: " + ", ".join(f"request {r}" for r in sorted(
            g.request_id for g in engine.scheduler.running)) + " running")
        print(render_text(engine_snapshot(engine)))
        for out in plan_outputs:
            finished[out.request_id] = out
    for i in range(len(args.prompts)):
        out = finished[str(i)]
        for c in out.outputs:
            print(f"{out.prompt}{c.text}")
            print(f"--- [{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat import ChatSession  # noqa: PLC0415

    return ChatSession(args).run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"chat": cmd_chat, "generate": cmd_generate, "fetch": cmd_fetch}
    try:
        if args.command == "bench":
            from .bench import cmd_bench  # noqa: PLC0415

            return cmd_bench(args)
        return commands[args.command](args)
    except (ValueError, ModelFetchError, ModelFormatError, NotImplementedError) as err:
        # User errors (bad flags' values, bad prompts, missing models): one clear line, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
