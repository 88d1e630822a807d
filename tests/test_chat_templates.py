"""The real chat templates of Qwen2.5, Qwen3, Llama 3.1/3.2 and Mistral render in minipaged's
sandbox exactly as transformers renders them; generation_config.json's EOS lists stop generation.

tests/data/templates/ holds each template verbatim (sources.json: where it comes from, and its
digest) and expected.json: what transformers' own apply_chat_template made of each conversation,
recorded by scripts/record_chat_templates.py (there is no transformers here). The tokenizers are
tiny byte-level BPEs with each family's special tokens, bos/eos named as the model ships them.
"""

import hashlib
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import pytest

from minipaged.model.random_llama import byte_level_backend
from minipaged.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "data" / "templates"
EXPECTED = json.loads((TEMPLATES / "expected.json").read_text())
SOURCES = json.loads((TEMPLATES / "sources.json").read_text())
RENDERED = [c for c in EXPECTED["cases"] if "text" in c]
REFUSED = [c for c in EXPECTED["cases"] if "error" in c]
PROBES = EXPECTED["probes"]   # made-up templates that look at the environment templates render in

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]


@lru_cache
def family_tokenizer(name: str) -> Tokenizer:
    family = EXPECTED["families"][name]
    return Tokenizer(byte_level_backend(family["specials"]),
                     chat_template=(TEMPLATES / family["file"]).read_text(),
                     bos_token=family["bos_token"], eos_token=family["eos_token"])


def render(case, **extra):
    kwargs = {**case["kwargs"], **extra}
    return family_tokenizer(case["family"]).apply_chat_template(case["messages"], **kwargs)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_templates_are_stored_verbatim(name):
    data = (TEMPLATES / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == SOURCES[name]["sha256"]
    if SOURCES[name]["git_blob"]:   # the very blob of the upstream file
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        assert blob == SOURCES[name]["git_blob"]


def test_every_family_is_recorded():
    families = {c["family"] for c in EXPECTED["cases"]}
    assert families == {"qwen2.5", "qwen3", "llama3.1", "llama3.2", "mistral-v0.3", "mistral-nemo"}
    assert {EXPECTED["families"][f]["file"] for f in families} == set(SOURCES)


@pytest.mark.parametrize("case", RENDERED, ids=lambda c: c["id"])
def test_renders_like_transformers(case):
    assert render(case) == case["text"]


@pytest.mark.parametrize("case", RENDERED[:1] + [c for c in RENDERED if c["id"].endswith("/multi_turn")],
                         ids=lambda c: c["id"])
def test_tokenized_prompt_is_the_rendered_text(case):
    tok = family_tokenizer(case["family"])
    ids = render(case, tokenize=True)
    assert ids == tok.encode(case["text"]) and tok.decode(ids) == case["text"]
    # the template's special tokens are single ids, none added on top
    eos = tok.eos_token_id
    assert ids.count(eos) == case["text"].count(tok.eos_token)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c["id"])
def test_refused_conversation_is_a_clear_value_error(case):
    with pytest.raises(ValueError) as info:
        render(case)
    assert str(info.value) == f"chat template failed: {case['message']}"
    assert "roles must alternate" in str(info.value)
    # raised from the template's raise_exception, not a traceback from inside Jinja
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p["id"])
def test_template_environment_is_transformers(probe):
    """Which variables are defined, how messages reach the template (None dropped, reasoning
    aliased), tojson, namespace, loop controls, whitespace control: as in transformers."""
    tokens = EXPECTED["probe_tokens"]
    tok = Tokenizer(byte_level_backend(tokens["specials"]), chat_template=probe["template"],
                    bos_token=tokens["bos_token"], eos_token=tokens["eos_token"])
    kwargs = {"add_generation_prompt": False, **probe["kwargs"]}   # transformers' default
    if "error" in probe:
        with pytest.raises(ValueError, match=f"^chat template failed: {re.escape(probe['message'])}$"):
            tok.apply_chat_template(probe["messages"], **kwargs)
    else:
        assert tok.apply_chat_template(probe["messages"], **kwargs) == probe["text"]


def test_llama32_prints_todays_date_without_date_string():
    case = next(c for c in RENDERED if c["id"] == "llama3.2/system_user")
    kwargs = {k: v for k, v in case["kwargs"].items() if k != "date_string"}
    before = datetime.now().strftime("%d %b %Y")
    text = family_tokenizer("llama3.2").apply_chat_template(case["messages"], **kwargs)
    after = datetime.now().strftime("%d %b %Y")
    recorded = f"Today Date: {case['kwargs']['date_string']}\n"
    assert text in {case["text"].replace(recorded, f"Today Date: {day}\n") for day in (before, after)}


# --- a model directory as it is shipped --------------------------------------------------

def write_model_dir(path: Path, specials, tokenizer_config: dict, generation_config=None,
                    config=None, template_file=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    byte_level_backend(specials).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in (("generation_config.json", generation_config), ("config.json", config)):
        if content is not None:
            (path / name).write_text(json.dumps(content))
    if template_file is not None:
        (path / "chat_template.jinja").write_text((TEMPLATES / template_file).read_text())
    return path


def llama3_dir(path: Path, eos_ids, **kw) -> Path:
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return write_model_dir(path, LLAMA3_SPECIALS, config, generation_config={"eos_token_id": eos_ids}, **kw)


def test_generation_config_eos_list_makes_every_id_a_stop_token(tmp_path):
    end_of_text, eot = LLAMA3_SPECIALS.index("<|end_of_text|>"), LLAMA3_SPECIALS.index("<|eot_id|>")
    tok = Tokenizer.from_dir(llama3_dir(tmp_path / "m", [end_of_text, eot]))
    assert (tok.eos_token, tok.eos_token_id) == ("<|eot_id|>", eot)
    assert tok.stop_token_ids == {end_of_text, eot}


def test_llama31_style_three_end_ids(tmp_path):
    eom = LLAMA3_SPECIALS.index("<|eom_id|>")
    ids = [LLAMA3_SPECIALS.index("<|end_of_text|>"), eom, LLAMA3_SPECIALS.index("<|eot_id|>")]
    tok = Tokenizer.from_dir(llama3_dir(tmp_path / "m", ids))
    assert tok.stop_token_ids == set(ids)
    assert tok.decode([eom]) == "<|eom_id|>"


def test_eos_list_without_a_named_eos_token(tmp_path):
    # no eos_token in tokenizer_config.json: EOS is the list's first id, every id stops
    ids = [LLAMA3_SPECIALS.index("<|eot_id|>"), LLAMA3_SPECIALS.index("<|end_of_text|>")]
    d = write_model_dir(tmp_path / "m", LLAMA3_SPECIALS, {"bos_token": "<|begin_of_text|>"},
                        generation_config={"eos_token_id": ids})
    tok = Tokenizer.from_dir(d)
    assert (tok.eos_token, tok.eos_token_id, tok.stop_token_ids) == ("<|eot_id|>", ids[0], set(ids))


def test_config_json_eos_list_when_no_generation_config(tmp_path):
    ids = [LLAMA3_SPECIALS.index("<|end_of_text|>"), LLAMA3_SPECIALS.index("<|eot_id|>")]
    d = write_model_dir(tmp_path / "m", LLAMA3_SPECIALS, {"eos_token": "<|eot_id|>"},
                        config={"eos_token_id": ids})
    assert Tokenizer.from_dir(d).stop_token_ids == set(ids)


def test_qwen_eos_list(tmp_path):
    specials = EXPECTED["families"]["qwen2.5"]["specials"]
    im_end, endoftext = specials.index("<|im_end|>"), specials.index("<|endoftext|>")
    d = write_model_dir(tmp_path / "m", specials, {"bos_token": None, "eos_token": "<|im_end|>"},
                        generation_config={"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext]})
    tok = Tokenizer.from_dir(d)
    assert tok.stop_token_ids == {im_end, endoftext} and tok.eos_token_id == im_end


def test_model_dir_renders_like_transformers(tmp_path):
    """from_dir: chat_template.jinja, bos/eos from tokenizer_config.json, EOS list from generation_config.json."""
    eot = LLAMA3_SPECIALS.index("<|eot_id|>")
    d = llama3_dir(tmp_path / "m", [LLAMA3_SPECIALS.index("<|end_of_text|>"), eot],
                   template_file=EXPECTED["families"]["llama3.1"]["file"])
    tok = Tokenizer.from_dir(d)
    for case in (c for c in RENDERED if c["family"] == "llama3.1"):
        assert tok.apply_chat_template(case["messages"], **case["kwargs"]) == case["text"], case["id"]


@pytest.mark.parametrize("case", [c for c in RENDERED if "tool" in c["id"]], ids=lambda c: c["id"])
def test_openai_shaped_tool_turns_render_like_transformers(case):
    """A tool conversation as an OpenAI client sends it (a call's arguments as JSON text, an
    assistant turn that only calls tools with content null) renders, through the server's
    request model, exactly as transformers rendered the same turns (arguments as an object)."""
    from minipaged.entrypoints.openai_protocol import ChatCompletionRequest

    messages = []
    for m in case["messages"]:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**call, "function": {**call["function"],
                                                     "arguments": json.dumps(call["function"]["arguments"])}}
                               for call in m["tool_calls"]]
            if m.get("content") == "":
                m["content"] = None          # what the openai client sends for a call-only turn
        messages.append(m)
    request = ChatCompletionRequest(model="m", messages=messages, tools=case["kwargs"].get("tools"))
    kwargs = {k: v for k, v in case["kwargs"].items() if k != "tools"}
    tools = {"tools": request.tools} if request.tools is not None else {}
    text = family_tokenizer(case["family"]).apply_chat_template(request.conversation(), **kwargs, **tools)
    assert text == case["text"]
