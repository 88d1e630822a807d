"""The weights' region of huge pages (``kernels/huge_pages.py``) and the panels packed into it
(``kernels/cpu.py`` ``pack_linears``): the same panels as packed one by one, every product the
NumPy product, and on Linux a mapping the kernel was asked to back with 2 MB pages."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from minipaged.kernels import reference
from minipaged.kernels.fast import layer_stack, linear as fast_linear
from minipaged.kernels.fast.huge_pages import ALIGN, HUGE_PAGE, Arena, huge_page_region, mapping_of
from minipaged.kernels.fast.panel_gemm import pack, panel_linear, panel_shape


def test_region_is_zeroed_rounded_to_huge_pages_and_advised():
    region = huge_page_region(3 * HUGE_PAGE + 1)
    assert region.dtype == np.uint8 and region.nbytes == 4 * HUGE_PAGE
    assert region.ctypes.data % HUGE_PAGE == 0                 # on a huge page's boundary
    assert not region.any() and region.flags.writeable
    region[-1] = 7                                             # writable to its last byte
    assert huge_page_region(0).nbytes == HUGE_PAGE
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        huge_page_region(-1)
    mapping = mapping_of(region)
    if sys.platform.startswith("linux"):
        assert mapping["bytes"] >= region.nbytes
        # madvise(MADV_HUGEPAGE) took, wherever the kernel has transparent huge pages at all
        assert mapping["advised"] == os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
        plain = np.frombuffer(mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
        assert mapping_of(plain)["advised"] is False                   # a mapping nobody advised
    else:
        assert mapping is None


def test_arena_hands_out_aligned_views_front_to_back():
    shapes = [(3, 5), (1,), (2, 4, 16), (7,)]
    arena = Arena(sum(Arena.footprint(s) for s in shapes))
    views = [arena.take(s) for s in shapes]
    for shape, view in zip(shapes, views):
        assert view.shape == shape and view.dtype == np.float32 and view.flags.c_contiguous
        assert view.ctypes.data % ALIGN == 0 and not view.any()
        view[...] = 1.0
    ends = [(v.ctypes.data, v.ctypes.data + v.nbytes) for v in views]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))   # disjoint, in order
    assert arena.used == sum(Arena.footprint(s) for s in shapes)
    assert arena.take((0,)).shape == (0,)
    small = Arena(64)
    small.take((small.capacity // 4,))                         # the whole region
    with pytest.raises(MemoryError, match="bytes asked"):
        small.take((1,))


def test_panels_in_the_arena_are_the_panels_and_multiply_as_numpy():
    rng = np.random.default_rng(11)
    weights = [rng.standard_normal(shape, dtype=np.float32) for shape in ((40, 24), (17, 33), (96, 8))]
    weights.append(np.ones((4, 4), np.float16))                # not float32: no panels, no room
    packed = fast_linear.pack_linears(weights)
    assert packed[-1] is None
    for w, p in zip(weights, packed[:-1]):
        assert p.data.shape == panel_shape(*w.shape)
        np.testing.assert_array_equal(p.data, pack(w).data)    # the same panels as packed alone
        for rows in (1, 4, 9):
            x = rng.standard_normal((rows, w.shape[1]), dtype=np.float32)
            np.testing.assert_allclose(panel_linear(x, p, 2), reference.linear(x, w), rtol=1e-4,
                                       atol=1e-4 * np.sqrt(w.shape[1]))
    bases = [p.data.ctypes.data for p in packed[:-1]]
    assert bases == sorted(bases) and bases[-1] - bases[0] < HUGE_PAGE   # back to back in one region
    assert fast_linear.pack_linears([]) == []
    assert fast_linear.pack_linears([np.ones((4, 4), np.float16)]) == [None]   # no float32 weight: no region


def test_weights_of_one_kind_are_rows_of_one_array():
    """Two kinds of one layout, layer after layer (a model's o and down when q_size == ffn): each
    kind's panels lie back to back, so the persistent kernel reads them as one (layers, bytes)
    view, not a copy (layer_stack.py)."""
    rng = np.random.default_rng(2)
    weights = [rng.standard_normal((40, 24), dtype=np.float32) for _ in range(6)]
    kinds = ["o", "down"] * 3
    packed = fast_linear.pack_linears(weights, kinds)
    for kind in ("o", "down"):
        rows = [p.data for p, k in zip(packed, kinds) if k == kind]
        assert all(b.ctypes.data == a.ctypes.data + a.nbytes for a, b in zip(rows, rows[1:]))
        stacked = layer_stack._rows([r.reshape(-1) for r in rows])
        assert stacked.shape == (3, rows[0].size) and np.shares_memory(stacked, rows[0])
    for w, p in zip(weights, packed):
        np.testing.assert_array_equal(p.data, pack(w).data)


def test_pack_into_refuses_a_wrong_destination():
    w = np.ones((8, 16), np.float32)
    with pytest.raises(ValueError, match="C-contiguous float32 array of shape"):
        pack(w, np.empty((1, 16, 8), np.float32))
    with pytest.raises(ValueError, match="C-contiguous float32 array of shape"):
        pack(w, np.empty(panel_shape(8, 16), np.float64))
    panels, k, width = panel_shape(8, 16)
    strided = np.empty((panels, k, 2 * width), np.float32)[:, :, ::2]    # the shape, not contiguous
    with pytest.raises(ValueError, match="C-contiguous float32 array of shape"):
        pack(w, strided)
