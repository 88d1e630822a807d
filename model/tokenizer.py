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


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate, as a bad decode leaves), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"{text[err.start]!r} at index {err.start} cannot be encoded as UTF-8 ({err.reason})"
    return None


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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
        so no BOS/EOS is added on top (as in transformers).
        """
        if self._template is None:
            raise ValueError("this model directory has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); use encode() on plain text instead")
        self.check_messages(messages)
        try:
            prompt = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                           **template_vars)
        except TemplateError as err:
            raise ValueError(f"chat template failed: {err}") from None
        return self.encode(prompt) if tokenize else prompt
