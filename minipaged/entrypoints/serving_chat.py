"""/v1/chat/completions: a conversation in, the assistant's turn out (a system call's body).

The messages are rendered by the model's own chat template (tokenizer_config.json, through
jinja2) and tokenized off the event loop; the request is then one engine request with ``n``
samples. A stream sends each choice's role first, then its text as it is detokenized, then
its finish reason, once. Logprobs come in the chat shape: per token its text, logprob and
UTF-8 bytes, with the ``top_logprobs`` most likely tokens at that step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from .api_errors import APIError, field_of
from .openai_protocol import ChatCompletionRequest
from .openai_serving import OpenAIServing, usage
from .tool_calls import calls_from_text, new_call_id


class ServingChat(OpenAIServing):
    async def chat_completions(self, request: ChatCompletionRequest, raw: Request):
        self.check_model(request.model)
        self.check_fields(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            mode = request.tool_mode()      # None, "none", "required" or a function's name
        except ValueError as err:
            raise APIError(400, str(err), param=field_of(str(err), ("tool_choice", "tools")) or "tools") from None
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
        streams = await self.open_streams([request.prompt_input(ids)], params, request_id,
                                          strict_max_tokens=asked_explicitly,
                                          rename={"logprobs": "top_logprobs",
                                                  "structured_outputs": self.constraint_field(request, mode)})
        if request.stream:
            return self.sse(self.chat_chunks(request, streams[0], request_id, mode))
        out = (await self.collect(streams, raw))[0]
        choices = []
        for c in out.outputs:
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            calls = calls_from_text(mode, c.text) if mode not in (None, "none") else None
            if calls is not None:     # a whole call: the text was its arguments (vLLM's content "")
                message = {"role": "assistant", "content": "", "tool_calls": calls}
                finish_reason = "tool_calls" if mode == "required" and finish_reason == "stop" else finish_reason
            choices.append({"index": c.index, "message": message,
                            "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0)
                            if request.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "prompt_logprobs": self.vllm_prompt_logprobs(out),
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                               out.num_cached_tokens)}

    def chat_prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        return self.conversation_ids(request.conversation(), request.add_generation_prompt, request.tools)

    async def chat_chunks(self, request: ChatCompletionRequest, stream, request_id: str,
                          mode: str | None = None) -> AsyncIterator[dict]:
        """The stream's chunks. A named tool call streams its arguments as tool_calls deltas; a
        "required" one sends its calls once the array is complete, as they cannot be split
        into calls before then."""
        created = int(time.time())
        with_usage = {"usage": None} if request.include_usage else {}   # OpenAI: null until the last chunk

        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}], **with_usage}

        calling = mode not in (None, "none")
        texts: dict[int, str] = {}          # a tool call's arguments so far, per choice
        headed: set[int] = set()            # choices whose named call's id and name were sent
        try:
            for i in range(request.n):                   # the role first, as OpenAI sends it
                yield chunk(i, {"role": "assistant", "content": ""})
            prompt_tokens, completion_tokens, cached = 0, 0, None
            async for out in stream:
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    logprobs = (self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0)
                                if request.logprobs else None)
                    reason = c.finish_reason
                    if calling:
                        texts[c.index] = texts.get(c.index, "") + c.text
                        if mode != "required" and c.text:     # a named call: its arguments as they come
                            call = {"index": 0, "function": {"arguments": c.text}}
                            if c.index not in headed:         # the first piece carries the id and name
                                headed.add(c.index)
                                call = {"index": 0, "id": new_call_id(), "type": "function",
                                        "function": {"name": mode, "arguments": c.text}}
                            yield chunk(c.index, {"tool_calls": [call]}, None, logprobs)
                        if reason and mode == "required":
                            calls = calls_from_text(mode, texts[c.index])
                            if calls is None:                 # cut short: the text as it is
                                yield chunk(c.index, {"content": texts[c.index]})
                            else:
                                yield chunk(c.index, {"tool_calls": [{"index": j, **call}
                                                                     for j, call in enumerate(calls)]})
                                reason = "tool_calls" if reason == "stop" else reason
                    elif c.text or (c.token_ids and request.logprobs):   # text held back (a partial
                        yield chunk(c.index, {"content": c.text}, None, logprobs)  # character) waits
                    if reason:
                        yield chunk(c.index, {}, reason, None, c.stop_reason)
            if request.include_usage:
                yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens, cached)}
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

