"""Geometry of one warpgroup's epilogue fragment, and the reductions built on it (CuTeDSL).

Sits under ``coda.mainloop``; used by the epilogue driver and by primitives' ``trace``.
A subtile of ``epi_m x epi_n`` (64 x 32) is held by the 128 threads of a consumer
warpgroup in the WGMMA accumulator layout: thread t of warp w holds rows
``16 w + t // 4 + {0, 8}`` and columns ``2 (t % 4) + {0, 1} + 8 j``. The fragment's
element order is fixed at trace time; this module derives, statically, each element's
(row, column) offset from the thread's base, and checks the lane structure the shuffles
below rely on (a different layout raises instead of silently reducing wrong values).

* row reductions (over columns): thread-local over the elements of a row, then a
  butterfly over the 4 lanes of a quad (lanes that share rows);
* column reductions (over rows): thread-local over the elements of a column, then across
  the 8 lane groups (lanes that share columns): a butterfly per column
  (:func:`column_allreduce`), or, with 8 or more columns per thread, a reduce-scatter by
  recursive halving (:func:`column_reduce_scatter`: 7 shuffles instead of 24 for 8
  columns, each lane left with its own columns' totals); the result covers the 16 rows
  of one warp, and the 4 warps are combined through shared memory by the caller.

Values of other widths (relative to N: 1/2 or 2) live in fragments derived from the
accumulator's, in a fixed canonical order that the primitives' traces and the kernel's
stores and loads share (:meth:`Fragment.at_width`, :meth:`Fragment.points`):

* width 2: element ``2 i + k`` is column ``2 c_i + k`` of element i's row (32 per thread);
* width 1/2: one element per (even, odd) column pair of the accumulator, in the order of
  the pairs' even elements, at column ``c_i / 2`` (8 per thread).

A (even, odd) column pair of a width-1 or width-2 value is held by one thread
(:meth:`Fragment.pairs`); at width 1/2 the partner column is in the neighbouring lane.
"""

from __future__ import annotations

from fractions import Fraction

from .cute_env import ensure_arch

ensure_arch()

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

#: Lane-offset structure of the WGMMA accumulator: (lane delta) -> (row delta, col delta)
_LANE_STEPS = {1: (0, 2), 4: (1, 0), 32: (16, 0)}


def _static_coords(thr_copy_for, epi_tile, thread: int):
    part = thr_copy_for(thread).partition_S(cute.make_identity_tensor(epi_tile))
    return [tuple(int(v) for v in part[i]) for i in range(cute.size(part))]


class Fragment:
    """Static element geometry of a subtile fragment held by one warpgroup.

    ``offsets[i]`` is (row, col) of element i relative to the thread's first element;
    ``rows`` / ``cols`` list the distinct row / column offsets; ``n`` the element count.
    """

    def __init__(self, tiled_copy, epi_tile):
        c0 = _static_coords(tiled_copy.get_slice, epi_tile, 0)
        r0, k0 = c0[0]
        self._set_offsets([(r - r0, c - k0) for r, c in c0], Fraction(1))
        for lane, (dr, dc) in _LANE_STEPS.items():
            cl = _static_coords(tiled_copy.get_slice, epi_tile, lane)
            moved = [(r - r0 - dr, c - k0 - dc) for r, c in cl]
            if moved != [(r, c) for r, c in self.offsets]:
                raise NotImplementedError(
                    f"epilogue fragment layout is not the WGMMA accumulator layout coda's "
                    f"reductions assume (lane {lane} is not offset by {(dr, dc)})"
                )

    def _set_offsets(self, offsets: list[tuple[int, int]], width: Fraction) -> None:
        self.offsets = offsets
        self.width = width
        self.n = len(offsets)
        self.rows = sorted({r for r, _ in offsets})
        self.cols = sorted({c for _, c in offsets})

    def points(self, points: list, width: Fraction) -> list:
        """(row, col) of every element of a width-``width`` fragment, in canonical order,
        from ``points`` of this (width-1) fragment's elements: static offsets, or a
        thread's global / subtile-local coordinates (DSL integers)."""
        if self.width != 1:
            raise ValueError("points() derives other widths from the width-1 fragment")
        if width == 1:
            return list(points)
        if width == 2:
            return [(r, 2 * c + k) for r, c in points for k in (0, 1)]
        if width == Fraction(1, 2):
            # columns of the accumulator fragment are 2 (lane % 4) + even offsets, so the
            # elements at even offsets are exactly the even (first) columns of pairs
            return [
                (r, c >> 1 if not isinstance(c, int) else c // 2)
                for (r, c), (_, off) in zip(points, self.offsets, strict=True)
                if off % 2 == 0
            ]
        raise ValueError(f"no fragment for width {width}")

    def at_width(self, width: Fraction) -> Fragment:
        """The geometry of a width-``width`` value's fragment (see the module doc)."""
        if width == self.width:
            return self
        geom = object.__new__(Fragment)
        geom._set_offsets(self.points(self.offsets, width), Fraction(width))
        return geom

    def pairs(self) -> list[tuple[int, int]] | None:
        """(even, odd) element indices of the column pairs this thread holds, in the
        canonical order of the half-width fragment; None when pairs span two lanes
        (width 1/2: the thread's first column is odd in every other lane)."""
        if self.width == Fraction(1, 2):
            return None
        return [(i, self.pair_partner(i)) for i, (_, c) in enumerate(self.offsets) if c % 2 == 0]

    def row_members(self, row: int) -> list[int]:
        return [i for i, (r, _) in enumerate(self.offsets) if r == row]

    def col_members(self, col: int) -> list[int]:
        return [i for i, (_, c) in enumerate(self.offsets) if c == col]

    def pair_partner(self, i: int) -> int:
        """Index of the element in the other column of i's (even, odd) column pair."""
        r, c = self.offsets[i]
        partner = (r, c ^ 1)
        return self.offsets.index(partner)


def combine(op: str, a, b):
    """Binary combine of two fp32 DSL scalars for a reduction op."""
    if op == "max":
        return cute.arch.fmax(a, b)
    return a + b


def identity(op: str) -> Float32:
    return Float32(-float("inf")) if op == "max" else Float32(0.0)


def quad_allreduce(op: str, v):
    """Reduce over the 4 lanes of a quad (lanes sharing rows); every lane gets the result."""
    for off in (1, 2):
        v = combine(op, v, cute.arch.shuffle_sync_bfly(v, offset=off))
    return v


def column_allreduce(op: str, v):
    """Reduce over the 8 lanes sharing columns within a warp (lane // 4 varies)."""
    for off in (4, 8, 16):
        v = combine(op, v, cute.arch.shuffle_sync_bfly(v, offset=off))
    return v


#: lane offsets of the 8 lane groups that share columns (lane // 4 varies)
_COLUMN_LANES = (16, 8, 4)


def column_reduce_scatter(op: str, vals: list, cols: list) -> list[tuple]:
    """Reduce this thread's column values over the 8 lanes that share its columns, each
    lane keeping ``len(vals) / 8`` of the totals: a reduce-scatter by recursive halving.
    Each round, a lane keeps one half of its list, sends the other half to its partner
    (the lane ``off`` away) and adds what the partner sent for the kept half: rounds of
    n/2, n/4 and n/8 shuffles (7 for n = 8, where a butterfly per column takes 24), and
    no lane ends up holding a total another lane also holds.

    ``vals[i]`` belongs to column ``cols[i]`` (DSL integers); the list must be in the same
    column order in the 8 lanes (the accumulator layout gives them the same columns).
    Returns this lane's (total, column) pairs. ``len(vals)`` must be a multiple of 8."""
    if len(vals) % 8 or len(vals) != len(cols):
        raise ValueError(f"column_reduce_scatter needs 8k values and columns; got {len(vals)}")
    lane = cute.arch.lane_idx()
    for off in _COLUMN_LANES:
        half = len(vals) // 2
        upper = (lane & off) != 0
        kept_vals, kept_cols = [], []
        for i in range(half):
            lo, hi = vals[i], vals[i + half]
            send = Float32(cutlass.select_(upper, lo, hi))
            keep = Float32(cutlass.select_(upper, hi, lo))
            got = cute.arch.shuffle_sync_bfly(send, offset=off)
            kept_vals.append(combine(op, keep, got))
            kept_cols.append(Int32(cutlass.select_(upper, cols[i + half], cols[i])))
        vals, cols = kept_vals, kept_cols
    return list(zip(vals, cols, strict=True))
