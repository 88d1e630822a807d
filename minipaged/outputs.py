"""What a request gets back, in vLLM's shape: RequestOutput holding CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int                            # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None      # sum of the log-probabilities of token_ids
    logprobs: list[dict[int, float]] | None  # per token: {token id: logprob}, if asked
    finish_reason: str | None = None      # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token, finish times
    # if SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (the top k and the
    # token itself, given the tokens before it); the first token, which has no context, gets None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens the prefix cache already held when the request was admitted (vLLM's name;
    # with a cache_salt, only blocks cached under the same salt count); None before admission
    num_cached_tokens: int | None = None
