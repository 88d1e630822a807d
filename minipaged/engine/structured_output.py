"""Structured outputs: each sequence follows a grammar, and a mask keeps its tokens inside it.

The OS idea is a protection mask checked on every access: a process's page-table bits say
which pages it may touch, and the MMU refuses the rest. Here a request that asks for JSON,
a regex, a choice or a grammar gets a *matcher* per sequence (its place in the grammar,
like a program counter in an automaton); before each sample the matcher says which tokens
may come next, as a bitmask over the vocabulary, and the sampler sets every other logit
to -inf. The sampled token then advances the matcher. When the grammar can take no more
tokens the sequence stops (finish_reason "stop").

The grammars are compiled and run by llguidance (docs/structured_outputs.md says why:
compiling is lazy, ~1 ms, where outlines-core builds a whole automaton over the vocabulary
first, 0.3-1.4 s a schema here; it takes context-free grammars too; and it needs no torch).
The masks of a batch are computed together, on llguidance's threads, into one
(B, ceil(V / 32)) int32 array; the sampler unpacks and applies them in one vectorised step.

Every sequence owns its matcher, so the samples of an n > 1 request walk the grammar
independently. Preemption keeps a sequence's output tokens, and with them its matcher's
state: recomputing or swapping the KV cache does not move it. Speculative decoding reads
the masks of every draft position (each drafted token consumed, then rolled back), and the
matcher only ever consumes the tokens that stood.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from ..sampling_params import StructuredOutputsParams

# a JSON object, whatever it holds (response_format {"type": "json_object"})
ANY_OBJECT = {"type": "object"}
# disable_any_whitespace: compact JSON, one space after each comma and colon
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_width(vocab_size: int) -> int:
    """int32 words in one token bitmask: one bit per token of the vocabulary."""
    return (vocab_size + 31) // 32


def load_llguidance():
    """The llguidance module, or an error saying how to install it."""
    try:
        import llguidance  # noqa: PLC0415 (only requests with a constraint need it)
        import llguidance.numpy  # noqa: F401, PLC0415
    except ImportError as err:   # pragma: no cover (a core dependency)
        raise RuntimeError(f"structured outputs need llguidance (pip install llguidance): {err}") from None
    return llguidance


class Grammar:
    """One sequence's place in its grammar (an llguidance matcher)."""

    def __init__(self, matcher, width: int) -> None:
        self.matcher = matcher
        self.width = width      # int32 words in one bitmask

    @property
    def is_finished(self) -> bool:
        """The grammar takes no more tokens (it ended, or an end-of-sequence token came)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (and the matcher broken) if the grammar forbids it."""
        return self.matcher.consume_token(int(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar would accept in a row, from here (nothing moves)."""
        return self.matcher.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the next token's bitmask into ``row`` (W,) int32 (C-contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def masks_ahead(self, drafts: list[int]) -> np.ndarray:
        """(k + 1, W) bitmasks: the next token's, then the one after each of the k ``drafts``.

        The drafts the grammar accepts are consumed one by one to read the next mask, then
        rolled back, so the state is as it was. Rows past the first draft the grammar refuses
        (or past its end) can never be used, as verification stops at that draft at the
        latest: they allow every token, so they stay finite numbers.
        """
        bits = np.full((len(drafts) + 1, self.width), -1, dtype=np.int32)   # (k + 1, W)
        valid = self.valid_prefix(drafts)
        consumed = 0
        try:
            for i in range(valid + 1):
                if self.matcher.is_stopped():
                    break
                self.fill_mask(bits[i])
                if i < valid:
                    self.matcher.consume_token(int(drafts[i]))
                    consumed += 1
        finally:
            if consumed and not self.matcher.rollback(consumed):
                raise RuntimeError(f"the grammar could not roll back {consumed} drafted tokens: {self.error}")
        return bits

    def copy(self) -> "Grammar":
        """Another matcher at the same place (a new sample of the same request)."""
        return Grammar(self.matcher.deep_copy(), self.width)


class GrammarCompiler:
    """Turns a request's StructuredOutputsParams into a grammar, checks it, and makes matchers.

    The vocabulary's llguidance tokenizer is built at the first constrained request (~0.3 s),
    not at engine start. ``stop_token_ids``: the tokens that end a sequence, which the grammar
    allows (and then stops) once its text is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, num_threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        # the masks are computed between the forward pass and the sample, when the model's
        # threads are idle: every core (up to 8) takes a share of the batch
        self.num_threads = num_threads or max(1, min(os.cpu_count() or 1, 8))
        self.width = mask_width(vocab_size)
        self._ll = None
        self._lltokenizer = None
        self._executor = None
        self._lock = threading.Lock()   # requests are checked on the server's worker threads

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                ll = load_llguidance()
                self._executor = ll.LLExecutor(num_threads=self.num_threads)
                self._lltokenizer = ll.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                   eos_token=self.stop_token_ids or None)
                self._ll = ll
        return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``spec``; a ValueError naming the problem if it is not valid."""
        lltokenizer = self.lltokenizer
        ll = self._ll
        kind = spec.kind
        if kind in ("json", "json_object"):
            schema = ANY_OBJECT if kind == "json_object" else spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as err:
                    raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            try:
                grammar = ll.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults=COMPACT_JSON if spec.disable_any_whitespace else None)
            except (ValueError, TypeError) as err:
                raise ValueError(f"the JSON schema cannot be used: {err}") from None
        elif kind == "regex":
            grammar = ll.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            grammar = ll.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        else:
            try:
                grammar = ll.grammar_from("grammar", spec.grammar)   # Lark, or GBNF converted to Lark
            except ValueError as err:
                raise ValueError(f"the grammar cannot be read: {err}") from None
        problem = ll.LLMatcher.validate_grammar(grammar, lltokenizer)
        if problem:
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}[kind]
            raise ValueError(f"the {what} cannot be compiled: {problem.strip()}")
        return grammar

    def matcher(self, grammar: str) -> Grammar:
        """A fresh matcher at the start of ``grammar`` (one per sequence)."""
        matcher = self._ll.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return Grammar(matcher, self.width)

    def masks_for(self, grammars: list[Grammar | None]) -> list[np.ndarray | None]:
        """Each grammar's next-token bitmask (W,) int32 (None where a row has no grammar), all
        computed together on llguidance's threads into one (B, W) array."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return [None] * len(grammars)
        bits = np.full((len(rows), self.width), -1, dtype=np.int32)          # (B, W)
        live = [(grammars[i].matcher, j) for j, i in enumerate(rows) if not grammars[i].matcher.is_stopped()]
        if live:
            self._ll.numpy.fill_next_token_bitmask_par(self._executor, live, bits)
        masks: list[np.ndarray | None] = [None] * len(grammars)
        for j, i in enumerate(rows):
            masks[i] = bits[j]
        return masks
