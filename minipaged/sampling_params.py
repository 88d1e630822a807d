"""SamplingParams: how one request wants its tokens chosen and when to stop (vLLM's names)."""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass


class OutputKind(enum.Enum):
    """What each ``LLMEngine.step()`` reports for a request (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything generated so far
    DELTA = "delta"            # only what this step added; a sample once finished, no more
    FINAL_ONLY = "final_only"  # nothing until the request finishes


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM does)
PENALTY_LIMIT = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (vLLM's and OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``.

    Sample 0 uses the request's seed itself; sample i >= 1 uses the first 64-bit
    word of numpy's SeedSequence([seed, i]). So sample i of an n-sample request
    draws exactly what an n=1 request seeded with ``derive_seed(seed, i)`` draws.
    """
    if index == 0:
        return seed
    import numpy as np  # noqa: PLC0415 (keeps this module importable without numpy)

    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0])


def as_int(value) -> int | None:
    """``value`` as a Python int if it is an integer (numpy's too), else None.

    A bool is an int to Python, but ``n=True`` or ``top_k=True`` is a mistake, not 1;
    and a numpy integer is converted so nothing downstream meets numpy's own
    overflow or comparison rules.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_float(value) -> float | None:
    """``value`` as a finite Python float if it is a real number (ints and numpy's scalars
    too, bools not), else None. An int too large for a float is not finite either."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        result = float(value)
    except (OverflowError, ValueError):
        return None
    return result if math.isfinite(result) else None


def as_flag(value) -> bool | None:
    """``value`` if it is a bool (numpy's too, as a Python bool), else None: a flag set to
    "no" or 0 is a mistake that truthiness would quietly read as yes or no."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    return None


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error naming a huge value stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def wrong_type(name: str, value, expected: str) -> str:
    """The sentence for a field of the wrong type; says so when a bool stood in for a number."""
    note = " (a bool is not a number here)" if as_flag(value) is not None and expected != "True or False" else ""
    return f"{name} must be {expected}, got {shown(value)}{note}"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's StructuredOutputsParams): exactly one of

    - ``json``: a JSON Schema (a dict, or its JSON text) the output must satisfy;
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: a list of strings, one of which the output is;
    - ``grammar``: a context-free grammar, in Lark or GBNF syntax;
    - ``json_object=True``: any JSON object.

    ``disable_any_whitespace`` (vLLM's name): JSON comes compact, ``{"a": 1, "b": [2, 3]}``,
    with no whitespace but one space after each comma and colon. The default here is True,
    where vLLM's is False: with whitespace allowed anywhere, SmolLM2 wandered into runs of
    newlines and spaces and ran out of tokens more often (docs/structured_outputs.md).

    Only the shape is checked here; whether the grammar library can compile the schema,
    regex or grammar is checked at add_request (engine/structured_output.py), so a bad one
    is refused before it is queued.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    KINDS = ("json", "regex", "choice", "grammar", "json_object")
    FIELDS = KINDS + ("disable_any_whitespace",)

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise ValueError(f"invalid structured_outputs: {message}")

        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            bad(f"give exactly one of {', '.join(self.KINDS)}; got "
                f"{', '.join(given) if given else 'none'}" + (" (they would conflict)" if given else ""))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad(f"json must be a JSON Schema (a dict or its JSON text), got {shown(self.json)}")
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", copy.deepcopy(self.json))   # the caller's may change later
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(f"{name} must be a non-empty string, got {shown(value)}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                bad(f"choice must be a non-empty list of non-empty strings, got {shown(self.choice)}")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and as_flag(value) is None:
                bad(wrong_type(name, value, "True or False"))
        object.__setattr__(self, "disable_any_whitespace", bool(self.disable_any_whitespace))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """How one request wants its tokens chosen and when to stop.

    Every field is type-checked when the object is built (so a mistake fails at the
    caller's line, not inside the sampler), and numpy scalars are turned into Python
    ones: integers stay integers (a bool is refused), numbers become floats, flags
    must be bools. Limits that depend on the engine (the vocabulary for
    ``stop_token_ids``, ``max_logprobs``, ``max_model_len``) are checked at add_request.
    """

    n: int = 1                        # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0          # 0 (or below 1e-5) means greedy
    top_p: float = 1.0                # keep the smallest set of tokens whose probability >= top_p
    top_k: int = -1                   # keep the k most likely tokens; -1 (or 0) keeps all
    min_p: float = 0.0                # drop tokens less likely than min_p * the top probability
    # Penalties (vLLM's apply_penalties), on the logits before temperature and the filters:
    presence_penalty: float = 0.0     # minus this once for every token already in the output
    frequency_penalty: float = 0.0    # minus this times how often the token is in the output
    repetition_penalty: float = 1.0   # tokens in the prompt or output: logit / p if > 0, else * p
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    seed: int | None = None           # per-request seed: same seed, same tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16              # at add_request, capped to max_model_len - prompt length
    min_tokens: int = 0               # EOS and stops are ignored before this many tokens
    logprobs: int | None = None       # return this many top log-probabilities per token
    prompt_logprobs: int | None = None  # and per prompt token (the first gets None): perplexity, echo
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # the output must follow a JSON Schema, regex, choice or grammar (docs/structured_outputs.md)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise ValueError(f"invalid SamplingParams: {message}")

        def store(name: str, value) -> None:
            object.__setattr__(self, name, value)

        # (names, their conversion, what a value must be, whether None is allowed)
        typed = [(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty"), as_float, "a finite number", False),
                 (("n", "top_k", "max_tokens", "min_tokens"), as_int, "an integer", False),
                 (("seed", "logprobs", "prompt_logprobs"), as_int, "an integer or None", True),
                 (("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"),
                  as_flag, "True or False", False)]
        for names, convert, expected, optional in typed:
            for name in names:
                raw = getattr(self, name)
                if optional and raw is None:
                    continue
                value = convert(raw)
                if value is None:
                    bad(wrong_type(name, raw, expected))
                store(name, value)
        if self.n < 1:
            bad(f"n must be a positive integer, got {shown(self.n)}")
        if not self.temperature >= 0.0:
            bad(f"temperature must be >= 0, got {shown(self.temperature)}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {shown(self.top_p)}")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {shown(self.top_k)}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {shown(self.min_p)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                bad(f"{name} must be in [-2, 2], got {shown(getattr(self, name))}")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be > 0 (1 = off), got {shown(self.repetition_penalty)}")
        store("logit_bias", self._checked_logit_bias(bad))
        if self.seed is not None and not 0 <= self.seed < 2**64:
            bad(f"seed must be an integer in [0, 2**64) or None, got {shown(self.seed)}")
        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {shown(self.max_tokens)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {shown(self.min_tokens)}")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be a non-negative integer or None, got {shown(self.logprobs)}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be a non-negative integer or None, got {shown(self.prompt_logprobs)}")
        # (not `self.stop or []`: the truth value of an array is an error of its own)
        stops = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or s == "" for s in stops):
            bad(f"stop must be a non-empty string or a list of them, got {shown(self.stop)}")
        store("stop", list(stops))
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            bad(f"stop_token_ids must be a list of non-negative integers, got {shown(self.stop_token_ids)}")
        converted = [as_int(t) for t in ids]
        for i, t in enumerate(converted):
            if t is None or t < 0:
                bad(f"stop_token_ids must be a list of non-negative integers, got {shown(ids[i])} "
                    f"at index {i}")
        store("stop_token_ids", converted)
        if self.stop and not self.detokenize:
            bad("stop strings need detokenize=True (they are matched in the text)")
        if not isinstance(self.output_kind, OutputKind):
            bad(f"output_kind must be an OutputKind, got {shown(self.output_kind)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            hint = " (build one: StructuredOutputsParams(json=...))" if isinstance(self.structured_outputs, dict) else ""
            bad(f"structured_outputs must be a StructuredOutputsParams or None, got "
                f"{type(self.structured_outputs).__name__}{hint}")

    def _checked_logit_bias(self, bad) -> dict[int, float] | None:
        """logit_bias as a new {int: float} dict (the caller's may change later), or None.

        Keys are token ids: integers, numpy's too, but not bools or strings (a JSON body's
        "50256" is the server's to convert). Values are finite numbers in [-100, 100]:
        OpenAI refuses more, and vLLM, which clamps them, gains nothing from a larger
        bias (+100 already makes a token all but certain). The vocabulary is checked at
        add_request, as for stop_token_ids.
        """
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            bad(f"logit_bias must be a dict of {{token id: bias}} or None, got {shown(self.logit_bias)}")
        checked = {}
        for key, value in self.logit_bias.items():
            token = as_int(key)
            if token is None or token < 0:
                bad(f"logit_bias keys must be non-negative integer token ids, got {shown(key)} "
                    f"({type(key).__name__})")
            bias = as_float(value)
            if bias is None:
                bad(wrong_type(f"logit_bias[{token}]", value, "a finite number"))
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                bad(f"logit_bias[{token}] must be in [-100, 100], got {shown(value)}")
            checked[token] = bias
        return checked

    @property
    def has_penalties(self) -> bool:
        """Does any penalty change the logits? (The sampler skips the rows where none does.)"""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows float32; the limit of
        # sampling as temperature -> 0 is the argmax anyway.
        return self.temperature < GREEDY_BELOW
