"""The OpenAI API's request shapes (pydantic), and what they turn into: SamplingParams.

The system-call interface of the analogy: a fixed, documented request format that any
client speaks (here: OpenAI's, with vLLM's extra fields), checked at the door and turned
into the engine's own vocabulary. Responses are built as plain dicts in api_server.py.
Field names, defaults and meanings follow OpenAI's API reference, and vLLM's
``protocol.py`` for the fields OpenAI does not have (``top_k``, ``min_p``, ``ignore_eos``...).
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ..engine.beam_search import BeamSearchParams
from ..sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from .tool_calls import check_tools, template_message, tool_choice_mode, tool_constraint


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients send fields a server may not know.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """The fields completions and chat completions share."""

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: Union[int, None] = None
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Union[dict[str, float], None] = None
    user: Union[str, None] = None
    # vLLM's extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Union[list[int], None] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    # constrained output (docs/structured_outputs.md): OpenAI's {"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or vLLM's
    # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}; one of them at most
    response_format: Union[dict, None] = None
    structured_outputs: Union[dict, None] = None
    cache_salt: Union[str, None] = None               # vLLM's: prefix-cache blocks shared only within a salt
    # vLLM's old names for structured_outputs' fields: refused with the new name, not ignored
    guided_json: Union[dict, str, None] = None
    guided_regex: Union[str, None] = None
    guided_choice: Union[list, None] = None
    guided_grammar: Union[str, None] = None
    prompt_logprobs: Union[int, None] = None          # vLLM's: log-probabilities of the prompt tokens
    use_beam_search: bool = False                     # vLLM's: n beams; the n best come back, ranked
    length_penalty: float = 1.0                       # beam search: score = logprob / length ** this

    # Fields beam search has no use for: it ranks beams by the model's log-probabilities alone.
    NOT_WITH_BEAMS: ClassVar[tuple[str, ...]] = (
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "prompt_logprobs",
        "structured_outputs")

    # Sampling fields the model's generation_config.json may recommend; a request that does
    # not set one gets the recommendation (vLLM's --generation-config auto), else OpenAI's default.
    GENERATION_KEYS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        generation_defaults: dict | None = None) -> SamplingParams | BeamSearchParams:
        """The engine's SamplingParams (BeamSearchParams with ``use_beam_search``); a bad value
        raises ValueError naming the field."""
        if self.use_beam_search:
            return self.beam_search_params(max_tokens, logprobs)
        constraint = self.constraint()
        chosen = {name: getattr(self, name) for name in self.GENERATION_KEYS}
        for name, value in (generation_defaults or {}).items():
            if name in chosen and name not in self.model_fields_set:
                chosen[name] = value
        return SamplingParams(
            n=self.n, **chosen, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.token_logit_bias(), prompt_logprobs=self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=constraint,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY)

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must follow: ``response_format`` or ``structured_outputs`` (not both)."""
        chosen = [(name, spec) for name, spec in (("response_format", response_format_params(self.response_format)),
                                                  ("structured_outputs", structured_outputs_params(
                                                      self.structured_outputs))) if spec is not None]
        if len(chosen) > 1:
            raise ValueError("response_format and structured_outputs both constrain the output; give one of them")
        return chosen[0][1] if chosen else None

    def prompt_input(self, prompt) -> dict:
        """An engine prompt (a string or token ids) as the dict that carries the cache_salt too."""
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        return {key: prompt} if self.cache_salt is None else {key: prompt, "cache_salt": self.cache_salt}

    def beam_search_params(self, max_tokens: int, logprobs: int | None) -> BeamSearchParams:
        """vLLM's ``use_beam_search``: ``n`` beams, the ``n`` best returned ranked, all at the
        end (a stream sends each beam's text and finish once, when the search is done)."""
        defaults = type(self).model_fields
        for name in self.NOT_WITH_BEAMS:
            value = getattr(self, name)
            if name in self.model_fields_set and value != defaults[name].default and not (
                    name == "temperature" and value == 0):           # greedy: what beams use anyway
                raise ValueError(f"{name} cannot be used with use_beam_search: beam search ranks beams by the "
                                 "model's log-probabilities alone")
        if logprobs is not None:
            raise ValueError("logprobs cannot be used with use_beam_search")
        if response_format_params(self.response_format) is not None:
            raise ValueError("response_format cannot be used with use_beam_search: beams are ranked by the "
                             "model's log-probabilities alone, with no grammar")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty)

    def token_logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias has token ids as JSON strings ("50256": -100); the engine's, ints."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def response_format_params(fmt: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as a constraint (None for ``{"type": "text"}``)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('response_format: a json_schema format needs "json_schema": {"name": ..., "schema": {...}}')
        return StructuredOutputsParams(json=spec.get("schema", {"type": "object"}))
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def structured_outputs_params(fields: dict | None) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` body field as the engine's StructuredOutputsParams."""
    if fields is None:
        return None
    unknown = sorted(set(fields) - set(StructuredOutputsParams.FIELDS))
    if unknown:
        raise ValueError(f"structured_outputs: unknown field {unknown[0]!r}; the fields are "
                         f"{', '.join(StructuredOutputsParams.FIELDS)}")
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as err:
        raise ValueError(str(err).replace("invalid structured_outputs", "structured_outputs")) from None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt (or several) to continue."""

    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]   # a bool is not a token id
    suffix: Union[str, None] = None            # refused (no fill-in-the-middle here)
    max_tokens: Union[int, None] = 16
    logprobs: Union[int, None] = None          # top log-probabilities per token (OpenAI allows <= 5)
    echo: bool = False                         # put the prompt in front of the completion

    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: Union[str, list[TextPart], None] = None
    tool_calls: Union[list[dict], None] = None     # an assistant turn that called tools
    tool_call_id: Union[str, None] = None          # a tool turn: which call it answers
    name: Union[str, None] = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content

    def for_template(self) -> dict:
        """The message as a chat template reads it: a tool call's arguments as an object, and an
        assistant turn that only calls tools (content null) with empty content, which every
        template renders (Qwen3's fails on a missing one)."""
        content = self.text()
        message = {"role": self.role, "content": "" if content is None and self.tool_calls else content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return template_message(message)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: a conversation to answer."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Union[int, None] = None               # deprecated by OpenAI in favour of the next
    max_completion_tokens: Union[int, None] = None
    logprobs: bool = False
    top_logprobs: Union[int, None] = None
    add_generation_prompt: bool = True                # vLLM's
    # function calling (entrypoints/tool_calls.py): the functions, and whether one must be called
    tools: Union[list, None] = None
    tool_choice: Union[str, dict, None] = None
    functions: Union[list, None] = None               # OpenAI's deprecated form: refused

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def tool_functions(self) -> dict[str, dict]:
        """{name: parameters schema} of the tools (empty without any); ValueError if malformed."""
        return check_tools(self.tools) if self.tools is not None else {}

    def tool_mode(self) -> str | None:
        """None (no tools), "none", "required", or the name of the function to call."""
        return tool_choice_mode(self.tool_choice, self.tool_functions())

    def beam_search_params(self, max_tokens: int, logprobs: int | None):
        if self.tool_mode() not in (None, "none"):
            raise ValueError("tool_choice cannot be used with use_beam_search: beams are ranked by the "
                             "model's log-probabilities alone, with no grammar")
        return super().beam_search_params(max_tokens, logprobs)

    def constraint(self) -> StructuredOutputsParams | None:
        """A required or named tool call's grammar, or else what response_format or
        structured_outputs ask for; two of them conflict."""
        asked = super().constraint()
        calls = tool_constraint(self.tool_mode(), self.tool_functions())
        if calls is not None and asked is not None:
            raise ValueError("tool_choice and response_format / structured_outputs both constrain the "
                             "output; give one of them")
        return calls if calls is not None else asked

    def top_logprobs_asked(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(OpenAIModel):
    """``POST /tokenize`` (vLLM's): a prompt, or a conversation through the chat template."""

    model: Union[str, None] = None
    prompt: Union[str, None] = None
    messages: Union[list[ChatMessage], None] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: Union[str, None] = None
    tokens: list[int]
