"""The command line: ``python -m minipaged chat | generate | serve | fetch | bench``.

The command table (the shell of the analogy): one parser per command, each with
the shared engine and sampling flags of args.py, and the small commands themselves
(``generate``, ``fetch``). ``chat`` is chat.py; ``bench`` is tools/bench.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..engine.parallel.worker import WorkerError
from ..model.errors import ModelFetchError, ModelFormatError
from ..model.fetch import DEFAULT_MODEL, KNOWN_MODELS
from ..sampling_params import OutputKind
from .args import add_engine_flags, add_sampling_flags, engine_kwargs, sampling_params, sampling_values
from .http_limits import HTTPLimits

SERVE_BATCHED_TOKENS = 512     # serve's step budget with chunked prefill (measured: docs/serving.md)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipaged",
                                     description="minipaged: PagedAttention inference, from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="talk to the model (streams; /reset, /stats, /exit)",
                          description="Interactive chat. Reads one message per line from a pipe too. "
                                      "Ctrl-C stops the current answer, Ctrl-D or /exit quits.")
    # each turn resubmits the whole conversation: the cache makes it prefill only the new part
    add_engine_flags(chat, log_stats_interval=0.0, prefix_caching=True)
    # repetition_penalty 1.1 unless the model's generation_config.json says otherwise: without it
    # SmolLM2 loops ("A memory's light, a memory's light, ...") in most answers of 300 tokens
    # (measured in docs/configuration.md, "chat")
    add_sampling_flags(chat, max_tokens=512, temperature=0.2, top_p=0.9, repetition_penalty=1.1,
                       model_defaults=True)
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

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                           description="Serve the model over HTTP with OpenAI's API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, ...), as `vllm serve` does: every "
                                       "client shares one engine and one pool of KV blocks. Needs "
                                       "pip install -e '.[serve]'. Details: docs/serving.md.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as `vllm serve MODEL` takes it (or use --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients give in the 'model' field (default: the model's)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (default: no check)")
    serve.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 503 to new requests while this many wait (default: no limit)")
    ops = serve.add_argument_group("liveness and limits", description="what an operator sets before the server "
                                   "meets its users (docs/serving.md, 'Operating the server')")
    ops.add_argument("--step-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="an engine step running longer than this (a hung or lost worker) turns /health to 503 "
                          "and ends the server with exit status 1; 0 turns it off (default 60, as vLLM's "
                          "VLLM_ENGINE_ITERATION_TIMEOUT_S)")
    ops.add_argument("--max-request-body-bytes", type=int, default=HTTPLimits.max_request_body_bytes, metavar="N",
                     help="a larger request body is answered 413 before it is read "
                          f"(default {HTTPLimits.max_request_body_bytes >> 20} MiB)")
    ops.add_argument("--timeout-header-read", type=float, default=HTTPLimits.timeout_header_read, metavar="SECONDS",
                     help="close a connection that has not sent a whole request head in this long "
                          f"(slow-loris; default {HTTPLimits.timeout_header_read:g})")
    ops.add_argument("--timeout-keep-alive", type=float, default=HTTPLimits.timeout_keep_alive, metavar="SECONDS",
                     help=f"close an idle connection after this long between requests (uvicorn's; "
                          f"default {HTTPLimits.timeout_keep_alive:g})")
    ops.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                     help="answer 503 to requests beyond N open connections or tasks (uvicorn's; default: no cap)")
    # prefix caching on: multi-turn chats resubmit their history
    # chunked prefill on, as vLLM's server: a long prompt no longer freezes every stream for its
    # whole prefill; the budget was measured (docs/serving.md, "Chunked prefill in the server")
    add_engine_flags(serve, log_stats_interval=10.0, prefix_caching=True, chunked_prefill=True,
                     max_num_batched_tokens=SERVE_BATCHED_TOKENS)

    from ..tools.bench import add_bench_parser  # noqa: PLC0415

    add_bench_parser(sub, add_engine_flags)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .api_server import serve  # noqa: PLC0415 (FastAPI and uvicorn: the serve extra)
    except ImportError as err:
        raise ValueError(f"serve needs the serve extra ({err.name} is missing): "
                         "pip install -e '.[serve]'") from None
    kwargs = engine_kwargs(args)
    if args.model_tag is not None:
        kwargs["model"] = args.model_tag
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.step_timeout < 0:
        raise ValueError(f"--step-timeout must be >= 0 seconds (0: off), got {args.step_timeout:g}")
    limits = HTTPLimits(max_request_body_bytes=args.max_request_body_bytes,
                        timeout_header_read=args.timeout_header_read, timeout_keep_alive=args.timeout_keep_alive,
                        limit_concurrency=args.limit_concurrency)
    return serve(kwargs, host=args.host, port=args.port, served_model_name=args.served_model_name,
                 api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                 step_timeout=args.step_timeout or None, limits=limits)


# --------------------------------------------------------------------------- commands

def cmd_fetch(args: argparse.Namespace) -> int:
    from ..model.fetch import fetch_model  # noqa: PLC0415

    path = fetch_model(args.name, gguf_path=args.gguf, force=args.force)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ..engine.beam_search import BeamSearchParams  # noqa: PLC0415
    from ..engine.llm import LLM  # noqa: PLC0415

    # The sampling flags are checked before the (slow) load, as the engine flags are.
    if args.show_blocks and args.beam_width is not None:
        raise ValueError("--show-blocks steps the engine by hand; use it without --beam-width")
    if args.beam_width is not None:
        max_tokens = sampling_values(args)[0]["max_tokens"]
        beam_params = BeamSearchParams(beam_width=args.beam_width, max_tokens=max_tokens,
                                       ignore_eos=args.ignore_eos, length_penalty=args.length_penalty)
    else:
        params = sampling_params(args, n=args.n)
    llm = LLM(**engine_kwargs(args))
    if args.show_blocks:
        return _generate_showing_blocks(llm.llm_engine, args.prompts,
                                        dataclasses.replace(params, output_kind=OutputKind.FINAL_ONLY))
    if args.beam_width is not None:
        beams = llm.beam_search(args.prompts, beam_params, use_tqdm=False)
        rows = [{"prompt": p, "outputs": [{"text": s.text, "token_ids": s.tokens,
                                             "cumulative_logprob": s.cum_logprob,
                                             "finish_reason": s.finish_reason} for s in b.sequences]}
                for p, b in zip(args.prompts, beams)]
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
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


def _generate_showing_blocks(engine, prompts: list[str], params) -> int:
    """generate, one step at a time, printing the pool and the page tables after each."""
    from ..tools.viz import engine_snapshot, render_text  # noqa: PLC0415

    for i, prompt in enumerate(prompts):
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
    for i in range(len(prompts)):
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
    commands = {"chat": cmd_chat, "generate": cmd_generate, "fetch": cmd_fetch, "serve": cmd_serve}
    try:
        if args.command == "bench":
            from ..tools.bench import cmd_bench  # noqa: PLC0415

            return cmd_bench(args, engine_kwargs(args))
        return commands[args.command](args)
    except (ValueError, ModelFetchError, ModelFormatError, NotImplementedError, WorkerError) as err:
        # User errors (bad flags' values, bad prompts, missing models) and a lost worker: one
        # clear line, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
