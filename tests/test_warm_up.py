"""The server's warm-up passes (engine/warm_up.py): they change no state and no token."""

import numpy as np
import pytest

from minipaged import SamplingParams
from minipaged.engine.warm_up import dummy_input, warm_up
from minipaged.model.config import LlamaConfig
from minipaged.model.weights import load_checkpoint
from minipaged.model.reference import DenseReference
from tiny_model import make_llm

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9, 10, 11], [12, 13] * 20, [1, 2, 3, 4, 5, 6, 7, 8] * 5]


def test_dummy_input_maps_each_token_to_its_own_slot():
    inp = dummy_input(num_seqs=3, query_len=2, seq_len=20, block_size=16, vocab=50)
    tables = inp.meta.block_tables
    assert tables.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert inp.positions.tolist() == [18, 19] * 3
    assert inp.meta.slot_mapping.tolist() == [1 * 16 + 2, 1 * 16 + 3, 3 * 16 + 2, 3 * 16 + 3, 5 * 16 + 2, 5 * 16 + 3]
    assert inp.meta.query_start_loc.tolist() == [0, 2, 4, 6] and inp.meta.seq_lens.tolist() == [20] * 3
    assert inp.logits_indices.tolist() == [1, 3, 5]
    assert inp.input_ids.min() >= 0 and inp.input_ids.max() < 50


@pytest.mark.parametrize("caching", [False, True])
def test_warm_up_changes_no_token_and_no_state(tiny_model_dir, caching):
    """Greedy tokens after the warm-up equal an engine's without it (the passes' K/V in the
    pool's first blocks is never read), and the engine's counters and pool are untouched."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = {}
    for warmed in (False, True):
        llm = make_llm(tiny_model_dir, num_blocks=64, max_model_len=128, enable_prefix_caching=caching)
        engine = llm.llm_engine
        before = engine.get_stats()
        if warmed:
            pool = engine.executor.driver_worker.cache.kv_cache     # (layers, 2, blocks, kv_heads, block, dim)
            assert not pool[:, :, :2].any()
            seconds = warm_up(engine)
            assert seconds is not None and seconds >= 0
            assert pool[:, :, :2].any()          # the passes did write K/V into the pool's first blocks
            after = engine.get_stats()
            for key in ("kv_blocks_used", "kv_blocks_peak", "num_running", "num_waiting", "num_steps",
                        "prefix_cache_queries", "num_preemptions", "prompt_tokens", "generation_tokens"):
                assert after[key] == before[key], key
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outputs[warmed] = [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in got]
        if caching:   # the fourth prompt repeats the first: its blocks came from the page cache
            assert engine.get_stats()["prefix_cache_hits"] > 0
    assert [t for t, _ in outputs[True]] == [t for t, _ in outputs[False]]
    for (_, a), (_, b) in zip(outputs[True], outputs[False]):
        for x, y in zip(a, b):
            assert [k for k, _ in x] == [k for k, _ in y]
            np.testing.assert_allclose([v for _, v in x], [v for _, v in y], rtol=1e-5, atol=1e-5)


def test_warm_up_is_skipped_when_it_could_disturb(tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_blocks=64, max_model_len=128, enable_prefix_caching=True)
    assert warm_up(llm.llm_engine, calculate_kv_scales=True) is None   # the scales come from real K/V
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert warm_up(llm.llm_engine) is None                             # cached blocks hold real K/V


def test_warm_up_passes_compute_real_logits(tiny_model_dir):
    """The dummy prefill is an ordinary forward pass: its last row's logits are the dense reference's."""
    llm = make_llm(tiny_model_dir, num_blocks=64, max_model_len=128)
    engine = llm.llm_engine
    inp = dummy_input(1, 40, 40, engine.block_manager.block_size, engine.model_config.vocab_size)
    logits = np.asarray(engine.executor.execute_model(inp))                    # (1, vocab)
    dense = DenseReference(LlamaConfig.from_dir(tiny_model_dir), load_checkpoint(tiny_model_dir))
    np.testing.assert_allclose(logits[0], dense.logits(inp.input_ids.tolist())[-1], rtol=1e-3, atol=1e-3)
