"""Tensor and pipeline parallelism with every worker in this process (``uni``).

The oracle is the single-worker engine: the same driver takes the same steps, so every
step's logits (within 1e-4) and every token must match, under preemption (swap and
recompute), prefix caching and copy-on-write samples. Each worker's pool must hold only
its share of the blocks' bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from minipaged import BeamSearchParams, LLMEngine
from minipaged.config import ConfigError, ParallelConfig
from minipaged.engine.parallel import executor as executor_module
from minipaged.engine.parallel.executor import run_in_lock_step
from minipaged.model.config import LlamaConfig
from minipaged.model.sharding import ShardSpec, shard_config, shard_tensors, stage_layers
from minipaged.model.random_llama import random_tensors, tiny_config, write_tiny_llama
from minipaged.model.reference import reference_logits
from parallel_workload import Run, assert_same_run, workload
from tiny_model import make_llm

SPLITS = [dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2),
          dict(tensor_parallel_size=3, pipeline_parallel_size=2), dict(pipeline_parallel_size=3)]
PREFIX = "every block was free"


@pytest.fixture(scope="session")
def parallel_model_dir(tmp_path_factory):
    """A tiny Llama that TP=3 splits: 6 query heads, 3 KV heads, 96 MLP columns; 3 layers, so
    PP=2 splits unevenly (2 + 1)."""
    return write_tiny_llama(tmp_path_factory.mktemp("parallel"), num_attention_heads=6, num_key_value_heads=3,
                            num_hidden_layers=3)


@pytest.fixture(scope="session")
def parallel_untied_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("parallel_untied"), seed=3, num_attention_heads=6,
                            num_key_value_heads=3, num_hidden_layers=4, tie_word_embeddings=False)


# ------------------------------------------------------------------ the split itself
def test_stage_layers_cover_the_model_in_order():
    for layers in range(1, 12):
        for pp in range(1, layers + 1):
            stages = [stage_layers(layers, pp, r) for r in range(pp)]
            assert [i for s in stages for i in s] == list(range(layers))
            assert max(map(len, stages)) - min(map(len, stages)) <= 1


def test_shards_add_up_to_the_layer():
    """Column-parallel q/k/v and gate/up, row-parallel o and down: the ranks' partial outputs
    sum to the unsplit layer's (checked in NumPy, outside the engine)."""
    raw = tiny_config(num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2)
    config = LlamaConfig.from_dict(raw)
    tensors = random_tensors(raw, seed=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, config.hidden_size)).astype(np.float32)          # (T, hidden)
    attn = rng.standard_normal((5, config.q_size)).astype(np.float32)            # (T, q_size)
    p = "model.layers.1."
    whole_o = attn @ tensors[p + "self_attn.o_proj.weight"].T
    parts_o, parts_down, ffn = 0, 0, config.intermediate_size
    gate, up = tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]
    act = (x @ gate.T) / (1 + np.exp(-(x @ gate.T))) * (x @ up.T)                 # (T, ffn) silu(gate) * up
    whole_mlp = act @ tensors[p + "mlp.down_proj.weight"].T
    for r in range(3):
        spec = ShardSpec(tp_rank=r, tp_size=3)
        shard = shard_tensors(tensors, config, spec)
        assert shard_config(config, spec).num_attention_heads == 2
        heads = slice(r * config.q_size // 3, (r + 1) * config.q_size // 3)
        parts_o = parts_o + attn[:, heads] @ shard[p + "self_attn.o_proj.weight"].T
        g, u = x @ shard[p + "mlp.gate_proj.weight"].T, x @ shard[p + "mlp.up_proj.weight"].T
        parts_down = parts_down + (g / (1 + np.exp(-g)) * u) @ shard[p + "mlp.down_proj.weight"].T
        assert shard[p + "self_attn.k_proj.weight"].shape == (config.kv_size // 3, config.hidden_size)
        assert shard[p + "mlp.gate_proj.weight"].shape == (ffn // 3, config.hidden_size)
    np.testing.assert_allclose(parts_o, whole_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(parts_down, whole_mlp, rtol=1e-5, atol=1e-5)


def test_only_the_right_workers_hold_embedding_and_head(parallel_untied_dir):
    engine = make_llm(parallel_untied_dir, num_blocks=16, tensor_parallel_size=3,
                      pipeline_parallel_size=2).llm_engine
    for stage in engine.executor.stages:
        for worker in stage:
            s = worker.shard
            assert (worker.model.embed is not None) == s.is_first_stage
            assert (worker.model.lm_head is not None) == (s.is_last_stage and s.tp_rank == 0)
            assert len(worker.model.layers) == 2


def test_lock_step_sums_every_all_reduce():
    def run(rank):
        total = yield np.full(3, rank + 1.0)      # a partial sum
        total = yield total * (rank + 1)          # another, built on the first total
        return total

    assert [list(r) for r in run_in_lock_step([run(0), run(1), run(2)])] == [[36.0] * 3] * 3


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("kw, words", [
    (dict(tensor_parallel_size=4), ["tensor_parallel_size=4", "6 query heads"]),
    (dict(tensor_parallel_size=2), ["tensor_parallel_size=2", "3 KV heads"]),
    (dict(pipeline_parallel_size=4), ["pipeline_parallel_size=4", "3 layers"]),
    (dict(tensor_parallel_size=0), ["tensor_parallel_size must be a positive integer"]),
    (dict(distributed_executor_backend="mp"), ["distributed_executor_backend", "'uni', 'ray'"]),
])
def test_bad_splits_are_refused_before_loading(parallel_model_dir, monkeypatch, kw, words):
    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the split was checked")

    monkeypatch.setattr(executor_module, "load_weights", no_load)
    with pytest.raises(ConfigError) as err:
        LLMEngine(str(parallel_model_dir), device="cpu", num_blocks=16, **kw)
    for word in words:
        assert word in str(err.value)


def test_smollm2_head_counts_allow_tp3_only():
    for tp, ok in ((3, True), (2, False), (9, False)):
        config = ParallelConfig(tensor_parallel_size=tp)
        try:
            config.check_model(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                               num_hidden_layers=30)
            assert ok
        except ConfigError as err:
            assert not ok and f"tensor_parallel_size={tp}" in str(err)


def test_calculate_kv_scales_is_refused_with_tensor_parallelism(parallel_model_dir):
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        LLMEngine(str(parallel_model_dir), device="cpu", num_blocks=16, kv_cache_dtype="fp8",
                  calculate_kv_scales=True, tensor_parallel_size=3)


# ------------------------------------------------------------------ same outputs as one worker
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(f"{k.split('_')[0]}{v}" for k, v in s.items()))
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_same_tokens_and_logits_as_one_worker(parallel_model_dir, split, mode):
    common = dict(num_blocks=30, block_size=4, preemption_mode=mode, enable_prefix_caching=True)
    want = Run(parallel_model_dir, workload(PREFIX), **common)
    got = Run(parallel_model_dir, workload(PREFIX), **common, **split)
    # the workload really preempts, hits the prefix cache and copies on write
    assert want.stats["num_preemptions"] > 0 and want.stats["prefix_cache_hits"] > 0 and want.copies > 0
    assert_same_run(got, want)
    assert got.stats["num_preemptions"] == want.stats["num_preemptions"]


def test_untied_model_and_chunked_prefill(parallel_untied_dir):
    common = dict(num_blocks=24, block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=16,
                  max_num_seqs=4)
    want = Run(parallel_untied_dir, workload(PREFIX, n=2), **common)
    got = Run(parallel_untied_dir, workload(PREFIX, n=2), **common, tensor_parallel_size=3, pipeline_parallel_size=2)
    assert_same_run(got, want)


def test_first_step_matches_the_dense_reference(parallel_model_dir):
    """Not only the same as one worker: as the cache-free reference forward too."""
    ids = list(b"paged attention, split three ways")
    run = Run(parallel_model_dir, [("r", {"prompt_token_ids": ids},
                                    workload(PREFIX)[0][2])], num_blocks=16, tensor_parallel_size=3,
              pipeline_parallel_size=2)
    config = LlamaConfig.from_dir(parallel_model_dir)
    from minipaged.model.weights import load_checkpoint
    want = reference_logits(config, load_checkpoint(parallel_model_dir), np.asarray(ids))[-1]   # (vocab,)
    np.testing.assert_allclose(run.logits[0][0], want, atol=1e-4)


def test_beam_search_is_the_same(parallel_model_dir):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    want = make_llm(parallel_model_dir, num_blocks=32, block_size=4).beam_search(["the pool"], params, use_tqdm=False)
    got = make_llm(parallel_model_dir, num_blocks=32, block_size=4, tensor_parallel_size=3,
                   pipeline_parallel_size=2).beam_search(["the pool"], params, use_tqdm=False)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in want[0].sequences]


def test_speculative_decoding_over_shards(parallel_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    requests = [("a", "abcabcabcabcabc", workload(PREFIX)[0][2])]
    want = Run(parallel_model_dir, requests, num_blocks=32, speculative_config=spec)
    got = Run(parallel_model_dir, requests, num_blocks=32, speculative_config=spec, tensor_parallel_size=3)
    assert_same_run(got, want)


# ------------------------------------------------------------------ each pool holds its share
@pytest.mark.parametrize("kv_cache_dtype, sparse", [("auto", None), ("int8", None), ("auto", 8)])
def test_each_worker_pool_holds_only_its_share(parallel_model_dir, kv_cache_dtype, sparse):
    common = dict(num_blocks=20, block_size=4, kv_cache_dtype=kv_cache_dtype, sparse_attention_budget=sparse)
    whole = make_llm(parallel_model_dir, **common).llm_engine.executor.pool_bytes()[0]
    tp = make_llm(parallel_model_dir, **common, tensor_parallel_size=3).llm_engine
    assert tp.executor.pool_bytes() == [whole // 3] * 3
    assert [w.cache.kv_cache.shape[3] for w in tp.executor.workers] == [1] * 3     # one KV head each
    pp = make_llm(parallel_model_dir, **common, pipeline_parallel_size=2).llm_engine
    assert pp.executor.pool_bytes() == [whole * 2 // 3, whole // 3]                 # layers 2 + 1
    both = make_llm(parallel_model_dir, **common, tensor_parallel_size=3, pipeline_parallel_size=2).llm_engine
    assert both.executor.pool_bytes() == [whole * 2 // 9] * 3 + [whole // 9] * 3
    # one block id costs the same across the workers as in one worker
    assert both.get_stats()["kv_blocks_total"] == 20
    assert both.executor.bytes_per_block == tp.executor.bytes_per_block == make_llm(
        parallel_model_dir, **common).llm_engine.executor.bytes_per_block


def test_a_shared_space_gives_the_same_block_count(parallel_model_dir):
    """Under uni every worker's frames share the driver's memory: kv_cache_space is split, not
    multiplied, so any split gets the same number of blocks."""
    one = make_llm(parallel_model_dir, kv_cache_space=0.001, swap_space=0.001).llm_engine
    split = make_llm(parallel_model_dir, kv_cache_space=0.001, swap_space=0.001, tensor_parallel_size=3,
                     pipeline_parallel_size=2).llm_engine
    assert split.executor.num_blocks == one.executor.num_blocks > 0
    assert split.executor.num_cpu_blocks == one.executor.num_cpu_blocks > 0


# ------------------------------------------------------------------ the real model
@pytest.mark.slow
def test_smollm2_same_as_one_worker():
    """SmolLM2 (9 query heads, 3 KV heads, 30 layers): TP=3 with PP=2, under swap and recompute
    preemption, prefix caching and copy-on-write samples (TP alone and PP alone are checked on the
    tiny models above, the same code with fewer layers)."""
    requests = workload("<|im_start|>user\nWhat is a page table? Answer briefly.", n=2)
    for mode in ("swap", "recompute"):
        common = dict(num_blocks=10, block_size=8, preemption_mode=mode, enable_prefix_caching=True)
        want = Run("smollm2-135m-instruct", requests, **common)
        assert want.stats["num_preemptions"] > 0 and want.stats["prefix_cache_hits"] > 0 and want.copies > 0
        assert_same_run(Run("smollm2-135m-instruct", requests, **common, **SPLITS[2]), want)
