"""Boot: what must happen before anything else loads (the boot loader of the analogy).

Two settings cannot wait for a module that needs them: the thread pools read their
environment variables when they start, and numpy starts OpenBLAS's pool when it is
first imported. So ``minipaged/__init__.py`` imports this module first, before any
module that imports numpy, and it imports nothing but the standard library.
It also sets up the ``minipaged`` logger.
"""

import logging
import os
import sys

# BLAS (numpy's matmuls) and Numba (our kernels) each keep a pool of threads on
# the same few cores, and each pool busy-waits after its work, stealing the cores
# the other needs next: a 0.5 ms matmul took 9 ms after a parallel kernel whose
# threads spun for their default time. Sleeping at once is no better: waking a
# sleeping pool costs ~70 us, more than many decode kernels take. So each pool
# spins briefly, then sleeps: Numba's OpenMP threads (GNU libgomp, Numba's pip
# wheels) spin 3,000 rounds (~30-100 us; LLVM's libomp, elsewhere, sleeps at once),
# read when Numba starts its pool at the first parallel kernel; OpenBLAS threads
# spin 2**16 cycles (~25 us), read when numpy loads OpenBLAS, and again by
# engine/thread_pools.py if numpy came first.
# (A user's OMP_WAIT_POLICY is a choice about the same spin: then neither is set.)
THREAD_ENV = {} if "OMP_WAIT_POLICY" in os.environ else {"GOMP_SPINCOUNT": "3000", "KMP_BLOCKTIME": "0"}
if "numpy" not in sys.modules:
    THREAD_ENV["OPENBLAS_THREAD_TIMEOUT"] = "16"
# Numba takes the first threading layer it finds in its priority list, TBB before OpenMP. The
# `mkl` wheel (kernels/packed_gemm.py) installs TBB as a dependency, which would move every
# Numba kernel off OpenMP: off GOMP_SPINCOUNT, and off the libgomp pool oneMKL is told to
# share. So OpenMP comes first; TBB or Numba's own workqueue only where OpenMP is missing.
NUMBA_LAYERS = "omp tbb workqueue"
if "NUMBA_THREADING_LAYER" not in os.environ:
    THREAD_ENV["NUMBA_THREADING_LAYER_PRIORITY"] = NUMBA_LAYERS
THREAD_ENV = {k: v for k, v in THREAD_ENV.items() if k not in os.environ}  # the user's choice wins
os.environ.update(THREAD_ENV)

# One stderr line per notice ("[minipaged] no CUDA GPU found; running on the CPU");
# MINIPAGED_LOG_LEVEL=WARNING silences them.
_logger = logging.getLogger("minipaged")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[minipaged] %(message)s"))
    _logger.addHandler(_handler)
    _level = os.environ.get("MINIPAGED_LOG_LEVEL", "INFO").upper()
    if _level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        _logger.warning("MINIPAGED_LOG_LEVEL=%r is not a log level (DEBUG, INFO, WARNING, ERROR, "
                        "CRITICAL); using INFO", _level)
        _level = "INFO"
    _logger.setLevel(_level)
    _logger.propagate = False
