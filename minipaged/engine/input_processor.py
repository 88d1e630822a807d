"""InputProcessor: a request is checked in full before it is queued (exec()'s checks).

An OS refuses to start a program it cannot load: a bad format, more memory than
the machine has. This module does the same for requests: it turns a prompt into
token ids, checks the ids, the length and the sampling parameters, and works out
the most KV blocks the request can ever need; only a request that could run alone
in the pool becomes a SequenceGroup. Everything here raises ``RequestError`` and
changes nothing, so a refused request never disturbs the ones already running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from ..memory.block_manager import BlockManager, blocks_for
from ..model.tokenizer import Tokenizer, unicode_problem
from ..sampling_params import OutputKind, SamplingParams, as_int, shown
from ..sequence import Sequence, SequenceGroup
from .beam_search import BeamSearchParams, BeamState
from .detokenizer import start_offsets
from .structured_output import GrammarCompiler


class RequestError(ValueError):
    """A request was refused before it was queued; no other request is affected."""


def check_sampling_params(params) -> SamplingParams:
    """``params`` if it is a SamplingParams, the default for None; else a RequestError that
    says what it was (a dict of fields, beam-search parameters) before anything uses it."""
    if params is None:
        return SamplingParams()
    if isinstance(params, BeamSearchParams):
        raise RequestError("sampling params must be a SamplingParams, got BeamSearchParams; for beam "
                           "search call LLM.beam_search() (or LLMEngine.add_beam_request())")
    if not isinstance(params, SamplingParams):
        hint = " (build one: SamplingParams(**fields))" if isinstance(params, dict) else ""
        raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}{hint}")
    return params


@dataclass(frozen=True)
class PromptInput:
    """A prompt after tokenization: the ids, and the text if there was one."""

    token_ids: list[int]
    text: str | None
    cache_salt: str | None = None   # the prompt dict's "cache_salt" (prefix caching per tenant)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 block_manager: BlockManager, kv_allocator: str, max_logprobs: int = 20,
                 max_num_seqs: int | None = None, block_copy_problem: str | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars   # compiles structured_outputs constraints (None: they are refused)
        self.block_copy_problem = block_copy_problem   # why blocks cannot be copied (no Numba CUDA), or None
        self.max_num_seqs = max_num_seqs     # the scheduler runs at most this many sequences at once
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.kv_allocator = kv_allocator   # "paged" or "contiguous" (reserves at admission)
        self.max_logprobs = max_logprobs   # most logprobs a request may ask for; -1: no cap

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest text that could still fit in max_model_len - 1 tokens (None: no bound;
        model/tokenizer.py chars_per_token_bound)."""
        per_token = self.tokenizer.max_chars_per_token
        return None if per_token is None else (self.max_model_len - 1) * per_token

    def check_prompt_chars(self, chars: int, what: str = "the prompt") -> None:
        """Refuse, before tokenizing it, a text too long to fit in any case: tokenizing 50 MB
        takes most of a minute, and the answer is known from its length alone."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise RequestError(
                f"{what} has {chars} characters: more than max_model_len={self.max_model_len} tokens can hold "
                f"(a token of this model is at most {self.tokenizer.max_chars_per_token} characters, so at most "
                f"{limit} characters fit in {self.max_model_len - 1} prompt tokens); shorten it")

    def tokenize(self, prompt) -> PromptInput:
        """Accept a str, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.

        Token ids may be numpy integers (they become Python ints); a bool is not a token id.
        A dict may also carry ``"cache_salt"``: a non-empty string (vLLM's name).
        """
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise RequestError(f"cache_salt must be a non-empty string, got {shown(salt)}")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple)):
                    raise RequestError(f"prompt_token_ids must be a list of ints, got {type(prompt).__name__}")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise RequestError(f"'prompt' must be a string, got {type(prompt).__name__}")
            else:
                raise RequestError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key, got keys "
                                   f"{shown(sorted(map(str, prompt)))}")
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
            problem = unicode_problem(prompt)
            if problem is not None:
                raise RequestError(f"the prompt is not valid Unicode text: {problem}")
            return PromptInput(self.tokenizer.encode(prompt, add_special_tokens=True), prompt, salt)
        if isinstance(prompt, (list, tuple)):
            ids = [as_int(t) for t in prompt]
            for i, t in enumerate(ids):
                if t is None:
                    raise RequestError(f"a token-id prompt must hold only ints, got {shown(prompt[i])} "
                                       f"({type(prompt[i]).__name__}) at index {i}")
            return PromptInput(ids, None, salt)
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def make_group(self, request_id: str, prompt, params: SamplingParams | None,
                   seq_ids: Iterator[int]) -> SequenceGroup:
        """Validate and build a request (one sequence per sample) without queueing it."""
        params = check_sampling_params(params)
        p = self.tokenize(prompt)
        ids = p.token_ids
        if not ids:
            raise RequestError("the prompt is empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {shown(bad[0])} is outside the vocabulary "
                               f"(ids 0..{self.vocab_size - 1})")
        if len(ids) >= self.max_model_len:   # vLLM's rule too: room for at least one new token
            raise RequestError(f"the prompt has {len(ids)} tokens, more than max_model_len="
                               f"{self.max_model_len} allows: it must leave room for at least one "
                               f"generated token (at most {self.max_model_len - 1} prompt tokens)")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:   # the sampler bans stop ids by indexing the logits (min_tokens)
            raise RequestError(f"stop_token_ids: token id {shown(bad[0])} is outside the vocabulary "
                               f"(ids 0..{self.vocab_size - 1})")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:   # the sampler adds the bias by indexing the logits
            raise RequestError(f"logit_bias: token id {shown(bad[0])} is outside the vocabulary "
                               f"(ids 0..{self.vocab_size - 1})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and 0 <= self.max_logprobs < asked:
                raise RequestError(f"{name}={asked} is more than max_logprobs={self.max_logprobs} "
                                   "(an engine option; raise it to get more)")
        if params.n > 1 and self.block_copy_problem is not None:
            raise RequestError(f"n={params.n} (or beam_width): the samples share their prompt's blocks "
                               f"copy-on-write, but {self.block_copy_problem}; or send n=1")
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            # its n sequences must run together, and the scheduler never runs that many
            raise RequestError(f"n={params.n} sequences can never run at once: max_num_seqs="
                               f"{self.max_num_seqs} (raise max_num_seqs or lower n / beam_width)")
        params = self._clamp_max_tokens(len(ids), params)
        self._check_fits(ids, params)
        grammars = self._grammars(params, request_id)
        seqs = [Sequence(next(seq_ids), list(ids), cache_salt=p.cache_salt, grammar=next(grammars, None))
                for _ in range(params.n)]
        for seq in seqs:
            start_offsets(seq)
        return SequenceGroup(request_id, seqs, params, prompt=p.text)

    def _grammars(self, params: SamplingParams, request_id: str) -> Iterator:
        """One matcher per sample of a constrained request (each walks the grammar on its own);
        a schema, regex or grammar the library cannot compile is a RequestError now."""
        spec = params.structured_outputs
        if spec is None:
            return iter(())
        if self.grammars is None:
            raise RequestError("structured_outputs are not available in this engine")
        try:
            first = self.grammars.matcher(self.grammars.compile(spec))
            return iter([first] + [first.copy() for _ in range(params.n - 1)])
        except ValueError as err:
            raise RequestError(f"structured_outputs: {err}") from None

    def make_beam_group(self, request_id: str, prompt, params: BeamSearchParams,
                        seq_ids: Iterator[int]) -> SequenceGroup:
        """A beam search starts as one sequence; beams fork from it after the prompt."""
        if not isinstance(params, BeamSearchParams):
            raise RequestError(f"beam search needs a BeamSearchParams, got {type(params).__name__}")
        # The scheduler sees a greedy request of the same length; beams are chosen by the engine.
        inner = SamplingParams(n=params.beam_width, temperature=0.0, max_tokens=params.max_tokens,
                               ignore_eos=True, detokenize=False, output_kind=OutputKind.FINAL_ONLY)
        group = self.make_group(request_id, prompt, inner, seq_ids)
        group.seqs = group.seqs[:1]
        group.beam = BeamState(params, self.tokenizer.eos_token_id)
        return group

    def _clamp_max_tokens(self, prompt_len: int, params: SamplingParams) -> SamplingParams:
        """max_tokens capped to what max_model_len leaves after the prompt, as vLLM does.

        The sequence would stop there anyway (finish_reason "length"); capping it here
        makes the group's own numbers (its footprint, the contiguous reservation) say so.
        The prompt left room for at least one token (``make_group``). The caller's object is
        left alone (a copy is changed), and min_tokens is capped with it (a longer min could
        never be reached).
        """
        room = self.max_model_len - prompt_len
        if params.max_tokens <= room:
            return params
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never run alone in the pool (it would wait forever)."""
        manager = self.block_manager
        # The most KV slots this request can ever hold at once: the last sampled
        # token is never written, so min(prompt + max_tokens, max_model_len) - 1.
        # Counted without sharing: a preempted n-sample request is recomputed sample by sample.
        longest = max(len(ids), min(len(ids) + params.max_tokens, self.max_model_len) - 1)
        if self.kv_allocator == "contiguous":
            if params.n != 1:
                raise RequestError("the contiguous allocator serves one sequence a request (n=1, no beams)")
            longest = manager.reservation_tokens(Sequence(-1, ids), params.max_tokens)
        needed = params.n * blocks_for(longest, manager.block_size)
        usable = manager.num_blocks - manager.watermark_blocks
        if needed > usable:
            samples = f"{params.n} samples x " if params.n > 1 else ""
            capped = (f" (all that max_model_len={self.max_model_len} leaves)"
                      if len(ids) + params.max_tokens >= self.max_model_len else "")
            raise RequestError(
                f"the request may need {needed} KV blocks ({samples}{longest} cached tokens: prompt "
                f"{len(ids)} + max_tokens {params.max_tokens}{capped} - 1, as the last token is never "
                f"cached) but the pool has only {usable} usable blocks; give the cache more "
                "blocks or lower max_tokens")
