"""Structured outputs, tool calls and cache_salt through the official ``openai`` client.

The server (``python -m minipaged serve`` on the tiny random model, prefix caching on) runs in a
child process on a free loopback port. Every answer is judged by an independent tool: JSON by
``jsonschema``, regexes by Python's ``re``, tool arguments by ``jsonschema`` against the tool's
own parameters. Bad constraints are a 400 naming the field, and the next request is served.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_process import MODEL, ServerProcess

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 10**7}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
HI = [{"role": "user", "content": "Answer in JSON, please."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(tiny_model_dir, "--enable-prefix-caching")
    yield s
    code, output = s.stop()
    assert code == 0, output[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    r = client.chat.completions.create(
        model=MODEL, messages=HI, n=2, temperature=temperature, seed=1, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)


def test_response_format_streamed_and_json_object(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, seed=2, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    jsonschema.validate(json.loads(text), CITY)
    assert reasons[-1] == "stop"
    r = client.chat.completions.create(model=MODEL, messages=HI, seed=3, max_tokens=40,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_on_completions(client):
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    r = client.completions.create(model=MODEL, prompt=["Call me at ", "Or at "], n=2, seed=4, max_tokens=30,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert len(r.choices) == 4
    for choice in r.choices:
        assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Colour: ", max_tokens=10, stream=True, seed=5,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("red", "green", "blue")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=100, seed=6, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_tool_call(client, temperature):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, seed=7,
        temperature=temperature, max_tokens=100, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_named_tool_call_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS, seed=8, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "add"}}, stream=True, n=2,
        stop=["\u0001"])         # a stop string holds text back: the first pieces arrive empty
    deltas = {0: [], 1: []}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas[chunk.choices[0].index].append(chunk.choices[0].delta.tool_calls[0])
    for pieces in deltas.values():         # each choice: one header with the id and name, then pieces
        assert pieces[0].id and pieces[0].function.name == "add"
        assert all(d.id is None and d.function.name is None for d in pieces[1:])
        jsonschema.validate(json.loads("".join(d.function.arguments for d in pieces)), ADD)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(client, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Use a tool."}], tools=TOOLS, seed=9,
                  temperature=1.0, max_tokens=400, tool_choice="required")
    if stream:
        calls, reason = [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].delta.tool_calls:
                calls += chunk.choices[0].delta.tool_calls
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kwargs)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert reason == "tool_calls" and len(calls) >= 1
    for call in calls:
        assert call.function.name in PARAMETERS and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS}, "tool_choice", '"auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", '"auto"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "both constrain"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "cannot be compiled"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "both constrain"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex cannot be compiled"),
    ({"structured_outputs": {"grammar": "start: b"}}, "structured_outputs", "grammar cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "conflict"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field 'regexp'"),
    ({"use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}}, "response_format", "beam"),
    ({"cache_salt": ""}, "cache_salt", "non-empty string"),
    ({"use_beam_search": True, "n": 2, "tools": TOOLS, "tool_choice": "required"}, "tool_choice", "beam"),
    ({"guided_json": CITY}, "guided_json", 'structured_outputs: {"json"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
     "response_format", "json_schema"),
])
def test_bad_constraints_are_400s_and_the_next_request_is_served(server, client, body, param, words):
    r = httpx.post(f"{server.url}/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 5, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in r.text
    ok = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=60, seed=10,
                                        extra_body={"structured_outputs": {"json": WEATHER}})
    jsonschema.validate(json.loads(ok.choices[0].message.content), WEATHER)


def test_two_tenants_salts(server, client):
    """The same long prompt: a second request of the same tenant hits the prefix cache, another
    tenant's (or an unsalted one) does not; the usage and /metrics show it."""
    long = [{"role": "system", "content": "A long shared system prompt for every tenant. " * 4}, *HI]

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        r = client.chat.completions.create(model=MODEL, messages=long, max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    def hits():
        for line in httpx.get(f"{server.base}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                return float(line.split()[-1])

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 150
    before = hits()
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert hits() == before
