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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                       RequestAbortedError)
from ..engine.input_processor import RequestError
from ..outputs import RequestOutput
from ..tools.viz import kv_map
from .openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                              SamplingFields, TokenizeRequest)
from .prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from .prometheus import ServerMetrics

KV_PAGE = Path(__file__).parent / "static" / "kv.html"   # the live memory map (GET /)

logger = logging.getLogger("minipaged")


def package_version() -> str:
    try:
        return importlib.metadata.version("minipaged")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree, not installed
        return "unknown"


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param,
                                                                         self.code or str(self.status)))


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def field_of(message: str, fields) -> str | None:
    """The request field an engine error message names, if any (for the error's ``param``)."""
    for name in sorted(fields, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message):
            return name
    return None


class OpenAIServer:
    """The endpoints' logic over one AsyncLLMEngine; ``build_app`` wires them to routes."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        # what the model's generation_config.json recommends, for fields a request leaves unset
        self.generation_defaults = dict(getattr(engine.engine, "generation_defaults", {}) or {})
        self.default_max_tokens = self.generation_defaults.pop("max_tokens", None)
        self.created = int(time.time())

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "NotFoundError", "model", "model_not_found")

    @staticmethod
    def check_fields(request: SamplingFields) -> None:
        """Fields that would change the answer's meaning but that this server does not do: a 400,
        not an answer to another question."""
        for name in ("suffix", "tools", "tool_choice", "response_format", "functions"):
            if getattr(request, name, None) not in (None, "none"):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options can only be given with stream=true", param="stream_options")

    def sampling_params(self, request: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None):
        try:
            if prompt_logprobs is not None:          # echo with logprobs asks for the prompt's too
                request = request.model_copy(update={"prompt_logprobs": prompt_logprobs})
            return request.sampling_params(max_tokens, logprobs, self.generation_defaults)
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param=field_of(str(err), type(request).model_fields)) from None

    async def open_streams(self, prompts: list, params, request_id: str, strict_max_tokens: bool,
                           rename: dict | None = None) -> list:
        """Queue every prompt (one engine request each); a refusal aborts those already queued.

        ``strict_max_tokens``: the client asked for max_tokens explicitly, so a prompt + max_tokens
        beyond max_model_len is a 400, as vLLM's server answers (the library caps it instead).
        ``rename`` maps an engine field to the request's name for it (logprobs -> top_logprobs).
        """
        streams = []
        rename = rename or {}
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params,
                                                             strict_max_tokens=strict_max_tokens))
        except BaseException as err:
            for stream in streams:
                await stream.aclose()
            if isinstance(err, QueueFullError):
                raise APIError(503, str(err), "ServiceUnavailableError", None, "queue_full") from None
            if isinstance(err, RequestError):
                message = str(err)
                param = field_of(message, ("logit_bias", "stop_token_ids", "prompt_logprobs", "logprobs",
                                           "max_tokens", "n")) or ("prompt" if "prompt" in message
                                                                   or "token id" in message else None)
                raise APIError(400, message, param=rename.get(param, param)) from None
            if isinstance(err, (ValueError, TypeError)):
                raise APIError(400, str(err)) from None
            raise
        return streams

    def max_tokens_for(self, asked: int | None, prompt_len: int) -> int:
        """OpenAI's chat default (no max_tokens) is "as many as fit": max_model_len - prompt."""
        if asked is not None:
            return asked
        return max(self.max_model_len - prompt_len, 1)

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, request: CompletionRequest, raw: Request):
        self.check_model(request.model)
        self.check_fields(request)
        prompts = request.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        asked = request.max_tokens if "max_tokens" in request.model_fields_set else self.default_max_tokens
        params = self.sampling_params(request, asked if asked is not None else (request.max_tokens or self.max_model_len),
                                      request.logprobs,
                                      request.logprobs if request.echo and request.logprobs is not None else None)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.open_streams(prompts, params, request_id,
                                          strict_max_tokens=request.max_tokens is not None)
        if request.stream:
            return self.sse(self.completion_chunks(request, streams, request_id))
        outputs = await self.collect(streams, raw)
        choices, completion_tokens = [], 0
        for p, out in enumerate(outputs):
            prompt_text = self.prompt_text(out) if request.echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.completion_logprobs(c.token_ids, c.logprobs, len(prompt_text), request.logprobs)
                    if request.echo:
                        logprobs = merge_logprobs(self.completion_logprobs(
                            out.prompt_token_ids, out.prompt_logprobs, 0, request.logprobs), logprobs)
                choices.append({"index": p * request.n + c.index, "text": prompt_text + c.text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "prompt_logprobs": self.vllm_prompt_logprobs(out) if c.index == 0 else None})
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}

    async def completion_chunks(self, request: CompletionRequest, streams: list,
                                request_id: str) -> AsyncIterator[dict]:
        created = int(time.time())
        prompt_tokens, completion_tokens = 0, 0
        with_usage = {"usage": None} if request.include_usage else {}   # OpenAI: null until the last chunk

        def chunk(index: int, text: str, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}], **with_usage}

        try:
            echoed: set[int] = set()
            offsets: dict[int, int] = {}
            async for p, out in merged(streams):
                if p not in echoed:
                    echoed.add(p)
                    prompt_tokens += len(out.prompt_token_ids)
                    if request.echo:
                        text = self.prompt_text(out)
                        echo_logprobs = (self.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, 0,
                                                                  request.logprobs)
                                         if request.logprobs is not None else None)
                        for i in range(request.n):
                            offsets[p * request.n + i] = len(text)
                            yield chunk(p * request.n + i, text, logprobs=echo_logprobs)
                for c in out.outputs:
                    index = p * request.n + c.index
                    completion_tokens += len(c.token_ids)
                    if c.text or c.finish_reason or (c.token_ids and request.logprobs is not None):
                        logprobs = (self.completion_logprobs(c.token_ids, c.logprobs, offsets.get(index, 0), request.logprobs)
                                    if request.logprobs is not None else None)
                        offsets[index] = offsets.get(index, 0) + len(c.text)
                        yield chunk(index, c.text, c.finish_reason, logprobs, c.stop_reason)
            if request.include_usage:
                yield {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
        finally:
            for stream in streams:      # closed early (a client gone while we wrote): abort
                await stream.aclose()

    def vllm_prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, decoded_token}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if top is None else {str(t): {"logprob": lp, "decoded_token": self.tokenizer.decode([t])}
                                          for t, lp in top.items()}
                for top in out.prompt_logprobs]

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def completion_logprobs(self, token_ids: list[int], logprobs, text_offset: int, top_n: int) -> dict:
        """The legacy completions shape: tokens, their logprobs, the ``top_n`` most likely at
        each step, and each token's offset in the text."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, top_k in zip(token_ids, logprobs or []):
            text = self.tokenizer.decode([token])
            tokens.append(text)
            if top_k is None:                    # the first prompt token: nothing before it
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(top_k.get(token))
                best = dict(sorted(top_k.items(), key=lambda kv: -kv[1])[:top_n])
                best.setdefault(token, top_k.get(token))      # the sampled token is always there (vLLM's)
                top.append({self.tokenizer.decode([t]): lp for t, lp in best.items()})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat_completions(self, request: ChatCompletionRequest, raw: Request):
        self.check_model(request.model)
        self.check_fields(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:   # rendering and tokenizing a long conversation takes a while: off the event loop
            ids = await asyncio.get_running_loop().run_in_executor(None, self.chat_prompt_ids, request)
        except (ValueError, TypeError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        asked = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        asked_explicitly = asked is not None
        if asked is None:
            asked = self.default_max_tokens
        params = self.sampling_params(request, self.max_tokens_for(asked, len(ids)), request.top_logprobs_asked())
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.open_streams([{"prompt_token_ids": ids}], params, request_id,
                                          strict_max_tokens=asked_explicitly, rename={"logprobs": "top_logprobs"})
        if request.stream:
            return self.sse(self.chat_chunks(request, streams[0], request_id))
        out = (await self.collect(streams, raw))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0) if request.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "prompt_logprobs": self.vllm_prompt_logprobs(out),
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}

    def chat_prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(request.conversation(),
                                                  add_generation_prompt=request.add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)   # the template wrote them as text

    async def chat_chunks(self, request: ChatCompletionRequest, stream, request_id: str) -> AsyncIterator[dict]:
        created = int(time.time())
        with_usage = {"usage": None} if request.include_usage else {}   # OpenAI: null until the last chunk

        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}], **with_usage}

        try:
            for i in range(request.n):                   # the role first, as OpenAI sends it
                yield chunk(i, {"role": "assistant", "content": ""})
            prompt_tokens, completion_tokens = 0, 0
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    logprobs = (self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0)
                                if request.logprobs else None)
                    if c.text or (c.token_ids and request.logprobs):   # text held back (a partial
                        yield chunk(c.index, {"content": c.text}, None, logprobs)  # character) waits
                    if c.finish_reason:
                        yield chunk(c.index, {}, c.finish_reason, None, c.stop_reason)
            if request.include_usage:
                yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
        finally:
            await stream.aclose()       # closed early (a client gone while we wrote): abort it

    def chat_logprobs(self, token_ids: list[int], logprobs, top_n: int) -> dict:
        """The chat shape: per token its text, logprob and UTF-8 bytes, and the ``top_n`` most
        likely tokens at that step (the engine's dict holds the sampled token too)."""
        def entry(token: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, top_k in zip(token_ids, logprobs or []):
            best = sorted(top_k.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({**entry(token, top_k.get(token)), "top_logprobs": [entry(t, lp) for t, lp in best]})
        return {"content": content}

    # ------------------------------------------------------------------ /tokenize, /detokenize
    def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if request.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()}
                                                           for m in request.messages],
                                                          add_generation_prompt=request.add_generation_prompt)
            except (ValueError, TypeError) as err:
                raise APIError(400, f"messages: {err}", param="messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            try:
                ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            except (ValueError, TypeError) as err:
                raise APIError(400, f"prompt: {err}", param="prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (ids 0..{vocab - 1})", param="tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}

    # ------------------------------------------------------------------ plumbing
    async def collect(self, streams: list, raw: Request) -> list[RequestOutput]:
        """The final output of each stream; a client that disconnects first aborts them all."""
        async def finals() -> list[RequestOutput]:
            results = []
            for stream in streams:
                last = None
                async for out in stream:
                    last = out
                results.append(last)
            return results

        work = asyncio.ensure_future(finals())
        watch = asyncio.ensure_future(wait_for_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:                       # the client went away: stop everything
                work.cancel()
                raise ClientGone()
            return await work
        finally:
            watch.cancel()
            for stream in streams:
                await stream.aclose()

    def sse(self, chunks: AsyncIterator[dict]) -> StreamingResponse:
        """Server-sent events: ``data: {json}`` per chunk, then ``data: [DONE]``. A disconnect
        cancels the generator, whose streams then abort their requests."""
        async def events():
            try:
                async with contextlib.aclosing(chunks) as inner:   # closing us closes them
                    async for c in inner:
                        yield f"data: {json.dumps(c)}\n\n"
            except (RequestAbortedError, EngineDeadError) as err:
                yield f"data: {json.dumps(error_body(str(err), 'ServiceUnavailableError', None, '503'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


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


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its requests are aborted)."""


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they arrive."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as err:  # noqa: BLE001 (handed to the consumer)
            await queue.put((i, err))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_ = len(streams)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


def merge_logprobs(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects one after the other (echo: the prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in first}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application: routes, the API key check, errors in OpenAI's shape."""
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

    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, err: RequestValidationError):
        problems = err.errors()
        if any(e.get("type") == "json_invalid" for e in problems):
            return APIError(400, f"the request body is not valid JSON ({problems[0].get('ctx', {}).get('error', '')})"
                            .replace(" ()", ""), param=None).response()
        first = problems[0] if problems else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None          # the request's field (pydantic adds union branches)
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in problems[:5])
        return APIError(400, message or "malformed request body", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        return APIError(err.status_code, str(err.detail), "NotFoundError" if err.status_code == 404
                        else "invalid_request_error").response()

    @app.exception_handler(RequestAbortedError)
    @app.exception_handler(EngineDeadError)
    async def unavailable(_: Request, err: Exception):      # a shutdown, not a bug: no traceback
        return APIError(503, str(err), "ServiceUnavailableError").response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone):
        return Response(status_code=499)            # nobody is listening; nginx's "client closed"

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception):
        logger.error("internal error: %s: %s", type(err).__name__, err)
        status = 503 if isinstance(err, (EngineDeadError, RequestAbortedError)) else 500
        return APIError(status, "the server could not answer this request" if status == 500 else str(err),
                        "InternalServerError" if status == 500 else "ServiceUnavailableError").response()

    @app.get("/health")
    async def health():
        if engine._dead is not None:
            raise APIError(503, f"the engine loop has stopped: {engine._dead}", "ServiceUnavailableError")
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
    """uvicorn, plus the two things `serve` adds: the real URL printed once listening (the
    port may be 0), and Ctrl-C aborting the requests in flight before connections drain."""

    def __init__(self, app: FastAPI, engine: AsyncLLMEngine, host: str, port: int, name: str) -> None:
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
        self.server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))

    def abort_in_flight(self) -> None:
        self.aborted += len(self.engine._queues)
        asyncio.ensure_future(self.engine.abort_all())

    def run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(main())


def serve(engine_kwargs: dict, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, max_queued_requests: int | None = None) -> int:
    """Build the engine, serve until Ctrl-C, then say what was aborted and that nothing is held."""
    name = served_model_name or str(engine_kwargs.get("model", "smollm2-135m-instruct"))
    engine = AsyncLLMEngine.from_engine_args(max_queued_requests=max_queued_requests, **engine_kwargs)
    seconds = engine.warm_up(bool(engine_kwargs.get("calculate_kv_scales")))   # before the first client
    if seconds is not None:
        logger.info("warmed up in %.1f s: a prefill and decode batches, before the first request", seconds)
    server = Server(build_app(engine, name, api_key), engine, host, port, name)
    server.run()
    used = engine.engine.block_manager.num_used_blocks
    print(f"minipaged: stopped; aborted {server.aborted} request(s) in flight; KV blocks in use: {used}", flush=True)
    return 0
