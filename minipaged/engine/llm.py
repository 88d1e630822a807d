"""LLM: the offline front door in vLLM's shape: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools

from tqdm.auto import tqdm

from .llm_engine import LLMEngine
from ..model.fetch import DEFAULT_MODEL
from ..outputs import RequestOutput
from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .input_processor import RequestError, check_sampling_params
from ..sampling_params import OutputKind, SamplingParams, as_int


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_space: float | None = None, max_num_seqs: int = 256,
                 max_model_len: int | None = None, seed: int = 0, **engine_kwargs) -> None:
        self.llm_engine = LLMEngine(
            model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
            kv_cache_space=kv_cache_space, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            seed=seed, **engine_kwargs)
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict:
        return self.llm_engine.get_stats()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in the order of the prompts.

        prompts: a str, a list of str, a list of token-id lists, or dicts with
        "prompt" / "prompt_token_ids"; sampling_params: one for all, or one each.
        """
        prompts = self._as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = []
            for i, sp in enumerate(sampling_params):   # None in the list is the default, as alone
                try:
                    params.append(check_sampling_params(sp))
                except RequestError as err:
                    raise RequestError(f"sampling_params[{i}]: {err}") from None
        else:
            params = [check_sampling_params(sampling_params)] * len(prompts)
        return self._run(prompts, params, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search for each prompt; returns, per prompt, its best beam_width sequences.

        Each sequence has ``tokens`` and ``text`` including the prompt (vLLM's shape) and
        ``cum_logprob``, the sum of the model's log-probabilities of the generated tokens.
        """
        prompts = self._as_prompt_list(prompts)
        engine = self.llm_engine
        groups = [engine._make_beam_group(str(next(self._request_ids)), p, params) for p in prompts]
        outputs = self._drive(groups, use_tqdm)
        tokenizer = self.get_tokenizer()
        return [BeamSearchOutput([BeamSearchSequence(
            tokens=o.prompt_token_ids + c.token_ids,
            text=tokenizer.decode(o.prompt_token_ids + c.token_ids, skip_special_tokens=True),
            cum_logprob=c.cumulative_logprob, finish_reason=c.finish_reason) for c in o.outputs])
            for o in outputs]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations.

        Every conversation is checked (and rendered) before any is queued; a bad message
        raises ValueError naming its conversation, its index and the field.
        """
        if not isinstance(messages, (list, tuple)):
            raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) or a "
                             f"list of conversations, got {type(messages).__name__}")
        single = bool(messages) and not isinstance(messages[0], (list, tuple))
        conversations = [messages] if single else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            except ValueError as err:
                if single:
                    raise
                raise ValueError(f"conversation {i}: {err}") from None
            # the template already wrote the special tokens as text; add none
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = tokenizer.decode(prompt["prompt_token_ids"])
        return outputs

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        """One prompt (a str, a dict, a list of token ids) becomes a list of one.

        A list whose first item is an integer, numpy's included, is one token-id prompt;
        any other list is a batch (each item then checked as a prompt of its own).
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and as_int(prompts[0]) is not None):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
        return list(prompts)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate every prompt before queueing any, so one bad prompt leaves no orphans.
        # Only the final output of each request is wanted here.
        groups = [engine._make_group(str(next(self._request_ids)), p,
                                     dataclasses.replace(sp, output_kind=OutputKind.FINAL_ONLY))
                  for p, sp in zip(prompts, params)]
        return self._drive(groups, use_tqdm)

    def _drive(self, groups: list, use_tqdm: bool) -> list[RequestOutput]:
        """Queue the (validated) requests, step until all are done, outputs in their order."""
        engine = self.llm_engine
        order = {g.request_id: i for i, g in enumerate(groups)}
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(groups), desc="Processed prompts", disable=not use_tqdm)
        try:
            for group in groups:
                engine._queue(group)
            while len(finished) < len(groups) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:  # others' requests are not ours
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for request_id in order:          # interrupted (Ctrl-C): leave the engine clean
                if request_id not in finished:
                    engine.abort_request(request_id)
        return sorted(finished.values(), key=lambda o: order[o.request_id])
