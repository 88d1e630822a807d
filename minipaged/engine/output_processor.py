"""OutputProcessor: from sampled token ids to what the user sees, and when a sequence ends.

It appends each sampled token, grows the text incrementally, applies the stop
rules in vLLM's order (min_tokens, EOS, stop token ids, stop strings, length)
and packages RequestOutputs as cumulative, delta or final-only reports. It also
keeps each request's ``prompt_logprobs`` as they arrive, chunk by chunk; a report
carries them all (a DELTA stream: once, in its first report).
"""

from __future__ import annotations

import logging

from .beam_search import Hypothesis, best_sequences
from .detokenizer import detokenize_new_tokens
from ..outputs import CompletionOutput, RequestOutput
from .sampler import SampleResult
from ..sampling_params import OutputKind
from ..sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger("minipaged")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # what each sequence has already reported, for DELTA outputs: seq_id -> (tokens, chars)
        self._reported: dict[int, tuple[int, int]] = {}
        self._finish_reported: set[int] = set()   # DELTA samples whose finish has been reported
        # request id -> its prompt logprobs so far: [None, {...}, ...], one per prompt token
        self._prompt_logprobs: dict[str, list[dict[int, float] | None]] = {}
        self._prompt_logprobs_sent: set[str] = set()   # DELTA requests that have had them

    def prompt_logprobs_from(self, group: SequenceGroup) -> int | None:
        """The first prompt position whose logits the request still needs for its
        prompt_logprobs (position p scores prompt token p + 1); None if it asked for none."""
        if group.sampling_params.prompt_logprobs is None:
            return None
        return len(self._prompt_logprobs.get(group.request_id, [None])) - 1

    def add_prompt_logprobs(self, group: SequenceGroup, first_token: int,
                            entries: list[dict[int, float]]) -> None:
        """Record the logprobs of prompt tokens first_token, first_token + 1, ..."""
        known = self._prompt_logprobs.setdefault(group.request_id, [None])   # the first token: None
        assert first_token == len(known), f"prompt logprobs of {group.request_id} arrived out of order"
        known.extend(entries)

    def banned_tokens(self, group: SequenceGroup, seq: Sequence, ahead: int = 0) -> list[int]:
        """Tokens that may not be sampled yet: every stop token until min_tokens is reached
        (``ahead``: for the token that many places further, after draft tokens)."""
        params = group.sampling_params
        if seq.num_output_tokens + ahead >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(params.stop_token_ids)

    def append(self, group: SequenceGroup, seq: Sequence, result: SampleResult) -> None:
        """Add one sampled token to ``seq`` and finish it if a stop rule fires."""
        params = group.sampling_params
        token = result.token_id
        seq.append_token(token, result.logprob)
        if params.logprobs is not None:
            seq.logprobs.append(result.top_logprobs)
        grammar_end = self._advance_grammar(group, seq, token) if seq.grammar is not None else None

        status, stop_reason = None, None
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif may_stop and token in params.stop_token_ids:
            status, stop_reason = SequenceStatus.FINISHED_STOPPED, token
        stop_token = status is not None
        if params.detokenize and not (stop_token and not params.include_stop_str_in_output):
            old_len = len(seq.output_text)
            seq.output_text += detokenize_new_tokens(self.tokenizer, seq, params.skip_special_tokens)
            if not stop_token and may_stop and params.stop:
                stop_reason = self._truncate_at_stop_string(seq, params, old_len)
                if stop_reason is not None:
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and grammar_end is not None:
            status = grammar_end      # complete: nothing may follow (or broken: the request ends)
        if status is None and (seq.num_output_tokens >= params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.status = status
            seq.stop_reason = stop_reason
            if params.detokenize and not isinstance(stop_reason, str):
                # flush text held back waiting for the rest of a UTF-8 character
                # (leaving out the stop token's own text unless it was asked for)
                seq.output_text += detokenize_new_tokens(
                    self.tokenizer, seq, params.skip_special_tokens, final=True,
                    exclude_last=stop_token and not params.include_stop_str_in_output)

    @staticmethod
    def _advance_grammar(group: SequenceGroup, seq: Sequence, token: int) -> SequenceStatus | None:
        """Structured outputs: move the sequence's grammar past ``token``. FINISHED_STOPPED if the
        grammar can take nothing more (finish_reason "stop"); FINISHED_ABORTED if the grammar
        broke (llguidance hit one of its limits: the text is not a valid answer, so it is not
        reported as one); None while it goes on."""
        grammar = seq.grammar
        if grammar.error is None and (grammar.is_finished or grammar.accept(token)):
            return SequenceStatus.FINISHED_STOPPED if grammar.is_finished else None
        logger.error("request %s: its grammar stopped at token %d: %s; the sequence is aborted",
                     group.request_id, token, grammar.error)
        return SequenceStatus.FINISHED_ABORTED


    @staticmethod
    def _truncate_at_stop_string(seq: Sequence, params, old_len: int) -> str | None:
        """If a stop string appeared in the new text, cut the text there and return it."""
        longest = max(len(s) for s in params.stop)
        search_from = max(old_len - longest + 1, 0)   # a stop may straddle old and new text
        for stop in params.stop:
            index = seq.output_text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                return stop
        return None

    def _beam_output(self, group: SequenceGroup) -> RequestOutput:
        """A finished beam search: its best beam_width hypotheses, ranked, as completions."""
        running = [Hypothesis(s.token_ids, s.cumulative_logprob, False) for s in group.seqs]
        prompt_len = len(group.prompt_token_ids)
        best = best_sequences(group.beam, running, lambda ids: self.tokenizer.decode(ids[prompt_len:],
                                                                                   skip_special_tokens=True))
        completions = [CompletionOutput(index=i, text=b.text, token_ids=b.tokens[prompt_len:],
                                        cumulative_logprob=b.cum_logprob, logprobs=None,
                                        finish_reason=b.finish_reason)
                       for i, b in enumerate(best)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True,
                             metrics={"arrival_time": group.arrival_time,
                                      "first_token_time": group.first_token_time,
                                      "finished_time": group.finished_time},
                             num_cached_tokens=group.num_cached_tokens)

    def forget(self, group: SequenceGroup) -> None:
        """Drop what was reported for a finished or aborted request."""
        for seq in group.seqs:
            self._reported.pop(seq.seq_id, None)
            self._finish_reported.discard(seq.seq_id)
        self._prompt_logprobs.pop(group.request_id, None)
        self._prompt_logprobs_sent.discard(group.request_id)

    def _prompt_logprobs_report(self, group: SequenceGroup) -> list[dict[int, float] | None] | None:
        """The request's prompt logprobs for this report (None if not asked, or already
        sent to a DELTA stream). Every prompt token has its entry before the first token
        is sampled, and only a sampled token makes a report, so the list is complete."""
        if group.sampling_params.prompt_logprobs is None:
            return None
        if group.sampling_params.output_kind == OutputKind.DELTA:
            if group.request_id in self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent.add(group.request_id)
        entries = self._prompt_logprobs.get(group.request_id, [None])
        assert len(entries) == len(group.prompt_token_ids), "a report came before the prompt's logprobs"
        return list(entries)

    def make_output(self, group: SequenceGroup) -> RequestOutput | None:
        """The report for this step, or None if the request's output kind says to stay quiet."""
        kind = group.sampling_params.output_kind
        finished = group.is_finished()
        if group.beam is not None:
            return self._beam_output(group) if finished else None
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for index, seq in enumerate(group.seqs):
            tokens, text = seq.output_token_ids, seq.output_text
            if group.sampling_params.stop and not seq.is_finished():
                # Hold back what could still turn out to be the start of a stop
                # string, so streamed text never shows what the final text cuts.
                hold = max(len(s) for s in group.sampling_params.stop) - 1
                text = text[:max(len(text) - hold, 0)]
            logprobs = seq.logprobs if group.sampling_params.logprobs is not None else None
            if kind == OutputKind.DELTA:
                # a sample that finished at an earlier step has nothing to add: reported once
                # (vLLM's deltas too), or a stream of n > 1 would repeat its finish_reason
                if seq.seq_id in self._finish_reported:
                    continue
                if seq.is_finished():
                    self._finish_reported.add(seq.seq_id)
                n_tok, n_chr = self._reported.get(seq.seq_id, (0, 0))
                self._reported[seq.seq_id] = (len(tokens), len(text))
                tokens, text = tokens[n_tok:], text[n_chr:]
                logprobs = logprobs[n_tok:] if logprobs is not None else None
            reason = seq.status.value if seq.is_finished() else None
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=list(tokens),
                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                finish_reason=reason, stop_reason=seq.stop_reason))
        prompt_logprobs = self._prompt_logprobs_report(group)
        if finished:
            self.forget(group)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, outputs=completions, finished=finished,
            metrics={"arrival_time": group.arrival_time, "first_token_time": group.first_token_time,
                     "finished_time": group.finished_time},
            prompt_logprobs=prompt_logprobs, num_cached_tokens=group.num_cached_tokens)
