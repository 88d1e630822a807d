"""The Numba CPU kernels against their NumPy specs (kernels/reference.py)."""

import platform

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels.fast import attention, attention_loop, attention_registers, elementwise, kv_write, simd, tuning
from minipaged.kernels.fast.tuning import FastTuning
from minipaged.kernels import reference as spec
from minipaged.kernels.layout import AttentionMetadata


def random_batch(rng, *, block_size, num_heads, num_kv_heads, head_dim, seqs):
    """A paged KV pool with shuffled physical blocks and a flattened batch of queries.

    seqs: list of (query_len, seq_len); queries are the last query_len positions.
    """
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3                       # a few blocks nobody owns
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    physical = rng.permutation(num_blocks)                    # shuffled: logical order != physical
    tables = np.full((len(seqs), max(blocks_per_seq)), -1, dtype=np.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = physical[used:used + n]
        used += n
    q_lens = [q for q, _ in seqs]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([n for _, n in seqs], dtype=np.int32)
    q = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(np.float32)
    meta = AttentionMetadata(slot_mapping=np.zeros(int(qsl[-1]), np.int64), query_start_loc=qsl,
                             seq_lens=seq_lens, block_tables=tables, max_query_len=max(q_lens),
                             max_seq_len=int(seq_lens.max()))
    return q, k_cache, v_cache, meta


@st.composite
def attention_cases(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))    # 6 and 8: two chunks of heads scored together
    head_dim = draw(st.sampled_from([4, 8, 16, 48, 64]))
    seqs = []
    for _ in range(draw(st.integers(1, 5))):
        seq_len = draw(st.integers(1, 80))
        kind = draw(st.sampled_from(["decode", "prefill", "partial"]))
        q_len = {"decode": 1, "prefill": seq_len}.get(kind) or draw(st.integers(1, seq_len))
        seqs.append((q_len, seq_len))
    return dict(block_size=block_size, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                head_dim=head_dim, seqs=seqs), draw(st.integers(0, 2**31))


@settings(max_examples=20, deadline=None)   # 60 cost a minute of CI time, 30 half a minute
@given(attention_cases(), st.sampled_from([True, True, False]))
def test_paged_attention_matches_spec(case, registers):
    """Either kernel (a third of the cases on the loop kernel a float pool no longer takes)."""
    shape, seed = case
    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(seed), **shape)
    scale = 1.0 / np.sqrt(shape["head_dim"])
    plan = attention.plan_attention(meta, None, FastTuning(vector_attention=registers))
    got = attention.paged_attention(q, k_cache, v_cache, plan, scale)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_paged_attention_reads_a_strided_pool():
    """A pool that is a view of a wider array (not C-contiguous, as no engine pool is) reads
    through its strides: the same answer as the spec."""
    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(11), block_size=16, num_heads=9,
                                             num_kv_heads=3, head_dim=64, seqs=[(1, 70), (1, 33)])
    wide = np.zeros(v_cache.shape[:3] + (96,), np.float32)   # (blocks, kv_heads, block_size, 96)
    wide[..., :64] = v_cache
    strided = wide[..., :64]
    assert not strided.flags.c_contiguous
    got = attention.paged_attention(q, k_cache, strided, meta, 0.125)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_heads_scored_together_divide_the_group():
    assert [attention_loop.heads_together(g) for g in (1, 2, 3, 4, 5, 6, 8, 12, 7)] == [1, 2, 3, 4, 1, 3, 4, 4, 1]


@pytest.mark.parametrize("kernel", ["registers", "loops"])
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("path", ["numba", "blas", "prompt", "mixed"])
def test_paged_attention_every_path(monkeypatch, kernel, threads, path):
    """Serial and threaded Numba kernels (the register kernel a float32 cache takes, and the
    loops that quantized caches take), the prompt kernel, and the gather + BLAS path for long
    query runs (in small query tiles, to cross tile edges), all agree with the spec."""
    taken = []
    real_call = attention_registers.vector_attention_call
    monkeypatch.setattr(attention, "vector_attention_call", lambda *a: taken.append(real_call(*a)) or taken[-1])
    at = 0 if threads == "parallel" else 1 << 62
    tuning_ = FastTuning(vector_attention=kernel == "registers", parallel_min_elements=at,
                         attention_parallel_min_work=at, softmax_parallel_min_elements=at,
                         prompt_min_queries={"numba": 1 << 30, "blas": 1, "prompt": 1, "mixed": 20}[path],
                         prompt_kernel=path != "blas", blas_query_tile=7)
    rng = np.random.default_rng(7)
    q, k_cache, v_cache, meta = random_batch(rng, block_size=16, num_heads=9, num_kv_heads=3,
                                             head_dim=64, seqs=[(1, 200), (37, 37), (20, 45), (1, 1)])
    got = attention.paged_attention(q, k_cache, v_cache, attention.plan_attention(meta, None, tuning_), 0.125)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # the kernel named ran: the register kernel was asked (and took the pool), or never asked
    assert taken == ([True] if path not in ("blas", "prompt") and kernel == "registers" else [])



def test_register_attention_takes_float_pools_it_can_address():
    """The register kernel reads float32 pools whose rows of head_dim are contiguous (strided
    pools included, through a flat window); head_dim off the register width goes to the loops."""
    from minipaged.kernels.fast.simd import LANES  # noqa: PLC0415

    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(3), block_size=16, num_heads=9,
                                             num_kv_heads=3, head_dim=64, seqs=[(1, 70), (2, 33)])
    plan = attention.plan_attention(meta)
    parts = (np.empty((0, 16 * 9, 64), np.float32), np.empty((0, 16 * 9), np.float32), np.empty((0, 16 * 9), np.float32))
    out = np.empty(q.shape, np.float32)
    assert attention_registers.vector_attention_call(q, k_cache, v_cache, plan, 0.125, *parts, out)
    wide = np.zeros(k_cache.shape[:3] + (96,), np.float32)   # rows of 64 inside rows of 96
    wide[..., :64] = k_cache
    window = attention_registers._flat_window(wide[..., :64])
    assert window.base is not None and window[96 * 5 + 3] == k_cache[0, 0, 5, 3]
    assert attention_registers._flat_window(wide[..., ::2]) is None           # head_dim itself strided
    wide_v = np.zeros_like(wide)
    wide_v[..., :64] = v_cache
    strided_k, strided_v = wide[..., :64], wide_v[..., :64]     # K and V both strided, alike
    assert attention_registers.vector_attention_call(q, strided_k, strided_v, plan, 0.125, *parts, out)
    np.testing.assert_allclose(out, spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                         meta.query_start_loc, 0.125), atol=2e-5, rtol=1e-5)
    assert attention_registers._flat_window(k_cache.astype(np.float16)) is None
    assert attention_registers._flat_window(k_cache[::-1]) is None             # a negative stride
    assert not attention_registers.vector_attention_call(q, k_cache, strided_k, plan, 0.125, *parts, out)   # K, V unalike
    q2, k2, v2, meta2 = random_batch(np.random.default_rng(4), block_size=8, num_heads=2, num_kv_heads=1,
                                     head_dim=LANES + 4, seqs=[(1, 20)])
    out2 = np.empty(q2.shape, np.float32)
    assert not attention_registers.vector_attention_call(q2, k2, v2, attention.plan_attention(meta2), 0.1, *parts, out2)
    np.testing.assert_allclose(attention.paged_attention(q2, k2, v2, meta2, 0.1),
                               spec.paged_attention(q2, k2, v2, meta2.block_tables, meta2.seq_lens,
                                                    meta2.query_start_loc, 0.1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 64, 512])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 48)])
def test_register_attention_walks_long_contexts_in_chunks(monkeypatch, block_size, split, heads, kv_heads,
                                                          head_dim):
    """Contexts of several SCORE_CHUNKs (a block of 512 is a chunk of its own): the online softmax
    carries its max and sums from chunk to chunk, a tile of queries reads a causal prefix of each
    chunk, and split-K slices (of a decode and of a tile of queries) start and end inside the
    context. Groups of 3 and 2 heads; head_dim 48 leaves registers over after the quads. The
    spec agrees."""
    assert 700 > 2 * tuning.SCORE_CHUNK
    if split and attention.get_num_threads() < 2:
        pytest.skip("split-K slices a context over two or more threads")
    split_tuning = FastTuning(split_min_tokens=64 if split else 1 << 30)
    q, k_cache, v_cache, meta = random_batch(np.random.default_rng(block_size), block_size=block_size,
                                             num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                             seqs=[(1, 700), (5, 600), (1, 257)] if not split else [(5, 700)])
    taken = []
    real_call = attention_registers.vector_attention_call
    monkeypatch.setattr(attention, "vector_attention_call", lambda *a: taken.append(real_call(*a)) or taken[-1])
    plan = attention.plan_attention(meta, None, split_tuning)
    assert len(plan.merges) == (1 if split else 0)
    got = attention.paged_attention(q, k_cache, v_cache, plan, 0.125)
    want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 0.125)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert taken == [True]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 4, 16, 64]), st.integers(1, 40), st.integers(0, 2**31))
def test_write_kv_matches_spec(block_size, num_tokens, seed):
    rng = np.random.default_rng(seed)
    num_blocks, heads, dim = 8 + num_tokens, 2, 8
    caches = [rng.standard_normal((num_blocks, heads, block_size, dim)).astype(np.float32) for _ in range(2)]
    expected = [c.copy() for c in caches]
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False).astype(np.int64)
    slots[rng.random(num_tokens) < 0.2] = -1                   # padding rows are skipped
    k, v = (rng.standard_normal((num_tokens, heads, dim)).astype(np.float32) for _ in range(2))
    kv_write.write_kv(caches[0], caches[1], k, v, slots)
    spec.write_kv(expected[0], expected[1], k, v, slots)
    np.testing.assert_array_equal(caches[0], expected[0])
    np.testing.assert_array_equal(caches[1], expected[1])


def test_fast_exp_matches_spec_over_its_whole_range():
    x = np.concatenate([np.linspace(-100, 100, 400_001), [-np.inf, -87.0, 0.0, 88.0, 1e30, -1e30],
                        np.random.default_rng(0).standard_normal(1000) * 1e-3]).astype(np.float32)
    got = elementwise.exp(x).astype(np.float64)
    want = spec.exp(x)
    normal = want > 0
    assert np.max(np.abs(got[normal] - want[normal]) / want[normal]) < 1e-6
    assert np.all(got[~normal] == 0.0)                       # below -87, and -inf, give 0
    assert elementwise.exp(np.zeros((2, 3), np.float32)).shape == (2, 3)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100])
def test_causal_softmax_matches_numpy(width):
    """The fused BLAS-path softmax: row maxima over the visible keys (any tail length; from
    row_first on, a sliding window, for half the rows), exp, zeros elsewhere, row sums; stable
    for scores far from 0."""
    rng = np.random.default_rng(width)
    rows = 3 * width
    scores = (rng.standard_normal((rows, width)) * 300).astype(np.float32)
    row_pos = rng.integers(0, width, size=rows)
    row_first = np.where(np.arange(rows) % 2, rng.integers(0, row_pos + 1), 0)      # (rows,) <= row_pos
    scale = np.float32(0.125)
    want = np.zeros((rows, width))
    for r in range(rows):
        seen = scores[r, row_first[r]: row_pos[r] + 1].astype(np.float64) * scale
        want[r, row_first[r]: row_pos[r] + 1] = np.exp(seen - seen.max())
    for parallel in (False, True):
        got, sums = scores.copy(), np.empty(rows, np.float32)
        getattr(attention._causal_softmax, "parallel" if parallel else "serial")(got, row_first, row_pos, scale, sums)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(sums, want.sum(axis=1), rtol=1e-5)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
def test_silu_gives_the_same_floats_wherever_its_output_lies(threads):
    """SiLU's loops check at run time whether out overlaps gate_up, and take a vector or a
    scalar copy of themselves; both must round alike, or a step's floats would hang on where
    np.empty put out. Out placed just after gate_up, further on, before it, and alone."""
    kernel = getattr(elementwise._silu_and_mul, threads)
    rng = np.random.default_rng(7)
    gate_up = (rng.standard_normal((4, 2 * 1536)) * 3).astype(np.float32)     # (T, 2 ffn)
    alone = np.empty((4, 1536), np.float32)
    kernel(gate_up, alone)
    memory = np.empty(gate_up.size + alone.size + 4096, np.float32)
    for gap in (1, 5, 8, 33, 1000):
        for out_first in (False, True):
            if out_first:
                out = memory[:alone.size].reshape(alone.shape)
                x = memory[alone.size + gap:alone.size + gap + gate_up.size].reshape(gate_up.shape)
            else:
                x = memory[:gate_up.size].reshape(gate_up.shape)
                out = memory[gate_up.size + gap:gate_up.size + gap + alone.size].reshape(alone.shape)
            x[...] = gate_up
            kernel(x, out)
            np.testing.assert_array_equal(out, alone)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("tokens", [1, 3, 200])
def test_elementwise_kernels_match_spec(monkeypatch, threads, tokens):
    at = 0 if threads == "parallel" else 1 << 62
    tuning_ = FastTuning(parallel_min_elements=at, light_parallel_min_elements=at, silu_parallel_min_elements=at)
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    np.testing.assert_allclose(elementwise.rms_norm(x, w, 1e-5, tuning_), spec.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)

    gate_up = rng.standard_normal((tokens, 2 * 48)).astype(np.float32)
    gate_up[0, :4] = [-120.0, -90.0, 90.0, 120.0]               # where e^-gate leaves float32's range
    np.testing.assert_allclose(elementwise.silu_and_mul(gate_up, tuning_), spec.silu_and_mul(gate_up), rtol=1e-5, atol=1e-6)

    heads = rng.standard_normal((tokens, 3, 16)).astype(np.float32)
    positions = rng.integers(0, 500, size=tokens)
    angles = np.outer(np.arange(512), 1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    original = heads.copy()
    np.testing.assert_allclose(elementwise.rotary(heads, positions, cos, sin, tuning_),
                               spec.rotary(heads, positions, cos, sin), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(heads, original)            # the input is left untouched


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4 * 16 * 3 + 9), st.integers(0, 2**31))
def test_row_max_matches_numpy(n, seed):
    """Four registers of running maxima and a tail (rows shorter than 4 x LANES are all tail):
    the maximum wherever it sits, in a register's lane or the tail, all-negative rows too."""
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(n + 5) * 100 - 50).astype(np.float32)
    row[rng.integers(0, n)] = 1e30 if seed % 3 == 0 else row[0]
    row[n:] = 1e38                                            # past n: never read
    assert elementwise.vector_max(row, n) == row[:n].max()


def test_row_max_of_nothing_is_minus_infinity():
    assert elementwise.vector_max(np.ones(4, np.float32), 0) == -np.inf


def test_prefetch_emits_a_prefetch_and_changes_nothing():
    """The hint compiles to the CPU's prefetch instruction and leaves memory and results alone."""
    from numba import njit

    @njit
    def touch_every_line(a):
        for offset in range(0, a.nbytes, 64):
            simd.prefetch(a, offset)
        return a.sum()

    a = np.arange(4096, dtype=np.float32)
    assert touch_every_line(a) == a.sum()
    np.testing.assert_array_equal(a, np.arange(4096, dtype=np.float32))
    asm = touch_every_line.inspect_asm(touch_every_line.signatures[0])
    if platform.machine() in ("x86_64", "AMD64"):
        assert "prefetcht0" in asm


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**31))
def test_swap_round_trip_is_bit_exact(num_moved, seed):
    """Device -> CPU pool -> device through different block ids returns every bit unchanged."""
    rng = np.random.default_rng(seed)
    shape = (3, 2, 16, 2, 4, 8)                                   # layers, k/v, blocks, heads, slots, dim
    device = rng.standard_normal(shape).astype(np.float32)
    device.view(np.uint32)[0, 0, 0, 0, 0, :2] = [0x7FC00001, 0x80000000]   # a NaN payload, -0.0
    original = device.copy()
    cpu_pool = np.zeros((3, 2, 12, 2, 4, 8), np.float32)
    out_map = np.stack([rng.choice(16, num_moved, replace=False),
                        rng.choice(12, num_moved, replace=False)], axis=1)
    expected_pool = cpu_pool.copy()
    spec.swap_blocks(device, expected_pool, out_map)
    kv_write.swap_blocks(device, cpu_pool, out_map)
    assert cpu_pool.tobytes() == expected_pool.tobytes()
    device[:] = 0                                                # the device blocks get reused
    back = np.stack([out_map[:, 1], rng.permutation(16)[:num_moved]], axis=1)
    kv_write.swap_blocks(cpu_pool, device, back)
    for (old, _), (_, new) in zip(out_map, back):
        assert device[:, :, new].tobytes() == original[:, :, old].tobytes()


def test_copy_blocks_matches_spec():
    rng = np.random.default_rng(3)
    cache = rng.standard_normal((2, 2, 10, 3, 4, 8)).astype(np.float32)
    expected = cache.copy()
    mapping = np.array([[1, 7], [4, 9]])
    spec.swap_blocks(expected, expected, mapping)
    kv_write.copy_blocks(cache, mapping)
    np.testing.assert_array_equal(cache, expected)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_split_k_slices_of_long_decodes_merge_to_the_spec(monkeypatch, block_size, sparse):
    """Fewer tiles than threads: each long decode's context is cut into one slice per thread
    (split-K), the slices merged; the same result as the spec, sparse too."""
    from numba import get_num_threads  # noqa: PLC0415

    if get_num_threads() < 2:
        pytest.skip("split-K needs at least two threads")
    rng = np.random.default_rng(block_size)
    q, k_cache, v_cache, meta = random_batch(rng, block_size=block_size, num_heads=6, num_kv_heads=2,
                                             head_dim=32, seqs=[(1, 37)])
    plan = attention.plan_attention(meta, None, FastTuning(split_min_tokens=8))
    assert len(plan.merges) == 1 and len(plan.items) == get_num_threads()
    if sparse:
        from minipaged.kernels.layout import BlockBounds  # noqa: PLC0415

        key_min, key_max = spec.key_bounds(k_cache)
        got = attention.paged_attention(q, k_cache, v_cache, plan, 0.2, None, BlockBounds(key_min, key_max, 3))
        want = spec.sparse_decode_attention(q, k_cache, v_cache, key_min, key_max, meta.block_tables,
                                            meta.seq_lens, 0.2, 3 * block_size)
    else:
        got = attention.paged_attention(q, k_cache, v_cache, plan, 0.2)
        want = spec.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.2)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,width", [(1, 5), (3, 17), (64, 49152), (0, 8)])
def test_logsumexp_matches_spec(rows, width):
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((rows, width)) * 8).astype(np.float32)
    if rows:
        x[0, 0] = 60.0                                   # one dominant logit
    got = elementwise.logsumexp(x)
    assert got.shape == (rows,) and got.dtype == np.float32
    if rows:
        np.testing.assert_allclose(got, spec.logsumexp(x), rtol=1e-6, atol=1e-5)
