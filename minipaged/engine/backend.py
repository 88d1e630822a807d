"""Backend: the one place that decides which hardware, and which tier of kernels, runs the model.

Everything above (block manager, scheduler, engine) is identical on every device and tier; it
only receives the ``KernelOps`` chosen here (``kernels/ops.py``): the CUDA tier on a GPU, else
the CPU tier ``EngineConfig.kernels`` names, "fast" (``kernels/fast/``) or "simple"
(``kernels/simple.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from dataclasses import dataclass

import numpy as np

from ..config import ConfigError
from ..kernels.fast.linear_paths import LinearPaths
from ..kernels.fast.tuning import DEFAULT_TUNING, FastTuning
from ..kernels.fast.thread_pools import settle_blas_threads, settle_numba_layer

logger = logging.getLogger("minipaged")


@dataclass(frozen=True)
class Backend:
    device: str        # "cpu" or "cuda"
    ops: object        # a KernelOps (kernels/ops.py): SimpleOps, FastOps or CudaOps
    dtype: np.dtype    # weights and KV cache
    gemm: object = None   # CPU: kernels.fast.packed_gemm.PackedGemm (oneMKL), where some kind of step uses it, or None
    cpu_gemm: str = "auto"   # what was asked for (auto, mkl, numba)
    # each kind of step's engine for the linear layers (kernels/linear_paths.py); None while
    # cpu_gemm="auto" with oneMKL installed has yet to measure them (engine/linear_calibration.py)
    linear_paths: LinearPaths | None = LinearPaths()
    # how the linear weights are stored (kernels/weight_formats.py): "float32", "bfloat16", "int8",
    # "gguf" (a GGUF file's own blocks, Q4_1 and Q8_0) or "gguf_a8" (those, x rounded to int8)
    weight_format: str = "float32"

    @property
    def xp(self):
        return self.ops.xp

    @property
    def kernels(self) -> str:
        """The tier that runs: "simple", "fast" or "cuda"."""
        return self.ops.name

    def block_copy_problem(self) -> str | None:
        """Why blocks cannot be copied here (copy-on-write, swapping), or None: on a GPU, the
        copies are Numba CUDA kernels, loaded apart from the CuPy ones (kernels/cuda.py)."""
        problem = getattr(self.ops, "block_copy_problem", None)
        return problem() if problem is not None else None

    def with_linear_paths(self, linear_paths: LinearPaths, gemm) -> Backend:
        """The same backend with each kind of step's engine settled (``engine/linear_calibration.py``)."""
        return dataclasses.replace(self, linear_paths=linear_paths, gemm=gemm,
                                   ops=self.ops.with_paths(linear_paths, gemm))


def without_block_copies(cache_config, copy_problem: str | None, preemption_mode: str):
    """``cache_config`` as it can be where blocks cannot be copied (``copy_problem``): without a
    swap space (a preempted request is then recomputed, with a warning), or a ConfigError if the
    preemption mode must swap. Requests that fork are refused as they come (input_processor)."""
    if copy_problem is None or cache_config.swap_space == 0:
        return cache_config
    if preemption_mode in ("swap", "partial"):
        raise ConfigError(f"preemption_mode={preemption_mode!r} swaps blocks out, but {copy_problem}; "
                          "or use preemption_mode='recompute'")
    logger.warning("%s; running without a swap space (swap_space=0): a preempted request is recomputed",
                   copy_problem)
    return dataclasses.replace(cache_config, swap_space=0)


def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency)
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # not installed, no driver, no device: all mean "no GPU"
        return False


def cupy_has_bfloat16() -> bool:
    """True when CuPy adds and multiplies ``ml_dtypes.bfloat16`` arrays (CuPy 14 on, with
    ml_dtypes and NumPy 2.1.2 or later); CuPy 13 has no bfloat16. Asked of CuPy itself, on a
    2 x 2 array: its bf16 support is new, and the version number alone does not promise it."""
    try:
        import cupy  # noqa: PLC0415

        from ..kernels.cuda import BFLOAT16  # noqa: PLC0415

        if BFLOAT16 is None:          # no ml_dtypes: no bfloat16 dtype to ask for
            return False
        x = cupy.ones((2, 2), dtype=BFLOAT16)
        return float(((x + x) @ x).astype(cupy.float32)[0, 0]) == 4.0
    except Exception:  # no ml_dtypes, an older CuPy, a bf16 header that does not compile: all mean "no"
        return False


def gpu_dtype(dtype: str, checkpoint_dtype: str = "float32", has_bfloat16=cupy_has_bfloat16) -> np.dtype:
    """The weights' and activations' type on a GPU (the KV cache's too, unless compressed).

    "float32" and "float16" are taken as they are; "bfloat16" needs CuPy's bfloat16
    (``has_bfloat16()``). "auto": bfloat16 where the checkpoint is bfloat16 (config.json's
    ``torch_dtype``), since such a model's activations may pass float16's largest value, 65504,
    which bfloat16's float-sized exponent holds; float16 otherwise (float16 keeps 3 more bits
    of each value). A bfloat16 checkpoint on a CuPy without bfloat16 runs in float32: its
    range, never float16's overflow."""
    if dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is not supported on a GPU; use 'auto', 'float32', 'float16' or 'bfloat16'")
    if dtype == "bfloat16" or (dtype == "auto" and checkpoint_dtype == "bfloat16"):
        from ..kernels.cuda import BFLOAT16  # noqa: PLC0415

        if has_bfloat16():
            return BFLOAT16
        if dtype == "bfloat16":
            raise ValueError("dtype='bfloat16' on a GPU needs CuPy 14 or later with ml_dtypes installed (CuPy's "
                             "bfloat16 arrays are ml_dtypes'); use dtype='float32', or 'float16' if the model's "
                             "activations stay within float16's range")
        logger.warning("this bfloat16 checkpoint runs in float32 on the GPU: CuPy has no bfloat16 here (CuPy 14 "
                       "with ml_dtypes has), and float16 may overflow where bfloat16 does not")
        return np.dtype(np.float32)
    return np.dtype(np.float32 if dtype == "float32" else np.float16)


def cpu_weight_format(dtype: str, quantization: str | None) -> str:
    """How the CPU stores the linear weights: ``--dtype bfloat16`` stores them in bfloat16,
    ``--quantization int8`` / ``gguf`` / ``gguf_a8`` in int8 or in a GGUF file's own blocks;
    activations and sums stay float32 (but gguf_a8's, ``kernels/weight_formats.py``)."""
    if quantization is not None:
        if dtype not in ("auto", "float32"):
            raise ValueError(f"dtype={dtype!r} and quantization={quantization!r} both choose how the weights are "
                             "stored; give one of them")
        return quantization
    if dtype == "float16":
        raise ValueError("dtype='float16' is not supported on the CPU: the CPU computes in float32 and stores the "
                         "weights in float32, bfloat16 (dtype='bfloat16') or fewer bytes (quantization='int8', "
                         "'gguf' or 'gguf_a8')")
    return "bfloat16" if dtype == "bfloat16" else "float32"


def select_backend(device: str, dtype: str, cpu_gemm: str = "auto", linear_paths: LinearPaths | None = None,
                   kernels: str = "fast", tuning: FastTuning = DEFAULT_TUNING,
                   checkpoint_dtype: str = "float32", quantization: str | None = None) -> Backend:
    """CUDA when asked for (or, with "auto", when CuPy sees a GPU), else the CPU, whose tier of
    kernels is ``kernels``: "fast" or "simple" (which multiplies with numpy's BLAS and has no use
    for oneMKL, linear paths or ``tuning``, the fast tier's switches). The fast tier's linear
    layers' engines: ``linear_paths`` when given (a worker elsewhere gets the driver's); else
    every step oneMKL's with ``cpu_gemm="mkl"``, ours with "numba" or without oneMKL installed,
    and, with "auto" and oneMKL installed, None: measured once the model is known
    (``engine/linear_calibration.py``). On a GPU, ``dtype`` and the checkpoint's
    ``checkpoint_dtype`` (config.json's ``torch_dtype``) choose float32, float16 or bfloat16
    (``gpu_dtype``); the CPU computes in float32, its weights stored as ``cpu_weight_format``
    says (``dtype`` bfloat16, or ``quantization`` "int8" / "gguf" / "gguf_a8": the CPU's only)."""
    if device in ("cuda", "auto") and cuda_available():
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} runs on the CPU only: the CUDA kernels multiply float16, "
                             "bfloat16 or float32 weights (use dtype=..., or device='cpu')")
        from ..kernels.cuda import gpu_ops  # noqa: PLC0415 (needs CuPy; compiles the .cu files once)

        return Backend("cuda", gpu_ops(), gpu_dtype(dtype, checkpoint_dtype))
    if device == "cuda":
        raise ValueError("device='cuda' was requested but no CUDA GPU is visible "
                         "(CuPy is not installed or sees no device); use device='cpu' or 'auto'")
    if device == "auto":
        logger.info("no CUDA GPU found; running on the CPU")
    weight_format = cpu_weight_format(dtype, quantization)
    settle_numba_layer()              # OpenMP first, whatever was imported first
    if kernels == "simple":
        from ..kernels.simple import SimpleOps  # noqa: PLC0415 (compiles Numba kernels on first use)

        settle_blas_threads()
        return Backend("cpu", SimpleOps(), np.dtype(np.float32), None, cpu_gemm, LinearPaths.every("numba"),
                       weight_format)
    from numba import get_num_threads  # noqa: PLC0415

    from ..kernels.fast.ops import FastOps  # noqa: PLC0415 (compiles Numba kernels on first use)
    from ..kernels.fast.packed_gemm import load_packed_gemm  # noqa: PLC0415

    # compact weights are multiplied by their own panels (decodes) or widened for numpy's BLAS
    # (prefills): oneMKL's packed float32 copies, and timing it against ours, have no part there
    if weight_format != "float32" and cpu_gemm == "mkl":
        raise ValueError(f"cpu_gemm='mkl' multiplies float32 weights; the CPU's {weight_format} weights are "
                         "multiplied by minipaged's own kernels (leave cpu_gemm at 'auto', or give 'numba')")
    gemm = load_packed_gemm(cpu_gemm, get_num_threads()) if weight_format == "float32" else None
    if weight_format != "float32":
        linear_paths = LinearPaths.every("numba")

    stuck = settle_blas_threads()     # whatever came first, numpy or minipaged
    if stuck:
        logger.info("the BLAS at %s cannot be told to stop busy-waiting after each matmul, which "
                    "slows the Numba kernels down (up to 2x); set OPENBLAS_THREAD_TIMEOUT=16 before "
                    "numpy is imported", ", ".join(stuck))
    if linear_paths is not None and "mkl" in linear_paths.used() and gemm is None:
        # a worker on a host without oneMKL, given the driver's "auto" choice: ours throughout
        logger.warning("the driver's linear paths (%s) take oneMKL, which this host lacks: every step runs "
                       "minipaged's kernels here", linear_paths.describe())
        linear_paths = LinearPaths.every("numba")
    if linear_paths is None and (cpu_gemm != "auto" or gemm is None):
        linear_paths = LinearPaths.every("mkl" if gemm is not None else "numba")
    if linear_paths is not None and "mkl" not in linear_paths.used():
        gemm = None
    # while "auto" has yet to measure (linear_paths None), ours for every step: the calibration times both
    ops = FastOps(tuning, gemm, linear_paths) if linear_paths is not None else FastOps(tuning)
    return Backend("cpu", ops, np.dtype(np.float32), gemm, cpu_gemm, linear_paths, weight_format)


def release_device_memory() -> None:
    """Give the device memory of dropped engines back to the device.

    CuPy keeps freed device memory in its pool for reuse, so an engine that is gone still
    holds its KV pool until the pool lets go. Call this after dropping an engine and before
    building the next, or the next one's profiling pass finds the device full. A no-op
    without CuPy.
    """
    gc.collect()                      # engines hold reference cycles: collect them now
    if "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
