"""The fused visitor: an ``Epilogue`` traced into ONE CuTeDSL visitor of the GEMM kernel.

Sits in ``coda.runtime`` between :class:`coda.Epilogue` (the composition) and
:mod:`coda.mainloop` (the kernel). :class:`FusedVisitor` implements the mainloop's
visitor protocol by calling every primitive's trace hooks in order, on each subtile:

* the M x N tensors of ``TileStore`` / ``TileLoad`` become the kernel's TMA stores and
  loads (``store_dtypes`` / ``load_dtypes``, in primitive order);
* every other bound tensor (row/col vectors, targets, per-tile partial outputs) and
  every runtime scalar travels in the kernel's ``extras`` tuple, in ``extras_specs``
  order, and a primitive reaches its own with ``ctx.extra(name)``;
* with ``finalize_in_kernel``, the results of the primitives that trace their finalize
  are kernel outputs too (in ``extras``, after the partials), followed by an int32
  arrival-counter tensor (:func:`counter_slots`): the last tile of each row of tiles
  finalizes those rows, the last of each column of tiles those columns, in the GEMM
  kernel itself (``after_tile``, once the warpgroup has handed the epilogue to the
  other), so no finalize launch follows;
* with ``early_rows``, every tile of a row of tiles inside M arrives at that row's
  counter (the same int32 tensor after the extras) and nothing more: the finalize kernel
  that follows finalizes each row band as soon as its count is complete, on the SMs the
  GEMM's last wave leaves idle, instead of after the whole grid
  (:mod:`coda.runtime.finalize_kernel`).

:func:`unsupported` says, before anything is compiled, why an epilogue cannot be fused
yet (the reference and simulator still run it).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import attrs
import torch

from ..epilogue import Epilogue
from ..primitives import TileLoad, TileStore
from ..primitives.base import Primitive, ZeroOutside
from ..specs import TensorSpec


def unsupported(epi: Epilogue) -> str | None:
    """Why ``epi`` cannot be traced into the kernel today (None when it can)."""
    for p in epi.primitives:
        if type(p).trace is Primitive.trace:
            return f"{p.label} has no CuTeDSL trace (it defines only the reference/simulator)"
    return None


def not_rollable(epi: Epilogue) -> list[str]:
    """Labels of the primitives of ``epi`` whose trace needs a static subtile column
    (``Primitive.rollable`` False): with any, ``GemmConfig.rolled_epilogue`` is refused."""
    return [p.label for p in epi.primitives if not p.rollable]


#: columns of the probe block :func:`zero_outside` evaluates elementwise functions on
_PROBE_COLS = 8


def zero_outside(epi: Epilogue) -> ZeroOutside:
    """The values of ``epi`` that are exactly 0 at every element outside M x N in the
    fused kernel: ``acc`` (TMA fills A's and B's rows and K-columns past their extents
    with zeros, so the accumulator's are 0; a map pass fills acc with 0), every
    ``TileLoad`` (zero-filled the same way), and every ``Elementwise`` result whose inputs
    are all such values and whose function gives exact zeros on zeros (evaluated here, in
    fp32 torch, on a zero block of each input's width). A sum over such a value needs no
    bounds mask (``TraceTile.zero_outside``; TileReduce skips it). Row/col vectors,
    scalars and every other primitive's values are not assumed zero: a product of acc and
    a vector stays masked, the out-of-bounds elements of an op like sigmoid are not 0.

    The result's ``past_n`` (``past_m``) is the wider set of values zero in the columns
    past N of the rows inside M (the rows past M of the columns inside N), where an
    elementwise input may also be a row vector or a scalar (a column vector or a
    scalar): those hold one real value per row inside M, so a function that maps zeros to
    zeros whatever that value is (checked on two probe values) keeps the zeros, e.g. the
    product of acc and rstd. A per-row (per-column) sum over such a value needs no mask:
    the rows past M (columns past N) are never written.

    (With an inf in A or B, or in such a vector, the out-of-bounds products are NaN, not
    0; the in-bounds elements of the same rows or columns are then non-finite too, and so
    are their sums, masked or not.)"""
    return ZeroOutside(
        _zeros_kept(epi, ()),
        past_n=_zeros_kept(epi, ("row", "scalar")),
        past_m=_zeros_kept(epi, ("col", "scalar")),
    )


#: the values a row/col vector or scalar takes in :func:`_zeros_kept`'s two probes
_PROBE_VALUES = (1.5, -2.75)


def _zeros_kept(epi: Epilogue, given_kinds: tuple[str, ...]) -> frozenset[str]:
    """``zero_outside``'s analysis with the values of ``given_kinds`` (row, col, scalar)
    allowed as inputs that hold some value there (probed with each of ``_PROBE_VALUES``)."""
    from ..primitives import Elementwise

    specs = epi.values
    zero = {"acc"}
    for p in epi.primitives:
        if isinstance(p, TileLoad):
            zero.add(p.name)
        elif isinstance(p, Elementwise) and p.ins and any(n in zero for n in p.ins):
            if not all(n in zero or specs[n].kind in given_kinds for n in p.ins):
                continue
            shape = (2, int(_PROBE_COLS * specs[p.out].width))
            if all(_maps_to_zero(p, specs, zero, shape, v) for v in _PROBE_VALUES):
                zero.add(p.out)
    return frozenset(zero)


def _probe_block(spec: Any, value: float) -> torch.Tensor:
    if spec.kind == "row":
        return torch.full((2, 1), value)
    if spec.kind == "scalar":
        return torch.full((1, 1), value)
    return torch.full((1, int(_PROBE_COLS * spec.width)), value)


def _maps_to_zero(p: Any, specs: Any, zero: set, shape: tuple[int, int], value: float) -> bool:
    blocks = {
        n: torch.zeros(2, int(_PROBE_COLS * specs[n].width))
        if n in zero
        else _probe_block(specs[n], value)
        for n in p.ins
    }
    try:
        out = p.evaluate(blocks, specs, shape)
    except Exception:  # an op that cannot run on the probe block: assume nothing
        return False
    return bool((out == 0).all())


def n_multiple(epi: Epilogue) -> int:
    """N must be a multiple of this for ``epi`` to run fused: column pairs never straddle
    the edge (``epi.n_alignment``) and every M x N*w tensor's rows are a multiple of 16
    bytes (TMA), as are B's and a plain output's (N a multiple of 8)."""
    need = math.lcm(8, epi.n_alignment)
    for spec in (*epi.inputs, *epi.outputs):
        if spec.role == "tile":
            row_bytes = spec.width * torch.empty(0, dtype=spec.dtype).element_size()
            need = math.lcm(need, (Fraction(16) / row_bytes).numerator)
    return need


def _extra_specs(epi: Epilogue, finalized: tuple[Primitive, ...]) -> tuple[TensorSpec, ...]:
    ins = tuple(s for s in epi.inputs if s.role != "tile")
    outs = tuple(s for s in epi.outputs if s.is_partials)
    results = tuple(
        s
        for p in finalized
        for s in p.tensors(epi.values)
        if s.direction == "out" and not s.is_partials
    )
    return ins + outs + results


def traced_finalizers(epi: Epilogue) -> tuple[Primitive, ...]:
    """The primitives whose finalize runs on the GPU (``traces_finalize``)."""
    return tuple(
        p
        for p in epi.primitives
        if type(p).finalize is not Primitive.finalize and p.traces_finalize
    )


def _partials_axis(p: Primitive, epi: Epilogue) -> tuple[str, Fraction] | None:
    """("row", 1) or ("col", width) when every partials tensor of ``p`` is of that one
    kind (and width), else None."""
    kinds = {
        (s.role[len("partials_") :], s.width if s.role == "partials_col" else Fraction(1))
        for s in p.tensors(epi.values)
        if s.direction == "out" and s.is_partials
    }
    return next(iter(kinds)) if len(kinds) == 1 else None


def in_kernel_axes(epi: Epilogue) -> tuple[bool, bool] | None:
    """(finalizes rows, finalizes columns) when every GPU-finalized primitive of ``epi``
    can be finalized inside the GEMM kernel, else None (the finalize kernel does it)."""
    rows = cols = False
    for p in traced_finalizers(epi):
        axis = _partials_axis(p, epi)
        if axis is None:
            return None
        rows |= axis[0] == "row"
        cols |= axis[0] == "col"
    return (rows, cols) if rows or cols else None


def padded_tiles(extent, tile: int, cluster: int):
    """Tiles along one dimension as the scheduler enumerates them (whole clusters; the
    tiles past the edge arrive too). Works on Python ints and DSL Int32."""
    tiles = (extent + tile - 1) // tile
    return (tiles + cluster - 1) // cluster * cluster


def counter_slots(config: Any, m: int, n: int) -> int:
    """Length of the arrival-counter tensor: one per row of tiles, then one per column."""
    return padded_tiles(m, config.tile_m, config.cluster_m) + padded_tiles(
        n, config.tile_n, config.cluster_n
    )


@attrs.frozen(cache_hash=True)
class FusedVisitor:
    """Mainloop visitor running ``epilogue`` (a frozen value: part of the cache key);
    ``finalize_in_kernel``: the GEMM kernel finalizes the results itself; ``early_rows``:
    its tiles count themselves in per-row-of-tiles counters for an early finalize kernel
    (module doc)."""

    epilogue: Epilogue
    finalize_in_kernel: bool = False
    early_rows: bool = False

    @property
    def takes_counters(self) -> bool:
        """Whether the kernel takes the int32 arrival counters after its extras."""
        return self.finalize_in_kernel or self.early_rows

    @property
    def finalized(self) -> tuple[Primitive, ...]:
        """The primitives this kernel finalizes (none without ``finalize_in_kernel``)."""
        return traced_finalizers(self.epilogue) if self.finalize_in_kernel else ()

    @property
    def reads_acc(self) -> bool:
        """``Epilogue.reads_acc``: False gives a kernel with no mainloop."""
        return self.epilogue.reads_acc

    @property
    def wants_clocks(self) -> bool:
        """Whether a primitive reads the tile's mainloop clocks (``reads_clocks``: a
        profiling hook; ``TraceTile.mainloop_clocks``)."""
        return any(getattr(p, "reads_clocks", False) for p in self.epilogue.primitives)

    @property
    def wants_waits(self) -> bool:
        """Whether a primitive reads the k-loop's wait cycles (``reads_waits``, with
        ``reads_clocks``: a profiling hook; ``TraceTile.mainloop_waits``)."""
        return any(getattr(p, "reads_waits", False) for p in self.epilogue.primitives)

    @property
    def stores(self) -> tuple[TileStore, ...]:
        return tuple(p for p in self.epilogue.primitives if isinstance(p, TileStore))

    @property
    def loads(self) -> tuple[TileLoad, ...]:
        return tuple(p for p in self.epilogue.primitives if isinstance(p, TileLoad))

    @property
    def store_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(p.dtype for p in self.stores)

    @property
    def load_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(p.dtype for p in self.loads)

    @property
    def store_widths(self) -> tuple[Fraction, ...]:
        return tuple(self.epilogue.values[p.value].width for p in self.stores)

    @property
    def load_widths(self) -> tuple[Fraction, ...]:
        return tuple(p.width for p in self.loads)

    @property
    def extras_specs(self) -> tuple[TensorSpec, ...]:
        return _extra_specs(self.epilogue, self.finalized)

    def _scratch(self, config: Any) -> tuple[dict[Any, int], int]:
        """(each primitive's first float in the shared scratch, the floats in all); with
        ``finalize_in_kernel`` the arrival flag's slot (key ``"arrival"``) comes last."""
        out, at = {}, 0
        for p in self.epilogue.primitives:
            n = p.smem_floats(self.epilogue.values, config.tile_n)
            if n:
                out[p] = at
                at += n
        if self.finalize_in_kernel:  # a slot per warpgroup (by thread index // 128)
            out["arrival"] = at
            at += 4
        return out, at

    def scratch_offsets(self, config: Any) -> dict[Primitive, int]:
        """Each primitive's first float in the shared scratch (those that need some)."""
        return self._scratch(config)[0]

    def smem_bytes(self, config: Any) -> int:
        return 4 * self._scratch(config)[1]

    # ---- compile-time description of extras ------------------------------------------
    def fake_extras(self, m, n) -> tuple:
        """Compile-time stand-ins for ``extras`` (symbolic M and N shared with A, B)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        from ..mainloop import dtypes

        out = []
        for spec in self.extras_specs:
            # columns: N itself at width 1, else its own symbol (N*w is not affine in N)
            cols = n if spec.width == 1 else cute.sym_int32()
            if spec.role == "scalar":
                out.append(cutlass.Float32(0.0))
            elif spec.role == "row":
                out.append(make_fake_compact_tensor(dtypes.to_cutlass(spec.dtype), (m,)))
            elif spec.role == "col":
                out.append(make_fake_compact_tensor(dtypes.to_cutlass(spec.dtype), (cols,)))
            elif spec.role in ("partials_row", "partials_col"):
                shape = (
                    (m, cute.sym_int32())
                    if spec.role == "partials_row"
                    else (
                        cute.sym_int32(),
                        cols,
                    )
                )
                out.append(make_fake_compact_tensor(cutlass.Float32, shape, stride_order=(1, 0)))
            else:
                raise NotImplementedError(f"extras role {spec.role!r} is not fused yet")
        if self.takes_counters:  # the arrival counters
            out.append(make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),)))
        return tuple(out)

    # ---- mainloop visitor hooks ----------------------------------------------------------
    def _trace_tile(self, tctx: Any) -> Any:
        from ..primitives.tracing import TraceTile

        index = {s.name: i for i, s in enumerate(self.extras_specs)}
        return TraceTile(
            mainloop=tctx,
            extras_index=index,
            specs=self.epilogue.values,
            scratch_offsets=self.scratch_offsets(tctx.config),
            zero_outside=zero_outside(self.epilogue),
        )

    def begin_tile(self, tctx: Any) -> Any:
        tile = self._trace_tile(tctx)
        return tile, [p.trace_begin_tile(tile) for p in self.epilogue.primitives]

    def visit(self, ctx: Any, acc: Any, loaded: tuple, vstate: Any) -> tuple:
        from ..primitives.tracing import TraceSubtile

        tile, states = vstate
        tile.loaded = {p.name: v for p, v in zip(self.loads, loaded, strict=True)}
        tile.stored = {}
        sub = TraceSubtile(tile=tile, subtile=ctx.subtile, coords=ctx.coords)
        values: dict[str, Any] = {"acc": acc}
        # an unrolled band ends in its last subtile's trace: each primitive writes its
        # band state out right after tracing it (as early as it can)
        ends = sub.band_done
        for p, state in zip(self.epilogue.primitives, states, strict=True):
            p.trace(sub, values, state)
            if ends:
                p.trace_end_band(sub, state)
        return tuple(tile.stored[p.out] for p in self.stores)

    def end_tile(self, tctx: Any, vstate: Any) -> None:
        tile, states = vstate
        for p, state in zip(self.epilogue.primitives, states, strict=True):
            p.trace_end_tile(tile, state)

    @property
    def splits_interior(self) -> bool:
        """Some primitive masks elements outside M x N (``Primitive.masks_edges``): the
        kernel traces the tile's epilogue twice, without the masks for the tiles inside
        M x N and with them for the edge tiles."""
        zero = zero_outside(self.epilogue)
        return any(p.masks_edges(zero) for p in self.epilogue.primitives)

    @property
    def rollable(self) -> bool:
        """Every primitive's trace takes a runtime subtile column (``Primitive.rollable``):
        the kernel may run a band's subtiles in a runtime loop
        (``GemmConfig.rolled_epilogue``)."""
        return not not_rollable(self.epilogue)

    def _band(self, ctx: Any, vstate: Any):
        from ..primitives.tracing import TraceSubtile

        tile, states = vstate
        return TraceSubtile(tile=tile, subtile=ctx.subtile, coords=ctx.coords), states

    def begin_band(self, ctx: Any, vstate: Any, rolled: bool) -> None:
        """Before band ``ctx.subtile[0]``'s subtiles (``ctx``: its first subtile)."""
        sub, states = self._band(ctx, vstate)
        for p, state in zip(self.epilogue.primitives, states, strict=True):
            p.trace_begin_band(sub, state, rolled)

    def end_band(self, ctx: Any, vstate: Any, rolled: bool) -> None:
        """After band ``ctx.subtile[0]``'s last subtile of a rolled loop (an unrolled
        band ended in its last subtile's ``visit``)."""
        if rolled:
            sub, states = self._band(ctx, vstate)
            for p, state in zip(self.epilogue.primitives, states, strict=True):
                p.trace_end_band(sub, state)

    # ---- the finalize in the kernel ------------------------------------------------------
    def _arrive(self, tctx: Any, tile: Any) -> None:
        """Count this tile in its row (and column) of tiles; remember (in ``tile.memo``)
        whether it was the last one there, which then finalizes."""
        from ..primitives import tracing

        rows, cols = in_kernel_axes(self.epilogue)
        cfg = tctx.config
        m, n = tctx.shape_mn
        tm, tn = tctx.tile_coord
        tiles_m = padded_tiles(m, cfg.tile_m, cfg.cluster_m)
        tiles_n = padded_tiles(n, cfg.tile_n, cfg.cluster_n)
        counters = tctx.extras[len(self.extras_specs)]
        scratch, at = tile.scratch_for("arrival")
        # a slot per warpgroup: the other one may be in its epilogue, using the scratch
        flag = tracing.scratch_slot(scratch, at + tracing.warpgroup_index())
        if rows:
            tile.memo["last_in_row"] = tracing.arrive_last(
                counters, tm, tiles_n, flag, tctx.barrier
            )
        if cols:
            tile.memo["last_in_col"] = tracing.arrive_last(
                counters, tiles_m + tn, tiles_m, flag, tctx.barrier
            )

    def _arrive_early(self, tctx: Any) -> None:
        """Count this tile at its row of tiles' counter, for rows of tiles inside M (the
        cluster's padding rows have no finalize to signal, and would leave their counters
        set)."""
        from ..primitives import tracing

        m, _ = tctx.shape_mn
        tm, _ = tctx.tile_coord
        counters = tctx.extras[len(self.extras_specs)]
        tracing.arrive(counters, tm, tctx.barrier, tm * tctx.config.tile_m < m)

    def after_tile(self, tctx: Any) -> None:
        """After the warpgroup has handed the epilogue to the other one: the tile
        arrives at its row's (column's) counter; the last tile of a row of tiles
        finalizes the row results of its rows (a thread per row), the last of a column
        of tiles the column results of its columns (a thread per column)."""
        if self.early_rows:
            self._arrive_early(tctx)
        if not self.finalize_in_kernel:
            return
        from ..primitives import tracing

        tile = self._trace_tile(tctx)
        # arriving here, not in end_tile, keeps its barriers and fences off the epilogue
        # turn: the other warpgroup's epilogue runs meanwhile
        self._arrive(tctx, tile)
        epi = self.epilogue
        cfg = tctx.config
        m, n = tctx.shape_mn
        tm, tn = tctx.tile_coord
        tensors = {s.name: tile.extra(s.name) for s in self.extras_specs}
        tid = tracing.thread_in_warpgroup()
        far = tracing.Int32(tracing.OUT_OF_RANGE)
        for p in self.finalized:
            kind, width = _partials_axis(p, epi)
            if kind == "row":
                fin = tracing.TraceFinalize(
                    row=tm * cfg.tile_m + tid, lane=tracing.Int32(0), col=far, tensors=tensors,
                    m=m, n=n, specs=epi.values, lanes=1,
                )  # fmt: skip
                tracing.when(tile.memo["last_in_row"], p.trace_finalize, fin)
            else:
                tile_cols = int(cfg.tile_n * width)
                for k in range(-(-tile_cols // 128)):
                    col = tn * tile_cols + tid + 128 * k
                    if 128 * (k + 1) > tile_cols:  # a partial last pass: stay in the tile
                        col = tracing.below_or(col, tn * tile_cols + tile_cols, far)
                    fin = tracing.TraceFinalize(
                        row=far, lane=tracing.Int32(0), col=col, tensors=tensors,
                        m=m, n=n, specs=epi.values, lanes=1,
                    )  # fmt: skip
                    tracing.when(tile.memo["last_in_col"], p.trace_finalize, fin)
