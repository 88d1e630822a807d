"""/v1/completions: a prompt (or several) in, text out, whole or streamed (a system call's body).

OpenAI's legacy completions: ``prompt`` is a string, a list of strings, token ids or lists of
them; each becomes one engine request with ``n`` samples, and the answer's choices are
numbered prompt by prompt. ``echo`` puts the prompt before each completion (with its
logprobs, scored by the engine's prompt_logprobs); the legacy logprobs shape gives tokens,
their logprobs, the ``top_n`` most likely at each step, and each token's text offset.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from .api_errors import APIError
from .openai_protocol import CompletionRequest
from .openai_serving import OpenAIServing, merged, usage


class ServingCompletion(OpenAIServing):
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
        streams = await self.open_streams([request.prompt_input(p) for p in prompts], params, request_id,
                                          strict_max_tokens=request.max_tokens is not None,
                                          rename={"structured_outputs": self.constraint_field(request)})
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
        cached = sum(o.num_cached_tokens or 0 for o in outputs)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached)}

    async def completion_chunks(self, request: CompletionRequest, streams: list,
                                request_id: str) -> AsyncIterator[dict]:
        created = int(time.time())
        prompt_tokens, completion_tokens, cached = 0, 0, {}
        with_usage = {"usage": None} if request.include_usage else {}   # OpenAI: null until the last chunk

        def chunk(index: int, text: str, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}], **with_usage}

        try:
            echoed: set[int] = set()
            offsets: dict[int, int] = {}
            async for p, out in merged(streams):
                cached[p] = out.num_cached_tokens or 0
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
                       "choices": [], "usage": usage(prompt_tokens, completion_tokens, sum(cached.values()))}
        finally:
            for stream in streams:      # closed early (a client gone while we wrote): abort
                await stream.aclose()


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



def merge_logprobs(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects one after the other (echo: the prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in first}
