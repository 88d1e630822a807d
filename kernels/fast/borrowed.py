"""Borrowed views: an array a kernel reads without counting references to it (a pinned page).

An operating system lets its kernel touch a user page without taking a reference each time,
as long as something else holds the page pinned for the whole call. Numba's compiled functions
count references instead: every array is a data pointer plus a *meminfo*, and a function that
hands an array to an inlined helper takes a reference when the helper starts and drops it when
the helper ends. LLVM removes such a pair when both sit in one basic block; a helper with a
branch (the panels' prefetch, ``kernels/panel_gemm.py``) leaves the pair around every step of
its loop, and the call drags every vector register to the stack.

The threads of a parallel region see their arrays without a meminfo (Numba hands a prange body
bare views), which is why ``_panel_product`` compiled well while the same loops compiled in a
serial function, the persistent decode kernel's product tasks, ran 4x slower at 8 rows
(docs/benchmarks.md). ``borrowed(a)`` gives such a view anywhere: the same data, shape and
strides, no meminfo, so LLVM drops every count on it. The caller must keep ``a`` alive while
the view is used, as the serial function that received ``a`` as an argument does: a view stays
a local of the function that borrowed it, passed down to the helpers it calls, never returned,
yielded or stored (``tests/test_persistent_decode.py`` reads every kernel that borrows one and
fails where a view could leave).

    borrowed(a)   a (NumPy: the same array; nothing is copied)
"""

from __future__ import annotations

from numba import types as nb_types
from numba.extending import intrinsic


@intrinsic
def borrowed(typingctx, arr):
    """arr, as a view that takes no reference (its meminfo and parent left null)"""
    if not isinstance(arr, nb_types.Array):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        view = context.make_array(sig.return_type)(context, builder)
        for field in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(view, field, getattr(src, field))
        view.meminfo = context.get_constant_null(nb_types.MemInfoPointer(sig.args[0].dtype))
        view.parent = context.get_constant_null(nb_types.pyobject)
        return view._getvalue()
    return arr(arr), codegen
