"""CuTeDSL helpers shared by the primitives' ``trace`` methods.

Sits under ``coda.primitives``; imported only at kernel trace time (it imports CuTeDSL).
A traced value is an fp32 ``TensorSSA`` with the shape of one warpgroup's subtile
fragment (tile values, and vectors/scalars broadcast to the fragment). The contexts a
primitive receives:

* ``TraceTile`` (``begin_tile`` / ``end_tile``): the tile coordinate, problem shape,
  fragment geometry, the warpgroup's scratch shared memory and barrier, and
  ``extra(name)`` for the primitive's bound global tensors (vectors, partial outputs,
  targets) and runtime scalars;
* ``TraceSubtile`` (``trace``): the same plus the subtile index (the band
  ``subtile[0]`` static, ``subtile[1]`` static unless the epilogue is rolled) and
  ``coords``, the global (row, col) of every fragment element.

Values have widths (relative to N): a tile or col value of width w is a fragment of
16 w elements in the canonical order of :mod:`coda.mainloop.fragment`; row values and
scalars are width-1 fragments, converted with :func:`broadcast` where they meet values of
another width. ``ctx.view(w)`` gives the geometry, global coordinates and layout of a
width-w fragment (``ctx.view(1)``: the accumulator's).

Row-wise state (reductions, online log-sum-exp, target selection) lives per 64-row band
of the tile in registers (:class:`BandRows`, set up by ``trace_begin_band``): subtiles are
visited row-major, so a band is complete after its last subtile, when
``trace_end_band`` writes the partial for those rows (one lane per quad writes). In a
rolled epilogue (``GemmConfig.rolled_epilogue``) a band's subtiles run in a runtime loop
over one copy of the traced code: ``subtile[1]`` is then a DSL integer.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import attrs

from ..mainloop.cute_env import ensure_arch

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
    scratch_offsets: dict = attrs.Factory(dict)  # primitive -> its first scratch float
    #: traced values shared by the subtiles of one row (or column) of subtiles of this
    #: tile: ``TraceSubtile.per_band`` (e.g. a row vector's loads, made once per band)
    memo: dict = attrs.Factory(dict)
    #: values that are exactly 0 outside M x N in this kernel
    #: (``coda.runtime.fused.zero_outside``, a ``ZeroOutside``: with the wider sets of
    #: values zero past N / past M): sums over them need no bounds mask
    zero_outside: frozenset = frozenset()

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
    def interior(self) -> bool:
        """This trace runs for tiles inside M x N only (``TileContext.interior``)."""
        return getattr(self.mainloop, "interior", False)

    @property
    def config(self):
        return self.mainloop.config

    @property
    def mainloop_clocks(self):
        """(SM clock when this warpgroup was ready for the tile's mainloop, when its last
        WGMMA completed): ``clock64`` values, set for primitives with ``reads_clocks =
        True`` (a profiling hook; ``coda.mainloop.visitor.TileContext``,
        ``benchmarks/epilogue_timeline.py``)."""
        return tuple(self.mainloop.clocks[:2])

    @property
    def mainloop_waits(self):
        """Where the tile's k-loop spent its cycles after its first k-tile, summed over
        the k-tiles: (waiting for each A/B stage to arrive, issuing the stage's WGMMAs,
        waiting for the previous stage's WGMMAs to complete; the last wait, for all of
        them, included): ``clock64`` differences, set for primitives with
        ``reads_waits = True`` as well as ``reads_clocks`` (a profiling hook that puts
        clock reads in the k-loop; ``benchmarks/epilogue_timeline.py --waits``)."""
        return tuple(self.mainloop.clocks[2:5])

    def extra(self, name: str):
        return self.mainloop.extras[self.extras_index[name]]

    def scratch_for(self, key) -> tuple[Any, int]:
        """(the visitor's fp32 shared scratch, the first float of ``key``'s part)."""
        return self.mainloop.scratch, self.scratch_offsets[key]


@attrs.frozen
class View:
    """A width-``width`` fragment of this thread: ``frag`` its static geometry,
    ``coords[i]`` the global (row, col) of element i (col in the value's own N*w
    columns), ``layout`` its register layout, ``shape_mn`` the value's (M, N*w)."""

    width: Fraction
    frag: fr.Fragment
    coords: Any
    layout: Any
    shape_mn: tuple


@attrs.define
class TraceSubtile:
    tile: TraceTile
    subtile: tuple[int, int]
    coords: Any
    _views: dict = attrs.Factory(dict)

    def extra(self, name: str):
        return self.tile.extra(name)

    def per_band(self, key, axis: int, make):
        """``make()`` traced once per tile and band of subtiles: the subtiles that share
        this one's subtile row (axis 0: values that depend only on the rows, e.g. a row
        vector's loads) or subtile column (axis 1: only on the columns), in the order the
        epilogue visits them; later subtiles of the band reuse the traced value instead of
        loading it again. The subtile loop is unrolled at trace time, so the value is
        defined (dominates) wherever it is reused. ``key`` names everything else the
        value depends on."""
        at = self.subtile[axis]
        if not isinstance(at, int):  # a rolled subtile loop: each subtile traces it anew
            return make()
        k = (key, axis, at)
        memo = self.tile.memo
        if k not in memo:
            memo[k] = make()
        return memo[k]

    def view(self, width: Fraction = Fraction(1)) -> View:
        """The fragment geometry of width-``width`` values in this subtile."""
        width = Fraction(width)
        if width not in self._views:
            frag = self.frag
            if width == 1:
                coords, layout = self.coords, cute.make_layout(self.coords.shape)
            else:
                base = [self.coords[i] for i in range(frag.n)]
                coords = frag.points(base, width)
                layout = cute.make_layout(len(coords))
            M, N = self.shape_mn
            shape = (M, value_cols(N, width))
            self._views[width] = View(width, frag.at_width(width), coords, layout, shape)
        return self._views[width]

    def view_of(self, name: str) -> View:
        """The view of value ``name``'s width (width 1 for row values and scalars)."""
        spec = self.specs[name]
        return self.view(spec.width if spec.has_cols else Fraction(1))

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
        """True on the last subtile of a 64-row band of an unrolled epilogue (static)."""
        last = self.tile.config.subtiles_per_tile[1] - 1
        return isinstance(self.subtile[1], int) and self.subtile[1] == last

    @property
    def first_in_band(self) -> bool:
        """True on the first subtile of a 64-row band of an unrolled epilogue (a rolled
        one's runtime subtile index is never known to be the first)."""
        return isinstance(self.subtile[1], int) and self.subtile[1] == 0


def value_cols(n, width: Fraction):
    """N * width for a DSL (or Python) integer N (N is even whenever width is 1/2)."""
    if width == 1:
        return n
    return n * 2 if width == 2 else n // 2


def frag_layout(ctx: TraceSubtile):
    return ctx.view(1).layout


def broadcast(ctx: TraceSubtile, value, width: Fraction):
    """A row value or scalar (a width-1 fragment) as a width-``width`` fragment."""
    width = Fraction(width)
    if width == 1:
        return value
    frag = ctx.frag
    src = to_rmem(value, frag_layout(ctx))
    # every element of a width-w fragment sits in the row of some accumulator element
    rows = frag.points(frag.offsets, width)
    idx = [frag.row_members(r)[0] for r, _ in rows]
    return place(pick(src, idx), ctx.view(width).layout)


def place(flat, layout):
    """A flat fragment re-laid out as ``layout`` (same element order and count)."""
    src = cute.make_rmem_tensor(cute.make_layout(cute.size(layout)), Float32)
    src.store(flat)
    out = cute.make_rmem_tensor(layout, Float32)
    for i in range(cute.size(layout)):
        out[i] = src[i]
    return out.load()


@cute.jit
def full(layout, value):
    """A fragment (TensorSSA) with every element equal to ``value``."""
    t = cute.make_rmem_tensor(layout, Float32)
    t.fill(Float32(value))
    return t.load()


def same_index_groups(frag: fr.Fragment, axis: int) -> tuple[tuple[int, ...], ...]:
    """Element indices of ``frag`` grouped by their static row (axis 0) or column
    (axis 1) offset: the elements of one group read the same vector entry."""
    keys = sorted({off[axis] for off in frag.offsets})
    return tuple(tuple(i for i, off in enumerate(frag.offsets) if off[axis] == k) for k in keys)


@cute.jit
def gather(layout, coords, vec, axis: cutlass.Constexpr[int], limit, groups: cutlass.Constexpr):
    """Fragment of ``vec[coord[axis]]`` (fp32) for every element: a row vector broadcast
    over columns (axis 0) or a column vector over rows (axis 1); 0 past ``limit``.
    ``groups`` (``same_index_groups``): one global load per group, copied to the rest
    (a subtile's 16 elements per thread span 2 rows and 8 columns)."""
    t = cute.make_rmem_tensor(layout, Float32)
    for g in cutlass.range_constexpr(len(groups)):
        first = groups[g][0]
        j = coords[first][axis]
        t[first] = Float32(0.0)
        if j < limit:
            t[first] = Float32(vec[j])
        for m in cutlass.range_constexpr(1, len(groups[g])):
            t[groups[g][m]] = t[first]
    return t.load()


@cute.jit
def masked(
    value,
    layout,
    coords,
    shape_mn,
    fill: cutlass.Constexpr[float],
    rows: cutlass.Constexpr[bool] = True,
    interior: cutlass.Constexpr[bool] = False,
):
    """rmem copy of fragment ``value`` with out-of-bounds elements set to ``fill``.

    ``rows=False`` masks the columns past N only: for per-row results, whose rows past M
    are never written (``write_row_partial`` checks the row), so their values may be
    anything; it saves a compare per element. ``interior=True`` (pass
    ``ctx.tile.interior``, with ``Primitive.masks_edges`` saying True): the trace is for
    tiles inside M x N, nothing to mask."""
    src = cute.make_rmem_tensor(layout, Float32)
    src.store(value)
    if cutlass.const_expr(interior):
        return src
    out = cute.make_rmem_tensor(layout, Float32)
    for i in cutlass.range_constexpr(cute.size(layout)):
        r, c = coords[i]
        out[i] = Float32(fill)
        if cutlass.const_expr(rows):
            if r < shape_mn[0] and c < shape_mn[1]:
                out[i] = src[i]
        else:
            if c < shape_mn[1]:
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


def sum_terms(terms):
    """The sum of traced fp32 ``terms`` (at least one), started at the first term: Python's
    ``sum`` starts with an add of 0.0, which the compiler must keep (-0 + 0 is +0)."""
    terms = iter(terms)
    total = next(terms)
    for t in terms:
        total = total + t
    return total


def quad_allreduce_band(band: BandRows, op: str) -> None:
    """Combine each row's values of ``band`` (``k`` = 1) across the quad's lanes, in
    place: for a row state whose lanes each keep their own elements' part over a band's
    subtiles and meet once, at the band's end (``Primitive.trace_end_band``;
    ``TargetSelect``). ``TileReduce``'s row sums do not: measured slower that way
    (docs/fused-epilogues.md, "Fewer FP32 instructions, measured")."""
    for r, vals in list(band.items()):
        band.put(r, (fr.quad_allreduce(op, vals[0]),))


def row_of(ctx: TraceSubtile, r: int):
    """Global row index of the thread's row offset ``r`` in this subtile."""
    return ctx.coords[ctx.frag.row_members(r)[0]][0]


@cute.jit
def write_row_partial(partials, row, col, value, rows, live):
    """partials[row, col] = value, by lane 0 of each quad, for in-bounds rows of a live
    tile (a cluster may own a tile past the last column: it has no partials column)."""
    lane = cute.arch.lane_idx()
    if live and lane % 4 == 0 and row < rows:
        partials[row, col] = value


class BandRows:
    """Per-row state of a row-wise reduction over one 64-row band: ``k`` fp32 values for
    each row offset ``r`` of the thread. Rolled (``identity`` given): registers set up
    before the band's runtime subtile loop (``Primitive.trace_begin_band``), filled with
    the identity, so the state outlives each subtile's code. Unrolled: the traced values
    themselves, the first subtile's put as they are (no combine with an identity)."""

    def __init__(self, rows, k: int, identity: tuple[float, ...] | None):
        self.slot = {r: i for i, r in enumerate(rows)}
        self.k = k
        self.regs = None
        self.vals: dict[int, tuple] = {}
        if identity is not None:
            self.regs = cute.make_rmem_tensor(cute.make_layout(len(self.slot) * k), Float32)
            for i in range(len(self.slot)):
                for j in range(k):
                    self.regs[i * k + j] = Float32(identity[j])

    def old(self, ctx: TraceSubtile, r: int) -> tuple | None:
        """Row offset ``r``'s values so far; None on an unrolled band's first subtile."""
        if self.regs is None and ctx.first_in_band:
            return None
        return self.old_values(r)

    def put(self, r: int, vals: tuple) -> None:
        if self.regs is None:
            self.vals[r] = tuple(vals)
            return
        at = self.slot[r] * self.k
        for j in range(self.k):
            self.regs[at + j] = vals[j]

    def fold(self, ctx: TraceSubtile, op: str, r: int, value) -> None:
        """Combine one value into row offset ``r`` (``k`` = 1) with ``op``."""
        old = self.old(ctx, r)
        self.put(r, (value if old is None else fr.combine(op, old[0], value),))

    def items(self):
        """(row offset, its values) for each row offset of the thread."""
        for r in self.slot:
            yield r, self.old_values(r)

    def old_values(self, r: int) -> tuple:
        if self.regs is None:
            return self.vals[r]
        at = self.slot[r] * self.k
        return tuple(self.regs[at + j] for j in range(self.k))


def write_band(ctx: TraceSubtile, band: BandRows, names: tuple[str, ...]) -> None:
    """After the last subtile of a 64-row band (``trace_end_band``; ``ctx``: a subtile of
    the band), write each row's state into the per-tile partials ``names`` (one per value
    of a row)."""
    _write_rows(ctx, band.items(), names)


def flush_band(ctx: TraceSubtile, band: dict, names: tuple[str, ...]) -> None:
    """From ``trace``, for state kept in a dict ``{row offset: value or tuple}``: on the
    last subtile of a 64-row band of an unrolled epilogue, write each row's state into
    the per-tile partials ``names``; on the others nothing. (Rolled epilogues need
    :class:`BandRows` and ``trace_end_band`` with :func:`write_band`.)"""
    if ctx.band_done:
        _write_rows(ctx, band.items(), names)


def _write_rows(ctx: TraceSubtile, rows, names: tuple[str, ...]) -> None:
    outs = [ctx.extra(n) for n in names]
    tn, m = ctx.tile.tile_coord[1], ctx.shape_mn[0]
    live = tn * ctx.tile.config.tile_n < ctx.shape_mn[1]
    for r, vals in rows:
        vals = vals if isinstance(vals, tuple) else (vals,)
        row = row_of(ctx, r)
        for out, v in zip(outs, vals, strict=True):
            write_row_partial(out, row, tn, v, m, live)


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
def index_below(index, limit):
    """``index`` if it is below ``limit``, else -1 (never a column)."""
    out = Int32(-1)
    if index < limit:
        out = index
    return out


@cute.jit
def select_eq(a, b, value):
    """``value`` where a == b, else 0."""
    out = Float32(0.0)
    if a == b:
        out = value
    return out


@cute.jit
def select_eq_else(a, b, value, other):
    """``value`` where a == b, else ``other`` (a select: no arithmetic)."""
    out = other
    if a == b:
        out = value
    return out


# ---- pairs of adjacent columns ---------------------------------------------------------
def pairwise(ctx: TraceSubtile, fn, mode: str, args: list, width: Fraction):
    """Apply ``fn`` to (even, odd) column pairs of width-``width`` values (``Elementwise``
    with ``pairwise=mode``). ``args``: (fragment, spec, split) per input; split inputs
    pass their even and odd columns, width/2 inputs one element per pair, row values and
    scalars their row's value. Returns the output fragment (width/2 for "reduce")."""
    view = ctx.view(width)
    pairs = view.frag.pairs()
    if pairs is None:
        return _pairwise_across_lanes(ctx, fn, args, view)
    evens = [e for e, _ in pairs]
    odds = [o for _, o in pairs]
    call = []
    for value, spec, split in args:
        if split:
            src = to_rmem(value, view.layout)
            call += [pick(src, evens), pick(src, odds)]
        elif spec.has_cols:  # width/2: its canonical order is the pairs' order
            half = ctx.view(width / 2)
            call.append(pick(to_rmem(value, half.layout), list(range(half.frag.n))))
        else:
            src = to_rmem(value, frag_layout(ctx))
            rows = [view.frag.offsets[e][0] for e in evens]
            call.append(pick(src, [ctx.frag.row_members(r)[0] for r in rows]))
    result = fn(*call)
    if mode == "reduce":
        flat = as_fragment(result, cute.make_layout(len(evens)))
        return place(flat, ctx.view(width / 2).layout)
    even, odd = result
    return interleave(even, odd, evens, odds, view.layout)


def _pairwise_across_lanes(ctx: TraceSubtile, fn, args: list, view: View):
    """``pairwise="map"`` at width 1/2: a pair's columns sit in lanes l and l ^ 1. Both
    lanes exchange their elements, evaluate ``fn`` on the pair and keep their half."""
    call = []
    for value, _spec, split in args:
        if split:
            even, odd = lane_pairs(to_rmem(value, view.layout), view.frag.n)
            call += [even, odd]
        else:  # row values and scalars (no width-1/4 values exist)
            call.append(broadcast(ctx, value, view.width))
    even, odd = fn(*call)
    return keep_lane_half(
        as_fragment(even, view.layout), as_fragment(odd, view.layout), view.layout
    )


@cute.jit
def lane_pairs(src, n: cutlass.Constexpr[int]):
    """(even, odd) column fragments of a pair split across lanes l, l ^ 1 (the odd lane
    of the two holds the odd column)."""
    odd_lane = cute.arch.lane_idx() % 2
    e = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    o = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    for k in cutlass.range_constexpr(n):
        mine = src[k]
        other = cute.arch.shuffle_sync_bfly(mine, offset=1)
        e[k] = mine
        o[k] = other
        if odd_lane == 1:
            e[k] = other
            o[k] = mine
    return e.load(), o.load()


@cute.jit
def keep_lane_half(even, odd, layout):
    """This lane's column of each pair: ``even`` in even lanes, ``odd`` in odd lanes."""
    odd_lane = cute.arch.lane_idx() % 2
    e = cute.make_rmem_tensor(layout, Float32)
    e.store(even)
    o = cute.make_rmem_tensor(layout, Float32)
    o.store(odd)
    out = cute.make_rmem_tensor(layout, Float32)
    for k in cutlass.range_constexpr(cute.size(layout)):
        out[k] = e[k]
        if odd_lane == 1:
            out[k] = o[k]
    return out.load()


# ---- column reductions (over the rows of a tile) ---------------------------------------
def col_accumulate(ctx: TraceSubtile, op: str, vals, view: View, key) -> None:
    """Reduce each column of this subtile over its 64 rows down to one value per warp
    (thread-local, then across the 8 lane groups: a reduce-scatter when a thread holds a
    multiple of 8 columns, else a butterfly per column) and combine it into the warp's
    slot of the tile's column scratch (written by the first row of subtiles, combined
    after)."""
    tile = ctx.tile
    scratch, base = tile.scratch_for(key)
    tile_cols = int(tile.config.tile_n * view.width)
    col0 = tile.tile_coord[1] * tile_cols
    first = ctx.subtile[0] == 0
    local, cols = [], []
    for c in view.frag.cols:
        members = view.frag.col_members(c)
        v = vals[members[0]]
        for i in members[1:]:
            v = fr.combine(op, v, vals[i])
        local.append(v)
        cols.append(view.coords[members[0]][1] - col0)
    if len(local) % 8 == 0:
        # each lane ends with its own columns' totals and writes them all
        for v, col in fr.column_reduce_scatter(op, local, cols):
            _col_slot(scratch, base, tile_cols, col, v, op, first, True)
        return
    for v, col in zip(local, cols, strict=True):  # width 1/2: 4 columns per thread
        _col_slot(scratch, base, tile_cols, col, fr.column_allreduce(op, v), op, first, False)


@cute.jit
def _col_slot(
    scratch,
    base,
    tile_cols,
    col,
    v,
    op: cutlass.Constexpr[str],
    first,
    every_lane: cutlass.Constexpr[bool],
):
    """Put warp-total ``v`` of column ``col`` into this warp's slot: from every lane (after
    a reduce-scatter each lane holds other columns' totals), or from lanes 0-3 only (after
    an all-reduce the 8 lanes of a column group hold the same totals)."""
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
    idx = base + warp * tile_cols + col
    if cutlass.const_expr(every_lane):
        _slot_update(scratch, idx, v, op, first)
    else:
        if cute.arch.lane_idx() < 4:
            _slot_update(scratch, idx, v, op, first)


@cute.jit
def _slot_update(scratch, idx, v, op: cutlass.Constexpr[str], first):
    if cutlass.const_expr(first):
        scratch[idx] = v
    else:
        scratch[idx] = fr.combine(op, scratch[idx], v)


def flush_cols(tile: TraceTile, key, width: Fraction, op: str, partials) -> None:
    """After a tile's last subtile: combine the 4 warps' column values in a fixed order
    and write the tile's row of column partials (in-bounds columns only)."""
    scratch, base = tile.scratch_for(key)
    tile_cols = int(tile.config.tile_n * width)
    limit = value_cols(tile.shape_mn[1], width)
    tile.mainloop.barrier.arrive_and_wait()
    # a cluster may own a tile past the last row (M not a multiple of the cluster's
    # rows): it has no row of partials
    live = tile.tile_coord[0] * tile.config.tile_m < tile.shape_mn[0]
    _write_cols(scratch, base, tile_cols, op, partials, tile.tile_coord, limit, live)


@cute.jit
def _write_cols(
    scratch,
    base,
    tile_cols: cutlass.Constexpr[int],
    op: cutlass.Constexpr[str],
    partials,
    tile_coord,
    limit,
    live,
):
    tid = cute.arch.thread_idx()[0] % 128
    tm, tn = tile_coord
    for k in cutlass.range_constexpr((tile_cols + 127) // 128):
        col = tid + 128 * k
        gcol = tn * tile_cols + col
        if live and col < tile_cols and gcol < limit:
            total = scratch[base + col]
            for w in cutlass.range_constexpr(1, 4):
                total = fr.combine(op, total, scratch[base + w * tile_cols + col])
            partials[tm, gcol] = total


# ---- finalize: per-tile partials -> results, in the epilogue's finalize kernel ---------
# Row results: ``lanes`` neighbouring threads per row (a warp for long rows), striding
# over the row's tiles (coalesced reads of the (rows, tiles) partials, however many
# tiles: an LM head has ~1000), then a butterfly across them. Column results:
# ``col_lanes`` threads per column, a warp holding 32 / col_lanes consecutive columns;
# the column's threads stride over the tiles' rows of the (tiles, cols) partials, then
# meet in a butterfly.
#: Iterations of a lane's loop over a row's tiles unrolled together where one thread
#: folds a whole row or column (the GEMM kernel's own finalize: few tiles, registers
#: tight). With 2 the LM head's finalize (2048 rows x 1002 tiles) was latency-bound at
#: about 0.6 TB/s (48 us on an H200).
FOLD_UNROLL = 8
#: Tiles each thread of the finalize kernel (several threads per row or column) reads
#: per round of its fold: a round issues all its loads before it combines any (a thread
#: past the last tile re-reads that tile and drops the value), so T tiles over L threads
#: take ceil(T / (L * FOLD_BATCH)) memory round trips. The unrolled loop above took
#: ~10 (3 unrolled bodies of 8 and a rolled remainder of 7 at 31 tiles a lane): the LM
#: head's log-sum-exp + target finalize ended 44 us after its GEMM on an H200
#: (2048 rows x 1002 tiles, 24.6 MB of partials: ~8 us at HBM speed).
FOLD_BATCH = 16
#: ... but a round holds no more slots than the thread has tiles, rounded up to one of
#: these sizes (a run-time branch on the line's tile count, uniform over the kernel):
#: with every round ``FOLD_BATCH`` long, a short row of 16 tiles over 16 threads issued
#: 16 loads a thread for its one tile (the slots past the end re-read the last tile),
#: and log-sum-exp + target's finalize at M = 16384, N = K = 2048 ended 11.2 us after its
#: GEMM instead of 4.2 with one load per tile (H200); sized rounds: 4.7 us, and 13.7 us
#: for the LM head's 1002 tiles a row (33.2 with one load per tile;
#: ``results/finalize_tail_ab_h200.json``).
FOLD_ROUND_SIZES = (1, 4, FOLD_BATCH)


@attrs.define
class TraceFinalize:
    """What a primitive's ``trace_finalize`` sees: ``row``, ``lane`` and ``lanes`` (for row
    results: the row, and this thread's place among the ``lanes`` neighbouring threads
    that share it: up to a warp in the finalize kernel, one thread in the GEMM kernel's
    own finalize), ``col``, ``col_lane`` and ``col_lanes`` (for column results: the
    column, and this thread's place among the column's threads: up to 32 in the finalize
    kernel, one in the GEMM kernel; a warp holds 32 / col_lanes consecutive columns, its lanes
    ``col_lane * (32 // col_lanes) + j``), ``tensor(name)`` for its partials
    and result tensors, the problem's ``m`` and ``n`` (Int32), ``cols(width)`` = N * width
    and the epilogue's value ``specs``. A row or column out of range (``row >= M``,
    ``col >= N * width``) has nothing to finalize: guard on it."""

    row: Any
    lane: Any
    col: Any
    tensors: dict
    m: Any
    n: Any
    specs: Any
    lanes: int = 32
    #: this thread's place among the ``col_lanes`` threads of its column (column results)
    col_lane: Any = 0
    col_lanes: int = 1

    def tensor(self, name: str):
        return self.tensors[name]

    def cols(self, width: Fraction):
        return value_cols(self.n, Fraction(width))


def lanes_allreduce(op: str, v, lanes: int, apart: int = 1):
    """Reduce over ``lanes`` threads of a warp that sit ``apart`` lanes from each other
    (a row's: neighbours, 32 of them in the finalize kernel, 1 in the GEMM kernel: nothing
    to do); every one of them gets the result (a butterfly)."""
    off = apart
    while off < apart * lanes:
        v = fr.combine(op, v, cute.arch.shuffle_sync_bfly(v, offset=off))
        off *= 2
    return v


def round_tiles(t0, lanes: int, n, size: int = FOLD_BATCH):
    """The ``size`` tiles a thread reads in the round starting at tile ``t0`` (its tiles
    ``lanes`` apart), each clamped to the last tile ``n - 1`` (in bounds: the values past
    the end are dropped by :func:`fold_round`); yielded one by one, so a caller loading as
    it goes traces each index right before its load."""
    for j in range(size):
        yield below_or(t0 + j * lanes, n, n - 1)


def fold_round(op: str, acc, loaded: list, t0, lanes: int, n):
    """``acc`` combined with one round's ``loaded`` fp32 values (the partials at
    :func:`round_tiles`, every load issued before this combines any), those past the
    last tile left out."""
    for j in range(len(loaded)):
        acc = fr.combine(op, acc, value_below(t0 + j * lanes, n, loaded[j], fr.identity(op)))
    return acc


@cute.jit
def _fold_rounds(
    p,
    line,
    lane,
    n,
    acc,
    op: cutlass.Constexpr[str],
    lanes: cutlass.Constexpr[int],
    size: cutlass.Constexpr[int],
):
    """``acc`` combined with this thread's tiles of ``p[line, :]`` in rounds of ``size``."""
    for t0 in cutlass.range(lane, n, lanes * size, unroll=1):
        got = [Float32(p[line, t]) for t in round_tiles(t0, lanes, n, size)]
        acc = fold_round(op, acc, got, t0, lanes, n)
    return acc


@cute.jit
def fold_tiles(p, line, lane, op: cutlass.Constexpr[str], lanes: cutlass.Constexpr[int]):
    """This thread's share of ``p[line, :]`` (a (lines, tiles) tensor) combined: the tiles
    from its ``lane`` on, ``lanes`` apart (one thread: a loop unrolled by ``FOLD_UNROLL``;
    several: rounds of up to ``FOLD_BATCH`` loads, ``FOLD_ROUND_SIZES``). The caller
    meets the line's threads."""
    acc = fr.identity(op)
    n = cute.size(p, mode=[1])
    if cutlass.const_expr(lanes == 1):
        for t in cutlass.range(lane, n, lanes, unroll=FOLD_UNROLL):
            acc = fr.combine(op, acc, Float32(p[line, t]))
    else:
        one, few, many = FOLD_ROUND_SIZES
        if n <= one * lanes:
            acc = _fold_rounds(p, line, lane, n, acc, op, lanes, one)
        else:
            if n <= few * lanes:
                acc = _fold_rounds(p, line, lane, n, acc, op, lanes, few)
            else:
                acc = _fold_rounds(p, line, lane, n, acc, op, lanes, many)
    return acc


@cute.jit
def fold_row(p, row, lane, op: cutlass.Constexpr[str], lanes: cutlass.Constexpr[int] = 32):
    """Combine ``p[row, :]`` (a (rows, tiles) tensor) over every tile, across the row's
    ``lanes`` neighbouring threads (:func:`fold_tiles`): every one of them returns the
    result."""
    return lanes_allreduce(op, fold_tiles(p, row, lane, op, lanes), lanes)


@cute.jit
def fold_col(p, col, op: cutlass.Constexpr[str], lane=0, lanes: cutlass.Constexpr[int] = 1):
    """Combine ``p[:, col]`` (a (tiles, cols) tensor) over every tile, across the column's
    ``lanes`` threads (:func:`fold_tiles` over the transposed view; they sit 32 / lanes
    lanes apart in one warp): every one of them returns the result."""
    by_col = cute.make_tensor(p.iterator, cute.select(p.layout, mode=[1, 0]))
    return col_lanes_allreduce(op, fold_tiles(by_col, col, lane, op, lanes), lanes)


def col_lanes_allreduce(op: str, v, lanes: int):
    """Reduce over the ``lanes`` threads of a column (32 / lanes apart in a warp)."""
    return lanes_allreduce(op, v, lanes, 32 // lanes)


@cute.jit
def finalize_row_reduce(
    p, out, row, lane, n, op: cutlass.Constexpr[str], post, lanes: cutlass.Constexpr[int] = 32
):
    """``out[row] = post(combined partials of the row, n)``: ``lanes`` threads per row."""
    if row < cute.size(p, mode=[0]):
        total = fold_row(p, row, lane, op, lanes)
        if cutlass.const_expr(post is not None):
            total = post(total, n)
        if lane == 0:
            out[row] = Float32(total)


@cute.jit
def finalize_col_reduce(
    p, out, col, n, op: cutlass.Constexpr[str], post, lane=0, lanes: cutlass.Constexpr[int] = 1
):
    """``out[col] = post(combined partials of the column, n)``: ``lanes`` threads per
    column (see :class:`TraceFinalize`)."""
    cols = cute.size(p, mode=[1])
    if cutlass.const_expr(lanes == 1):
        if col < cols:
            total = fold_col(p, col, op)
            if cutlass.const_expr(post is not None):
                total = post(total, n)
            out[col] = Float32(total)
    else:
        # the warp's first column decides for the whole warp (the shuffles need every
        # lane); lanes past the last column read it and write nothing
        if col - col % (32 // lanes) < cols:
            total = fold_col(p, below_or(col, cols, cols - 1), op, lane, lanes)
            if col < cols:
                if lane == 0:
                    if cutlass.const_expr(post is not None):
                        total = post(total, n)
                    out[col] = Float32(total)


def merge_max_sum(m, s, m2, s2):
    """Two running (max, sum of exp(x - max)) pairs merged into one (a -inf max: no
    element yet)."""
    top = fr.combine("max", m, m2)
    base = finite_or_zero(top)
    return top, s * cute.math.exp(m - base) + s2 * cute.math.exp(m2 - base)


def warp_merge_max_sum(m, s, lanes: int = 32):
    """Merge the running (max, sum of exp(x - max)) of each group of ``lanes`` neighbouring
    lanes (a power of two, at most 32); every lane of the group gets the merged pair."""
    off = 1
    while off < lanes:
        om = cute.arch.shuffle_sync_bfly(m, offset=off)
        os_ = cute.arch.shuffle_sync_bfly(s, offset=off)
        m, s = merge_max_sum(m, s, om, os_)
        off *= 2
    return m, s


@cute.jit
def _logsumexp_rounds(
    pmax, psum, row, lane, n, m, s, lanes: cutlass.Constexpr[int], size: cutlass.Constexpr[int]
):
    """The running (max, sum of exp(x - max)) ``(m, s)`` merged with this thread's tiles
    of the row in rounds of ``size`` (``finalize_logsumexp``)."""
    for t0 in cutlass.range(lane, n, lanes * size, unroll=1):
        at = list(round_tiles(t0, lanes, n, size))
        pms = [Float32(pmax[row, t]) for t in at]
        pss = [Float32(psum[row, t]) for t in at]
        for j in cutlass.range_constexpr(size):
            inside = t0 + j * lanes
            pm = value_below(inside, n, pms[j], Float32(-float("inf")))
            ps = value_below(inside, n, pss[j], Float32(0.0))
            top = fr.combine("max", m, pm)
            base = finite_or_zero(top)
            s = s * cute.math.exp(m - base) + ps * cute.math.exp(pm - base)
            m = top
    return m, s


@cute.jit
def finalize_logsumexp(pmax, psum, out, row, lane, lanes: cutlass.Constexpr[int] = 32):
    """``out[row]`` = log-sum-exp of the row from its per-tile (max, sum of exp(x - max)),
    ``lanes`` threads per row, in ONE pass over the partials: each thread keeps its own
    running (max, sum) (``merge_max_sum``), then the row's threads merge their pairs."""
    if row < cute.size(pmax, mode=[0]):
        m = Float32(-float("inf"))
        s = Float32(0.0)
        n = cute.size(pmax, mode=[1])
        if cutlass.const_expr(lanes == 1):
            for t in cutlass.range(lane, n, lanes, unroll=FOLD_UNROLL):
                # merge_max_sum, written out: the loop carries m and s as plain names (the
                # form run on the H200; a tuple assignment in this dynamic loop has not been)
                pm = Float32(pmax[row, t])
                ps = Float32(psum[row, t])
                top = fr.combine("max", m, pm)
                base = finite_or_zero(top)
                s = s * cute.math.exp(m - base) + ps * cute.math.exp(pm - base)
                m = top
        else:  # rounds of tiles (FOLD_ROUND_SIZES): every load of a round issued first
            one, few, many = FOLD_ROUND_SIZES
            if n <= one * lanes:
                m, s = _logsumexp_rounds(pmax, psum, row, lane, n, m, s, lanes, one)
            else:
                if n <= few * lanes:
                    m, s = _logsumexp_rounds(pmax, psum, row, lane, n, m, s, lanes, few)
                else:
                    m, s = _logsumexp_rounds(pmax, psum, row, lane, n, m, s, lanes, many)
        if cutlass.const_expr(lanes > 1):
            m, s = warp_merge_max_sum(m, s, lanes)
        if lane == 0:
            out[row] = finite_or_zero(m) + cute.math.log(s)


def merge_entropy(m, s, t, m2, s2, t2):
    """Two running (max, sum of exp(x - max), sum of exp(x - max) (x - max)) triples of
    ``SoftmaxEntropy`` merged into one (a -inf max: no element yet, sums 0)."""
    top = fr.combine("max", m, m2)
    base = finite_or_zero(top)
    f = cute.math.exp(m - base)
    f2 = cute.math.exp(m2 - base)
    t_out = (t + (finite_or_zero(m) - base) * s) * f + (t2 + (finite_or_zero(m2) - base) * s2) * f2
    return top, s * f + s2 * f2, t_out


def warp_merge_entropy(m, s, t, lanes: int = 32):
    """``merge_entropy`` over each group of ``lanes`` neighbouring lanes (a power of two,
    at most 32); every lane of the group gets the merged triple."""
    off = 1
    while off < lanes:
        om = cute.arch.shuffle_sync_bfly(m, offset=off)
        os_ = cute.arch.shuffle_sync_bfly(s, offset=off)
        ot = cute.arch.shuffle_sync_bfly(t, offset=off)
        m, s, t = merge_entropy(m, s, t, om, os_, ot)
        off *= 2
    return m, s, t


@cute.jit
def finalize_entropy(
    pmax, psum, pwsum, out, out_lse, row, lane, lanes: cutlass.Constexpr[int] = 32
):
    """``out[row]`` = the entropy log S - T / S of the row's softmax from its per-tile
    (max, sum, weighted sum) triples (``SoftmaxEntropy``), and ``out_lse[row]`` = its
    log-sum-exp M + log S unless ``out_lse`` is None; ``lanes`` threads per row: each
    thread merges its tiles (``merge_entropy``, written out: the dynamic loop carries m,
    s and t as plain names), then the row's threads merge theirs."""
    if row < cute.size(pmax, mode=[0]):
        m = Float32(-float("inf"))
        s = Float32(0.0)
        t = Float32(0.0)
        n = cute.size(pmax, mode=[1])
        for k in cutlass.range(lane, n, lanes, unroll=1):
            pm = Float32(pmax[row, k])
            ps = Float32(psum[row, k])
            pt = Float32(pwsum[row, k])
            top = fr.combine("max", m, pm)
            base = finite_or_zero(top)
            f = cute.math.exp(m - base)
            f2 = cute.math.exp(pm - base)
            t = (t + (finite_or_zero(m) - base) * s) * f + (
                pt + (finite_or_zero(pm) - base) * ps
            ) * f2
            s = s * f + ps * f2
            m = top
        if cutlass.const_expr(lanes > 1):
            m, s, t = warp_merge_entropy(m, s, t, lanes)
        if lane == 0:
            h = Float32(0.0)
            if s > Float32(0.0):
                h = cute.math.log(s) - t / s
            out[row] = h
            if cutlass.const_expr(out_lse is not None):
                out_lse[row] = finite_or_zero(m) + cute.math.log(s)


# ---- finalize inside the GEMM kernel ---------------------------------------------------
# The last tile to finish a row of tiles (or a column of tiles) finalizes those rows (or
# columns) itself, so a reducing epilogue needs no second launch. Each row (column) of
# tiles has an int32 arrival counter in global memory; a tile's warpgroup arrives once,
# after all its partials are written, and the arrival that completes the count resets the
# counter to 0 (so the buffer is ready for the next launch on the same stream) and
# finalizes. The ordering is the usual one of a grid-wide arrival: every thread's partial
# stores precede a barrier of the warpgroup; one thread then fences (acquire-release, GPU
# scope) and adds 1; the thread that completes the count fences again before its
# warpgroup reads the other tiles' partials.

#: An index past every row and column: the finalize guard of the other kind of result.
OUT_OF_RANGE = 1 << 30


def is_counting_thread():
    """Whether this thread counts its warpgroup's tile at an arrival counter: the
    warpgroup's last thread, not the one that issued its TMA stores (which a fence
    would wait for)."""
    return thread_in_warpgroup() == 127


def count_tile(counters, index):
    """One thread's arrival at ``counters[index]`` once its warpgroup's barrier has
    ordered every partial store before it: a GPU-scope acquire-release fence, then a
    relaxed atomic add of 1; the count before it."""
    cute.arch.fence_acq_rel_gpu()
    return cute.arch.atomic_add(
        ptr=(counters.iterator + index).llvm_ptr, val=Int32(1), sem="relaxed", scope="gpu"
    )


@cute.jit
def arrive_last(counters, index, expected, flag, barrier):
    """True (in every thread of the warpgroup) when this tile is the last of the
    ``expected`` tiles to arrive at ``counters[index]``. ``flag``: a one-float slot of
    the warpgroup's shared scratch that carries the answer to its 128 threads."""
    barrier.arrive_and_wait()
    if is_counting_thread():
        old = count_tile(counters, index)
        flag[0] = Float32(0.0)
        if old == expected - 1:
            counters[index] = Int32(0)
            cute.arch.fence_acq_rel_gpu()
            flag[0] = Float32(1.0)
    barrier.arrive_and_wait()
    return flag[0] != Float32(0.0)


@cute.jit
def arrive(counters, index, barrier, live):
    """When ``live`` (the same in the whole warpgroup), count this tile at
    ``counters[index]`` once all its partials are written (the warpgroup's barrier, then
    one thread's GPU-scope fence and atomic add): the signal a finalize kernel that
    finalizes each row of tiles as soon as it is complete waits for
    (``coda.runtime.finalize_kernel``, ``early``), which also resets the counter."""
    if live:
        barrier.arrive_and_wait()
        if is_counting_thread():
            count_tile(counters, index)


def thread_in_warpgroup():
    """This thread's index in its warpgroup (0..127)."""
    return cute.arch.thread_idx()[0] % 128


def scratch_slot(scratch, offset):
    """A one-element view of the shared scratch at ``offset`` (a float)."""
    return cute.make_tensor(scratch.iterator + offset, cute.make_layout(1))


def warpgroup_index():
    """This thread's warpgroup in the CTA (thread index // 128), warp-uniform."""
    return cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128)


@cute.jit
def when(flag, body, arg):
    """``body(arg)`` traced under the dynamic condition ``flag``."""
    if flag:
        body(arg)


@cute.jit
def below_or(index, limit, other):
    """``index`` if it is below ``limit``, else ``other``."""
    out = other
    if index < limit:
        out = index
    return out


@cute.jit
def value_below(index, limit, value, other):
    """``value`` if ``index`` is below ``limit``, else ``other`` (fp32)."""
    out = other
    if index < limit:
        out = value
    return out
