"""How the fast tier compiles a kernel: twice (serial and threaded), specialised, never raising.

The OS idea is the loader: one source, several images, and the one that runs picked at call
time. ``two_ways`` compiles a kernel for one thread and for the pool; the caller picks by the
size of the work against a threshold of ``tuning.FastTuning``. ``specialize`` bakes constants
into a copy (a storage format, the heads scored together) so that every branch on them folds
away. ``never_raising`` gives the persistent kernel copies that cannot raise inside its region, and
``guarded`` copies that report a failure (an allocation that failed, say) instead of raising it.
"""

from __future__ import annotations

import types

from numba import njit


def two_ways(fn, cache: bool = True, fastmath: bool = True, error_model: str = "python"):
    """Compile ``fn`` twice: serial (prange acts as range) and across threads (each cached on disk
    when ``cache``); ``pick(work, threshold)`` returns the threaded copy from ``threshold`` up
    (``.serial`` and ``.parallel`` name each: a kernel that runs inside another's threads calls
    the serial one).
    ``fastmath=False`` keeps IEEE arithmetic (write_kv's int8 scales must round as the spec's).
    ``error_model="numpy"``: a float division gives inf or nan for a zero divisor, as NumPy's,
    instead of testing it first to raise Python's ZeroDivisionError, a test that keeps LLVM
    from vectorising a loop that divides.

    The serial copy gets its own name: Numba's on-disk cache is keyed by the
    function's qualified name and signature, not by the ``parallel`` flag, so
    two compilations of one function would overwrite each other's cache entry.
    """
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                              fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    serial = njit(fastmath=fastmath, cache=cache, error_model=error_model)(twin)
    parallel = njit(fastmath=fastmath, cache=cache, parallel=True, error_model=error_model)(fn)

    def pick(work: int, threshold: int):
        return parallel if work >= threshold else serial
    pick.serial, pick.parallel = serial, parallel
    return pick


def specialize(fn, **constants):
    """A copy of ``fn`` that sees these module constants (KV_FORMAT, HEADS_TOGETHER) with the
    given values, under its own name (Numba caches by name), so every branch on them folds
    away. The copy reads a snapshot of its module's globals taken here."""
    suffix = "_".join(str(v) for v in constants.values())
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **constants}, f"{fn.__name__}_{suffix}",
                              fn.__defaults__, fn.__closure__)
    copy.__qualname__ = f"{fn.__qualname__}_{suffix}"
    return copy


def never_raising(kernel, cache: bool = True):
    """A copy of a serial kernel compiled with NumPy's error model: a float division by zero
    gives inf or nan instead of raising ZeroDivisionError (the same arithmetic otherwise). In
    the persistent kernel a task that raised would leave its thread's iteration without
    counting the task done, and the other threads would poll for it for ever."""
    fn = kernel.py_func
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_never_raising", fn.__defaults__,
                              fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_never_raising"
    return njit(fastmath=kernel.targetoptions.get("fastmath", False), cache=cache, error_model="numpy")(twin)




def _guarded_body(*args):
    try:
        KERNEL(*args)          # noqa: F821 (each copy's own, given by ``guarded``)
    except Exception:          # nothing escapes into the region: the caller is told instead
        return False
    return True


def guarded(kernel, cache: bool = True):
    """A copy of ``kernel`` (a Numba dispatcher) that returns True when it ran and False where it
    raised (an allocation that failed, an error of any kind), for the persistent kernel's tasks:
    an exception leaving a task would leave its thread's iteration without counting the task
    done, and the other threads would poll for it for ever. The caller marks the step failed."""
    fn, name = _guarded_body, f"guarded_{kernel.py_func.__name__}"
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, "KERNEL": kernel}, name, fn.__defaults__,
                              fn.__closure__)
    copy.__qualname__ = name
    return njit(cache=cache)(copy)
