"""Atomic counters shared by the threads of one parallel region: the futex word of the analogy.

An operating system's threads agree through a few words of memory that every core reads and
writes atomically (a spin-lock, a futex, a ticket counter); a thread that finds a word not yet
as it wants it polls it, with the CPU's ``pause`` between reads, rather than sleeping. The
persistent decode kernel (``kernels/persistent_decode.py``) keeps its threads in one parallel
region for a whole step this way: they take tasks by adding one to a counter, and wait for a
phase's tasks to be done by polling another. Numba has no atomics on the CPU, so this module
names the three instructions it needs, as ``kernels/simd.py`` names vector registers:

    fetch_add(a, i, v)   old = a[i]; a[i] += v; return old   (one indivisible step, every thread
                         sees the additions in one order, and what a thread wrote before it is
                         visible to a thread that reads the new value: sequentially consistent)
    load_acquire(a, i)   a[i], read from memory each time (never kept in a register across a
                         loop), and what the thread that stored it wrote before is visible after
    spin_pause()         x86 ``pause`` (a polling loop's hint to the core; nothing elsewhere)

``a`` is a 1-D int64 array known to Numba to be contiguous; no bounds are checked. NumPy's
meaning is the comment beside each; ``tests/test_persistent_decode.py`` checks them, one thread
and two at once.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types as nb_types
from numba.extending import intrinsic

from .simd import _address   # LLVM: the address of arr[index], as the vector intrinsics take it

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _int64_1d(arr) -> bool:
    return (isinstance(arr, nb_types.Array) and arr.ndim == 1 and arr.dtype == nb_types.int64
            and arr.layout == "C")


@intrinsic
def fetch_add(typingctx, arr, index, value):
    """old = arr[index]; arr[index] += value; return old (atomically)"""
    if not _int64_1d(arr) or not isinstance(index, nb_types.Integer) or not isinstance(value, nb_types.Integer):
        return None

    def codegen(context, builder, sig, args):
        add = context.cast(builder, args[2], sig.args[2], nb_types.int64)
        return builder.atomic_rmw("add", _address(context, builder, sig, args), add, "seq_cst")
    return nb_types.int64(arr, index, value), codegen


@intrinsic
def load_acquire(typingctx, arr, index):
    """arr[index] (read from memory, with acquire ordering)"""
    if not _int64_1d(arr) or not isinstance(index, nb_types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_address(context, builder, sig, args), "acquire", 8)
    return nb_types.int64(arr, index), codegen


@intrinsic
def spin_pause(typingctx):
    """nothing (on x86, ``pause``: the core eases a polling loop and leaves it sooner)"""

    def codegen(context, builder, sig, args):
        if _X86:
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", [],
                                                  ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        return context.get_dummy_value()
    return nb_types.void(), codegen
