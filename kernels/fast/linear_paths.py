"""Linear paths: which engine multiplies a step's linear layers, by the kind of step.

The CPU has two engines for the products of the linear layers:

- ``"numba"``: our own kernels. A decode step multiplies the weights' panels
  (``panel_gemm.py``), every layer in one persistent kernel
  (``persistent_decode.py``); a prefill goes to numpy's BLAS gemm.
- ``"mkl"``: Intel's oneMKL (``packed_gemm.py``), multiplying a packed copy of every
  weight made once at load (from ``FastTuning.packed_min_rows`` rows; fewer go to the skinny kernel),
  and a prompt's attention through its sgemm.

Which is faster depends on the machine and on the kind of step: one row streams the weights
at the memory's speed, a batch of decodes reuses each weight row a few dozen times, a prefill
is all arithmetic. ``LinearPaths`` names an engine for each kind, as an OS driver table names
a routine per operation; ``minipaged/engine/linear_calibration.py`` fills it in by timing both
on the machine (``cpu_gemm="auto"``), or one engine is asked for (``"numba"``, ``"mkl"``).

A step's kind follows from its rows (tokens): 1 row is a single-stream decode; up to
``DECODE_MAX_ROWS`` rows a batched decode (decode steps of up to 128 sequences, and the short
prompts of a chat turn, which the panels also take); more rows are a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

PATHS = ("numba", "mkl")
STEP_KINDS = ("single_decode", "batched_decode", "prefill")
KIND_NAMES = {"single_decode": "single-stream decode", "batched_decode": "batched decode", "prefill": "prefill"}
# The most rows a batched decode has: the panels' and the persistent kernel's limit
# (FastTuning.panel_max_rows, kernels/fast/tuning.py; a test checks that the two agree).
DECODE_MAX_ROWS = 128


def step_kind(rows: int) -> str:
    """The kind of a step of ``rows`` tokens: "single_decode", "batched_decode" or "prefill"."""
    if rows <= 1:
        return "single_decode"
    return "batched_decode" if rows <= DECODE_MAX_ROWS else "prefill"


@dataclass(frozen=True)
class LinearPaths:
    """The engine ("numba" or "mkl") that multiplies each kind of step's linear layers."""

    single_decode: str = "numba"
    batched_decode: str = "numba"
    prefill: str = "numba"

    def __post_init__(self) -> None:
        for kind in STEP_KINDS:
            if getattr(self, kind) not in PATHS:
                raise ValueError(f"LinearPaths.{kind} must be one of {PATHS}, got {getattr(self, kind)!r}")

    @classmethod
    def every(cls, path: str) -> LinearPaths:
        """The same engine for every kind of step."""
        return cls(path, path, path)

    def for_kind(self, kind: str) -> str:
        if kind not in STEP_KINDS:
            raise ValueError(f"a step's kind is one of {STEP_KINDS}, got {kind!r}")
        return getattr(self, kind)

    def for_rows(self, rows: int) -> str:
        """The engine that multiplies a step of ``rows`` tokens."""
        return self.for_kind(step_kind(rows))

    def used(self) -> tuple[str, ...]:
        """The engines some kind of step takes, in PATHS' order (each needs its copy of the weights)."""
        return tuple(path for path in PATHS if path in {getattr(self, kind) for kind in STEP_KINDS})

    def as_dict(self) -> dict[str, str]:
        return {kind: getattr(self, kind) for kind in STEP_KINDS}

    def describe(self) -> str:
        """One line: "single-stream decode numba, batched decode numba, prefill mkl"."""
        return ", ".join(f"{KIND_NAMES[kind]} {getattr(self, kind)}" for kind in STEP_KINDS)
