"""Qwen2, Qwen3, Mistral and Llama checkpoints that transformers wrote, against transformers.

tests/data/families/ holds tiny random checkpoints of each family and transformers' own greedy
tokens, top-2 margins and logits (scripts/make_family_checkpoints.py; CI needs no torch):

- llama:   llama3 rope scaling, tied, sharded over three safetensors files with an index;
- qwen2:   q/k/v biases, a window of 16 on layers 1 and 2 (layer 0 full), EOS ids [2, 0];
- qwen3:   q/k norms, head_dim 32 (not hidden / heads), bf16 weights;
- mistral: a window of 16 on every layer, so blocks slide out and go back to the pool.

Greedy tokens must equal transformers' 80 of them (far past the window), except past a near-tie
(a top-2 margin < 1e-3). The engine suites' features (prefix caching, samples, beams, swap,
recompute, partial preemption, speculative decoding, chunked prefill) run on the window model
with every block manager invariant checked at each step.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from minipaged import LLM, BeamSearchParams, LLMEngine, SamplingParams
from minipaged.model.config import LlamaConfig
from minipaged.model.errors import ModelFormatError
from minipaged.model.reference import DenseReference
from minipaged.model.tokenizer import Tokenizer
from minipaged.model.weights import checkpoint_files, load_checkpoint

FAMILIES = Path(__file__).parent / "data" / "families"
NEAR_TIE = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)


def expected(family):
    return json.loads((FAMILIES / family / "expected.json").read_text())


def assert_greedy_matches(got, want, margins):
    """Equal to transformers' tokens up to the first near-tie; a split elsewhere fails."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert margins[i] < NEAR_TIE, f"step {i}: {a} != transformers' {b} (margin {margins[i]:.4f})"
            return
    assert len(got) == len(want)


# ----------------------------------------------------------------------------- loading


def test_each_family_is_read_with_its_options():
    llama, qwen2, qwen3, mistral = (LlamaConfig.from_dir(FAMILIES / f) for f in ("llama", "qwen2", "qwen3", "mistral"))
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.layer_windows == (0, 0, 0)
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.layer_windows == (0, 16, 16)
    assert qwen2.rope_theta == 1e6 and qwen2.sliding_window == 0       # layer 0 reads every token
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.hidden_size // qwen3.num_attention_heads == 16
    assert mistral.layer_windows == (16, 16, 16) and mistral.sliding_window == 16
    for family in ("qwen2", "mistral"):
        assert expected(family)["layer_types"] == [
            "sliding_attention" if w else "full_attention" for w in LlamaConfig.from_dir(FAMILIES / family).layer_windows]


@pytest.mark.parametrize("changes, windows", [
    ({"use_sliding_window": False}, (0, 0, 0)),                       # Qwen keeps the window only when on
    ({"sliding_window": None}, (0, 0, 0)),                            # layer types without a window: full
    ({"layer_types": None, "max_window_layers": 2}, (0, 0, 16)),      # derived as transformers does
    ({"layer_types": None, "max_window_layers": 0}, (16, 16, 16)),
])
def test_qwen2_windows_follow_transformers_rules(changes, windows):
    raw = {**json.loads((FAMILIES / "qwen2" / "config.json").read_text()), **changes}
    raw = {k: v for k, v in raw.items() if v is not None or k == "sliding_window"}
    assert LlamaConfig.from_dict(raw).layer_windows == windows


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": None, "max_window_layers": None}, "max_window_layers must be an integer"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"layer_types": ["full_attention"]}, "one type per layer"),
    ({"layer_types": ["full_attention", "chunked_attention", "sliding_attention"]}, "not supported"),
    ({"mlp_bias": True}, "mlp_bias is not supported"),
])
def test_bad_window_settings_are_named(changes, message):
    raw = {**json.loads((FAMILIES / "qwen2" / "config.json").read_text()), **changes}
    raw = {k: v for k, v in raw.items() if k != "layer_types" or v is not None}
    with pytest.raises(ModelFormatError, match=message):
        LlamaConfig.from_dict(raw)


def test_sharded_and_bf16_checkpoints_load():
    assert len(checkpoint_files(FAMILIES / "llama")) == 3                  # the index's shards
    header = json.loads((FAMILIES / "qwen3" / "model.safetensors").read_bytes()[8:][
        :int.from_bytes((FAMILIES / "qwen3" / "model.safetensors").read_bytes()[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    tensors = load_checkpoint(FAMILIES / "qwen3")
    q_norm = tensors["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.dtype == np.float32 and q_norm.shape == (32,)
    assert not (q_norm.view(np.uint32) & 0xFFFF).any()                     # widened bf16: low half zero


def test_an_index_naming_a_missing_shard_is_named(tmp_path):
    for f in (FAMILIES / "llama").iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelFormatError, match=shard.name):
        checkpoint_files(tmp_path)


@pytest.mark.parametrize("model_type, arch", [("gemma3_text", "Gemma3ForCausalLM"), ("phi3", "Phi3ForCausalLM")])
def test_another_family_is_refused_naming_the_supported_ones(tmp_path, model_type, arch):
    config = json.loads((FAMILIES / "mistral" / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"not a supported model family.*'qwen2'.*'qwen3'.*'mistral'"):
        LlamaConfig.from_dir(tmp_path)


def test_generation_config_eos_list_stops_on_each():
    assert {0, 2} <= Tokenizer.from_dir(FAMILIES / "qwen2").stop_token_ids


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_dense_reference_matches_transformers_logits(family):
    want = np.load(FAMILIES / family / "expected_logits.npz")["prompt_logits_1"]      # (40, vocab)
    ref = DenseReference(LlamaConfig.from_dir(FAMILIES / family), load_checkpoint(FAMILIES / family))
    got = ref.logits(expected(family)["prompts"][1])
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_match_transformers(family, block_size, kernels_tier):
    exp = expected(family)
    llm = LLM(str(FAMILIES / family), device="cpu", block_size=block_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in exp["prompts"]], GREEDY, use_tqdm=False)
    for out, want, margins in zip(outs, exp["greedy"], exp["margins"]):
        assert_greedy_matches(out.outputs[0].token_ids, want, margins)
    assert llm.get_stats()["kv_blocks_used"] == 0
    llm.llm_engine.block_manager.check_invariants()


# ----------------------------------------------------------------------------- blocks slide out


def held_blocks(engine, prompt, max_tokens):
    """Blocks in use after each step of one greedy request, invariants checked every step."""
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        engine.block_manager.check_invariants(
            [s for g in engine.scheduler.running for s in g.unfinished_seqs()])
        held.append(engine.block_manager.num_used_blocks)
    return held, tokens


def test_a_long_generation_holds_about_a_window_of_blocks(kernels_tier):
    exp = expected("mistral")
    engine = LLMEngine(str(FAMILIES / "mistral"), device="cpu", block_size=4, num_blocks=128, swap_space=0)
    held, tokens = held_blocks(engine, exp["prompts"][1], 80)
    assert_greedy_matches(tokens, exp["greedy"][1], exp["margins"][1])
    # a window of 16 tokens spans at most 5 blocks of 4, plus the block the next token goes to
    assert max(held[1:]) <= 16 // 4 + 2, held
    assert engine.block_manager.num_used_blocks == 0


def test_a_model_with_a_full_layer_frees_nothing(kernels_tier):
    exp = expected("qwen2")               # layer 0 reads every token: no block may go
    engine = LLMEngine(str(FAMILIES / "qwen2"), device="cpu", block_size=4, num_blocks=128, swap_space=0)
    held, tokens = held_blocks(engine, exp["prompts"][1], 40)
    assert held[-2] == -(-(40 + 39) // 4)
    assert_greedy_matches(tokens, exp["greedy"][1][:40], exp["margins"][1])


def test_slid_out_blocks_serve_a_later_identical_prompt(kernels_tier):
    """Named blocks that slid out wait in the prefix cache's LRU: the same prompt hits them."""
    exp = expected("mistral")
    llm = LLM(str(FAMILIES / "mistral"), device="cpu", block_size=4, enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": exp["prompts"][1]}], GREEDY, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": exp["prompts"][1]}], GREEDY, use_tqdm=False)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    assert_greedy_matches(second[0].outputs[0].token_ids, exp["greedy"][1], exp["margins"][1])
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0.4
    llm.llm_engine.block_manager.check_invariants()


# ----------------------------------------------------------------------------- every feature, with a window


def prompts(n, seed, lo=5, hi=60):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 259, size=int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def run(batch, params, **kwargs):
    kwargs.setdefault("num_blocks", 512)      # a small pool: check_invariants walks all of it
    llm = LLM(str(FAMILIES / "mistral"), device="cpu", swap_space=0.002, **kwargs)
    out = [[c.token_ids for c in o.outputs] for o in llm.generate(batch, params, use_tqdm=False)]
    llm.llm_engine.block_manager.check_invariants()
    assert llm.get_stats()["kv_blocks_used"] == 0
    return out, llm.get_stats()


SAMPLES = SamplingParams(n=3, temperature=0.9, max_tokens=40, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy():
    """Greedy and sampled outputs of a pool that never preempts."""
    batch = prompts(6, seed=3, hi=30)
    greedy, stats = run(batch, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), block_size=4)
    sampled, _ = run(batch, SAMPLES, block_size=4)
    assert stats["num_preemptions"] == 0
    return batch, greedy, sampled


@pytest.mark.parametrize("mode", ["swap", "recompute", "partial"])
def test_preemption_with_a_window_changes_no_token(roomy, mode, kernels_tier):
    batch, greedy, sampled = roomy
    got, stats = run(batch, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), block_size=4,
                     num_blocks=20, preemption_mode=mode)
    assert got == greedy and stats["num_preemptions"] > 0
    got, stats = run(batch, SAMPLES, block_size=4, num_blocks=52, preemption_mode=mode)
    assert got == sampled and stats["num_preemptions"] > 0    # copy-on-write samples, forked then slid apart


@pytest.mark.parametrize("chunk", [8, 24])
def test_chunked_prefill_with_a_window_changes_no_token(roomy, chunk, kernels_tier):
    batch, greedy, _ = roomy
    got, _ = run(batch, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), block_size=4,
                 enable_chunked_prefill=True, max_num_batched_tokens=chunk, max_num_seqs=6)
    assert got == greedy


def test_speculative_decoding_with_a_window_changes_no_token(roomy, kernels_tier):
    batch, greedy, _ = roomy
    got, stats = run(batch, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), block_size=4,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
                                         "prompt_lookup_min": 1})
    assert got == greedy


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_draft_model_on_a_window_model_changes_no_token(roomy, adaptive, kernels_tier):
    """The window model drafting for itself: the draft writes its K/V of the same blocks later than
    the target (from where it last drafted), so no block slides out under it, and the tokens stay."""
    batch, greedy, _ = roomy
    got, stats = run(batch, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), block_size=4,
                     speculative_config={"method": "draft_model", "model": str(FAMILIES / "mistral"),
                                         "num_speculative_tokens": 3, "adaptive": adaptive})
    assert got == greedy


def test_beams_with_a_window_match_the_dense_reference(kernels_tier):
    """Beam search on the window model: each beam's cumulative log-probability is the dense
    reference's (windowed) sum over its tokens, and the blocks all come back."""
    engine = LLM(str(FAMILIES / "mistral"), device="cpu", block_size=4)
    ref = DenseReference(LlamaConfig.from_dir(FAMILIES / "mistral"), load_checkpoint(FAMILIES / "mistral"))
    prompt = expected("mistral")["prompts"][1][:24]
    out = engine.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                                ignore_eos=True), use_tqdm=False)
    for beam in out[0].sequences:
        logits = ref.logits(beam.tokens[:-1])[len(prompt) - 1:]                 # (6, vocab)
        logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total = sum(logprobs[i, t] for i, t in enumerate(beam.tokens[len(prompt):]))
        assert abs(total - beam.cum_logprob) < 1e-3
    assert engine.get_stats()["kv_blocks_used"] == 0
    engine.llm_engine.block_manager.check_invariants()


@pytest.mark.parametrize("family, tp, pp", [("qwen2", 2, 1), ("qwen3", 2, 1), ("mistral", 1, 3), ("llama", 2, 3)])
def test_tensor_and_pipeline_shards_of_each_family(family, tp, pp, kernels_tier):
    """Biases cut by heads, q/k norms on every rank, each stage its layers' windows: the same tokens."""
    exp = expected(family)
    llm = LLM(str(FAMILIES / family), device="cpu", block_size=4, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    outs = llm.generate([{"prompt_token_ids": p} for p in exp["prompts"]],
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for out, want, margins in zip(outs, exp["greedy"], exp["margins"]):
        assert_greedy_matches(out.outputs[0].token_ids, want[:30], margins)


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_bias_on_q_k_v_and_o_matches_the_dense_reference(tmp_path, tp, kernels_tier):
    """Llama's attention_bias: biases on q, k, v and o (o's added once, by rank 0's partial sum)."""
    from safetensors.numpy import save_file

    from minipaged.model.random_llama import random_tensors, tiny_config, write_tiny_llama

    write_tiny_llama(tmp_path, seed=2, attention_bias=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    tensors = random_tensors(tiny_config(**raw), 2)
    rng = np.random.default_rng(2)
    q, kv = raw["num_attention_heads"] * raw["head_dim"], raw["num_key_value_heads"] * raw["head_dim"]
    for i in range(raw["num_hidden_layers"]):
        for name, size in (("q", q), ("k", kv), ("v", kv), ("o", raw["hidden_size"])):
            tensors[f"model.layers.{i}.self_attn.{name}_proj.bias"] = (0.3 * rng.standard_normal(size)).astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = LlamaConfig.from_dir(tmp_path)
    assert config.qkv_bias and config.o_bias
    prompt = [5, 77, 31, 200, 9, 14, 150, 3, 40]
    want = DenseReference(config, load_checkpoint(tmp_path)).greedy(prompt, 12)
    llm = LLM(str(tmp_path), device="cpu", block_size=4, tensor_parallel_size=tp)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_fp16_weights_load_and_run(tmp_path):
    """A float16 checkpoint: widened to float32 at load, the same tokens as the dense reference
    on the same (float16-valued) weights."""
    from safetensors.numpy import save_file

    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((FAMILIES / "qwen2" / name).read_bytes())
    tensors = {k: v.astype(np.float16) for k, v in load_checkpoint(FAMILIES / "qwen2").items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_checkpoint(tmp_path)
    assert loaded["model.embed_tokens.weight"].dtype == np.float16
    prompt = expected("qwen2")["prompts"][1]
    want = DenseReference(LlamaConfig.from_dir(tmp_path), loaded).greedy(prompt, 20)
    llm = LLM(str(tmp_path), device="cpu", block_size=4)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
