"""coda.primitives.tilereduce: ``TileReduce``, row- or column-wise reductions as partials.

``TileReduce(name, of, op, per, post=None)`` reduces tile value ``of`` (width w, C = N*w
columns) with ``op`` in {"sum", "sumsq", "max"}:

* ``per="row"``: one result per row, reducing over columns. Each tile (i, j) writes its
  partial into ``{name}.partials`` of shape (M, n_tiles_n), column j.
* ``per="col"``: one result per column, reducing over rows. Each tile writes row i of
  ``{name}.partials`` of shape (n_tiles_m, C).

Partials are fp32; out-of-bounds elements of ragged tiles contribute the identity (0 for
sum/sumsq, -inf for max). There are no atomics: every partial is written by exactly one
tile, so results are deterministic. ``finalize`` combines the partials (sum, or max) into
output ``name``, of shape (M,) or (C,); if ``post`` is given, the output is
``post(total, n)`` where n is the number of elements reduced per entry (C for per="row",
M for per="col"), e.g. RMSNorm's ``rstd = rsqrt(total / n + eps)``. ``post`` is
backend-polymorphic like an Elementwise ``fn``.

The result is an *output*, not a value: it exists only after the last tile, so no primitive
of the same epilogue can read it (feed it to the next GEMM's epilogue with a VecLoad).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch

from coda.errors import KindError
from coda.geometry import Problem, ceil_div
from coda.primitives._blocks import as_block
from coda.primitives._validators import new_name, one_of, optional_callable_of, read_name
from coda.primitives.base import Primitive
from coda.primitives.context import ReferenceEnv, Subtile, Tile
from coda.specs import TensorSpec, ValueSpec

__all__ = ["TileReduce"]

_IDENTITY = {"sum": 0.0, "sumsq": 0.0, "max": float("-inf")}


@attrs.frozen
class TileReduce(Primitive):
    """Reduce tile value ``of`` per row or per column into per-tile partials + a result."""

    name: str = attrs.field(validator=new_name)
    of: str = attrs.field(validator=read_name)
    op: Literal["sum", "sumsq", "max"] = attrs.field(
        default="sum", validator=one_of("sum", "sumsq", "max")
    )
    per: Literal["row", "col"] = attrs.field(default="row", validator=one_of("row", "col"))
    post: Callable[[Any, int], Any] | None = attrs.field(
        default=None, validator=optional_callable_of(2)
    )

    @property
    def partials_name(self) -> str:
        return f"{self.name}.partials"

    @property
    def identity(self) -> float:
        return _IDENTITY[self.op]

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.of,)

    @property
    def writes(self) -> tuple[str, ...]:
        return ()

    @property
    def label(self) -> str:
        post = "" if self.post is None else f", post={getattr(self.post, '__name__', 'fn')}"
        return f"TileReduce({self.name!r} = {self.op} of {self.of!r} per {self.per}{post})"

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        spec = values[self.of]
        if spec.kind != "tile":
            raise KindError(
                f"{self.label}: {self.of!r} is a {spec.describe()}; TileReduce reduces tile "
                "values (use an Elementwise to broadcast a vector onto a tile first)"
            )
        return ()

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        w = values[self.of].width if self.per == "col" else 1
        role = f"partials_{self.per}"
        return (
            TensorSpec(self.name, self.per, torch.float32, w, direction="out"),
            TensorSpec(self.partials_name, role, torch.float32, w, direction="out"),
        )

    # ---- math shared by every stage -----------------------------------------------------
    def _mapped(self, v: torch.Tensor) -> torch.Tensor:
        return v * v if self.op == "sumsq" else v

    def _reduce(self, v: torch.Tensor, dim: int) -> torch.Tensor:
        return v.amax(dim) if self.op == "max" else v.sum(dim)

    def _combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if self.op == "max" else a + b

    def _post(self, total: torch.Tensor, n: int) -> torch.Tensor:
        if self.post is None:
            return total
        return as_block(self.post(total, n), tuple(total.shape), total.device, f"{self.label}.post")

    # ---- semantics ---------------------------------------------------------------------
    def reference(self, env: ReferenceEnv) -> None:
        f = self._mapped(env.values[self.of])  # (M, C), fp32
        M, C = f.shape
        dim = 1 if self.per == "row" else 0
        env.outputs[self.name] = self._post(self._reduce(f, dim), f.shape[dim])
        if env.tile is None:
            return
        tm, tn = env.tile
        if self.per == "row":  # columns of tile j: [j*tc, (j+1)*tc), tc = tn * width
            tc = int(tn * env.specs[self.of].width)
            nt = ceil_div(env.problem.N, tn)
            padded = torch.full((M, nt * tc), self.identity, dtype=f.dtype, device=f.device)
            padded[:, :C] = f
            env.outputs[self.partials_name] = self._reduce(padded.reshape(M, nt, tc), 2)
        else:
            nt = ceil_div(M, tm)
            padded = torch.full((nt * tm, C), self.identity, dtype=f.dtype, device=f.device)
            padded[:M] = f
            env.outputs[self.partials_name] = self._reduce(padded.reshape(nt, tm, C), 1)

    # ---- tile simulator ----------------------------------------------------------------
    def begin_tile(self, tile: Tile) -> torch.Tensor:
        if self.per == "row":
            return tile.full_rows(self.identity)
        return tile.full_cols(tile.specs[self.of].width, self.identity)

    def visit(self, sub: Subtile, state: torch.Tensor) -> None:
        w = sub.specs[self.of].width
        f = self._mapped(sub.values[self.of])
        f = torch.where(sub.mask(w), f, torch.full_like(f, self.identity))
        if self.per == "row":
            rows = sub.local_rows()
            state[rows] = self._combine(state[rows], self._reduce(f, 1))
        else:
            cols = sub.local_cols(w)
            state[cols] = self._combine(state[cols], self._reduce(f, 0))

    def end_tile(self, tile: Tile, state: torch.Tensor) -> None:
        if self.per == "row":
            tile.write_row_partial(self.partials_name, state)
        else:
            tile.write_col_partial(self.partials_name, state, tile.specs[self.of].width)

    def finalize(
        self,
        partials: Mapping[str, torch.Tensor],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> dict[str, torch.Tensor]:
        p = partials[self.partials_name]
        if self.per == "row":
            total, n = self._reduce(p, 1), problem.cols(specs[self.of].width)
        else:
            total, n = self._reduce(p, 0), problem.M
        return {self.name: self._post(total, n)}

    # ---- CuTeDSL ------------------------------------------------------------------------
    traces_finalize = True

    def trace_finalize(self, fin: Any) -> None:
        from coda.primitives import tracing

        p, out = fin.tensor(self.partials_name), fin.tensor(self.name)
        # sums of squares combine by addition, like sums
        op = "max" if self.op == "max" else "sum"
        if self.per == "row":  # ``post`` divides by the reduced extent: N * width ...
            n = tracing.Float32(fin.cols(fin.specs[self.of].width))
            tracing.finalize_row_reduce(p, out, fin.row, fin.lane, n, op, self.post, fin.lanes)
        else:  # ... or M
            tracing.finalize_col_reduce(
                p, out, fin.col, tracing.Float32(fin.m), op, self.post, fin.col_lane, fin.col_lanes
            )

    # per="row": each thread's rows reduce over a quad, per 64-row band (tracing.BandRows,
    # written by trace_end_band).
    # per="col": each column reduces over a warp's 16 rows (lane butterflies), the 4 warps
    # meet in shared scratch (4 x tile columns fp32) and the tile's row of partials is
    # written after its last subtile.
    def smem_floats(self, values: Mapping[str, ValueSpec], tile_n: int) -> int:
        if self.per == "row":
            return 0
        return 4 * int(tile_n * values[self.of].width)

    def trace_begin_tile(self, tile: Any) -> dict:
        return {}

    def masks_edges(self, zero_outside: frozenset[str]) -> bool:
        # a sum over a value that is 0 past the edge it reduces across needs no mask (see
        # trace): past N for a per-row sum, past M for a per-column one (the other
        # direction's results are never written); a plain frozenset: past both
        zero = getattr(zero_outside, "past_n" if self.per == "row" else "past_m", zero_outside)
        return not (self.op in ("sum", "sumsq") and self.of in zero)

    def trace(self, ctx: Any, values: dict[str, Any], state: dict) -> None:
        from coda.primitives import tracing

        v = ctx.view_of(self.of)
        x = values[self.of]
        if self.op == "sumsq":
            x = x * x
        op = "max" if self.op == "max" else "sum"
        if not self.masks_edges(ctx.tile.zero_outside):
            # 0 outside M x N already (the sum's identity): no per-element bounds mask
            vals = tracing.to_rmem(x, v.layout)
        else:
            # per-row results: rows past M are never written, only columns past N masked
            vals = tracing.masked(
                x,
                v.layout,
                v.coords,
                v.shape_mn,
                _IDENTITY[self.op],
                rows=self.per == "col",
                interior=ctx.tile.interior,
            )
        if self.per == "col":
            tracing.col_accumulate(ctx, op, vals, v, self)
            return
        red = tracing.row_reduce(op, vals, v.frag)
        band = state[ctx.subtile[0]]
        for r, s in red.items():
            band.fold(ctx, op, r, s)

    rollable = True

    def trace_begin_band(self, ctx: Any, state: dict, rolled: bool) -> None:
        if self.per == "row":
            from coda.primitives import tracing

            rows = ctx.view_of(self.of).frag.rows
            state[ctx.subtile[0]] = tracing.BandRows(
                rows, 1, (_IDENTITY[self.op],) if rolled else None
            )

    def trace_end_band(self, ctx: Any, state: dict) -> None:
        if self.per == "row":
            from coda.primitives import tracing

            tracing.write_band(ctx, state[ctx.subtile[0]], (self.partials_name,))

    def trace_end_tile(self, tile: Any, state: dict) -> None:
        if self.per == "col":
            from coda.primitives import tracing

            op = "max" if self.op == "max" else "sum"
            width = tile.specs[self.of].width
            tracing.flush_cols(tile, self, width, op, tile.extra(self.partials_name))
