"""Tutorial 23: the sliding window, a page-replacement policy that knows the future.

Goal: see a sliding-window model (Mistral; Qwen2 with ``use_sliding_window``) hold a window's worth
of KV blocks however long it generates. In such a layer the token at position p attends only to
positions p - w + 1 .. p: a token further back than the window is never read again. Paging makes
that worth something: the blocks that slid out go back to the pool while the request runs. We:

1. read the window from a model's config.json (``LlamaConfig.layer_windows``) and write the rule
   each attention kernel follows;
2. step one long request through the engine and draw its block table as the window slides: the
   leading entries become ``-`` (unmapped), their frames free; count the blocks held against the
   tokens generated, and again with the release turned off: the same tokens, linear memory;
3. check those tokens against the dense reference forward (no cache, no paging, the window as a
   mask), so the release changes memory and nothing else;
4. with prefix caching, see the slid-out blocks wait in the page cache's LRU, still free, and a
   second identical prompt hit them;
5. load a model whose first layer reads everything (Qwen2's ``max_window_layers``): one block
   table serves every layer, so nothing may slide out.

The OS analogy: page replacement. An OS guesses which page will not be used again (LRU, the
clock); Belady's optimal policy would evict the page used furthest in the future, if only it
knew the future. A sliding window is that knowledge, given by the architecture: a block before
every layer's window has no future reference at all, so it is freed with certainty, not guessed.
Prefix caching then keeps it as a clean page in the page cache: free, yet able to serve a later
reader of the same tokens.

Run it:  python tutorials/23_sliding_window_paging.py   (no download: random tiny models)

Exercises (also printed at the end):
  1. Make the window 64 (WINDOW). How many blocks does the request hold at most, and why is it
     window // block_size + 2 rather than + 1?
  2. Admission still counts a request's whole length (``LLMEngine._check_fits``): a preempted
     request is recomputed from its first token, in one prefill that writes every position.
     What would the block manager need to admit by the window instead?
"""

import json
import tempfile
from pathlib import Path

from minipaged import LLMEngine, SamplingParams  # before numpy: it sets up numpy's thread pools
import numpy as np
from safetensors.numpy import save_file

from minipaged.memory.block_table import SLID_OUT
from minipaged.model.config import LlamaConfig
from minipaged.model.random_llama import random_tensors, tiny_config, write_tiny_llama
from minipaged.model.reference import DenseReference
from minipaged.model.weights import load_checkpoint

WINDOW, BLOCK, NEW_TOKENS = 32, 4, 160
POOL = 256                                          # blocks: a small pool (and no swap pool), audited every step
ROOT = Path(tempfile.mkdtemp(prefix="minipaged-t23-"))
MISTRAL = write_tiny_llama(ROOT / "mistral", seed=3, model_type="mistral", architectures=["MistralForCausalLM"],
                           sliding_window=WINDOW, max_position_embeddings=1024)
PROMPT = list(range(40, 60))                        # 20 token ids
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

print("1. The window, from config.json")
config = LlamaConfig.from_dir(MISTRAL)
print(f"   model_type={config.model_type}, sliding_window={WINDOW}: layer windows {config.layer_windows}")
print(f"   the token at position p reads positions max(0, p - {WINDOW} + 1) .. p in every layer, so a block")
print(f"   of {BLOCK} tokens wholly before the next token's p - {WINDOW} + 1 is never read again")
assert config.layer_windows == (WINDOW,) * config.num_hidden_layers and config.sliding_window == WINDOW


def entries(table) -> str:
    return " ".join("-" if b == SLID_OUT else str(b) for b in table.block_ids)


def run(release: bool, show: bool):
    """One greedy request stepped by hand: (blocks held after each step, tokens, the engine)."""
    engine = LLMEngine(str(MISTRAL), device="cpu", block_size=BLOCK, num_blocks=POOL, swap_space=0,
                       log_stats_interval=0)
    if not release:   # the same engine, the block manager's release turned off: pages stay mapped
        engine.block_manager.sliding_window = 0
    engine.add_request("r", {"prompt_token_ids": PROMPT}, GREEDY)
    held, tokens, shown = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        held.append(engine.block_manager.num_used_blocks)
        engine.block_manager.check_invariants()
        seq = next((s for g in engine.scheduler.running for s in g.seqs), None)
        if show and seq is not None and len(tokens) in (1, 14, 15, 60, 61):
            table = engine.block_manager.tables[seq.seq_id]
            pos = seq.num_tokens - 2          # the position the step just run computed
            print(f"   step at position {pos:3d} read {max(pos - WINDOW + 1, 0):3d}..{pos:3d}: "
                  f"table [{entries(table)}]  held {held[-1]}")
            shown += 1
    return held, tokens, engine


print("\n2. One request, 20 prompt tokens + 160 generated, block size 4; '-' = slid out, frame freed")
held, tokens, engine = run(release=True, show=True)
kept, same, _ = run(release=False, show=False)
print("   tokens so far : blocks held with the release | without")
for i in range(0, NEW_TOKENS, 20):
    print(f"   {len(PROMPT) + i + 1:13d} : {'#' * held[i]:<12} {held[i]:2d} | {'#' * kept[i]} {kept[i]}")
most = max(held[1:])
print(f"   at most {most} blocks held ({WINDOW} // {BLOCK} + 2), against {max(kept)} without the release")
assert most <= WINDOW // BLOCK + 2 and max(kept) == -(-(len(PROMPT) + NEW_TOKENS - 1) // BLOCK)
print(f"   the same tokens with and without the release: {tokens == same}")
assert tokens == same

print("\n3. The dense reference (every position recomputed, the window a mask) agrees")
reference = DenseReference(config, load_checkpoint(MISTRAL)).greedy(PROMPT, 24)
print(f"   first 24 tokens equal: {tokens[:24] == reference}")
assert tokens[:24] == reference

print("\n4. Slid-out blocks are clean pages: with prefix caching they wait in the LRU")
engine = LLMEngine(str(MISTRAL), device="cpu", block_size=BLOCK, num_blocks=POOL, swap_space=0,
                   enable_prefix_caching=True, log_stats_interval=0)
first = engine.block_manager
engine.add_request("a", {"prompt_token_ids": PROMPT + tokens[:40]}, SamplingParams(temperature=0.0, max_tokens=4))
freed_while_running = 0
while engine.has_unfinished_requests():
    engine.step()
    freed_while_running = max(freed_while_running, len(first.cache.evictable))
print(f"   while request a ran, up to {freed_while_running} of its slid-out blocks sat in the LRU, counted free")
hits_before = first.cache.hits
engine.add_request("b", {"prompt_token_ids": PROMPT + tokens[:40]}, SamplingParams(temperature=0.0, max_tokens=4))
while engine.has_unfinished_requests():
    engine.step()
print(f"   request b, the same 60 tokens: {first.cache.hits - hits_before} tokens found in the cache")
assert freed_while_running > 0 and first.cache.hits - hits_before >= 48

print("\n5. A full-attention layer pins every block (Qwen2 with max_window_layers=1)")
qwen = ROOT / "qwen2"
write_tiny_llama(qwen, seed=4, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                 sliding_window=WINDOW, max_window_layers=1, max_position_embeddings=1024)
raw = json.loads((qwen / "config.json").read_text())
tensors = random_tensors(tiny_config(**raw), 4)
rng = np.random.default_rng(4)
for i in range(raw["num_hidden_layers"]):     # Qwen2's q/k/v biases
    heads = {"q": raw["num_attention_heads"], "k": raw["num_key_value_heads"], "v": raw["num_key_value_heads"]}
    for name, rows in heads.items():
        tensors[f"model.layers.{i}.self_attn.{name}_proj.bias"] = (
            0.1 * rng.standard_normal(rows * raw["head_dim"])).astype(np.float32)
save_file(tensors, str(qwen / "model.safetensors"))
mixed = LlamaConfig.from_dir(qwen)
print(f"   layer windows {mixed.layer_windows}: layer 0 reads every token, so the pool's one block table")
print(f"   (shared by every layer) may free nothing: sliding_window for paging = {mixed.sliding_window}")
engine = LLMEngine(str(qwen), device="cpu", block_size=BLOCK, num_blocks=POOL, swap_space=0, log_stats_interval=0)
engine.add_request("q", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
peak = 0
while engine.has_unfinished_requests():
    engine.step()
    peak = max(peak, engine.block_manager.num_used_blocks)
print(f"   80 tokens held {peak} blocks: one per {BLOCK} tokens, as any full-attention model")
assert mixed.sliding_window == 0 and peak == -(-(len(PROMPT) + 60 - 1) // BLOCK)

print("""
Exercises:
  1. Make the window 64 (WINDOW). How many blocks does the request hold at most, and why is it
     window // block_size + 2 rather than + 1?
  2. Admission still counts a request's whole length (LLMEngine._check_fits): a preempted request
     is recomputed from its first token, in one prefill that writes every position. What would the
     block manager need to admit by the window instead?""")
