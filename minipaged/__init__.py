"""minipaged: a from-scratch LLM inference engine that implements vLLM's PagedAttention.

    from minipaged import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct, fetched on first use
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

import os
import sys

# BLAS (numpy's matmuls) and Numba (our kernels) each keep a pool of threads on
# the same cores. OpenBLAS threads busy-wait ~0.1 s after each call, which makes
# every Numba parallel kernel wait a scheduler tick (~4 ms) for a core. Telling
# OpenBLAS to sleep at once removes that; it only works before numpy is loaded
# (see backend.py for what happens when numpy came first).
BLAS_SPIN_FIXED = "numpy" not in sys.modules or "OPENBLAS_THREAD_TIMEOUT" in os.environ
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import logging  # noqa: E402

# One stderr line per notice ("[minipaged] no CUDA GPU found; running on the CPU");
# MINIPAGED_LOG_LEVEL=WARNING silences them.
_logger = logging.getLogger("minipaged")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[minipaged] %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(os.environ.get("MINIPAGED_LOG_LEVEL", "INFO").upper())
    _logger.propagate = False

from .engine import LLMEngine, RequestError
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import OutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "OutputKind", "RequestOutput",
           "CompletionOutput", "RequestError"]
__version__ = "0.1.0"
