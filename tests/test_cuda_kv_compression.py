"""The CUDA C kernels of the compressed KV cache (int8, fp8 e4m3, fp8 e5m2) and of block-sparse
decode attention, on the CPU harness, against the NumPy specs and ml_dtypes: quantizing writes
(float, half and bfloat16 input), attention over byte blocks (decode, split-K, prefill, mixed batches;
shuffled tables, partial blocks), the key bounds, the block choice, and the model end to end
against the Numba kernels. NVRTC compiles the same sources (tests/test_cuda_kernels.py);
tests/test_gpu.py repeats the checks on a device."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels import cuda, kv_quant
from minipaged.kernels.fast import kv_write
from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels import reference as spec
from minipaged.kernels.kv_quant import KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8
from minipaged.kernels.layout import AttentionMetadata, BlockBounds, KVQuant
from test_cuda_kernels import random_batch

FORMATS = [KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2]
FP8 = {KV_FP8_E4M3: ml_dtypes.float8_e4m3fn, KV_FP8_E5M2: ml_dtypes.float8_e5m2}


@pytest.fixture(scope="module")
def ops():
    return cuda.cpu_harness_ops()


def empty_pool(fmt, shape, layer_scale=1.0):
    """One layer's byte caches and scales, as the cache engine makes them."""
    storage = kv_quant.STORAGE_DTYPE[fmt]
    caches = [np.zeros(shape, storage), np.zeros(shape, storage)]
    scales = ([np.zeros(shape[:3], np.float32) for _ in range(2)] if fmt == KV_INT8
              else [np.full((1, 1, 1), layer_scale, np.float32) for _ in range(2)])
    return caches, KVQuant(fmt, *scales)


def tokens_of(cache):
    """(num_blocks, heads, block_size, D) -> every slot's row, in slot order: (slots, heads, D)."""
    return cache.transpose(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])


@pytest.mark.parametrize("fmt", [KV_FP8_E4M3, KV_FP8_E5M2])
def test_the_harness_narrows_fp8_as_ml_dtypes_does(ops, fmt):
    """The shim's __nv_cvt_float_to_fp8 (through write_kv): every exact value, every midpoint
    between neighbours (ties to even), random magnitudes and values past the largest (saturated)."""
    dtype = FP8[fmt]
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    exact = np.unique(values[np.isfinite(values)])
    rng = np.random.default_rng(fmt)
    x = np.concatenate([exact, (exact[:-1] + exact[1:]) / 2, [0.0, -0.0, 1e9, -1e9]]
                       + [rng.standard_normal(512) * s for s in (1e-3, 1, 100, 1e5)]).astype(np.float32)
    x = x[: len(x) // 32 * 32].reshape(-1, 1, 32)                  # tokens of one head, head_dim 32
    (kc, vc), quant = empty_pool(fmt, (len(x), 1, 1, 32))
    ops.write_kv(kc, vc, x, x, np.arange(len(x), dtype=np.int64), quant)
    largest = float(np.finfo(dtype).max)
    want = np.clip(x, -largest, largest).astype(dtype).view(np.uint8)
    got, want = kc[:, 0, 0, :], want[:, 0, :]                      # (tokens, 32) bytes
    wrong = got != want
    assert not wrong.any(), (x[:, 0][wrong][:5], got[wrong][:5], want[wrong][:5])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_quantizes_as_the_spec_says(ops, fmt, dtype):
    rng = np.random.default_rng(fmt)
    block_size, heads, head_dim, num_tokens = 4, 3, 16, 11
    num_blocks = -(-num_tokens // block_size) + 2
    k = (rng.standard_normal((num_tokens, heads, head_dim)) * 3).astype(dtype)
    v = rng.standard_normal((num_tokens, heads, head_dim)).astype(dtype)
    k[0, 0] = 0                                             # an all-zero head: scale 0, codes 0
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    slots[1] = -1                                           # a token not written
    layer_scale = rng.uniform(0.5, 2)                       # fp8: a scale other than 1 is used
    (kc, vc), quant = empty_pool(fmt, (num_blocks, heads, block_size, head_dim), layer_scale)
    (ekc, evc), want = empty_pool(fmt, (num_blocks, heads, block_size, head_dim), layer_scale)
    ops.write_kv(kc, vc, k, v, slots, quant)
    spec.write_kv(ekc, evc, k.astype(np.float32), v.astype(np.float32), slots, want)
    np.testing.assert_array_equal(kc, ekc)
    np.testing.assert_array_equal(vc, evc)
    np.testing.assert_array_equal(quant.k_scale, want.k_scale)
    np.testing.assert_array_equal(quant.v_scale, want.v_scale)


def compressed(rng, fmt, k_float, v_float):
    """Every slot of a random float pool written through the spec's quantizer; returns the
    byte caches, their quant, and the dequantized caches the dense spec reads."""
    (kc, vc), quant = empty_pool(fmt, k_float.shape, rng.uniform(0.02, 0.05))
    spec.write_kv(kc, vc, tokens_of(k_float), tokens_of(v_float),
                  np.arange(k_float.shape[0] * k_float.shape[2], dtype=np.int64), quant)
    return kc, vc, quant, spec.dequantize_kv(kc, fmt, quant.k_scale), spec.dequantize_kv(vc, fmt, quant.v_scale)


@st.composite
def quant_cases(draw):
    seqs = []
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    for _ in range(draw(st.integers(1, 3))):
        seq_len = draw(st.integers(1, 60))
        q_len = {"decode": 1, "prefill": seq_len}.get(kind) or draw(st.sampled_from([1, seq_len, 1 + seq_len // 2]))
        seqs.append((min(q_len, seq_len), seq_len))
    num_kv_heads = draw(st.integers(1, 2))
    shape = dict(block_size=draw(st.sampled_from([1, 4, 16])), num_kv_heads=num_kv_heads,
                 num_heads=num_kv_heads * draw(st.sampled_from([1, 3])), head_dim=draw(st.sampled_from([16, 64])),
                 seqs=seqs)
    return draw(st.sampled_from(FORMATS)), shape, draw(st.integers(0, 2**31))


@settings(max_examples=12, deadline=None)
@given(quant_cases())
def test_attention_over_compressed_blocks_matches_the_spec(ops, case):
    fmt, shape, seed = case
    rng = np.random.default_rng(seed)
    q, k_float, v_float, meta = random_batch(rng, **shape)
    kc, vc, quant, kd, vd = compressed(rng, fmt, k_float, v_float)
    got = ops.paged_attention(q, kc, vc, meta, 0.2, quant)
    want = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_and_half_precision_over_compressed_blocks(ops, fmt):
    """Long contexts cut into partitions, merged by the reduce kernel; half-precision queries
    (as on a GPU) over the same bytes; a prefill in half precision too."""
    ops = cuda.cpu_harness_ops(split_k_above=40, partition_size=32)
    rng = np.random.default_rng(fmt)
    q, k_float, v_float, meta = random_batch(rng, block_size=8, num_heads=2, num_kv_heads=1, head_dim=64,
                                             seqs=[(1, 150), (1, 3), (1, 64)])
    kc, vc, quant, kd, vd = compressed(rng, fmt, k_float, v_float)
    assert ops.plan_attention(meta).num_partitions == 5
    want = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2)
    np.testing.assert_allclose(ops.paged_attention(q, kc, vc, meta, 0.2, quant), want, atol=3e-5, rtol=1e-4)
    half = ops.paged_attention(q.astype(np.float16), kc, vc, meta, 0.2, quant)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half.astype(np.float32), want, atol=3e-3, rtol=3e-3)
    q, k_float, v_float, meta = random_batch(rng, block_size=8, num_heads=2, num_kv_heads=1, head_dim=64,
                                             seqs=[(20, 40), (9, 9)])
    kc, vc, quant, kd, vd = compressed(rng, fmt, k_float, v_float)
    want = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2)
    half = ops.paged_attention(q.astype(np.float16), kc, vc, meta, 0.2, quant)
    np.testing.assert_allclose(half.astype(np.float32), want, atol=3e-3, rtol=3e-3)


def test_calibrate_sets_the_layer_scales_as_the_cpu_does(ops):
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((7, 2, 16)).astype(np.float32) * s for s in (5, 2))
    got = KVQuant(KV_FP8_E4M3, np.ones((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32))
    want = KVQuant(KV_FP8_E4M3, np.ones((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32))
    ops.calibrate_kv_scales(k, v, got)
    spec.calibrate_kv_scales(k, v, want)
    np.testing.assert_array_equal(got.k_scale, want.k_scale)
    np.testing.assert_array_equal(got.v_scale, want.v_scale)


# ---------------------------------------------------------------- block-sparse decode attention


def bounded_pool(ops, rng, k_float, v_float, fmt=None):
    """Every slot written through the harness's write_kv, keeping the key bounds."""
    num_blocks, num_kv_heads, block_size, head_dim = k_float.shape
    key_min = np.zeros((num_blocks, num_kv_heads, head_dim), np.float32)
    key_max = np.zeros_like(key_min)
    quant = None
    kc, vc = np.zeros_like(k_float), np.zeros_like(v_float)
    if fmt is not None:
        (kc, vc), quant = empty_pool(fmt, k_float.shape, 0.03)
    ops.write_kv(kc, vc, tokens_of(k_float), tokens_of(v_float), np.arange(num_blocks * block_size, dtype=np.int64),
                 quant, BlockBounds(key_min, key_max, 0))
    kd = kc if fmt is None else spec.dequantize_kv(kc, fmt, quant.k_scale)
    vd = vc if fmt is None else spec.dequantize_kv(vc, fmt, quant.v_scale)
    return kc, vc, quant, key_min, key_max, kd, vd


def test_write_kv_keeps_each_blocks_key_bounds(ops):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 2, 4, 8)).astype(np.float32)
    kc, _, _, key_min, key_max, _, _ = bounded_pool(ops, rng, k, k.copy())
    want_min, want_max = spec.key_bounds(k)
    np.testing.assert_array_equal(key_min, want_min)
    np.testing.assert_array_equal(key_max, want_max)
    new = rng.standard_normal((2, 2, 8)).astype(np.float32) * 0.01   # block 2 written again: forgotten
    ops.write_kv(kc, kc.copy(), new, new, np.array([8, 9], np.int64), None, BlockBounds(key_min, key_max, 0))
    np.testing.assert_array_equal(key_min[2], np.minimum(new[0], new[1]))
    np.testing.assert_array_equal(key_max[2], np.maximum(new[0], new[1]))


@st.composite
def sparse_cases(draw):
    num_kv_heads = draw(st.integers(1, 2))
    return dict(block_size=draw(st.sampled_from([1, 4, 8])), num_kv_heads=num_kv_heads,
                num_heads=num_kv_heads * draw(st.sampled_from([1, 3])),
                seq_lens=draw(st.lists(st.integers(1, 90), min_size=1, max_size=3)),
                keep=draw(st.integers(2, 6)), fmt=draw(st.sampled_from([None, KV_INT8, KV_FP8_E4M3])),
                with_prompt=draw(st.booleans()), seed=draw(st.integers(0, 2**31)))


@settings(max_examples=12, deadline=None)
@given(sparse_cases())
def test_sparse_decode_matches_the_spec(ops, case):
    """Decoding heads read the blocks the spec chooses (decode kernel; with a prompt in the
    batch, the prefill kernel), the prompt stays dense."""
    rng = np.random.default_rng(case["seed"])
    seqs = [(1, n) for n in case["seq_lens"]] + ([(12, 12)] if case["with_prompt"] else [])
    q, k_float, v_float, meta = random_batch(rng, block_size=case["block_size"], num_heads=case["num_heads"],
                                             num_kv_heads=case["num_kv_heads"], head_dim=16, seqs=seqs)
    kc, vc, quant, key_min, key_max, kd, vd = bounded_pool(ops, rng, k_float, v_float, case["fmt"])
    keep, decodes = case["keep"], len(case["seq_lens"])
    got = ops.paged_attention(q, kc, vc, meta, 0.25, quant, BlockBounds(key_min, key_max, keep))
    want = spec.sparse_decode_attention(q[:decodes], kd, vd, key_min, key_max, meta.block_tables[:decodes],
                                        meta.seq_lens[:decodes], 0.25, keep * case["block_size"])
    np.testing.assert_allclose(got[:decodes], want, atol=3e-5, rtol=1e-4)
    dense = spec.paged_attention(q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    np.testing.assert_allclose(got[decodes:], dense[decodes:], atol=3e-5, rtol=1e-4)


def test_a_covering_budget_is_dense_attention_exactly_and_split_k_keeps_the_choice(ops):
    rng = np.random.default_rng(3)
    q, k_float, v_float, meta = random_batch(rng, block_size=16, num_heads=6, num_kv_heads=2, head_dim=64,
                                             seqs=[(1, 200), (1, 37), (1, 16)])
    kc, vc, _, key_min, key_max, _, _ = bounded_pool(ops, rng, k_float, v_float)
    dense = ops.paged_attention(q, kc, vc, meta, 0.125)
    covering = ops.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 13))
    np.testing.assert_array_equal(covering, dense)
    sparse = ops.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 4))
    assert not np.array_equal(sparse[0], dense[0])              # 200 tokens in 13 blocks: 4 kept
    np.testing.assert_array_equal(sparse[1:], dense[1:])        # 3 and 1 blocks: all kept
    ops = cuda.cpu_harness_ops(split_k_above=40, partition_size=64)               # the same choice across partitions
    assert ops.plan_attention(meta).num_partitions == 4
    split = ops.paged_attention(q, kc, vc, meta, 0.125, None, BlockBounds(key_min, key_max, 4))
    np.testing.assert_allclose(split, sparse, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------- the model end to end


class LockStep:
    """The ``ops`` of a LlamaModel whose every kernel runs twice on the same inputs: on the CUDA
    harness and as the Numba kernel. The CUDA side's result is checked against the Numba one's,
    and the Numba one's goes on, so each layer's CUDA kernels meet exactly the inputs the Numba
    kernels met. (Two free runs do not: an ulp of difference upstream, their own norms' sums
    in another order, puts a K value on the other side of an fp8 rounding boundary, and through
    the next layer's calibrated scale moves every code after it.) The KV writes go to copies of
    the pools, scales and bounds, compared byte for byte with the Numba kernels' writes."""

    xp = np
    name = "lock-step"

    def __init__(self, cuda_ops):
        self.cuda = cuda_ops
        self.fast = FastOps()
        self.checked = {}                            # kernel name -> calls checked

    def _seen(self, name):
        self.checked[name] = self.checked.get(name, 0) + 1

    def prepare(self, weights):
        return self.fast.prepare(weights)            # the fast tier's copies; the CUDA side reads .weight

    def weight_bytes(self, weights):
        return self.fast.weight_bytes(weights)

    def decode_step(self, *args, **kwargs):
        return None                                  # layer by layer: every kernel checked

    def linear(self, x, w, plan=None):
        want = self.fast.linear(x, w, plan[0])
        np.testing.assert_allclose(self.cuda.linear(x, w.weight), want, rtol=1e-4, atol=1e-4 * np.sqrt(w.shape[1]))
        self._seen("linear")
        return want

    def _same(self, name, *args):
        want = getattr(self.fast, name)(*args)
        np.testing.assert_allclose(getattr(self.cuda, name)(*args), want, rtol=1e-5, atol=1e-5)
        self._seen(name)
        return want

    def rms_norm(self, x, weight, eps):
        return self._same("rms_norm", x, weight, eps)

    def rotary(self, x, positions, cos, sin):
        return self._same("rotary", x, positions, cos, sin)

    def silu_and_mul(self, gate_up):
        return self._same("silu_and_mul", gate_up)

    def plan_step(self, weights, meta, kv_cache):
        return self.fast.plan_step(weights, meta, kv_cache), self.cuda.plan_step(weights, meta, kv_cache)

    @staticmethod
    def _copies(quant, bounds):
        """The CUDA side's own scales and bounds, equal to the Numba side's before the call."""
        quant = quant and KVQuant(quant.fmt, quant.k_scale.copy(), quant.v_scale.copy(), quant.calibrate)
        bounds = bounds and BlockBounds(bounds.key_min.copy(), bounds.key_max.copy(), bounds.keep)
        return quant, bounds

    def calibrate_kv_scales(self, k, v, quant):
        theirs, _ = self._copies(quant, None)
        self.cuda.calibrate_kv_scales(k, v, theirs)
        kv_write.calibrate_kv_scales(k, v, quant)
        np.testing.assert_allclose(theirs.k_scale, quant.k_scale, rtol=1e-6)
        np.testing.assert_allclose(theirs.v_scale, quant.v_scale, rtol=1e-6)
        self._seen("calibrate_kv_scales")

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, quant=None, bounds=None):
        caches = k_cache.copy(), v_cache.copy()
        theirs, their_bounds = self._copies(quant, bounds)
        self.cuda.write_kv(*caches, k, v, slot_mapping, theirs, their_bounds)
        kv_write.write_kv(k_cache, v_cache, k, v, slot_mapping, quant, bounds)
        np.testing.assert_array_equal(caches[0], k_cache)          # the same bytes
        np.testing.assert_array_equal(caches[1], v_cache)
        if quant is not None:
            np.testing.assert_allclose(theirs.k_scale, quant.k_scale, rtol=1e-6)
            np.testing.assert_allclose(theirs.v_scale, quant.v_scale, rtol=1e-6)
        if bounds is not None:
            np.testing.assert_array_equal(their_bounds.key_min, bounds.key_min)
            np.testing.assert_array_equal(their_bounds.key_max, bounds.key_max)
        self._seen("write_kv")

    def paged_attention(self, q, k_cache, v_cache, plan, scale, quant=None, bounds=None, window=0):
        ours, theirs = plan
        want = self.fast.paged_attention(q, k_cache, v_cache, ours, scale, quant, bounds, window)
        got = self.cuda.paged_attention(q, k_cache, v_cache, theirs, scale, quant, bounds, window)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        self._seen("paged_attention")
        return want


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_model_over_compressed_blocks_through_the_cuda_kernels(tiny_model_dir, ops, kv_cache_dtype):
    """A prefill then decodes of the tiny model over int8 / fp8 blocks with sparse key bounds, every
    kernel run on the CUDA harness and as the Numba kernel in lock step (``LockStep``): the same
    bytes, scales and bounds written, and the same attention, norms, rotations and products, layer
    after layer, as the model really calls them (the Numba kernels meet the specs in the CPU tests)."""
    from minipaged.kernels.layout import kv_cache_shape
    from minipaged.model.config import LlamaConfig
    from minipaged.model.llama import LlamaModel
    from minipaged.model.weights import load_checkpoint

    config = LlamaConfig.from_dir(tiny_model_dir)
    fmt = kv_quant.kv_format(kv_cache_dtype)
    layers, heads, dim, block_size = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4
    ids = [5, 77, 31, 200, 9, 14, 150, 3, 99, 41, 8]
    table = np.array([[3, 0, 5]], dtype=np.int32)
    slots = np.array([table[0, p // block_size] * block_size + p % block_size for p in range(len(ids))])
    lock_step = LockStep(ops)
    model = LlamaModel(config, load_checkpoint(tiny_model_dir), lock_step)
    kv = np.zeros(kv_cache_shape(layers, 6, heads, block_size, dim), kv_quant.STORAGE_DTYPE[fmt])
    scales = (np.zeros((layers, 2, 6, heads, block_size), np.float32) if fmt == KV_INT8
              else np.ones((layers, 2, 1, 1, 1), np.float32))
    bounds = np.zeros((layers, 2, 6, heads, dim), np.float32)
    calibrate = [fmt != KV_INT8]
    quant = lambda i: KVQuant(fmt, scales[i, 0], scales[i, 1], calibrate[0])   # noqa: E731
    keep = lambda i: BlockBounds(bounds[i, 0], bounds[i, 1], 2)                # noqa: E731
    for first, last in ((0, 8), (8, 9), (9, 10), (10, 11)):   # a prompt, then decodes (sparse: 2 of 3 blocks)
        n = last - first
        meta = AttentionMetadata(slots[first:last], np.array([0, n], np.int32), np.array([last], np.int32),
                                 table, n, last)
        logits = model.forward(np.array(ids[first:last]), np.arange(first, last), kv, meta, np.arange(n),
                               quant, keep)
        assert logits.shape == (n, config.vocab_size) and np.isfinite(logits).all()
        calibrate[0] = False
    steps = 4 * layers
    assert lock_step.checked["write_kv"] == lock_step.checked["paged_attention"] == steps
    assert lock_step.checked.get("calibrate_kv_scales", 0) == (layers if fmt != KV_INT8 else 0)
    assert lock_step.checked["rms_norm"] == 4 * (2 * layers + 1) and lock_step.checked["rotary"] == 2 * steps
    assert (kv != 0).any() and (bounds != 0).any()            # the blocks and bounds were written
