"""The persistent decode kernel (kernels/persistent_decode.py) and its atomics (kernels/atomics.py).

The oracle is the layer-by-layer forward of model/llama.py: a single sequence's step through
the persistent kernel must give the very same floats (logits and the K/V it writes), because
each of its tasks calls the same kernels on the same values in the same order.
"""

import numpy as np
import pytest
from numba import get_num_threads, njit, prange

from minipaged.kernels import cpu, persistent_decode
from minipaged.kernels.atomics import fetch_add, load_acquire, spin_pause
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel
from minipaged.model.random_llama import random_tensors, tiny_config
from tiny_model import make_llm
from minipaged import SamplingParams


@njit
def _atomics_roundtrip(a):
    old = fetch_add(a, 1, 5)          # a[1] += 5, the old value back
    seen = load_acquire(a, 1)
    spin_pause()
    return old, seen


def test_atomics_mean_their_numpy_expressions():
    a = np.array([10, 20, 30], np.int64)
    old, seen = _atomics_roundtrip(a)
    assert (old, seen) == (20, 25)
    assert a.tolist() == [10, 25, 30]


@njit(parallel=True)
def _claim_all(counter, owner, iterations):
    for t in prange(iterations):
        task = fetch_add(counter, 0, 1)
        while task < owner.shape[0]:
            owner[task] += t + 1      # each task number is handed out once: written by one thread
            task = fetch_add(counter, 0, 1)


def test_every_task_is_claimed_exactly_once_across_threads():
    """Threads claiming from one counter (as the kernel's phases do) never share a task, never
    skip one; also with more iterations than threads, which then run one after another."""
    for iterations in (get_num_threads(), get_num_threads() + 1):
        counter = np.zeros(1, np.int64)
        owner = np.zeros(200_000, np.int64)
        _claim_all(counter, owner, iterations)
        assert owner.min() >= 1 and owner.max() <= iterations
        claimed_once = np.isin(owner, np.arange(1, iterations + 1))
        assert claimed_once.all()
        assert counter[0] == owner.shape[0] + iterations   # every iteration's last claim found none


def _model(seed=0, **shape):
    config = tiny_config(**shape)
    cfg = LlamaConfig.from_dict(config)
    return cfg, LlamaModel(cfg, random_tensors(config, seed), cpu)


def _prefill(cfg, model, prompt_len, block_size, rng):
    """A pool with one sequence's prompt written through scattered blocks; its block table."""
    context = prompt_len + 1
    num_blocks = -(-context // block_size) + 3
    kv = np.zeros(kv_cache_shape(cfg.num_hidden_layers, num_blocks, cfg.num_key_value_heads, block_size,
                                 cfg.head_dim), np.float32)
    table = [int(b) for b in rng.permutation(num_blocks)[: -(-context // block_size)]]
    ids = rng.integers(0, cfg.vocab_size, size=context)
    slots = np.array([table[p // block_size] * block_size + p % block_size for p in range(context)], np.int64)
    meta = AttentionMetadata(slots[:prompt_len], np.array([0, prompt_len], np.int32),
                             np.array([prompt_len], np.int32), np.array([table], np.int32), prompt_len, prompt_len)
    model.forward(ids[:prompt_len], np.arange(prompt_len), kv, meta, np.array([prompt_len - 1]))
    step = AttentionMetadata(slots[prompt_len:], np.array([0, 1], np.int32), np.array([context], np.int32),
                             np.array([table], np.int32), 1, context)
    return kv, ids[prompt_len:], np.array([prompt_len]), step


def _count_runs(monkeypatch) -> list:
    """Record each run of the persistent kernel (so that a test cannot pass on the other path)."""
    runs, real = [], persistent_decode.run

    def counted(*args):
        runs.append(args[2].shape)
        return real(*args)
    monkeypatch.setattr(persistent_decode, "run", counted)
    return runs


SHAPES = [
    # group 1 (heads scored one at a time), widths that are whole panels
    dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_size=64, intermediate_size=96),
    # group 2, hidden and MLP widths that leave the last panel partly empty
    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=72, intermediate_size=100),
    # group 3 (SmolLM2's), four layers
    dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, hidden_size=48, intermediate_size=80,
         num_hidden_layers=4),
    # group 4 (Llama-3's), scored two at a time; head_dim 32
    dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=64, intermediate_size=64),
]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_a_single_sequence_step_gives_the_layer_by_layer_floats(monkeypatch, shape, block_size, split):
    """The same logits and the same K/V written, bit for bit, at contexts from 1 token up;
    ``split``: long contexts cut over the threads (split-K items, then merged)."""
    monkeypatch.setattr(cpu, "SPLIT_MIN_TOKENS", 8 if split else 1 << 30)
    runs = _count_runs(monkeypatch)
    cfg, model = _model(seed=shape, **SHAPES[shape])
    assert model.persistent is not None
    rng = np.random.default_rng(shape + 10 * block_size)
    for prompt_len in (1, 7, 40, 130):
        kv, ids, positions, meta = _prefill(cfg, model, prompt_len, block_size, rng)
        kv_ref = kv.copy()
        monkeypatch.setattr(cpu, "PERSISTENT_DECODE", False)
        expected = model.forward(ids, positions, kv_ref, meta, np.array([0]))
        monkeypatch.setattr(cpu, "PERSISTENT_DECODE", True)
        plan = cpu.plan_attention(meta)
        assert persistent_decode.usable(model.persistent, 1, plan, kv)
        assert len(plan.merges) == (split and get_num_threads() > 1 and prompt_len + 1 >= 8 * get_num_threads())
        got = model.forward(ids, positions, kv, meta, np.array([0]))
        np.testing.assert_array_equal(got, expected)        # the LM head's logits, made in the kernel
        np.testing.assert_array_equal(kv, kv_ref)
        twice = model.forward(ids, positions, kv, meta, np.array([0, 0]))   # two samples of one row
        np.testing.assert_array_equal(twice, np.concatenate([expected, expected]))
    assert len(runs) == 9                   # each decode step (twice), and the one-token prompt, as the kernel


@pytest.mark.parametrize("num_threads", [1, 3])
def test_the_step_completes_whatever_threads_run_it(num_threads):
    """The kernel's iterations on one thread, or more iterations than threads (some run one
    after another): no thread waits for another to start, and the floats are the same."""
    cfg, model = _model(seed=5, **SHAPES[2])
    rng = np.random.default_rng(3)
    kv, ids, positions, meta = _prefill(cfg, model, 50, 16, rng)
    plan = cpu.plan_attention(meta)
    hidden = model.embed[ids]
    kv_ref = kv.copy()
    args = (plan, model.scale, cfg.rms_norm_eps, model.cos, model.sin, cfg.num_attention_heads)
    expected = cpu.decode_layers(model.persistent, hidden, positions, kv_ref, *args, with_head=True)
    got = cpu.decode_layers(model.persistent, hidden, positions, kv, *args, with_head=True, num_threads=num_threads)
    np.testing.assert_array_equal(got[0], expected[0])      # the last layer's output
    np.testing.assert_array_equal(got[1], expected[1])      # the logits
    np.testing.assert_array_equal(kv, kv_ref)


def test_a_stage_without_the_head_returns_its_hidden_states():
    """A pipeline stage that does not hold the LM head (a stack made without it): the kernel
    runs the layers and returns their output, the same floats as the layer-by-layer path."""
    cfg, model = _model(seed=4, **SHAPES[1])
    kv, ids, positions, meta = _prefill(cfg, model, 33, 16, np.random.default_rng(1))
    headless = persistent_decode.stack(model.layers, model.packed)
    assert headless is not None and not headless.has_head and model.persistent.has_head
    plan = cpu.plan_attention(meta)
    kv_ref = kv.copy()
    expected = llama_run_layers(model, ids, positions, kv_ref, meta, plan)
    hidden, logits = cpu.decode_layers(headless, model.embed[ids], positions, kv, plan, model.scale,
                                       cfg.rms_norm_eps, model.cos, model.sin, cfg.num_attention_heads,
                                       with_head=True)
    assert logits is None
    np.testing.assert_array_equal(hidden, expected)
    np.testing.assert_array_equal(kv, kv_ref)


def llama_run_layers(model, ids, positions, kv, meta, plan):
    """The layer-by-layer path's last layer output (model._layers, run to its end)."""
    from minipaged.model.llama import run_to_end
    return run_to_end(model._layers(model.embed[ids], positions, kv, meta, plan, None, None))


def test_other_steps_go_layer_by_layer():
    """More than one token, a compressed pool, or panels missing: ``decode_layers`` declines
    (None) and the model runs its layers one kernel at a time."""
    cfg, model = _model(seed=1, **SHAPES[1])
    rng = np.random.default_rng(0)
    kv, ids, positions, meta = _prefill(cfg, model, 20, 16, rng)
    plan = cpu.plan_attention(meta)
    args = (model.scale, cfg.rms_norm_eps, model.cos, model.sin, cfg.num_attention_heads)
    hidden = model.embed[ids]
    assert cpu.decode_layers(model.persistent, hidden, positions, kv, plan, *args) is not None
    two = AttentionMetadata(np.array([meta.slot_mapping[0], -1]), np.array([0, 2], np.int32), meta.seq_lens + 1,
                            meta.block_tables, 2, int(meta.seq_lens[0]) + 1)
    assert cpu.decode_layers(model.persistent, np.repeat(hidden, 2, 0), np.array([20, 21]), kv,
                             cpu.plan_attention(two), *args) is None
    assert cpu.decode_layers(model.persistent, hidden, positions, kv.astype(np.int8), plan, *args) is None
    assert persistent_decode.stack(model.layers, [type(p)() for p in model.packed]) is None


@pytest.mark.parametrize("n", [1, 2])
def test_generation_is_unchanged_by_the_persistent_kernel(tiny_model_dir, monkeypatch, n):
    """Greedy tokens and their log-probabilities through the engine, kernel on and off
    (n = 2: two sequences decode together, so only the prompt's last steps are single)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = ["The page table", "A frame"][:n]
    runs = _count_runs(monkeypatch)
    outputs = {}
    for on in (False, True):
        monkeypatch.setattr(cpu, "PERSISTENT_DECODE", on)
        llm = make_llm(tiny_model_dir)
        outputs[on] = [(c.token_ids, [sorted(lp.items()) for lp in c.logprobs])
                       for out in llm.generate(prompts, params) for c in out.outputs]
    assert outputs[True] == outputs[False]
    assert len(runs) == (11 if n == 1 else 0)   # n = 1: every step after the prompt's
