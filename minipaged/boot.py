"""Boot: what must happen before anything else loads (the boot loader of the analogy).

Three settings cannot wait for a module that needs them: the thread pools read their
environment variables when they start, numpy starts OpenBLAS's pool when it is first
imported, and Numba picks the directory of its disk cache when a kernel is decorated. So ``minipaged/__init__.py`` imports this module first, before any
module that imports numpy, and it imports nothing but the standard library.
It also sets up the ``minipaged`` logger.
"""

import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

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


def kernel_cache_dir(kernels: Path, home: Path, keep: int = 4) -> Path:
    """Where Numba caches the kernels' machine code: a directory named after a digest of every
    kernel source (``kernels/**/*.py``), under ``home``; the ``keep`` most recently used others
    stay, older ones are deleted.

    Numba's own cache checks a kernel's file only: a kernel that inlines a function from
    another file (the attention kernels' from simd.py, say) kept its stale machine code after that file
    changed. Keyed by all of them, any edit of a kernel source compiles afresh.
    """
    digest = hashlib.sha256()
    for path in sorted(kernels.rglob("*.py")):      # every tier's sources, kernels/fast/ included
        digest.update(path.relative_to(kernels).as_posix().encode() + b"\0" + path.read_bytes())
    root = home / "numba"
    here = root / digest.hexdigest()[:16]
    try:
        here.mkdir(parents=True, exist_ok=True)
        os.utime(here)                              # used now: the newest
        others = sorted((d for d in root.iterdir() if d.is_dir() and d != here),
                        key=lambda d: d.stat().st_mtime, reverse=True)
        for old in others[keep - 1:]:
            for path in sorted(old.rglob("*"), reverse=True):    # files, then their folders
                path.unlink() if path.is_file() else path.rmdir()
            old.rmdir()
    except OSError:                                 # unwritable, or another process pruning: fine
        pass
    return here


# MINIPAGED_HOME, as model/fetch.py's cache_dir() reads it (this module imports no package).
_HOME = Path(os.environ["MINIPAGED_HOME"]).expanduser() if os.environ.get("MINIPAGED_HOME") \
    else Path.home() / ".cache" / "minipaged"


def _kernels_dir() -> Path:
    """minipaged.kernels' folder, found without importing it (``kernels/`` beside this package
    in a source tree, ``minipaged/kernels/`` once installed)."""
    try:
        spec = importlib.util.find_spec("minipaged.kernels")
        return Path(spec.submodule_search_locations[0])
    except (ImportError, AttributeError, TypeError, IndexError, ValueError):
        return Path(__file__).resolve().parent.parent / "kernels"


if "NUMBA_CACHE_DIR" not in os.environ:             # the user's choice wins
    os.environ["NUMBA_CACHE_DIR"] = str(kernel_cache_dir(_kernels_dir(), _HOME))
    if "numba.core.config" in sys.modules:          # numba came first: have it read the variable again
        sys.modules["numba.core.config"].reload_config()

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
