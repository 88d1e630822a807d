"""Tokenizer: text <-> token ids, and the chat template that turns messages into one prompt.

This is the runtime half of a Hugging Face tokenizer: the `tokenizers` library does the
byte-level BPE described by `tokenizer.json`, and a Jinja2 template from the model
directory formats a conversation the way the model was trained to read it (for SmolLM2,
ChatML: `<|im_start|>user\\n...<|im_end|>`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from .errors import ModelFormatError


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{path} is not valid JSON: {err}") from None


def _token_string(value) -> str | None:
    """tokenizer_config.json writes a special token either as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


BASE_ROLES = ("system", "user", "assistant")   # every chat template knows these
# The names a message's reasoning comes under; templates read the first (Qwen3) or "thinking" (gpt-oss).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate, as a bad decode leaves), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"{text[err.start]!r} at index {err.start} cannot be encoded as UTF-8 ({err.reason})"
    return None


# How many times shorter a normalizer may make text, by its kind; a kind not named here may
# shorten it without bound (Strip, a regex Replace, SentencePiece's Precompiled map, ...).
# NFC composes at most four code points into one (Greek: alpha, two accents, iota subscript).
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that keep every character (those that drop some, Whitespace say, are unbounded).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _shrink(normalizer: dict | None) -> int | None:
    """How many times shorter ``normalizer`` (tokenizer.json's) may make a text; None: no bound."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":                  # a plain string replaced by one at least as long
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return 1 if pattern is not None and len(content) >= len(pattern) else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_characters(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", []))
    if str(pre_tokenizer.get("behavior", "")).lower() == "removed":   # Split, Punctuation: drop the match
        return False
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS | {"Split"}


def chars_per_token_bound(backend) -> int | None:
    """The most characters of text one token can stand for, or None if there is no bound.

    A token's vocabulary string is at least as long as the text it decodes to (byte-level
    BPE writes one character per byte; SentencePiece one per character, ``<0x0A>`` for a
    byte), so a text of C characters has at least C / L tokens, L the longest string: a
    prompt can be refused by its length before it is tokenized. A normalizer that shortens
    text (NFC) multiplies L; one that may shorten it without bound (Strip), a pre-tokenizer
    that drops characters (Whitespace), or a model that maps a whole unknown word to one
    token (WordPiece, WordLevel, a Unigram or BPE fusing unknowns without byte fallback)
    leaves no bound.
    """
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    kind = model.get("type")
    # Unigram always fuses a run of unknown characters into one token; BPE only with fuse_unk.
    fuses_unknowns = kind == "Unigram" or model.get("fuse_unk")
    if kind not in ("BPE", "Unigram") or (fuses_unknowns and not model.get("byte_fallback")):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    longest = max((len(text) for text in backend.get_vocab(with_added_tokens=True)), default=1)
    return longest * shrink


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _as_template_sees_it(message: dict) -> dict:
    """A message as transformers hands it to a template: keys whose value is None dropped (an
    OpenAI client's "tool_calls": null is no tool call), and its reasoning, under whichever name
    it came, under "reasoning_content" and "thinking" too."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _compile_template(source: str):
    """Compile a chat template the way transformers does, so templates render identically."""
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & for HTML; a prompt wants the plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    # A template is code shipped with downloaded weights: run it sandboxed.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A model's tokenizer (from `tokenizer.json`) plus its chat template and stop tokens."""

    def __init__(self, backend, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, extra_stop_ids: Iterable[int] = ()):
        self.backend = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        self._bos_id = None if bos_token is None else backend.token_to_id(bos_token)
        self._stop_ids = frozenset(_as_list(self._eos_id) + list(extra_stop_ids))
        self.max_chars_per_token = chars_per_token_bound(backend)   # None: no bound
        try:
            self._template = None if chat_template is None else _compile_template(chat_template)
        except TemplateError as err:
            raise ModelFormatError(f"the chat template does not compile: {err}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face style model directory."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelFormatError(f"{path} has no tokenizer.json")
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as err:  # the tokenizers library raises a bare Exception on bad files
            raise ModelFormatError(f"{path / 'tokenizer.json'} could not be loaded: {err}") from None
        tok_config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        # Newer transformers save the template as its own file; older ones inside tokenizer_config.json.
        template = tok_config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif isinstance(template, list):  # several named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")

        def token_for(key: str) -> str | None:
            name = _token_string(tok_config.get(key))
            if name is not None:
                return name
            # No string given: fall back to the id in generation_config.json, then config.json.
            ids = _as_list(gen_config.get(f"{key}_id")) or _as_list(model_config.get(f"{key}_id"))
            return backend.id_to_token(ids[0]) if ids else None

        # generation_config.json may list several ids that end a turn (e.g. <|eot_id|> and <|end_of_text|>).
        extra = _as_list(gen_config.get("eos_token_id")) or _as_list(model_config.get("eos_token_id"))
        return cls(backend, chat_template=template, bos_token=token_for("bos_token"),
                   eos_token=token_for("eos_token"), extra_stop_ids=extra)

    # --- ids ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS plus any extra end ids from generation_config.json."""
        return self._stop_ids

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- text ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. <|im_start|>) become their ids.

        add_special_tokens=True lets the tokenizer's post-processor add BOS/EOS, if it has one.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        problem = unicode_problem(text)
        if problem is not None:   # the tokenizers library would raise a bare TypeError
            raise ValueError(f"encode() takes valid Unicode text: {problem}")
        # encode_batch lets go of the GIL while it works (encode holds it): a long prompt
        # tokenized in a thread does not stop the server's event loop or the engine's steps.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_roles(self) -> tuple[str, ...]:
        """The roles a message may have: system, user, assistant, and tool if the template
        mentions it (a template that does not would render a tool turn as something else)."""
        roles = BASE_ROLES
        if self.chat_template is not None and any(f"{q}tool{q}" in self.chat_template for q in "'\""):
            roles += ("tool",)
        return roles

    def check_messages(self, messages) -> None:
        """Refuse a conversation the template cannot render as meant, naming the message and
        the field, before Jinja fails somewhere inside the template with a TypeError."""
        shape = "messages must be a list of dicts, each with a string 'role' and 'content'"
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"{shape}; got {type(messages).__name__}")
        roles = self.chat_roles()
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"{shape}; messages[{i}] is a {type(message).__name__}")
            for key in ("role", "content"):
                if key not in message:
                    raise ValueError(f"{shape}; messages[{i}] has no {key!r}")
                if not isinstance(message[key], str):
                    raise ValueError(f"{shape}; messages[{i}][{key!r}] is {_shown(message[key])} "
                                     f"({type(message[key]).__name__})")
                problem = unicode_problem(message[key])
                if problem is not None:
                    raise ValueError(f"messages[{i}][{key!r}] is not valid Unicode text: {problem}")
            if message["role"] not in roles:
                raise ValueError(f"messages[{i}]['role'] is {_shown(message['role'])}; the chat template "
                                 f"knows the roles {', '.join(roles)}")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **template_vars) -> str | list[int]:
        """Render a conversation ([{"role": "user", "content": "..."}, ...]) into the model's prompt.

        With tokenize=True return its ids. The template writes every special token itself,
        so no BOS/EOS is added on top (as in transformers). template_vars (tools, date_string,
        enable_thinking, ...) reach the template; as in transformers they win over the
        tokenizer's own bos_token and eos_token.
        """
        if self._template is None:
            raise ValueError("this model directory has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); use encode() on plain text instead")
        self.check_messages(messages)
        # transformers always defines tools and documents (None when not given)
        variables = {"tools": None, "documents": None, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or "", **template_vars}
        try:
            prompt = self._template.render(messages=[_as_template_sees_it(m) for m in messages],
                                           add_generation_prompt=add_generation_prompt, **variables)
        except TemplateError as err:
            raise ValueError(f"chat template failed: {err}") from None
        return self.encode(prompt) if tokenize else prompt
