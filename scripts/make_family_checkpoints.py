"""Tiny random checkpoints of four model families, with transformers' own greedy outputs.

transformers is the oracle here: it builds each model (llama, qwen2, qwen3, mistral),
saves it as a Hugging Face directory, loads it back in float32 with eager attention and
records plain greedy decoding (a full forward pass per step, no KV cache) so the
engine's tests, which run without torch, can compare against it. Needs torch and
transformers; deterministic (seeded weights, prompts, one CPU thread).

    python scripts/make_family_checkpoints.py [--out tests/data/families]

Writes tests/data/families/<family>/: config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, *.safetensors (+ model.safetensors.index.json
for llama, sharded), expected.json and expected_logits.npz.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from minipaged.model.random_llama import write_tokenizer

SEED = 4  # every family's top-2 margins >= 0.008 with it; several seeds were tried
NEW_TOKENS = 80
PROMPT_LENGTHS = (5, 40)
SPECIAL_IDS = (0, 1, 2)  # <|endoftext|>, <|im_start|>, <|im_end|>: made unlikely, so greedy runs its full length
KEEP = {"config.json", "generation_config.json", "model.safetensors.index.json"}
COMMON = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def family_configs() -> dict[str, tuple[transformers.PreTrainedConfig, torch.dtype]]:
    """family -> (config, dtype the weights are saved in)."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    return {
        "llama": (transformers.LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling=llama3,
                                           tie_word_embeddings=True), torch.float32),
        "qwen2": (transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=False,
                                           use_sliding_window=True, sliding_window=16,
                                           max_window_layers=1), torch.float32),
        "qwen3": (transformers.Qwen3Config(**{**COMMON, "head_dim": 32}, rope_theta=1e6,
                                           tie_word_embeddings=True, use_sliding_window=False),
                  torch.bfloat16),
        "mistral": (transformers.MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=16,
                                               tie_word_embeddings=False), torch.float32),
    }


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Large deterministic weights: clear top-2 margins, a model that does not repeat one token.

    Linear weights N(0, 1/fan_in), residual outputs (o_proj, down_proj) 8x that std (else a
    tied model repeats its last token), embeddings and lm_head N(0, 1) (logits of std ~8),
    norms 1 + 0.1 N(0, 1), biases N(0, 0.25); the special tokens' output rows shrunk 10x so
    none of them is ever the argmax.
    """
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("bias"):
                value = 0.5 * noise
            elif p.ndim == 1:  # RMSNorm weights, q_norm / k_norm included
                value = 1.0 + 0.1 * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = noise
            else:  # Linear [out, in]
                gain = 8.0 if ("o_proj" in name or "down_proj" in name) else 1.0
                value = noise * gain / math.sqrt(p.shape[1])
            p.copy_(value)
        head = model.get_output_embeddings().weight  # [vocab, hidden]
        head[list(SPECIAL_IDS)] *= 0.1


def build_and_save(family: str, config, dtype: torch.dtype, path: Path, seed: int) -> None:
    """Random model written by save_pretrained, then the tokenizer files over it."""
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        old.unlink()
    torch.manual_seed(seed)  # transformers' own init runs before ours overwrites it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    shard = {"max_shard_size": "200KB"} if family == "llama" else {}
    model.save_pretrained(path, **shard)
    for f in path.iterdir():
        if f.name not in KEEP and f.suffix != ".safetensors":
            f.unlink()
    write_tokenizer(path)  # tokenizer.json, tokenizer_config.json, generation_config.json
    if family == "qwen2":
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))


def load_float32(path: Path, **overrides) -> torch.nn.Module:
    """The saved checkpoint, widened to float32 (bf16 exactly), eager attention, no hub kernels
    (transformers 5.25 defaults use_kernels to True and fails without the `kernels` package)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 use_kernels=False, **overrides)
    return model.eval()


def make_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, size=n).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def all_logits(model, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] float32 logits of one full forward pass."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float], np.ndarray]:
    """Greedy argmax, re-running the whole sequence each step; EOS does not stop it."""
    ids, tokens, margins, rows = list(prompt), [], [], []
    for _ in range(steps):
        last = all_logits(model, ids)[-1]  # [vocab]
        top2 = np.sort(last)[-2:]
        token = int(np.argmax(last))
        tokens.append(token)
        margins.append(float(top2[1] - top2[0]))
        rows.append(last)
        ids.append(token)
    return tokens, margins, np.stack(rows)  # [steps, vocab]


def record(family: str, path: Path, prompts: list[list[int]]) -> dict:
    """expected.json and expected_logits.npz from the checkpoint as saved."""
    model = load_float32(path)
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)  # Llama's config has no such key
    layer_types = getattr(cfg, "layer_types", None) or [
        "sliding_attention" if window is not None else "full_attention"
    ] * cfg.num_hidden_layers  # Llama and Mistral have no layer_types; Mistral's window covers every layer
    runs = [greedy(model, p, NEW_TOKENS) for p in prompts]
    expected = {
        "family": family,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "layer_types": list(layer_types),
        "sliding_window": window,
        "prompts": prompts,
        "greedy": [r[0] for r in runs],
        "margins": [r[1] for r in runs],
    }
    (path / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    arrays = {f"logits_{i}": r[2].astype(np.float32) for i, r in enumerate(runs)}  # [80, vocab]
    arrays["prompt_logits_1"] = all_logits(model, prompts[1]).astype(np.float32)  # [40, vocab]
    np.savez_compressed(path / "expected_logits.npz", **arrays)
    return expected


def window_changes_output(family: str, path: Path, expected: dict) -> int | None:
    """Same weights, no sliding window (in memory only): the first step where prompt B's
    greedy tokens differ, None if they never do."""
    overrides = {"sliding_window": None}
    if family == "qwen2":
        overrides.update(use_sliding_window=False, layer_types=["full_attention"] * 3)
    model = load_float32(path, **overrides)
    tokens, _, _ = greedy(model, expected["prompts"][1], NEW_TOKENS)
    return next((i for i, (a, b) in enumerate(zip(tokens, expected["greedy"][1])) if a != b), None)


def summarize(family: str, path: Path, expected: dict, window_changed: int | None | str) -> None:
    sizes = {f.name: f.stat().st_size for f in sorted(path.iterdir())}
    margins = np.array(expected["margins"])  # [2, 80]
    print(f"== {family}: {sum(sizes.values()) / 1024:.1f} KiB in {len(sizes)} files; "
          f"layer_types {expected['layer_types']}")
    for name, size in sizes.items():
        print(f"   {size:>9}  {name}")
    distinct = [len(set(g)) for g in expected["greedy"]]
    print(f"   margins: min {margins.min():.4g}, median {np.median(margins):.3g}, "
          f"< 1e-3: {(margins < 1e-3).sum()}; distinct greedy tokens per prompt {distinct}; "
          f"specials generated: {sum(t in SPECIAL_IDS for g in expected['greedy'] for t in g)}")
    if window_changed != "skipped":
        print(f"   without the sliding window prompt B's greedy tokens first differ at step {window_changed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data/families"))
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--no-window-check", action="store_true",
                        help="skip re-running qwen2/mistral without their sliding window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    prompts = make_prompts(args.seed)
    for i, (family, (config, dtype)) in enumerate(family_configs().items()):
        path = args.out / family
        build_and_save(family, config, dtype, path, args.seed + i)
        expected = record(family, path, prompts)
        changed = "skipped"
        if family in ("qwen2", "mistral") and not args.no_window_check:
            changed = window_changes_output(family, path, expected)
        summarize(family, path, expected, changed)


if __name__ == "__main__":
    main()
