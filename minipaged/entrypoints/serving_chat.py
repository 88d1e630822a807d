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

from .api_errors import APIError
from .openai_protocol import ChatCompletionRequest
from .openai_serving import OpenAIServing, usage


class ServingChat(OpenAIServing):
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
        return self.conversation_ids(request.conversation(), request.add_generation_prompt)

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

