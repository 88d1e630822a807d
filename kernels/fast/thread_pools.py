"""Thread pools: two schedulers on one set of cores, told to yield to each other.

On the CPU two thread pools share the cores: OpenBLAS's (numpy's matrix products) and
Numba's (every other kernel). Like two processes that each busy-wait for the CPU, a pool
that spins after its work steals the cores the other needs next: a 0.5 ms matmul once took
9 ms after a parallel kernel. ``minipaged/boot.py`` asks both pools to sleep soon
(``GOMP_SPINCOUNT=3000`` for Numba, ``OPENBLAS_THREAD_TIMEOUT=16`` for OpenBLAS), but
OpenBLAS reads its variable once, when numpy loads it. A program that imports numpy before
minipaged, the ordinary way to use a library, has already missed that moment.

``settle_blas_threads`` makes the setting hold whatever the import order: it finds every
OpenBLAS that is loaded (``threadpoolctl`` lists the native thread pools of a process),
asks it to read its environment again (``openblas_read_env``) and stops its threads
(``blas_thread_shutdown_``); OpenBLAS starts them afresh, with the new timeout, at its next
parallel call. That restart must not happen while another thread is inside a BLAS call, so
it happens only when the setting differs: in practice once, when the first CPU engine is
built.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("minipaged")

THREAD_TIMEOUT = 16   # OpenBLAS threads spin 2**16 cycles (~25 us), then sleep


def settle_numba_layer() -> None:
    """Numba read NUMBA_THREADING_LAYER_PRIORITY when it was imported; if that was before
    ``minipaged/boot.py`` set it, give its config the same order now. The layer is chosen at
    the first parallel kernel, so this holds until one has run (then it is too late, and
    harmless: ``numba.threading_layer()`` says which layer runs)."""
    import sys  # noqa: PLC0415

    wanted = os.environ.get("NUMBA_THREADING_LAYER_PRIORITY")   # boot.py's, or the user's own
    numba = sys.modules.get("numba")
    if wanted and numba is not None and numba.config.THREADING_LAYER_PRIORITY != wanted.split():
        numba.config.THREADING_LAYER_PRIORITY = wanted.split()


def openblas_libraries() -> list[dict]:
    """threadpoolctl's record of each OpenBLAS loaded in this process (empty without one)."""
    try:
        import threadpoolctl  # noqa: PLC0415
    except ImportError:
        return []
    return [info for info in threadpoolctl.threadpool_info() if info.get("internal_api") == "openblas"]


def thread_timeout(filepath: str) -> int | None:
    """The spin exponent the OpenBLAS at ``filepath`` uses now (0: its default, 2**28 cycles)."""
    return _timeout_of(ctypes.CDLL(filepath))


def _timeout_of(lib) -> int | None:
    if not hasattr(lib, "openblas_thread_timeout"):
        return None
    lib.openblas_thread_timeout.restype = ctypes.c_int
    return int(lib.openblas_thread_timeout())


def atoi(text: str) -> int:
    """The number C's atoi reads from text (leading blanks, a sign, digits; else 0), as
    OpenBLAS reads its variables: "016" and " 16" are 16, "abc" is 0."""
    text = text.lstrip()
    sign = -1 if text[:1] == "-" else 1
    text = text[1:] if text[:1] in "+-" else text
    digits = len(text) - len(text.lstrip("0123456789"))
    return sign * int(text[:digits]) if digits else 0


def settle_blas_threads() -> list[str]:
    """Make every loaded OpenBLAS use ``OPENBLAS_THREAD_TIMEOUT`` (16 unless the user set it).

    Called each time an engine is built; it acts only on a library whose timeout differs from
    the variable (the first build after numpy came first, or after the variable changed), so
    later engines never restart a pool that another thread may be using. Returns the
    libraries that still spin too long (this OpenBLAS cannot re-read its environment); the
    backend names them in one notice.
    """
    wanted = atoi(os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(THREAD_TIMEOUT)))
    stuck = []
    for info in openblas_libraries():
        path = info["filepath"]
        try:
            lib = ctypes.CDLL(path)          # already loaded: the same handle numpy uses
            current = _timeout_of(lib)
            if current is not None and current == wanted:
                continue
            if not (hasattr(lib, "openblas_read_env") and hasattr(lib, "blas_thread_shutdown_")):
                stuck.append(path)
                continue
            lib.openblas_read_env()          # OpenBLAS copies its variables into its globals
            lib.blas_thread_shutdown_()      # the pool restarts at the next parallel call
            if _timeout_of(lib) != wanted:
                stuck.append(path)
        except OSError:                      # cannot be opened again: leave it as it is
            stuck.append(path)
    return stuck
