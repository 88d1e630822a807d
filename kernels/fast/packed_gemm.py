"""Packed GEMM: the CPU maker's own matrix engine for the linear layers (a vendor's driver).

Through numpy, OpenBLAS copies each weight into its own tiled layout at every call (it
"packs" it) before multiplying. For a prefill of thousands of rows that copy is paid once
for much arithmetic; for a decode step of 8-64 rows it is as costly as the product itself,
and every decode step multiplies every weight again. Intel's oneMKL (the ``mkl`` wheel on
PyPI, ``pip install 'minipaged[mkl]'``) lets a program pack a weight **once**
(``cblas_sgemm_pack``) and then multiply any number of rows by the packed copy
(``cblas_sgemm_compute``): the page cache of the analogy, applied to a weight's layout.
Its plain ``cblas_sgemm`` (``PackedGemm.sgemm``) also multiplies a prompt's attention, whose
operands (queries, gathered keys and values) change every call.

MKL is loaded with ctypes and told to run on GNU OpenMP (``MKL_Set_Threading_Layer``), the
runtime Numba's threaded kernels already use (libgomp), so its products share their thread
pool and its spin setting (``minipaged/boot.py``): no third pool busy-waits on the cores.

Without MKL (not installed, not x86-64, or ``cpu_gemm="numba"``), ``load_packed_gemm`` returns
None and ``linear.py`` keeps its own kernels. With it, which kinds of step it
multiplies is ``kernels/linear_paths.py``'s choice: timed on the machine under
``cpu_gemm="auto"`` (``minipaged/engine/linear_calibration.py``), every step with "mkl". The
NumPy product ``x @ w.T`` is the spec both are tested against.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import mmap
import platform
import re
import sys
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger("minipaged")

CPU_GEMMS = ("auto", "mkl", "numba")

# oneMKL's CBLAS enumerations (mkl_cblas.h) and threading layers (mkl_service.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_THREADING_GNU, _INTERFACE_LP64 = 3, 0
# cblas_sgemm_pack sizes its buffer for a typical row count; any count may then use it
_PACK_ROWS_HINT = 64
# MKL's packed copy takes at least ~8 MB of address space, whatever the matrix (a 64 x 32
# one: 968x its size), and a small product gains nothing from it: weights with fewer
# elements than this are not packed (SmolLM2's smallest, 576 x 576, has 331,776).
MIN_PACKED_ELEMENTS = 1 << 18


def find_mkl_library() -> str | None:
    """The path of the ``mkl`` wheel's libmkl_rt, or None when it is not installed."""
    try:
        files = importlib.metadata.distribution("mkl").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if re.fullmatch(r"libmkl_rt\.so(\.\d+)*", f.name):
            return str(f.locate())
    return None


@dataclass(frozen=True)
class PackedWeight:
    """A weight (out, in) in MKL's packed layout, ready for any number of rows."""

    gemm: PackedGemm
    buffer: np.ndarray     # (bytes,) uint8: MKL's opaque packed copy of the weight (2-9x its size)
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) float32 -> x @ w.T, (T, out)."""
        return self.gemm.matmul(x, self)


class PackedGemm:
    """oneMKL's packed single-precision GEMM, loaded from ``path`` with ctypes."""

    def __init__(self, path: str, num_threads: int) -> None:
        ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)   # MKL's GNU layer calls into it
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        for setter in (lib.MKL_Set_Interface_Layer, lib.MKL_Set_Threading_Layer):
            setter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
        # before any other MKL call: 32-bit integers (the c_int arguments below), GNU OpenMP
        lib.MKL_Set_Interface_Layer(_INTERFACE_LP64)
        self.threading_layer = lib.MKL_Set_Threading_Layer(_THREADING_GNU)
        if self.threading_layer != _THREADING_GNU:   # another library set MKL up first
            logger.info("oneMKL was already set up with threading layer %d by another library: its "
                        "products run on that pool, beside Numba's", self.threading_layer)
        lib.MKL_Set_Num_Threads.argtypes = [ctypes.c_int]
        lib.MKL_Set_Num_Threads(num_threads)
        i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
        lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
        lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
        lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
        lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        self._lib = lib
        self.path = path
        self.num_threads = num_threads

    def pack(self, w: np.ndarray) -> PackedWeight:
        """Pack w (out, in) float32 as the right operand of x @ w.T."""
        if w.ndim != 2 or w.dtype != np.float32:
            raise ValueError(f"pack: w must be a (out, in) float32 matrix, got {w.dtype} {w.shape}")
        w = np.ascontiguousarray(w)
        n, k = w.shape
        size = self._lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k)
        # An anonymous mapping of its own, not numpy's allocator: numpy asks the kernel for
        # huge pages on large arrays, and faulting those in (compacting memory for each) made
        # packing SmolLM2 take 4.5 s instead of ~0.7; the products ran as fast on either.
        buffer = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)   # (bytes,)
        # B = w.T: w row-major is B transposed, with leading dimension k
        self._lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0,
                                   w.ctypes.data, k, buffer.ctypes.data)
        return PackedWeight(self, buffer, n, k)

    def pack_if_worth_it(self, w: np.ndarray, min_elements: int = MIN_PACKED_ELEMENTS) -> PackedWeight | None:
        """``pack(w)`` for a float32 weight of at least ``min_elements`` elements (the fast tier's
        ``FastTuning.min_packed_elements``), else None."""
        return self.pack(w) if w.dtype == np.float32 and w.size >= min_elements else None

    def matmul(self, x: np.ndarray, w: PackedWeight) -> np.ndarray:
        """x (T, in) @ w.T -> (T, out) float32."""
        if x.ndim != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"matmul: x {x.shape} does not fit a packed ({w.out_features}, {w.in_features}) weight")
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows = x.shape[0]
        out = np.empty((rows, w.out_features), np.float32)            # (T, out)
        if rows:
            self._lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, w.out_features, w.in_features,
                                          x.ctypes.data, w.in_features, w.buffer.ctypes.data, 0, 0.0,
                                          out.ctypes.data, w.out_features)
        return out


    def sgemm(self, a: np.ndarray, b: np.ndarray, trans_b: bool = False) -> np.ndarray:
        """a (m, k) @ b (k, n), or a @ b.T for b (n, k) with ``trans_b``: MKL's plain sgemm,
        for products whose operands change every call (attention's scores and values)."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        b = np.ascontiguousarray(b, dtype=np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != (b.shape[1] if trans_b else b.shape[0]):
            raise ValueError(f"sgemm: a {a.shape} and b {b.shape}{'.T' if trans_b else ''} do not multiply")
        m, k = a.shape
        n = b.shape[0] if trans_b else b.shape[1]
        out = np.empty((m, n), np.float32)                                 # (m, n)
        if m and n:
            if k == 0:
                out[:] = 0.0
            else:
                self._lib.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k, 1.0,
                                      a.ctypes.data, k, b.ctypes.data, b.shape[1], 0.0, out.ctypes.data, n)
        return out


def cpuinfo_field(name: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first CPU's ``name`` field in /proc/cpuinfo ("vendor_id", "model name"), or None."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's maker as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD", ...), or None."""
    return cpuinfo_field("vendor_id", cpuinfo)


def load_packed_gemm(choice: str, num_threads: int) -> PackedGemm | None:
    """oneMKL for ``cpu_gemm``: "auto" (when its wheel is installed, on Linux x86-64, whatever
    the CPU's maker: which steps it then takes is measured), "mkl" (required), "numba" (never)."""
    if choice not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm must be one of {CPU_GEMMS}, got {choice!r}")
    if choice == "numba":
        return None
    linux_x86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
    path = find_mkl_library() if linux_x86 else None
    if path is None:
        if choice == "mkl":
            raise ValueError("cpu_gemm='mkl' needs Intel's oneMKL on Linux x86-64: pip install 'minipaged[mkl]' "
                             "(or use cpu_gemm='auto' or 'numba')")
        return None
    try:
        return PackedGemm(path, num_threads)
    except (OSError, AttributeError) as e:        # a broken install: say so, or fall back
        if choice == "mkl":
            raise ValueError(f"cpu_gemm='mkl': oneMKL at {path} could not be loaded ({e})") from None
        return None
