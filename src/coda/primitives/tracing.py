"""CuTeDSL helpers shared by the primitives' ``trace`` methods.

Sits under ``coda.primitives``; imported only at kernel trace time (it imports CuTeDSL).
A traced value is an fp32 ``TensorSSA`` with the shape of one warpgroup's subtile
fragment (tile values, and vectors/scalars broadcast to the fragment). The contexts a
primitive receives:

* ``TraceTile`` (``begin_tile`` / ``end_tile``): the tile coordinate, problem shape,
  fragment geometry, the warpgroup's scratch shared memory and barrier, and
  ``extra(name)`` for the primitive's bound global tensors (vectors, partial outputs,
  targets) and runtime scalars;
* ``TraceSubtile`` (``trace``): the same plus the static subtile index and ``coords``,
  the global (row, col) of every fragment element.

Row-wise state (reductions, online log-sum-exp, target selection) lives per 64-row band
of the tile: subtiles are visited row-major, so a band is complete after its last
subtile, when the partial for those rows is written (one lane per quad writes).
"""

from __future__ import annotations

from typing import Any

import attrs

from ..runtime.cute_env import ensure_arch

ensure_arch()

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..mainloop import fragment as fr


@attrs.define
class TraceTile:
    mainloop: Any  # coda.mainloop.visitor.TileContext
    extras_index: dict
    specs: Any  # the epilogue's value specs
    loaded: dict = attrs.Factory(dict)  # TileLoad name -> fragment (per subtile)
    stored: dict = attrs.Factory(dict)  # TileStore output name -> fragment (per subtile)

    @property
    def tile_coord(self):
        return self.mainloop.tile_coord

    @property
    def shape_mn(self):
        return self.mainloop.shape_mn

    @property
    def frag(self) -> fr.Fragment:
        return self.mainloop.frag

    @property
    def config(self):
        return self.mainloop.config

    def extra(self, name: str):
        return self.mainloop.extras[self.extras_index[name]]


@attrs.define
class TraceSubtile:
    tile: TraceTile
    subtile: tuple[int, int]
    coords: Any

    def extra(self, name: str):
        return self.tile.extra(name)

    @property
    def specs(self):
        return self.tile.specs

    @property
    def frag(self) -> fr.Fragment:
        return self.tile.frag

    @property
    def shape_mn(self):
        return self.tile.shape_mn

    @property
    def band_done(self) -> bool:
        """True on the last subtile of a 64-row band (static)."""
        return self.subtile[1] == self.tile.config.subtiles_per_tile[1] - 1


def frag_layout(ctx: TraceSubtile):
    return cute.make_layout(ctx.coords.shape)


@cute.jit
def full(layout, value):
    """A fragment (TensorSSA) with every element equal to ``value``."""
    t = cute.make_rmem_tensor(layout, Float32)
    t.fill(Float32(value))
    return t.load()


@cute.jit
def gather(layout, coords, vec, axis: cutlass.Constexpr[int], limit):
    """Fragment of ``vec[coord[axis]]`` (fp32) for every element: a row vector broadcast
    over columns (axis 0) or a column vector over rows (axis 1); 0 past ``limit``."""
    t = cute.make_rmem_tensor(layout, Float32)
    for i in cutlass.range_constexpr(cute.size(layout)):
        j = coords[i][axis]
        t[i] = Float32(0.0)
        if j < limit:
            t[i] = Float32(vec[j])
    return t.load()


@cute.jit
def masked(value, layout, coords, shape_mn, fill: cutlass.Constexpr[float]):
    """rmem copy of fragment ``value`` with out-of-bounds elements set to ``fill``."""
    src = cute.make_rmem_tensor(layout, Float32)
    src.store(value)
    out = cute.make_rmem_tensor(layout, Float32)
    for i in cutlass.range_constexpr(cute.size(layout)):
        r, c = coords[i]
        out[i] = Float32(fill)
        if r < shape_mn[0] and c < shape_mn[1]:
            out[i] = src[i]
    return out


def as_fragment(value, layout):
    """A TensorSSA fragment from a traced result (broadcasting a scalar result)."""
    if isinstance(value, cute.TensorSSA):
        return value
    return full(layout, value)


def pick(src, idx: list[int]):
    """TensorSSA of ``src[i] for i in idx`` (a 1-D fragment of len(idx) elements)."""
    t = cute.make_rmem_tensor(cute.make_layout(len(idx)), Float32)
    for j, i in enumerate(idx):
        t[j] = src[i]
    return t.load()


def interleave(even, odd, evens: list[int], odds: list[int], layout):
    """Inverse of two ``pick``s: scatter ``even``/``odd`` back into a full fragment."""
    e = cute.make_rmem_tensor(cute.make_layout(len(evens)), Float32)
    e.store(as_fragment(even, cute.make_layout(len(evens))))
    o = cute.make_rmem_tensor(cute.make_layout(len(odds)), Float32)
    o.store(as_fragment(odd, cute.make_layout(len(odds))))
    t = cute.make_rmem_tensor(layout, Float32)
    for j in range(len(evens)):
        t[evens[j]] = e[j]
        t[odds[j]] = o[j]
    return t.load()


def to_rmem(value, layout):
    t = cute.make_rmem_tensor(layout, Float32)
    t.store(value)
    return t


def row_reduce(op: str, vals, frag: fr.Fragment) -> dict[int, Any]:
    """Per row offset of the thread: reduce its elements, then across the quad."""
    out = {}
    for r in frag.rows:
        members = frag.row_members(r)
        v = vals[members[0]]
        for i in members[1:]:
            v = fr.combine(op, v, vals[i])
        out[r] = fr.quad_allreduce(op, v)
    return out


def row_of(ctx: TraceSubtile, r: int):
    """Global row index of the thread's row offset ``r`` in this subtile."""
    return ctx.coords[ctx.frag.row_members(r)[0]][0]


@cute.jit
def write_row_partial(partials, row, col, value, rows):
    """partials[row, col] = value, by lane 0 of each quad, for in-bounds rows."""
    lane = cute.arch.lane_idx()
    if lane % 4 == 0 and row < rows:
        partials[row, col] = value


def flush_band(ctx: TraceSubtile, band: dict, names: tuple[str, ...]) -> None:
    """On the last subtile of a 64-row band, write each row's state into the per-tile
    partials ``names`` (one value per name: a scalar, or a tuple for several)."""
    if not ctx.band_done:
        return
    outs = [ctx.extra(n) for n in names]
    tn, rows = ctx.tile.tile_coord[1], ctx.shape_mn[0]
    for r, vals in band.items():
        vals = vals if isinstance(vals, tuple) else (vals,)
        row = row_of(ctx, r)
        for out, v in zip(outs, vals, strict=True):
            write_row_partial(out, row, tn, v, rows)


def exp(x):
    return cute.math.exp(x)


@cute.jit
def finite_or_zero(m):
    """``m`` unless it is -inf (a row with no in-bounds element yet), else 0."""
    out = Float32(0.0)
    if m > Float32(-float("inf")):
        out = m
    return out


@cute.jit
def load_index(vec, row, rows, ignore_index: cutlass.Constexpr[int]):
    """``vec[row]`` as Int32 for in-bounds rows whose target is not ``ignore_index``,
    else -1 (never a column)."""
    out = Int32(-1)
    if row < rows:
        t = Int32(vec[row])
        if t != Int32(ignore_index):
            out = t
    return out


@cute.jit
def select_eq(a, b, value):
    """``value`` where a == b, else 0."""
    out = Float32(0.0)
    if a == b:
        out = value
    return out
