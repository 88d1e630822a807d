"""``python -m minipaged serve``: an OpenAI-compatible HTTP server (the OS's system-call gate).

Many clients, each arriving whenever it likes, share one engine and one pool of KV
blocks: every HTTP request becomes an engine request through ``AsyncLLMEngine``, and
joins the running batch at the next step. This module only translates: OpenAI's
request shapes (openai_protocol.py) into SamplingParams, the engine's RequestOutputs
back into OpenAI's responses and server-sent-event chunks, and every failure into
OpenAI's error JSON. The engine never imports the web stack.

    GET  /v1/models  /health  /version
    POST /v1/completions  /v1/chat/completions   (stream or not)
    POST /tokenize  /detokenize                   (vLLM's)
    GET  /metrics                                 (Prometheus, vLLM's metric names)
    GET  /kv  /                                   (the pool as JSON; the live memory map)
    GET  /stats                                   (minipaged's get_stats())

A client that disconnects, streaming or not, aborts its request: its blocks are free
after the next step. Ctrl-C (SIGINT or SIGTERM) aborts every request in flight and exits 0.
An engine that dies (a step fails, or runs past ``--step-timeout``) answers 503 to the
requests in flight, then the server exits 1, so that a supervisor restarts it; /health says
503 from the moment a step overruns. Requests meet the door's limits (http_limits.py) first.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import sys
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from ..engine.async_llm_engine import AsyncLLMEngine
from ..tools.viz import kv_map
from .api_errors import APIError, install_error_handlers
from .http_limits import BodySizeLimit, HTTPLimits
from .openai_protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from .prometheus import ServerMetrics
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion

KV_PAGE = Path(__file__).parent / "static" / "kv.html"   # the live memory map (GET /)

logger = logging.getLogger("minipaged")


def package_version() -> str:
    try:
        return importlib.metadata.version("minipaged")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree, not installed
        return "unknown"


class OpenAIServer(ServingCompletion, ServingChat):
    """Every endpoint's logic over one AsyncLLMEngine; ``build_app`` wires them to routes."""


class APIKeyCheck:
    """``--api-key``: every /v1 request must carry ``Authorization: Bearer <key>``, else 401.

    A plain ASGI middleware. Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) would
    hand every chunk of a streamed answer from the route's task to its own through a queue:
    more work and more task switches on the event loop for each token of each stream.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization")   # ASGI: lower-case byte names
            if given != self.expected:
                response = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                    "AuthenticationError", None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              limits: HTTPLimits | None = None) -> FastAPI:
    """The FastAPI application: routes, the API key check, the body-size limit, errors in
    OpenAI's shape."""
    limits = limits or HTTPLimits()
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await engine.shutdown()        # abort what is left, free its blocks, stop the loop

    app = FastAPI(title="minipaged", version=package_version(), lifespan=lifespan,
                  description="An OpenAI-compatible server over minipaged's PagedAttention engine.")
    server = OpenAIServer(engine, served_model_name)
    app.state.server = server
    metrics = ServerMetrics(served_model_name)
    engine.finished_listeners.append(metrics.observe_finished)

    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes,
                       read_timeout=limits.timeout_header_read)
    if api_key is not None:           # the outermost: no body is read for a client without the key
        app.add_middleware(APIKeyCheck, api_key=api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        """200 while the engine loop is alive; 503 once it stopped, or a step overran the step
        timeout (read from its heartbeat: never waits on the engine's thread)."""
        problem = engine.health()
        if problem is not None:
            raise APIError(503, problem, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/stats")
    async def stats():
        """minipaged's own: the engine's get_stats() (queues, KV blocks, preemptions, latencies)."""
        return {**(await engine.get_stats()), "steps_with_several_requests": engine.steps_with_several_requests}

    @app.get("/metrics")
    async def prometheus_metrics():
        """Prometheus text, under vLLM's metric names (entrypoints/prometheus.py)."""
        return Response(metrics.render(await engine.get_stats()), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/kv")
    async def kv():
        """The KV pool and every page table as JSON, read between two steps (tools/viz.py kv_map)."""
        return await engine.call_between_steps(kv_map, engine.engine)

    @app.get("/", response_class=HTMLResponse)
    async def live_map():
        """The live memory map: a page that polls /kv and draws the pool and the page tables."""
        return HTMLResponse(KV_PAGE.read_text())

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": server.created,
                                            "owned_by": "minipaged", "root": str(engine.engine.config.model),
                                            "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await server.completions(request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await server.chat_completions(request, raw)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await asyncio.get_running_loop().run_in_executor(None, server.tokenize, request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await asyncio.get_running_loop().run_in_executor(None, server.detokenize, request)

    return app


# --------------------------------------------------------------------------- the command

class Server:
    """uvicorn, plus what `serve` adds: the real URL printed once listening (the port may be
    0), Ctrl-C aborting the requests in flight before connections drain, and a dead engine
    ending the server (after ``grace`` seconds in which the 503s in flight are written)."""

    def __init__(self, app: FastAPI, engine: AsyncLLMEngine, host: str, port: int, name: str,
                 limits: HTTPLimits | None = None, grace: float = 1.0) -> None:
        import uvicorn  # noqa: PLC0415 (the serve extra)

        outer = self

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                await super().startup(sockets=sockets)
                if self.started:
                    bound = self.servers[0].sockets[0].getsockname()
                    outer.url = f"http://{host}:{bound[1]}/v1"
                    print(f"minipaged: serving {name!r} at {outer.url} (Ctrl-C to stop)", flush=True)

            def handle_exit(self, sig, frame) -> None:
                if not self.should_exit and outer.loop is not None:
                    outer.loop.call_soon_threadsafe(outer.abort_in_flight)
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn's own re-raises the signal once it has shut down (a KeyboardInterrupt,
                # or death by SIGTERM); a server that stopped cleanly should exit 0 instead.
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        self.engine = engine
        self.url: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.aborted = 0
        self.engine_died: BaseException | None = None
        self.grace = grace
        engine.dead_listeners.append(self.on_engine_death)
        self.server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                             **(limits or HTTPLimits()).uvicorn_limits()))

    def on_engine_death(self, err: BaseException) -> None:
        """The engine cannot serve any more: stop accepting, let the 503s go out, exit (and
        a few seconds later stop waiting for connections that still hang on)."""
        self.engine_died = err
        if self.loop is not None:
            self.loop.call_later(self.grace, setattr, self.server, "should_exit", True)
            self.loop.call_later(self.grace + 5.0, setattr, self.server, "force_exit", True)

    def abort_in_flight(self) -> None:
        self.aborted += len(self.engine._queues)
        asyncio.ensure_future(self.engine.abort_all())

    def run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(main())


def serve(engine_kwargs: dict, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, max_queued_requests: int | None = None, step_timeout: float | None = 60.0,
          limits: HTTPLimits | None = None) -> int:
    """Build the engine, serve until Ctrl-C (exit 0: says what was aborted and that nothing is
    held) or until the engine dies (exit 1: says why)."""
    name = served_model_name or str(engine_kwargs.get("model", "smollm2-135m-instruct"))
    limits = limits or HTTPLimits()
    engine = AsyncLLMEngine.from_engine_args(max_queued_requests=max_queued_requests, step_timeout=step_timeout,
                                             **engine_kwargs)
    seconds = engine.warm_up(bool(engine_kwargs.get("calculate_kv_scales")))   # before the first client
    if seconds is not None:
        logger.info("warmed up in %.1f s: a prefill and decode batches, before the first request", seconds)
    server = Server(build_app(engine, name, api_key, limits), engine, host, port, name, limits)
    server.run()
    if server.engine_died is not None:
        err = server.engine_died
        print(f"minipaged: the engine died ({type(err).__name__}: {err}); exiting with status 1 so that a "
              "supervisor restarts the server", file=sys.stderr, flush=True)
        if engine.thread_stuck:                   # a hung step's thread would keep the process alive
            os._exit(1)
        return 1
    used = engine.engine.block_manager.num_used_blocks
    print(f"minipaged: stopped; aborted {server.aborted} request(s) in flight; KV blocks in use: {used}", flush=True)
    return 0
