"""The CUDA tier: ``KernelOps`` (``kernels/ops.py``), launched from CUDA C sources.

The host-side logic (which kernel, what grid, which partitions) lives in ``CudaOps``
and is independent of where the kernels run: on a GPU the launchers come from
``cupy.RawModule`` and arrays are CuPy arrays; in tests the launchers come from the
CPU harness (``kernels/cuda_harness.py``) and arrays are NumPy arrays, so this very
code runs in CI. Block copies (copy-on-write, swapping) are Numba CUDA kernels
(``kernels/block_copy.py``) on the GPU and NumPy slices in the harness.

Three activation types, each with its own entry point of every kernel (``_f32``, ``_f16``,
``_bf16``), chosen by the arrays' dtype: float32, float16 and bfloat16. NumPy has no bfloat16;
``ml_dtypes.bfloat16`` is the dtype, in NumPy arrays (the harness) and in CuPy's, which take it
from CuPy 14 on (``engine/backend.py`` chooses it on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from .kv_quant import K_SCALE_CONSTANT, KV_FLOAT, V_SCALE_CONSTANT
from .layout import AttentionMetadata, BlockBounds, KVQuant
from .ops import ModelWeights

try:   # bfloat16 as a NumPy (and CuPy 14) dtype; without ml_dtypes, float32 and float16 only
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None

KERNEL_DIR = Path(__file__).parent
SOURCES = ("cache_ops.cu", "paged_attention.cu", "paged_prefill.cu", "fused.cu")
# the entry point of each activation type: paged_decode_f32, paged_decode_f16, paged_decode_bf16, ...
SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BFLOAT16: "bf16"}

NUM_WARPS = 4            # must match common.cuh
GROUP_MAX = 8            # query heads a decode thread block serves at most (common.cuh)
QUERY_TILE = 16          # must match paged_prefill.cu
PARTITION_SIZE = 512     # split-K partition, a multiple of every block size (<= 256)
SPLIT_K_ABOVE = 1024     # contexts longer than this use the split-K decode kernel
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class CudaAttentionPlan:
    meta: AttentionMetadata
    decode_only: bool        # every sequence has one query: the decode kernel
    num_partitions: int      # > 1: split-K decode, merged by the reduce kernel
    tiles: object            # (W, 2) int64 (sequence, first query row) for the prefill kernel
    scratch: dict = field(default_factory=dict)   # the split-K partials, allocated once a step


def decode_group_width(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads a decode thread block serves, thread blocks per KV head): the whole GQA group
    at once, in a kernel compiled for 1, 4 or GROUP_MAX heads; a group larger than GROUP_MAX in
    several thread blocks (each reads the KV head again)."""
    group = num_heads // num_kv_heads
    width = 1 if group == 1 else 4 if group <= 4 else GROUP_MAX
    return width, -(-group // width)


class CudaOps:
    """The CUDA tier of ``KernelOps`` (``kernels/ops.py``): ``prepare``, ``plan_step``, ``linear``,
    ``rms_norm``, ``rotary``, ``silu_and_mul``, ``write_kv``, ``calibrate_kv_scales``,
    ``paged_attention``, ``swap_blocks``, ``copy_blocks``; ``decode_step`` always declines."""

    name = "cuda"

    def __init__(self, xp, kernels, block_copy=None, split_k_above: int = SPLIT_K_ABOVE,
                 partition_size: int = PARTITION_SIZE) -> None:
        """``split_k_above``: decodes of longer contexts split into ``partition_size``-position
        partitions (a multiple of every block size), merged by the reduce kernel."""
        if not (isinstance(partition_size, int) and partition_size > 0 and partition_size & (partition_size - 1) == 0):
            raise ValueError(f"partition_size must be a power of two, got {partition_size!r}")
        if not (isinstance(split_k_above, int) and split_k_above >= 0):
            raise ValueError(f"split_k_above must be an integer >= 0, got {split_k_above!r}")
        self.xp = xp                 # cupy on a GPU, numpy in the CPU harness
        self._kernels = kernels      # name -> launcher(grid, block, args)
        self._block_copy = block_copy
        self.split_k_above, self.partition_size = split_k_above, partition_size
        self._none = xp.ones(1, np.float32)   # what a float cache passes for its scales
        self._no_choice = xp.zeros(1, np.uint8)   # ... and dense attention for its chosen blocks

    def _launch(self, name: str, dtype, grid, block, args) -> None:
        # CuPy launches one block for a zero grid dimension (and a 0-size array's pointer is
        # NULL): callers skip empty work instead.
        assert min(grid) >= 1, f"{name}: empty grid {grid}"
        self._kernels[f"{name}_{SUFFIX[np.dtype(dtype)]}"](tuple(grid), tuple(block), args)

    def _compute_dtype(self, cache, x):
        """The kernels' activation type: a float cache's own; with a compressed cache, x's."""
        return cache.dtype if cache.dtype.kind == "f" else np.dtype(x.dtype)

    # ------------------------------------------------------------------ KV writes
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, quant: KVQuant | None = None,
                 bounds: BlockBounds | None = None) -> None:
        """Scatter k, v (T, kv_heads, head_dim) into the caches at slot_mapping (T,); with
        ``quant``, as int8 / fp8 bytes (int8's per-token scales into quant.k_scale / v_scale);
        with ``bounds``, widening each written block's key [min, max] (block-sparse attention)."""
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        xp = self.xp
        dtype = self._compute_dtype(k_cache, k)
        (k, k_stride), (v, v_stride) = self._rows(k, dtype), self._rows(v, dtype)
        slots = xp.ascontiguousarray(slot_mapping, dtype=np.int64)
        block_size = k_cache.shape[2]
        if bounds is not None:
            row = num_kv_heads * head_dim
            self._launch("update_key_bounds", dtype, (num_tokens, -(-row // 128)), (128,), [
                k, slots, bounds.key_min, bounds.key_max, np.int32(num_tokens), np.int32(num_kv_heads),
                np.int32(head_dim), np.int32(block_size), k_stride])
        fmt, k_scale, v_scale = self._scales(quant)
        self._launch("write_kv", dtype, (num_tokens,), (128,), [
            k, v, k_cache, v_cache, k_scale, v_scale, slots, np.int32(num_kv_heads), np.int32(head_dim),
            np.int32(block_size), np.int32(fmt), k_stride, v_stride])

    def _rows(self, x, dtype):
        """x (T, heads, D) as the kernels read it, and the stride between its rows (elements): a
        view whose rows lie a stride apart (q, k or v cut from the fused qkv output: (T, heads, D)
        of a (T, q + 2kv) matrix) as it is, with no copy; anything else as a contiguous copy."""
        item = np.dtype(dtype).itemsize
        _, heads, dim = x.shape
        if (x.dtype == dtype and x.strides[2] == item and x.strides[1] == dim * item
                and x.strides[0] % item == 0 and x.strides[0] >= heads * dim * item):
            return x, np.int32(x.strides[0] // item)
        return self.xp.ascontiguousarray(x, dtype=dtype), np.int32(heads * dim)

    def _scales(self, quant: KVQuant | None):
        """(format, K scales, V scales) as the kernels take them."""
        if quant is None:
            return KV_FLOAT, self._none, self._none
        return quant.fmt, quant.k_scale, quant.v_scale

    def calibrate_kv_scales(self, k, v, quant: KVQuant) -> None:
        """fp8's calculate_kv_scales, on the device (the CPU tiers' rule): the layer's scales
        are max|k| / K_SCALE_CONSTANT and max|v| / V_SCALE_CONSTANT, 1.0 where all are 0."""
        xp = self.xp
        for x, scale, constant in ((k, quant.k_scale, K_SCALE_CONSTANT), (v, quant.v_scale, V_SCALE_CONSTANT)):
            top = xp.abs(x).max().astype(np.float64) if x.size else xp.zeros((), np.float64)
            scale[...] = xp.where(top > 0, top / constant, 1.0)   # no host round trip

    # ------------------------------------------------------------------ weights, a step
    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """The weights as they are: cuBLAS reads every linear weight in the checkpoint's layout,
        and every family's option (biases, q/k norms, a layer's window) is read where it is."""
        return weights

    def weight_bytes(self, weights: ModelWeights) -> int:
        return sum(int(a.nbytes) for a in weights.arrays())

    def plan_step(self, weights: ModelWeights, meta: AttentionMetadata, kv_cache) -> CudaAttentionPlan:
        """The step's attention plan. The block tables stay on the device: their ids are not read
        back to be checked here (the block manager hands out only ids of the pool)."""
        return self.plan_attention(meta)

    def decode_step(self, *args, **kwargs):
        """None: the GPU goes layer by layer (one launch a kernel)."""
        return None

    # ------------------------------------------------------------------ attention
    def plan_attention(self, meta: AttentionMetadata) -> CudaAttentionPlan:
        """How the attention kernels split this batch: decode, split-K decode, or prefill tiles."""
        decode_only = meta.max_query_len == 1
        parts = 1
        if decode_only and meta.max_seq_len > self.split_k_above:
            parts = -(-meta.max_seq_len // self.partition_size)
        tiles = None
        if not decode_only:
            host = meta.host_query_start_loc         # no device-to-host copy where the step kept it
            qsl = np.asarray(_to_numpy(meta.query_start_loc) if host is None else host, dtype=np.int64)
            q_lens = np.diff(qsl)
            counts = -(-q_lens // QUERY_TILE)
            seq = np.repeat(np.arange(len(q_lens)), counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            starts = qsl[seq] + (np.arange(len(seq)) - first) * QUERY_TILE
            tiles = self.xp.asarray(np.stack([seq, starts], axis=1).astype(np.int64))   # (W, 2)
        return CudaAttentionPlan(meta, decode_only, parts, tiles)

    def decode_partitions(self, plan: CudaAttentionPlan, window: int, block_size: int) -> int:
        """How many partitions the decode kernel splits each context into: the plan's, or with a
        sliding window only as many as the window's blocks span (paged_attention.cu), at most
        window + block_size - 1 positions from the block holding its first."""
        if window and plan.num_partitions > 1:
            return min(plan.num_partitions, -(-(window + block_size - 1) // self.partition_size))
        return plan.num_partitions

    def paged_attention(self, q, k_cache, v_cache, plan, scale: float, quant: KVQuant | None = None,
                        bounds: BlockBounds | None = None, window: int = 0):
        """Causal attention of q (T, heads, head_dim) through block tables -> (T, heads, head_dim).

        ``quant``: a compressed cache (int8 / fp8 bytes and their scales), widened as it is read.
        ``bounds``: block-sparse decode attention: a sequence whose one new token decodes reads
        only the ``bounds.keep`` blocks ``paged_select_blocks`` chooses per head.
        ``window`` > 0: a sliding window, the query at p reads p - window + 1 .. p; the table
        entries of blocks wholly before every query's window are never read (they may be -1)."""
        sparse = bounds is not None and bounds.keep > 0
        if sparse and window:
            raise ValueError("the CUDA kernels: block-sparse decode attention with a sliding window is not supported")
        if isinstance(plan, AttentionMetadata):
            plan = self.plan_attention(plan)
        xp, meta = self.xp, plan.meta
        num_tokens, num_heads, head_dim = q.shape
        assert head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} not supported"
        dtype = self._compute_dtype(k_cache, q)
        q, q_stride = self._rows(q, dtype)            # a view of the qkv output, read in place
        out = xp.empty(q.shape, dtype=dtype)
        num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
        tables = xp.ascontiguousarray(meta.block_tables, dtype=np.int32)
        seq_lens = xp.ascontiguousarray(meta.seq_lens, dtype=np.int32)
        qsl = xp.ascontiguousarray(meta.query_start_loc, dtype=np.int32)
        num_seqs, max_blocks = int(seq_lens.shape[0]), int(tables.shape[1])
        common = [np.int32(max_blocks), np.int32(num_kv_heads), np.int32(head_dim), np.int32(block_size)]
        fmt, k_scale, v_scale = self._scales(quant)
        chosen = self._no_choice
        if sparse:     # which blocks each decoding head reads: (S, heads, max_blocks) 0 / 1
            chosen = xp.zeros((num_seqs, num_heads, max_blocks), np.uint8)
            scores = xp.empty((num_seqs, num_heads, max_blocks), np.float32)   # (S, heads, max_blocks)
            self._launch("paged_select_blocks", dtype, (num_heads, num_seqs), (128,), [
                chosen, scores, q, bounds.key_min, bounds.key_max, tables, seq_lens, qsl, *common,
                np.int32(bounds.keep), q_stride, np.float32(scale)])
        if plan.decode_only:
            parts = self.decode_partitions(plan, window, block_size)
            if parts > 1 and self.partition_size % block_size:
                raise ValueError(f"split-K: partitions of {self.partition_size} positions do not hold whole "
                                 f"blocks of {block_size}")
            width, chunks = decode_group_width(num_heads, num_kv_heads)
            scratch = self._split_k_scratch(plan, num_seqs, num_heads, head_dim)
            self._launch("paged_decode", dtype, (num_kv_heads * chunks, num_seqs, parts), (NUM_WARPS * 32,),
                         [out, *scratch, q, k_cache, v_cache, k_scale, v_scale, chosen, tables, seq_lens,
                          np.int32(max_blocks), np.int32(num_heads), *common[1:],
                          np.int32(self.partition_size if parts > 1 else max(meta.max_seq_len, 1)),
                          np.int32(fmt), np.int32(sparse), np.int32(window), np.int32(width), q_stride,
                          np.float32(scale)])
            if parts > 1:
                self._launch("paged_decode_reduce", dtype, (num_heads, num_seqs), (128,),
                             [out, *scratch, np.int32(parts), np.int32(head_dim)])
            return out
        self._launch("paged_prefill", dtype, (plan.tiles.shape[0], num_heads), (NUM_WARPS * 32,),
                     [out, q, k_cache, v_cache, k_scale, v_scale, chosen, tables, seq_lens, qsl, plan.tiles,
                      *common, np.int32(fmt), np.int32(sparse), np.int32(window), q_stride, np.float32(scale)])
        return out

    def _split_k_scratch(self, plan: CudaAttentionPlan, num_seqs, num_heads, head_dim) -> list:
        """The split-K partials (S, heads, parts, head_dim) and their max and sum (S, heads, parts),
        allocated once a step, at the first layer that needs them, and reused by every other (a
        layer with a window may launch fewer partitions: it uses the front of the same memory)."""
        parts = plan.num_partitions
        key = (num_seqs, num_heads, parts, head_dim)
        if plan.scratch.get("key") != key:
            xp = self.xp
            plan.scratch.update(key=key, arrays=[xp.empty(num_seqs * num_heads * parts * head_dim, np.float32),
                                                 xp.empty(num_seqs * num_heads * parts, np.float32),
                                                 xp.empty(num_seqs * num_heads * parts, np.float32)])
        return plan.scratch["arrays"]

    # ------------------------------------------------------------------ matrix products
    def linear(self, x, w, plan=None):
        """x (T, in) times w (out, in) -> x @ w.T, (T, out): cuBLAS through CuPy, which reads
        the transposed view in place (NumPy's BLAS in the harness). In bfloat16, CuPy calls
        cuBLAS's gemmEx with bf16 inputs and float32 accumulation, rounding the output once; the
        harness does the same through float32 (NumPy's own bf16 product is a slow scalar loop)."""
        if self.xp is np and x.dtype == BFLOAT16:
            return (x.astype(np.float32) @ w.astype(np.float32).T).astype(BFLOAT16)
        return x @ w.T

    # ------------------------------------------------------------------ fused elementwise
    def rms_norm(self, x, weight, eps: float):
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty_like(x)
        if x.shape[0] == 0:
            return out
        self._launch("rms_norm", x.dtype, (x.shape[0],), (128,),
                     [out, x, self.xp.ascontiguousarray(weight, dtype=x.dtype), np.int32(x.shape[1]),
                      np.float32(eps)])
        return out

    def rotary(self, x, positions, cos, sin):
        """In place (``KernelOps.rotary``): q and k, views of the fused qkv output, are rotated
        where they lie, rows a stride apart, and returned; anything else is copied first."""
        out, stride = self._rows(x, x.dtype)
        tokens, heads, head_dim = out.shape
        n = tokens * heads * head_dim // 2
        if n == 0:
            return out
        self._launch("rotary", out.dtype, (-(-n // 256),), (256,),
                     [out, self.xp.ascontiguousarray(positions, dtype=np.int64),
                      self.xp.ascontiguousarray(cos, dtype=np.float32),
                      self.xp.ascontiguousarray(sin, dtype=np.float32),
                      np.int32(tokens), np.int32(heads), np.int32(head_dim), stride])
        return out

    def silu_and_mul(self, gate_up):
        gate_up = self.xp.ascontiguousarray(gate_up)
        tokens, ffn = gate_up.shape[0], gate_up.shape[1] // 2
        out = self.xp.empty((tokens, ffn), dtype=gate_up.dtype)
        if tokens * ffn == 0:
            return out
        self._launch("silu_and_mul", gate_up.dtype, (-(-tokens * ffn // 256),), (256,),
                     [out, gate_up, np.int32(tokens), np.int32(ffn)])
        return out

    # ------------------------------------------------------------------ block copies
    def swap_blocks(self, src, dst, block_mapping) -> None:
        if len(block_mapping):
            # Numba has no bfloat16; a copy moves bits: 16-bit words (the pinned swap pool of a
            # bfloat16 pool is kept as its uint16 bits already, cache_engine._pinned)
            src = src.view(np.uint16) if src.dtype == BFLOAT16 else src
            dst = dst.view(np.uint16) if dst.dtype == BFLOAT16 else dst
            self._block_copy.swap_blocks(src, dst, np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2))

    def copy_blocks(self, kv_cache, block_mapping) -> None:
        self.swap_blocks(kv_cache, kv_cache, block_mapping)

    def block_copy_problem(self) -> str | None:
        """Why copy-on-write and swapping cannot run on this backend (Numba CUDA missing), or None."""
        problem = getattr(self._block_copy, "problem", None)
        return problem() if problem is not None else None


def _to_numpy(array):
    return array.get() if hasattr(array, "get") else array


def kernel_sources() -> dict[str, str]:
    return {name: (KERNEL_DIR / name).read_text() for name in SOURCES}


def cpu_harness_ops(**split_k) -> CudaOps:
    """CudaOps whose kernels run on the CPU (tests): the same host code, NumPy arrays.
    ``split_k``: CudaOps's split_k_above and partition_size (small ones test split-K on short contexts)."""
    from . import cuda_harness  # noqa: PLC0415
    from .reference import swap_blocks as numpy_swap  # noqa: PLC0415

    kernels = {}
    for name in SOURCES:
        lib = cuda_harness.load(KERNEL_DIR / name)
        for kernel in lib.signatures:
            kernels[kernel] = getattr(lib, kernel)

    class NumpyCopy:
        @staticmethod
        def swap_blocks(src, dst, mapping):
            numpy_swap(src, dst, mapping)

    return CudaOps(np, kernels, NumpyCopy(), **split_k)


NUMBA_CUDA_HINT = ("the numba-cuda package: pip install 'minipaged[gpu]' (CUDA 13) or 'minipaged[gpu-cu12]' "
                   "(CUDA 12); on a toolkit install, set CUDA_HOME")


class NumbaCudaCopies:
    """The block copies of ``kernels/block_copy.py`` (Numba CUDA), imported at the first copy.

    The CuPy kernels need no Numba: attention, KV writes and the rest run without it. Only
    copy-on-write and swapping (a DMA engine, in OS terms) do; ``problem()`` says why they
    cannot run here, and a copy without Numba CUDA raises that as a RuntimeError."""

    def __init__(self) -> None:
        self._module = None
        self._error: str | None = None

    def problem(self) -> str | None:
        """None if Numba CUDA's copies load; else why not, and what to install."""
        if self._module is None and self._error is None:
            try:
                from . import block_copy  # noqa: PLC0415 (imports numba.cuda)

                self._module = block_copy
            except Exception as err:  # noqa: BLE001 (any failure to load is the same answer)
                self._error = (f"copy-on-write and swapping on a GPU need Numba CUDA ({NUMBA_CUDA_HINT}), "
                               f"which did not load: {type(err).__name__}: {err}")
        return self._error

    def swap_blocks(self, src, dst, mapping) -> None:
        if self.problem() is not None:
            raise RuntimeError(self._error)
        self._module.swap_blocks(src, dst, mapping)


@lru_cache(maxsize=None)
def gpu_ops() -> CudaOps:
    """CudaOps on the current GPU: every .cu file compiled once per process by NVRTC via CuPy.
    Numba CUDA is not imported here: only the block copies need it (``NumbaCudaCopies``)."""
    import cupy  # noqa: PLC0415

    from .cuda_harness import kernel_signatures  # noqa: PLC0415

    # The shared header is pasted in: CuPy's compile cache is keyed by the source text, so
    # an edited header must change it.
    common = (KERNEL_DIR / "common.cuh").read_text()
    nvrtc_major = cupy.cuda.runtime.runtimeGetVersion() // 1000   # CuPy's NVRTC is this CUDA's
    options = ("-std=c++17", *(f"-I{d}" for d in cuda_include_dirs(nvrtc_major)))
    kernels = {}
    for source in kernel_sources().values():
        module = cupy.RawModule(code=source.replace('#include "common.cuh"', common), options=options)
        for kernel in kernel_signatures(source):
            kernels[kernel] = module.get_function(kernel)
    return CudaOps(cupy, kernels, NumbaCudaCopies())


def cuda_include_dirs(major: int | None = None) -> list[str]:
    """Where cuda_fp16.h, cuda_bf16.h, cuda_fp8.h and the vector types they include may be (CuPy
    no longer bundles them).

    A toolkit first ($CUDA_PATH, $CUDA_HOME, /usr/local/cuda), then the pip wheels'
    headers: CUDA 12's runtime wheel (``nvidia/cuda_runtime/include``) and CUDA 13's
    (``nvidia/cu13/include``). With ``major`` (NVRTC's major version), only wheel headers
    of that version are taken: headers of another major version may not compile.
    """
    import os  # noqa: PLC0415

    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    dirs = [os.path.join(root, "include") for root in roots if root]
    try:
        import nvidia  # noqa: PLC0415 (the namespace package of NVIDIA's wheels)

        for base in nvidia.__path__:
            for version, folder in ((13, ("cu13", "include")), (12, ("cuda_runtime", "include"))):
                if major is None or major == version:
                    dirs.append(os.path.join(base, *folder))
    except ImportError:
        pass
    found = []
    for d in dirs:   # the headers the kernels include (cuda_fp8.h since CUDA 11.8)
        if all(os.path.exists(os.path.join(d, h)) for h in ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h")) \
                and d not in found:
            found.append(d)
    return found
