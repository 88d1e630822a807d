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

    @property
    def xp(self):
        return self.ops.xp

    @property
    def kernels(self) -> str:
        """The tier that runs: "simple", "fast" or "cuda"."""
        return self.ops.name

    def with_linear_paths(self, linear_paths: LinearPaths, gemm) -> Backend:
        """The same backend with each kind of step's engine settled (``engine/linear_calibration.py``)."""
        return dataclasses.replace(self, linear_paths=linear_paths, gemm=gemm,
                                   ops=self.ops.with_paths(linear_paths, gemm))


def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency)
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # not installed, no driver, no device: all mean "no GPU"
        return False


def select_backend(device: str, dtype: str, cpu_gemm: str = "auto", linear_paths: LinearPaths | None = None,
                   kernels: str = "fast", tuning: FastTuning = DEFAULT_TUNING) -> Backend:
    """CUDA when asked for (or, with "auto", when CuPy sees a GPU), else the CPU, whose tier of
    kernels is ``kernels``: "fast" or "simple" (which multiplies with numpy's BLAS and has no use
    for oneMKL, linear paths or ``tuning``, the fast tier's switches). The fast tier's linear
    layers' engines: ``linear_paths`` when given (a worker elsewhere gets the driver's); else
    every step oneMKL's with ``cpu_gemm="mkl"``, ours with "numba" or without oneMKL installed,
    and, with "auto" and oneMKL installed, None: measured once the model is known
    (``engine/linear_calibration.py``)."""
    if device in ("cuda", "auto") and cuda_available():
        from ..kernels.cuda import gpu_ops  # noqa: PLC0415 (needs CuPy; compiles the .cu files once)

        return Backend("cuda", gpu_ops(), np.dtype(np.float32 if dtype == "float32" else np.float16))
    if device == "cuda":
        raise ValueError("device='cuda' was requested but no CUDA GPU is visible "
                         "(CuPy is not installed or sees no device); use device='cpu' or 'auto'")
    if device == "auto":
        logger.info("no CUDA GPU found; running on the CPU")
    if dtype not in ("auto", "float32"):
        raise ValueError(f"dtype={dtype!r} is not supported on the CPU; use 'float32' or 'auto'")
    settle_numba_layer()              # OpenMP first, whatever was imported first
    if kernels == "simple":
        from ..kernels.simple import SimpleOps  # noqa: PLC0415 (compiles Numba kernels on first use)

        settle_blas_threads()
        return Backend("cpu", SimpleOps(), np.dtype(np.float32), None, cpu_gemm, LinearPaths.every("numba"))
    from numba import get_num_threads  # noqa: PLC0415

    from ..kernels.fast.ops import FastOps  # noqa: PLC0415 (compiles Numba kernels on first use)
    from ..kernels.fast.packed_gemm import load_packed_gemm  # noqa: PLC0415

    gemm = load_packed_gemm(cpu_gemm, get_num_threads())

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
    return Backend("cpu", ops, np.dtype(np.float32), gemm, cpu_gemm, linear_paths)


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
