"""NVRTC without a GPU: compile CUDA C to PTX with every CUDA toolkit pip installed.

The ``dev`` extra installs two toolkits' NVRTC and headers as wheels: CUDA 12.9
(``nvidia/cuda_nvrtc/lib`` + ``nvidia/cuda_runtime/include``) and CUDA 13
(``nvidia/cu13/lib`` + ``nvidia/cu13/include``). NVRTC is a plain C library, so it is
loaded with ctypes, once per toolkit, side by side in one process; no driver and no
device are involved in compiling.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Toolkit:
    version: tuple[int, int]  # NVRTC's (major, minor)
    library: Path             # libnvrtc.so.N
    include: Path             # holds cuda_fp16.h

    def __str__(self) -> str:
        return f"CUDA {self.version[0]}.{self.version[1]}"


def toolkits() -> list[Toolkit]:
    """Every NVRTC wheel found under the ``nvidia`` namespace package, newest first."""
    try:
        import nvidia  # noqa: PLC0415 (the namespace package the NVIDIA wheels share)
    except ImportError:
        return []
    found = []
    for root in map(Path, nvidia.__path__):
        for library in sorted(root.glob("*/lib/libnvrtc.so.*")):
            if "builtins" in library.name or library.suffix == ".alt":
                continue
            include = library.parent.parent / "include"          # cu13 layout: one folder
            if not (include / "cuda_fp16.h").exists():
                include = root / "cuda_runtime" / "include"      # cu12 layout: runtime wheel apart
            if (include / "cuda_fp16.h").exists():
                found.append(Toolkit(_version(_load(library)), library, include))
    return sorted(found, key=lambda t: t.version, reverse=True)


def _load(library: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(library))


def _version(nvrtc: ctypes.CDLL) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_to_ptx(toolkit: Toolkit, source: str, name: str, options: list[str]) -> tuple[bool, str, str]:
    """(compiled?, NVRTC's log, the PTX) for one source."""
    nvrtc = _load(toolkit.library)
    program = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None)
    assert status == 0, f"nvrtcCreateProgram failed ({status})"
    try:
        opts = [o.encode() for o in [*options, f"-I{toolkit.include}"]]
        status = nvrtc.nvrtcCompileProgram(program, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        ptx = ""
        if status == 0:
            nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetPTX(program, buffer)
            ptx = buffer.value.decode()
        return status == 0, log.value.decode(errors="replace"), ptx
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
