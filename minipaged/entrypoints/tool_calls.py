"""Function calling: ``tools`` and ``tool_choice`` turned into a grammar, and the answer into tool_calls.

In the system-call analogy a tool is a syscall the model may ask the client to make: the
request lists them (``tools``, each a name and a JSON Schema for its arguments), and
``tool_choice`` says whether the model must call one. minipaged makes a call valid by
construction, as vLLM does for these two choices, through structured outputs:

- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is
  constrained to that function's ``parameters`` schema, and becomes the call's
  ``arguments`` (finish_reason "stop", as OpenAI answers);
- ``"required"``: the answer is constrained to a JSON array of one or more
  ``{"name": ..., "parameters": ...}`` objects, each a listed function with its own
  schema, and becomes that many calls (finish_reason "tool_calls");
- ``"none"``: the tools are shown to the model (the chat template renders them) but the
  answer is plain text;
- ``"auto"`` (the default when tools are given) is refused: it needs a parser of each model
  family's own tool-call syntax, which this server does not have.
"""

from __future__ import annotations

import json
import uuid

from ..sampling_params import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def check_tools(tools) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI's ``tools`` list; a ValueError naming the problem."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if name in functions:
            raise ValueError(f"tools[{i}]: the function name {name!r} is given twice")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        functions[name] = parameters
    return functions


def tool_choice_mode(tool_choice, functions: dict[str, dict]) -> str | None:
    """What ``tool_choice`` asks for: "none", "required", a function's name, or None (no tools).

    A ValueError where it cannot be served: an unknown function, a choice without tools,
    or "auto".
    """
    if not functions:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools: give the functions the model may call")
        return None
    if tool_choice is None or tool_choice == "auto":
        raise ValueError('tool_choice "auto" (the default when tools are given) is not supported: this '
                         "server cannot parse each model's own tool-call syntax; name a function "
                         '({"type": "function", "function": {"name": ...}}), or send "required" or "none"')
    if tool_choice in ("none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(sorted(functions))})")
        return name
    raise ValueError('tool_choice must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": ...}}')


def tool_constraint(mode: str | None, functions: dict[str, dict]) -> StructuredOutputsParams | None:
    """The grammar that makes the answer a valid call (None: plain text)."""
    if mode in (None, "none"):
        return None
    if mode != "required":
        return StructuredOutputsParams(json=functions[mode])
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions.items()]
    return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def calls_from_text(mode: str, text: str) -> list[dict] | None:
    """The tool_calls an answer makes (OpenAI's shape: arguments as JSON text), or None if the
    text is not a whole call (it was cut short by max_tokens)."""
    if mode != "required":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        return [{"id": new_call_id(), "type": "function", "function": {"name": mode, "arguments": text}}]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": item["name"], "arguments": json.dumps(item["parameters"], ensure_ascii=False)}}
            for item in items]


def template_message(message: dict) -> dict:
    """A chat message as the templates want it: a tool call's ``arguments`` as an object, not JSON
    text (Qwen's and Llama's templates print it with tojson), as vLLM hands them over."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                raise ValueError(f"a tool call's arguments are not JSON: {arguments[:60]!r}") from None
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}
