"""coda.testing.probes: profiling primitives that read the SM clock inside a fused kernel.

* ``MainloopCycles(name)``: per output tile, the SM cycles from the warpgroup ready for the
  tile's mainloop (it reached its tensor-core turn) to its last WGMMA done, through the
  engine's clock hook (``reads_clocks``: ``TraceTile.mainloop_clocks``), as read by the
  warpgroup's thread i for the tile's row i; they write it into the partials
  ``{name}.partials`` (M, tiles_n); the call returns ``name`` (M,): per row, the largest
  value over its row of tiles. Append it to any epilogue::

      out = epi.add(MainloopCycles("cycles"))(A, B, **tensors)
      cycles = out["cycles"][::128]  # the first row of each 128-row tile row

  The value includes the wait for the turn (the other warpgroup's mainloop) when the
  warpgroup was early, so it is at least the tensor cores' time for the tile
  (2 x 128 x tile_n x K / 4096 FLOP per cycle per SM). Off the GPU (reference,
  simulator) the result is 0. ``benchmarks/epilogue_timeline.py`` builds a full per-tile
  timeline the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from coda.geometry import Problem, ceil_div
from coda.primitives._validators import new_name
from coda.primitives.base import Primitive
from coda.primitives.context import ReferenceEnv, Subtile, Tile
from coda.specs import TensorSpec, ValueSpec

__all__ = ["MainloopCycles", "store_if"]


@attrs.frozen
class MainloopCycles(Primitive):
    """Per tile, the mainloop's SM cycles (see the module doc) -> output ``name`` (M,)."""

    name: str = attrs.field(validator=new_name)
    #: the engine hands this primitive the tile's mainloop clocks
    reads_clocks = True

    @property
    def partials(self) -> str:
        return f"{self.name}.partials"

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    @property
    def writes(self) -> tuple[str, ...]:
        return ()

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        return ()

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec(self.name, "row", torch.float32, direction="out"),
            TensorSpec(self.partials, "partials_row", torch.float32, direction="out"),
        )

    def reference(self, env: ReferenceEnv) -> None:
        env.outputs[self.name] = torch.zeros(env.problem.M)  # no clock off the GPU
        if env.tile is not None:
            nt = ceil_div(env.problem.N, env.tile[1])
            env.outputs[self.partials] = torch.zeros(env.problem.M, nt)

    def visit(self, sub: Subtile, state: Any) -> None:
        return None

    def end_tile(self, tile: Tile, state: Any) -> None:
        tile.write_row_partial(self.partials, tile.full_rows(0.0))

    def finalize(
        self,
        partials: Mapping[str, torch.Tensor],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> dict[str, torch.Tensor]:
        return {self.name: partials[self.partials].amax(1)}

    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        return None

    def trace_end_tile(self, tile: Any, state: Any) -> None:
        from cutlass import Float32

        from coda.primitives import tracing

        start, end = tile.mainloop_clocks
        tm, tn = tile.tile_coord
        m, n = tile.shape_mn
        # thread i of the warpgroup writes the tile's row i: every row of the partials
        # that a tile covers is written (the partials live in reused scratch)
        row = tm * tile.config.warpgroup_config.tile_m + tracing.thread_in_warpgroup()
        live = (row < m) & (tn * tile.config.tile_n < n)
        store_if()(tile.extra(self.partials), row, tn, Float32(end - start), live)


@functools.cache
def store_if():
    """``out[row, col] = value`` where ``live`` (a jitted helper: the DSL turns the
    condition into a device branch only in jitted code)."""
    import cutlass.cute as cute

    @cute.jit
    def store_if(out, row, col, value, live):
        if live:
            out[row, col] = value

    return store_if
