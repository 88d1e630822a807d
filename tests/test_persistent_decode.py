"""The persistent decode kernel (kernels/persistent_decode.py) and its atomics (kernels/atomics.py).

The oracle is the layer-by-layer forward of model/llama.py: a single sequence's step through
the persistent kernel must give the very same floats (logits and the K/V it writes), because
each of its tasks calls the same kernels on the same values in the same order.
"""

import dataclasses

import numpy as np
import pytest
from numba import get_num_threads, njit, prange

from minipaged.kernels.fast import layer_stack, persistent_decode
from minipaged.kernels.fast import attention, ops as fast_ops
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.ops import LayerWeights
from minipaged.kernels.fast.tuning import DEFAULT_TUNING, FastTuning
from minipaged.kernels.fast.atomics import fetch_add, load_acquire, spin_pause
from minipaged.kernels.fast.borrowed import borrowed
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel
from minipaged.model.random_llama import random_tensors, tiny_config
from minipaged.model.weights import quantize_matrices
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


@njit
def _through_borrowed(a, b):
    va, vb = borrowed(a), borrowed(b)
    va[0] += np.float32(1.0)          # a write through the view lands in the array
    total = np.float32(0.0)
    for i in range(va.shape[0]):
        total += va[i]
    return total, va.shape[0], vb[2, 1], vb.shape[1]


def test_a_borrowed_view_is_the_array_itself():
    """``borrowed(a)`` (kernels/borrowed.py) means ``a``: the same data, shape and strides (its
    point, no reference counting, shows in the speed of the serial product loops, and their
    floats in the tests below)."""
    a = np.arange(5, dtype=np.float32)
    b = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]      # a strided 2-D view
    total, n, b21, cols = _through_borrowed(a, b)
    assert a.tolist() == [1, 1, 2, 3, 4] and total == 11 and n == 5
    assert (b21, cols) == (10, 2) == (b[2, 1], b.shape[1])


@njit(parallel=True)
def _claim_all(ctr, owner, iterations):
    for it in prange(iterations):
        task, r = persistent_decode._claim(ctr, 1, owner.shape[0], it)
        while task < owner.shape[0]:
            owner[task] += it + 1     # each task number is handed out once: written by one thread
            persistent_decode._done(ctr, 1)
            task, r = persistent_decode._claim(ctr, 1, owner.shape[0], r)


@pytest.mark.parametrize("tasks", [1, 2, 7, 200_000])
def test_every_task_is_claimed_exactly_once_across_threads(tasks):
    """Threads claiming a phase's tasks (each its own range first, then the others') never
    share a task, never skip one, and count each done; also with more iterations than threads
    (they then run one after another: the first takes every range) and fewer tasks than ranges."""
    for iterations in (get_num_threads(), get_num_threads() + 1):
        ctr = np.zeros((3, (iterations + 1) * persistent_decode.LINE), np.int64)   # phase 1's row
        owner = np.zeros(tasks, np.int64)
        _claim_all(ctr, owner, iterations)
        claimed_once = np.isin(owner, np.arange(1, iterations + 1))
        assert claimed_once.all()
        assert ctr[1, 0] == tasks                       # each counted done once
        assert not ctr[0].any() and not ctr[2].any()    # other phases' rows untouched
        # (which thread runs which range depends on when each wakes: tutorial 19 prints it)


def _model(seed=0, **shape):
    config = tiny_config(**shape)
    cfg = LlamaConfig.from_dict(config)
    return cfg, LlamaModel(cfg, random_tensors(config, seed), FastOps())


def _tune(model, **changes):
    """The model's tier with these FastTuning fields changed (its prepared weights serve both)."""
    model.ops = FastOps(dataclasses.replace(model.ops.tuning, **changes))


def _stack(model):
    """The persistent kernel's view of the model's layers (made by FastOps.prepare)."""
    return model.weights.tier_state.persistent


def _panels(model):
    """Each layer with its linear weights' panels in their place (what ``layer_stack.stack`` reads)."""
    return [LayerWeights(layer.input_norm, layer.qkv.numba, layer.o.numba, layer.post_norm, layer.gate_up.numba,
                         layer.down.numba) for layer in model.weights.layers]


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
    runs = _count_runs(monkeypatch)
    cfg, model = _model(seed=shape, **SHAPES[shape])
    threshold = 8 if split else 1 << 30       # both paths' plans alike: the same items, the same floats
    _tune(model, split_min_tokens=threshold, persistent_split_min_tokens=threshold)
    assert _stack(model) is not None
    rng = np.random.default_rng(shape + 10 * block_size)
    for prompt_len in (1, 7, 40, 130):
        kv, ids, positions, meta = _prefill(cfg, model, prompt_len, block_size, rng)
        kv_ref = kv.copy()
        _tune(model, persistent_decode=False)
        expected = model.forward(ids, positions, kv_ref, meta, np.array([0]))
        _tune(model, persistent_decode=True)
        plan = attention.plan_attention(meta, None, model.ops.tuning)
        assert persistent_decode.usable(_stack(model), 1, plan, kv, DEFAULT_TUNING.panel_max_rows)
        assert len(plan.merges) == (split and get_num_threads() > 1 and prompt_len + 1 >= 8 * get_num_threads())
        got = model.forward(ids, positions, kv, meta, np.array([0]))
        np.testing.assert_array_equal(got, expected)        # the LM head's logits, made in the kernel
        np.testing.assert_array_equal(kv, kv_ref)
        twice = model.forward(ids, positions, kv, meta, np.array([0, 0]))   # two samples of one row
        np.testing.assert_array_equal(twice, np.concatenate([expected, expected]))
    assert len(runs) == 10   # each decode step (twice), and the prompts of 1 and 7 tokens (under BLAS_MIN_QUERIES)


def test_a_persistent_step_splits_shorter_contexts_than_the_layer_by_layer_path(monkeypatch):
    """Inside the persistent kernel the threads already run, so its plan cuts a single decode's
    context from ``persistent_split_min_tokens`` a thread; a step that goes layer by layer (the
    kernel turned off, or a compressed KV cache) keeps ``split_min_tokens``. Either way the
    slices' merged output is the unsplit floats' to float32 rounding (the spec: the dense path)."""
    cfg, model = _model(seed=7, **SHAPES[2])
    _tune(model, split_min_tokens=1 << 30, persistent_split_min_tokens=8)
    kv, ids, positions, meta = _prefill(cfg, model, 40, 16, np.random.default_rng(2))
    runs = _count_runs(monkeypatch)
    threads = get_num_threads()
    plan = model.ops.plan_step(model.weights, meta, kv).attention
    assert len(plan.merges) == (threads > 1 and 41 >= 8 * threads)   # persistent: split
    assert len(model.ops.plan_step(model.weights, meta, kv.astype(np.int8)).attention.merges) == 0
    _tune(model, persistent_decode=False)
    assert len(model.ops.plan_step(model.weights, meta, kv).attention.merges) == 0
    unsplit = model.forward(ids, positions, kv.copy(), meta, np.array([0]))
    assert not runs
    _tune(model, persistent_decode=True)
    got = model.forward(ids, positions, kv.copy(), meta, np.array([0]))
    assert len(runs) == 1                                      # the split step ran in the kernel
    np.testing.assert_allclose(got, unsplit, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 16, 128, 256])
@pytest.mark.parametrize("context", [100, 200, 300, 520, 1100])
def test_every_slice_of_a_split_context_reads_a_block_or_more(block_size, context):
    """Slices read the blocks their token edges fall in: a context splits (from 64 tokens a
    thread, three threads) only where every slice gets at least one block, and the slices' blocks
    cover the context's once, in order."""
    meta = AttentionMetadata(np.zeros(1, np.int64), np.array([0, 1], np.int32), np.array([context], np.int32),
                             np.zeros((1, -(-context // block_size)), np.int32), 1, context)
    items, merges = attention.split_work(np.array([[0, 0]]), meta, 3, 64, None, block_size)
    assert len(merges) == (context >= 3 * max(64, block_size))
    if len(merges):
        blocks = [(first // block_size, min(end // block_size, -(-context // block_size))) for _, _, first, end, _ in items]
        assert all(b0 < b1 for b0, b1 in blocks)                              # no slice without a block
        assert blocks[0][0] == 0 and blocks[-1][1] == -(-context // block_size)
        assert all(blocks[i][1] == blocks[i + 1][0] for i in range(len(blocks) - 1))


@pytest.mark.parametrize("num_threads", [1, 3])
def test_the_step_completes_whatever_threads_run_it(num_threads):
    """The kernel's iterations on one thread, or more iterations than threads (some run one
    after another): no thread waits for another to start, and the floats are the same."""
    cfg, model = _model(seed=5, **SHAPES[2])
    rng = np.random.default_rng(3)
    kv, ids, positions, meta = _prefill(cfg, model, 50, 16, rng)
    plan = attention.plan_attention(meta)
    hidden = model.weights.embed[ids]
    kv_ref = kv.copy()
    args = (plan, model.scale, cfg.rms_norm_eps, model.rope.cos, model.rope.sin, cfg.num_attention_heads)
    expected = fast_ops.decode_layers(_stack(model), hidden, positions, kv_ref, *args, with_head=True)
    got = fast_ops.decode_layers(_stack(model), hidden, positions, kv, *args, with_head=True, num_threads=num_threads)
    np.testing.assert_array_equal(got[0], expected[0])      # the last layer's output
    np.testing.assert_array_equal(got[1], expected[1])      # the logits
    np.testing.assert_array_equal(kv, kv_ref)


def test_a_stage_without_the_head_returns_its_hidden_states():
    """A pipeline stage that does not hold the LM head (a stack made without it): the kernel
    runs the layers and returns their output, the same floats as the layer-by-layer path."""
    cfg, model = _model(seed=4, **SHAPES[1])
    kv, ids, positions, meta = _prefill(cfg, model, 33, 16, np.random.default_rng(1))
    headless = layer_stack.stack(_panels(model), _panels(model))
    assert headless is not None and not headless.has_head and _stack(model).has_head
    plan = model.ops.plan_step(model.weights, meta, kv)
    kv_ref = kv.copy()
    expected = llama_run_layers(model, ids, positions, kv_ref, meta, plan)
    hidden, logits = fast_ops.decode_layers(headless, model.weights.embed[ids], positions, kv, plan.attention,
                                            model.scale, cfg.rms_norm_eps, model.rope.cos, model.rope.sin,
                                            cfg.num_attention_heads, with_head=True)
    assert logits is None
    np.testing.assert_array_equal(hidden, expected)
    np.testing.assert_array_equal(kv, kv_ref)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_product_tasks_share_a_weight_evenly_among_the_threads(threads):
    """``task_panels``: each task at most TASK_BYTES (or one panel), and the threads' own ranges
    of tasks, as ``_claim`` cuts them, differ by at most one task."""
    for panels in (1, 2, 5, 7, 18, 30, 96, 1536):
        for panel_bytes in (100, 11_520, 30_720, 73_728, 200_000):
            per = layer_stack.task_panels(panels, panel_bytes, threads)
            assert per == 1 or per * panel_bytes <= layer_stack.TASK_BYTES
            tasks = -(-panels // per)
            sizes = [min(per, panels - t * per) for t in range(tasks)]           # panels of each task
            shares = [sum(sizes[r * tasks // threads:(r + 1) * tasks // threads]) for r in range(threads)]
            assert sum(shares) == panels and max(shares) - min(shares) <= per, (panels, panel_bytes, shares)


def test_one_compilation_serves_every_depth_and_stage():
    """Each product's panels reach the kernel as one (layers, bytes) array, a view of the
    region the panels were packed into (no copy): models of 1, 2 and 3 layers and a pipeline
    stage's share of them run the same compiled kernel (a tuple of one array a layer made each
    depth a compilation of its own), and each gives the layer-by-layer floats."""
    kernel = fast_ops._PERSISTENT[2]
    seen = None
    for depth in (1, 2, 3):
        cfg, model = _model(seed=depth, num_hidden_layers=depth, **SHAPES[1])
        stack_ = _stack(model)
        assert stack_.qkv.shape[0] == stack_.down.shape[0] == depth
        assert all(np.shares_memory(stack_.qkv[i], layer.qkv.numba.data) for i, layer in enumerate(model.weights.layers))
        stages = [stack_] + ([layer_stack.stack(_panels(model)[1:], _panels(model)[1:])] if depth > 1 else [])
        for stage in stages:
            kv, ids, positions, meta = _prefill(cfg, model, 9, 4, np.random.default_rng(depth))
            plan = model.ops.plan_step(model.weights, meta, kv)
            kv_ref = kv.copy()
            hidden, _ = fast_ops.decode_layers(stage, model.weights.embed[ids], positions, kv, plan.attention,
                                               model.scale, cfg.rms_norm_eps, model.rope.cos, model.rope.sin,
                                               cfg.num_attention_heads)
            assert hidden.shape == (1, cfg.hidden_size) and np.isfinite(hidden).all()
            if stage is stack_:        # every layer: the layer-by-layer path's floats
                np.testing.assert_array_equal(hidden, llama_run_layers(model, ids, positions, kv_ref, meta, plan))
            signatures = set(kernel.signatures)
            assert seen is None or signatures == seen, "a new depth compiled the kernel again"
            seen = signatures


def llama_run_layers(model, ids, positions, kv, meta, plan):
    """The layer-by-layer path's last layer output (model._layers, run to its end)."""
    from minipaged.model.llama import run_to_end
    return run_to_end(model._layers(model.weights.embed[ids], positions, kv, meta, plan, None, None))


def _batch(cfg, model, block_size, rng, chunks):
    """A pool holding one sequence per entry of ``chunks`` (its prompt prefilled, written
    through scattered blocks), and the step that adds ``chunks[i]`` new tokens to sequence i
    (1: a decode; more: a short prompt chunk): (kv, ids, positions, meta)."""
    prompts = [int(n) for n in rng.integers(3, 60, size=len(chunks))]
    lens = [p + c for p, c in zip(prompts, chunks)]
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 2
    kv = np.zeros(kv_cache_shape(cfg.num_hidden_layers, num_blocks, cfg.num_key_value_heads, block_size,
                                 cfg.head_dim), np.float32)
    free = [int(b) for b in rng.permutation(num_blocks)]
    tables = [[free.pop() for _ in range(n)] for n in per_seq]
    table_array = np.full((len(chunks), max(per_seq)), -1, np.int32)
    for i, table in enumerate(tables):
        table_array[i, :len(table)] = table
    seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in lens]

    def slot(i, pos):
        return tables[i][pos // block_size] * block_size + pos % block_size

    for i, p in enumerate(prompts):          # each prompt alone, layer by layer (it is long)
        meta = AttentionMetadata(np.array([slot(i, t) for t in range(p)], np.int64), np.array([0, p], np.int32),
                                 np.array([p], np.int32), table_array[i:i + 1], p, p)
        model.forward(seqs[i][:p], np.arange(p), kv, meta, np.array([p - 1]))
    ids = np.concatenate([s[p:] for s, p in zip(seqs, prompts)])
    positions = np.concatenate([np.arange(p, n) for p, n in zip(prompts, lens)])
    slots = np.array([slot(i, t) for i, (p, n) in enumerate(zip(prompts, lens)) for t in range(p, n)], np.int64)
    meta = AttentionMetadata(slots, np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32),
                             np.array(lens, np.int32), table_array, max(chunks), max(lens))
    return kv, ids, positions, meta


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("chunks", [[1, 1], [1, 1, 1], [1, 1, 1, 1], [2, 1], [3, 1], [1] * 6, [1] * 13, [1] * 24,
                                    [5] + [1] * 9, [1] * 40, [1] * 99 + [20]])
def test_a_step_of_several_sequences_gives_the_layer_by_layer_floats(monkeypatch, chunks, threaded):
    """Decodes of 2 to 99 sequences (rows padded to a multiple of 4: each tile shape of the
    panels, 4 rows and AVX2's pairs of 6; 119 rows in all, near PANEL_MAX_ROWS), or a short
    prompt chunk beside decodes: the same
    logits, for every row and for a subset, and the same K/V written. ``threaded``: the
    layer-by-layer path runs its attention, norms, rotary, SiLU and KV writes on the thread pool."""
    cfg, model = _model(seed=7, **SHAPES[2])
    threads = dict(attention_parallel_min_work=0, silu_parallel_min_elements=0, light_parallel_min_elements=0,
                   write_kv_parallel_min_tokens=0) if threaded else {}
    kv, ids, positions, meta = _batch(cfg, model, 4, np.random.default_rng(len(chunks)), chunks)
    runs = _count_runs(monkeypatch)    # (after the prompts: the short ones ran as the kernel too)
    rows = np.arange(len(ids))
    for wanted in (rows, rows[np.cumsum(chunks) - 1]):    # every row; each sequence's last
        kv_ref, kv_got = kv.copy(), kv.copy()
        _tune(model, persistent_decode=False, **threads)
        expected = model.forward(ids, positions, kv_ref, meta, wanted)
        _tune(model, persistent_decode=True)
        got = model.forward(ids, positions, kv_got, meta, wanted)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(kv_got, kv_ref)
        assert got.flags.c_contiguous     # vocab 259: the head's panels pad it to 272 columns
    assert len(runs) == 2


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4_1", "q4_1_a8", "q8_0_a8"])
def test_a_quantized_step_gives_the_layer_by_layer_floats_at_every_row_count(monkeypatch, fmt):
    """A model stored in ``fmt`` (its panels the only copy of its weights): decode steps of 1, 2
    and 3 sequences (codes times one or two rows in registers, three padded to four), 4 and 8 (four
    rows at a time), 12 (the runs widened for the float32 tiles): the persistent kernel gives the
    layer-by-layer path's logits and K/V bit for bit, every row through the same product loops."""
    config = tiny_config(intermediate_size=128)
    cfg = LlamaConfig.from_dict(config)
    model = LlamaModel(cfg, quantize_matrices(random_tensors(config, 9), fmt), FastOps())
    assert _stack(model) is not None and model.weights.tier_state.quantized
    runs = _count_runs(monkeypatch)
    for n in (1, 2, 3, 4, 8, 12):
        kv, ids, positions, meta = _batch(cfg, model, 4, np.random.default_rng(n), [1] * n)
        kv_ref, kv_got = kv.copy(), kv.copy()
        _tune(model, persistent_decode=False)
        expected = model.forward(ids, positions, kv_ref, meta, np.arange(n))
        _tune(model, persistent_decode=True)
        runs.clear()                   # (the prompts, short, ran as the kernel too)
        got = model.forward(ids, positions, kv_got, meta, np.arange(n))
        assert runs == [(n, cfg.hidden_size)]                  # the step ran in the kernel
        np.testing.assert_array_equal(got, expected, err_msg=f"{n} rows")
        np.testing.assert_array_equal(kv_got, kv_ref)


def test_other_steps_go_layer_by_layer():
    """More tokens than the panels take (PANEL_MAX_ROWS), a prompt long enough for the prompt
    path, a compressed pool, or panels missing: ``decode_layers`` declines (None) and the model
    runs its layers one kernel at a time."""
    cfg, model = _model(seed=1, **SHAPES[1])
    rng = np.random.default_rng(0)
    args = (model.scale, cfg.rms_norm_eps, model.rope.cos, model.rope.sin, cfg.num_attention_heads)

    def declines(chunks, pool=None):
        kv, ids, positions, meta = _batch(cfg, model, 16, rng, chunks)
        out = fast_ops.decode_layers(_stack(model), model.weights.embed[ids], positions,
                                     kv if pool is None else pool(kv), attention.plan_attention(meta), *args)
        return out is None

    assert not declines([1] * DEFAULT_TUNING.panel_max_rows)
    assert declines([1] * (DEFAULT_TUNING.panel_max_rows + 1))
    assert declines([DEFAULT_TUNING.prompt_min_queries])                  # a prompt: the prompt kernel's
    assert declines([1], pool=lambda kv: kv.astype(np.int8))
    no_panels = [LayerWeights(layer.input_norm, None, None, layer.post_norm, None, None) for layer in _panels(model)]
    assert layer_stack.stack(no_panels, no_panels) is None      # no panels (oneMKL's copies, a GPU)


@pytest.mark.parametrize("n", [1, 2, 6])
def test_generation_is_unchanged_by_the_persistent_kernel(tiny_model_dir, monkeypatch, n):
    """Greedy tokens and their log-probabilities through the engine, kernel on and off: one
    sequence, two and six decoding together. The kernel is our own engine's (cpu_gemm="numba",
    asked for by name: what "auto" takes on this host is its own measurement)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = ["The page table", "A frame", "Swap", "A block of sixteen", "Copy on write", "LRU"][:n]
    runs = _count_runs(monkeypatch)
    outputs = {}
    for on in (False, True):
        llm = make_llm(tiny_model_dir, cpu_gemm="numba", fast_tuning=FastTuning(persistent_decode=on))
        outputs[on] = [(c.token_ids, [sorted(lp.items()) for lp in c.logprobs])
                       for out in llm.generate(prompts, params) for c in out.outputs]
    assert outputs[True] == outputs[False]
    assert len(runs) == 12   # every step: the prompts' (each under BLAS_MIN_QUERIES tokens) and 11 decodes


NO_HANG = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_persistent_decode import SHAPES, _batch, _model
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.fast.tuning import FastTuning

# a nan in the hidden states (a broken checkpoint): the layer-by-layer attention raises
# ZeroDivisionError on it; a task that raised would leave the other threads polling for ever
cfg, model = _model(seed=3, **SHAPES[1])
kv, ids, positions, meta = _batch(cfg, model, 16, np.random.default_rng(0), [1, 1])
model.weights.embed[ids[0], :] = np.nan
try:
    model.forward(ids, positions, kv, meta, np.arange(2))
except FloatingPointError as error:
    print("raised:", error)
# rms_norm_eps = 0: a zero row would divide by zero (a 2-token step's padding rows, which no norm
# may touch); the real rows do not
cfg, model = _model(seed=3, rms_norm_eps=0.0, **SHAPES[1])
kv, ids, positions, meta = _batch(cfg, model, 16, np.random.default_rng(1), [1, 1])
model.ops = FastOps(FastTuning(persistent_decode=False))
expected = model.forward(ids, positions, kv.copy(), meta, np.arange(2))
model.ops = FastOps()
print("eps 0 equal:", np.array_equal(model.forward(ids, positions, kv.copy(), meta, np.arange(2)), expected))
"""


def test_a_failing_step_raises_instead_of_hanging():
    """No task may raise inside the region (a thread that left on an exception would never
    count its task done): a nan hidden state is reported after it, as FloatingPointError, and
    the zero padding rows of a step under rms_norm_eps = 0 hurt no real row (nor are they
    normed). In a child process, so that a hang fails the test instead of stopping the suite."""
    import subprocess
    import sys
    from pathlib import Path
    script = NO_HANG.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: the decode step's hidden states came out nan or inf" in done.stdout
    assert "eps 0 equal: True" in done.stdout


FAILING_TASK = """
import sys
import numpy as np
from numba import njit
sys.path.insert(0, {tests!r})
from test_persistent_decode import SHAPES, _batch, _model, _stack
from minipaged.kernels.fast import attention, ops as fast_ops, persistent_decode
from minipaged.kernels.fast.tuning import QUERY_TILE

@njit
def attention_that_cannot_allocate(q, *rest):
    scratch = np.empty(1 << 60, np.float32)     # more than any machine holds: MemoryError
    scratch[0] = q[0, 0, 0]

cfg, model = _model(seed=3, **SHAPES[1])
kv, ids, positions, meta = _batch(cfg, model, 16, np.random.default_rng(0), [1, 1])
kernel = fast_ops.persistent_kernel(1, cache=False, ATTENTION=attention_that_cannot_allocate)
for threads in (1, 2, 3):
    try:
        persistent_decode.run(kernel, _stack(model), model.embed[ids], positions, kv, attention.plan_attention(meta),
                              model.scale, cfg.rms_norm_eps, model.rope.cos, model.rope.sin,
                              cfg.num_attention_heads, QUERY_TILE, threads, True)
    except RuntimeError as error:
        print(threads, "raised:", error)
"""


def test_a_task_that_fails_ends_the_step_with_an_error_not_a_hang():
    """An attention task whose scratch cannot be allocated, inside the region: every thread leaves
    (no thread polls for the task for ever) and the step raises, on one thread or several. In a
    child process with a time limit: a hang fails the test instead of stopping the suite."""
    import subprocess
    import sys
    from pathlib import Path

    code = FAILING_TASK.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "raised:" in line]
    assert len(lines) == 3 and all("one of its tasks failed" in line for line in lines), done.stdout


def _escapes(source: str) -> list[str]:
    """Where a view from ``borrowed(...)`` could outlive the call that borrowed it, or the array
    under it could die first: a name bound to one that is returned, yielded, stored into an
    attribute, an item or a container, or bound anywhere but a plain local; or a view of anything
    but the function's own parameters, never rebound but to their views (an array the function
    made, its only reference a local, is freed after that local's last use: the view would be
    read after it). ("function: line")"""
    import ast

    found = []
    for fn in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]:
        params = {a.arg for a in fn.args.args}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            for target, value in zip(targets, values if len(values) == len(targets) else [None] * len(targets)):
                is_view = isinstance(value, ast.Call) and getattr(value.func, "id", "") == "borrowed"
                if isinstance(target, ast.Name) and not is_view:
                    params.discard(target.id)                   # rebound to something else
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "borrowed":
                viewed, exprs = [], [node.args[0]]                      # the arrays it may view
                while exprs:
                    e = exprs.pop()
                    exprs += [e.body, e.orelse] if isinstance(e, ast.IfExp) else []
                    viewed += [e] if not isinstance(e, ast.IfExp) else []
                if any(not (isinstance(e, ast.Name) and e.id in params) for e in viewed):
                    found.append(f"{fn.name}: {node.lineno} (not a parameter)")
        names = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "borrowed"
                                                    for c in ast.walk(node.value)):
                for target in node.targets:
                    if not all(isinstance(t, ast.Name) for t in (target.elts if isinstance(target, ast.Tuple) else [target])):
                        found.append(f"{fn.name}: {node.lineno} (stored)")
                    names |= {t.id for t in ast.walk(target) if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            leaving = []
            if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)) and node.value is not None:
                leaving = [node.value]
            elif isinstance(node, ast.Assign) and any(not isinstance(t, (ast.Name, ast.Tuple)) for t in node.targets):
                leaving = [node.value]                            # obj.attr = view, a[i] = view
            elif isinstance(node, (ast.List, ast.Dict, ast.Set)):
                leaving = [node]
            if any(isinstance(n, ast.Name) and n.id in names for v in leaving for n in ast.walk(v)):
                found.append(f"{fn.name}: {node.lineno}")
    return found


def test_borrowed_views_never_leave_the_function_that_borrowed_them():
    """``borrowed`` views hold no reference: one that outlived its call could read freed memory.
    Every use in the kernels keeps them to locals of the borrowing function, passed down only."""
    from pathlib import Path

    kernels = Path(__file__).resolve().parents[1] / "kernels"
    users = [p for p in kernels.rglob("*.py") if "borrowed(" in p.read_text() and p.name != "borrowed.py"]
    assert users, "no kernel borrows a view: the check checks nothing"
    for path in users:
        assert _escapes(path.read_text()) == [], path
    # the check sees an escape where there is one
    leaky = "def f(x):\n    v = borrowed(x)\n    return v\n\ndef g(x, box):\n    box.view = borrowed(x)\n"
    assert _escapes(leaky) == ["f: 3", "g: 6 (stored)"]
    freed = ("def h(x, n):\n    x = make(x, n)\n    v = borrowed(x)\n    use(v)\n\n"      # x: h's own array
             "def k(x, b, n):\n    x, b = borrowed(x), borrowed(b)\n    use(borrowed(b if n else x))\n")
    assert _escapes(freed) == ["h: 3 (not a parameter)"]
