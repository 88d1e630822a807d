"""OpenAIServing: what every OpenAI endpoint shares (the system-call gate's argument checks).

A kernel copies a system call's arguments in, checks them, and only then touches its own
state. Here the endpoints (serving_completion.py, serving_chat.py) share the checks of a
request's model and fields, the turn of OpenAI's sampling fields into ``SamplingParams``,
the queueing of prompts as engine requests (a refusal aborts those already queued), and the
two ways an answer goes back: whole (``collect``, which aborts everything if the client
hangs up) or as server-sent events (``sse``). /tokenize and /detokenize live here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.async_llm_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                       RequestAbortedError)
from ..engine.input_processor import RequestError
from ..outputs import RequestOutput
from .api_errors import APIError, ClientGone, error_body, field_of
from .openai_protocol import DetokenizeRequest, SamplingFields, TokenizeRequest


class OpenAIServing:
    """The endpoints' shared checks and plumbing over one AsyncLLMEngine."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        # what the model's generation_config.json recommends, for fields a request leaves unset
        self.generation_defaults = dict(getattr(engine.engine, "generation_defaults", {}) or {})
        self.default_max_tokens = self.generation_defaults.pop("max_tokens", None)
        self.created = int(time.time())
        self.input_processor = engine.engine.input_processor

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "NotFoundError", "model", "model_not_found")

    @staticmethod
    def check_fields(request: SamplingFields) -> None:
        """Fields that would change the answer's meaning but that this server does not do: a 400,
        not an answer to another question."""
        for name in ("suffix", "functions", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(request, name, None) is not None:
                hint = {"functions": "; use tools"}.get(name, "")
                if name.startswith("guided_"):   # vLLM's old name
                    hint = f"; send structured_outputs: {{\"{name[len('guided_'):]}\": ...}} (vLLM's current name)"
                raise APIError(400, f"{name} is not supported by this server{hint}", param=name)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options can only be given with stream=true", param="stream_options")

    @staticmethod
    def constraint_field(request: SamplingFields, tool_mode: str | None = None) -> str:
        """The request field a constraint came from, to name it in an error."""
        if tool_mode not in (None, "none"):
            return "tools"
        return "response_format" if request.response_format is not None else "structured_outputs"

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
                                           "max_tokens", "n", "structured_outputs", "cache_salt")) or (
                    "prompt" if "prompt" in message or "token id" in message else None)
                if param in rename and message.startswith(f"{param}:"):   # named as the request named it
                    message = rename[param] + message[len(param):]
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

    def vllm_prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, decoded_token}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if top is None else {str(t): {"logprob": lp, "decoded_token": self.tokenizer.decode([t])}
                                          for t, lp in top.items()}
                for top in out.prompt_logprobs]

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)


    def conversation_ids(self, conversation: list[dict], add_generation_prompt: bool, tools=None) -> list[int]:
        """The token ids of a conversation rendered by the chat template (with the ``tools`` the
        model may call, where the template shows them); one too long to fit is
        refused by its characters once rendered (a template may trim or drop messages, so the
        messages alone say nothing; the body limit bounds the rendering), before it is
        tokenized: a RequestError (a ValueError). Run it off the event loop."""
        extra = {} if tools is None else {"tools": tools}
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **extra)
        self.input_processor.check_prompt_chars(len(text), "the conversation, rendered by the chat template,")
        return self.tokenizer.encode(text, add_special_tokens=False)   # the template wrote them as text

    # ------------------------------------------------------------------ /tokenize, /detokenize
    def tokenize(self, request: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the ids and their count, whatever the length (a client counts the
        tokens of a document this way); ``max_model_len`` says what would fit."""
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if request.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()}
                                                           for m in request.messages],
                                                          add_generation_prompt=request.add_generation_prompt)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            except (ValueError, TypeError) as err:
                raise APIError(400, f"messages: {err}", param="messages") from None
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with ``cached_tokens`` (prompt tokens the prefix cache held) its
    prompt_tokens_details too."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts
