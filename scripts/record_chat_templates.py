"""Record how transformers renders the real chat templates in tests/data/templates/.

tests/test_chat_templates.py checks that minipaged's sandboxed renderer (model/tokenizer.py)
gives the same text; it has no transformers to ask, so this script asks it once and writes
tests/data/templates/expected.json. Run it by hand where transformers is installed (CI has
none, and needs none):

    python scripts/record_chat_templates.py

Each family gets a small byte-level BPE tokenizer with its special tokens, named as the model
ships them (bos/eos as in its tokenizer_config.json), wrapped in transformers' own
PreTrainedTokenizerFast with the template as `chat_template=`; every conversation below goes
through its `apply_chat_template(..., tokenize=False)`. A conversation the template refuses
(Mistral's alternation check) is recorded with transformers' error message. Nothing here
depends on today's date: the Llama cases pass `date_string`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast

from minipaged.model.random_llama import byte_level_backend

TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "data" / "templates"

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

# name: the template file, and bos/eos as the model's tokenizer_config.json names them (Qwen has no BOS).
FAMILIES = {
    "qwen2.5": {"file": "Qwen-Qwen2.5-7B-Instruct.jinja", "bos_token": None, "eos_token": "<|im_end|>",
                "specials": QWEN_SPECIALS},
    "qwen3": {"file": "Qwen-Qwen3-0.6B.jinja", "bos_token": None, "eos_token": "<|im_end|>",
              "specials": QWEN_SPECIALS + ["<think>", "</think>", "<tool_response>", "</tool_response>"]},
    "llama3.1": {"file": "meta-llama-Llama-3.1-8B-Instruct.jinja", "bos_token": "<|begin_of_text|>",
                 "eos_token": "<|eot_id|>", "specials": LLAMA_SPECIALS},
    "llama3.2": {"file": "meta-llama-Llama-3.2-3B-Instruct.jinja", "bos_token": "<|begin_of_text|>",
                 "eos_token": "<|eot_id|>", "specials": LLAMA_SPECIALS},
    "mistral-v0.3": {"file": "mistralai-Mistral-7B-Instruct-v0.3.jinja", "bos_token": "<s>", "eos_token": "</s>",
                     "specials": MISTRAL_SPECIALS},
    "mistral-nemo": {"file": "mistralai-Mistral-Nemo-Instruct-2407.jinja", "bos_token": "<s>",
                     "eos_token": "</s>", "specials": MISTRAL_SPECIALS},
}

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one word."}
USER = {"role": "user", "content": "What is the capital of France?"}
# Spaces and a newline around the answer: Llama and Mistral v0.3 trim a turn, Qwen does not.
ANSWER = {"role": "assistant", "content": "  Paris.\n"}
USER2 = {"role": "user", "content": "And of Italy? <b>café</b> ½ 🙂"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Paris"}},
                   "required": ["city"]}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "content": '{"temperature": 18, "sky": "clear"}', "tool_call_id": "call12345"}
AFTER_TOOL = {"role": "assistant", "content": "It is 18 degrees and clear."}
TOOL_TURNS = [USER, CALL, RESULT]

DATE = {"date_string": "05 Mar 2025"}   # Llama 3.2 would otherwise print today's date

# Every family: (name, messages, template variables).
COMMON = [
    ("system_user", [SYSTEM, USER], {"add_generation_prompt": True}),
    ("user_only", [USER], {"add_generation_prompt": True}),
    ("multi_turn", [SYSTEM, USER, ANSWER, USER2], {"add_generation_prompt": True}),
    ("multi_turn_no_system", [USER, ANSWER, USER2], {"add_generation_prompt": True}),
    ("closed_no_prompt", [USER, ANSWER], {"add_generation_prompt": False}),
    ("system_user_no_prompt", [SYSTEM, USER], {"add_generation_prompt": False}),
]

QWEN3_THINKING = [
    ("no_thinking", [USER], {"add_generation_prompt": True, "enable_thinking": False}),
    ("no_thinking_multi_turn", [SYSTEM, USER, ANSWER, USER2],
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("thinking_on", [USER], {"add_generation_prompt": True, "enable_thinking": True}),
    # reasoning_content of the turn after the last query is shown; of an earlier turn, dropped
    ("reasoning_last_turn", [USER, dict(ANSWER, reasoning_content="\nFrance's capital is Paris.\n")],
     {"add_generation_prompt": False}),
    ("reasoning_earlier_turn", [USER, dict(ANSWER, reasoning_content="France's capital is Paris."), USER2],
     {"add_generation_prompt": True}),
    ("think_in_content", [USER, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nParis."}],
     {"add_generation_prompt": False}),
    # the reasoning under another name: transformers passes it on as reasoning_content too
    ("reasoning_named_reasoning", [USER, dict(ANSWER, reasoning="France's capital is Paris.")],
     {"add_generation_prompt": False}),
]

TOOLS = [
    ("tools_system", [SYSTEM, USER], {"add_generation_prompt": True, "tools": [WEATHER]}),
    ("tools_no_system", [USER], {"add_generation_prompt": True, "tools": [WEATHER]}),
    ("tool_round_trip", TOOL_TURNS + [AFTER_TOOL], {"add_generation_prompt": False, "tools": [WEATHER]}),
    ("tool_result_pending", TOOL_TURNS, {"add_generation_prompt": True}),
]

LLAMA_TOOLS = [
    ("tools_in_user_message", [SYSTEM, USER], {"add_generation_prompt": True, "tools": [WEATHER], **DATE}),
    ("tools_in_system", [SYSTEM, USER],
     {"add_generation_prompt": True, "tools": [WEATHER], "tools_in_user_message": False, **DATE}),
    ("tool_round_trip", TOOL_TURNS, {"add_generation_prompt": True, **DATE}),
    # an OpenAI client's "tool_calls": null is no tool call ('tool_calls' in message would say there is)
    ("null_tool_calls", [USER, dict(ANSWER, tool_calls=None), USER2], {"add_generation_prompt": True, **DATE}),
]

MISTRAL_EXTRA = [
    ("tools_last_user", [USER, ANSWER, USER2], {"add_generation_prompt": True, "tools": [WEATHER]}),
    ("tool_round_trip", TOOL_TURNS + [AFTER_TOOL, USER2], {"add_generation_prompt": True}),
    # roles that do not alternate: the template raises
    ("two_users", [USER, USER2], {"add_generation_prompt": True}),
    ("assistant_first", [SYSTEM, ANSWER, USER], {"add_generation_prompt": True}),
]


# Small made-up templates that look at the environment a template renders in, rather than at
# one family: which variables are defined, how a message reaches the template, the filters.
PROBE_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "specials": ["<s>", "</s>"]}
SHOW_REASONING = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.reasoning }};{% endfor %}"
ENVIRONMENT = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
               "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }} "
               "{{ messages | tojson }} {{ {'b': [1, 'é'], 'a': none} | tojson(indent=2, sort_keys=True) }} "
               "{{ messages[0] | tojson(ensure_ascii=True, separators=(',', ':')) }} "
               "{{ strftime_now is defined }}")
WHITESPACE = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.role }}: {{ m.content }}\n"
              "    {%- else %}\n  {{ m.content | trim }}\n    {% endif %}\n{% endfor %}\n"
              "{% if add_generation_prompt %}assistant:{% endif %}")
PROBES = [
    ("tools_documents_undefined", "{{ tools is defined }} {{ tools is none }} {{ documents is defined }} "
     "{{ documents is none }} {{ 'yes' if tools is not none else 'no' }}", [USER], {}),
    ("tools_given", "{{ tools | tojson }} {{ documents is none }}", [USER], {"tools": [WEATHER]}),
    ("reasoning_aliases", SHOW_REASONING,
     [USER, dict(ANSWER, reasoning="r"), dict(ANSWER, thinking="t"), dict(ANSWER, reasoning_content="c"),
      dict(ANSWER, reasoning_content="c", reasoning="r")], {}),
    ("none_keys_dropped", "{% for m in messages %}{{ 'tool_calls' in m }} {{ m.tool_calls is defined }};"
     "{% endfor %}", [USER, dict(ANSWER, tool_calls=None, reasoning_content=None)], {}),
    ("environment", ENVIRONMENT, [USER, dict(ANSWER, content="<b>&</b>"), USER2], {}),
    ("whitespace_control", WHITESPACE, [USER, ANSWER], {"add_generation_prompt": True}),
    ("kwargs_win_over_special_tokens", "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}",
     [USER], {"bos_token": "<B>", "add_generation_prompt": True}),
    ("raise_exception", "{{ raise_exception('no ' + messages[0].role + ' turns here') }}", [USER], {}),
]


def cases(family: str) -> list:
    if family.startswith("llama"):
        found = [(name, msgs, {**kw, **DATE}) for name, msgs, kw in COMMON] + LLAMA_TOOLS
        if family == "llama3.1":   # 3.1 has its own fixed date, and builtin tools
            found += [("default_date", [USER], {"add_generation_prompt": True}),
                      ("builtin_tools", [USER], {"add_generation_prompt": True,
                                                 "builtin_tools": ["brave_search", "wolfram_alpha"], **DATE})]
        return found
    if family.startswith("mistral"):
        return COMMON + MISTRAL_EXTRA
    return COMMON + TOOLS + (QWEN3_THINKING if family == "qwen3" else [])


def render(tokenizer, messages: list, kwargs: dict) -> dict:
    """transformers' rendering of one conversation, or the error it raised."""
    try:
        return {"text": tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)}
    except jinja2.TemplateError as err:
        return {"error": type(err).__name__, "message": str(err)}


def hf_tokenizer(spec: dict, template: str) -> PreTrainedTokenizerFast:
    tokens = {k: spec[k] for k in ("bos_token", "eos_token") if spec[k] is not None}
    return PreTrainedTokenizerFast(tokenizer_object=byte_level_backend(spec["specials"]),
                                   chat_template=template, **tokens)


def record() -> dict:
    out = {"transformers": transformers.__version__, "jinja2": jinja2.__version__,
           "families": FAMILIES, "probe_tokens": PROBE_TOKENS, "cases": [], "probes": []}
    for family, spec in FAMILIES.items():
        tokenizer = hf_tokenizer(spec, (TEMPLATES / spec["file"]).read_text())
        for name, messages, kwargs in cases(family):
            out["cases"].append({"id": f"{family}/{name}", "family": family, "messages": messages,
                                 "kwargs": kwargs, **render(tokenizer, messages, kwargs)})
    for name, template, messages, kwargs in PROBES:
        out["probes"].append({"id": name, "template": template, "messages": messages, "kwargs": kwargs,
                              **render(hf_tokenizer(PROBE_TOKENS, template), messages, kwargs)})
    return out


def main() -> None:
    expected = record()
    path = TEMPLATES / "expected.json"
    path.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    errors = sum("error" in c for c in expected["cases"])
    print(f"wrote {path}: {len(expected['cases'])} renderings ({errors} refused) and "
          f"{len(expected['probes'])} probes, by transformers {expected['transformers']}")


if __name__ == "__main__":
    main()
