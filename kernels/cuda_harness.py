"""Run the CUDA C kernels (kernels/*.cu) on a CPU, to test them where there is no GPU.

A kernel file is compiled as C++ by the system compiler with ``cuda_cpu_shim.h`` in
front (threads, barriers, warp shuffles, shared memory, half precision emulated on
OS threads), plus a generated launcher per ``extern "C" __global__`` function that takes
the grid, the block and a ``void**`` of arguments, the way the CUDA driver receives a
launch. ``load(path)`` returns an object whose attributes launch the kernels:

    lib = load("kernels/paged_attention.cu")
    lib.paged_decode_f32(grid=(H, S, P), block=(128,), args=[out, ..., np.float32(scale)])

Array arguments are numpy arrays (passed by pointer), scalars numpy scalars of the
kernel's parameter type. Slow (one OS thread per CUDA thread) and only for tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).parent
SHIM = KERNEL_DIR / "cuda_cpu_shim.h"
_SCALARS = {"int": ctypes.c_int, "float": ctypes.c_float, "long long": ctypes.c_longlong,
            "unsigned": ctypes.c_uint}
# CuPy passes a Python float as a double and a Python int as a 64-bit int: a kernel's
# float or int parameter would then read garbage on a GPU. The harness insists on the
# numpy scalar type CuPy needs, so a wrong call fails here, in CI, not there.
_NUMPY_SCALARS = {"int": np.int32, "float": np.float32, "long long": np.int64, "unsigned": np.uint32}
_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)


def kernel_signatures(source: str) -> dict[str, list[str]]:
    """name -> parameter types of every extern "C" __global__ function in a source."""
    kernels = {}
    for name, params in _SIGNATURE.findall(source):
        types = []
        for param in params.split(","):
            words = param.replace("__restrict__", "").split()
            decl = " ".join(words)
            # drop the parameter name, keep the type (pointer stars stay with the type)
            types.append(re.sub(r"\s*\b\w+$", "", decl).strip())
        kernels[name] = types
    return kernels


def _launcher_source(cu_path: Path, kernels: dict[str, list[str]]) -> str:
    lines = [f'#include "{cu_path.resolve()}"']
    for name, types in kernels.items():
        args = ", ".join(f"*({t}*)args[{i}]" for i, t in enumerate(types))
        lines.append(
            f'extern "C" void launch_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"unsigned by, unsigned bz, void** args) {{\n"
            f"    cuda_cpu::run_grid(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, [&] {{ {name}({args}); }});\n}}")
    return "\n".join(lines) + "\n"


class CpuKernels:
    """Launchers for the kernels of one compiled .cu file."""

    def __init__(self, library: ctypes.CDLL, kernels: dict[str, list[str]], strided: set[str]) -> None:
        self._lib = library
        self.signatures = kernels
        self._strided = strided      # kernels that take a row stride (a *_stride parameter)

    def __getattr__(self, name: str):
        if name not in self.signatures:
            raise AttributeError(f"no kernel named {name!r}")
        launch = getattr(self._lib, f"launch_{name}")

        def run(grid, block, args):
            grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
            assert min(grid) >= 1, f"{name}: a grid dimension is 0 (CuPy would run one block)"
            assert len(args) == len(self.signatures[name]), f"{name} takes {len(self.signatures[name])} args"
            holders = []
            for value, ctype in zip(args, self.signatures[name]):
                if ctype.endswith("*"):
                    assert isinstance(value, np.ndarray) and (value.flags.c_contiguous or (
                        name in self._strided and _row_strided(value))), (
                        f"{name}: pointer arguments are C-contiguous numpy arrays (or, to a kernel that "
                        "takes a row stride, (T, heads, D) rows a stride apart)")
                    holders.append(ctypes.c_void_p(value.ctypes.data))
                else:
                    assert type(value) is _NUMPY_SCALARS[ctype], (
                        f"{name}: pass a {_NUMPY_SCALARS[ctype].__name__} for a {ctype} parameter, "
                        f"not {type(value).__name__}")
                    holders.append(_SCALARS[ctype](value))
            pointers = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
            launch(*[ctypes.c_uint(v) for v in grid + block], pointers)

        return run


def _row_strided(a: np.ndarray) -> bool:
    """(T, heads, D) whose rows lie a stride apart, each row's heads and dims contiguous."""
    return a.ndim == 3 and a.strides[2] == a.itemsize and a.strides[1] == a.shape[2] * a.itemsize \
        and a.strides[0] >= a.shape[1] * a.strides[1]


def load(cu_path: str | Path, build_dir: str | Path | None = None) -> CpuKernels:
    """Compile (once per source content) and load a .cu file for the CPU."""
    cu_path = Path(cu_path)
    source = cu_path.read_text()
    kernels = kernel_signatures(source)
    digest = hashlib.sha256((source + SHIM.read_text() + (KERNEL_DIR / "common.cuh").read_text())
                            .encode()).hexdigest()[:16]
    build = Path(build_dir or Path(tempfile.gettempdir()) / "minipaged-cuda-cpu")
    build.mkdir(parents=True, exist_ok=True)
    library = build / f"{cu_path.stem}-{digest}.so"
    if not library.exists():
        launcher = build / f"{cu_path.stem}-{digest}.cpp"
        launcher.write_text(_launcher_source(cu_path, kernels))
        cmd = ["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
               "-DMINIPAGED_CPU_HARNESS",
               "-include", str(SHIM), "-I", str(KERNEL_DIR), str(launcher), "-o", str(library) + ".tmp"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {cu_path.name} for the CPU failed:\n{done.stderr[-4000:]}")
        Path(str(library) + ".tmp").rename(library)
    strided = {name for name, params in _SIGNATURE.findall(source) if "_stride" in params}
    return CpuKernels(ctypes.CDLL(str(library)), kernels, strided)
