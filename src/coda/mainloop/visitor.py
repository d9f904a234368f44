"""The epilogue-visitor hook protocol of the PingPong mainloop.

Sits under ``coda.mainloop`` between the fixed GEMM kernel and whatever runs in its
epilogue. The kernel's epilogue driver walks each output tile in subtiles
(``GemmConfig.epi_tile``); for every tile and subtile it calls the visitor's hooks at
trace time, so the visitor emits CuTeDSL straight into the kernel:

* ``begin_tile(ctx)``   once per output tile, before the first subtile;
* ``visit(ctx, frag)``  per subtile, on the fp32 register fragment of the accumulator;
  returns the fragment to store as D (the kernel converts and TMA-stores it);
* ``end_tile(ctx)``     once per output tile, after the last subtile.

``smem_bytes`` declares extra shared memory the visitor needs (reserved out of the
A/B ring by :func:`coda.mainloop.config.plan_smem`). A plain GEMM is the identity
visitor. Visitors are frozen values: they are part of the kernel's compile-cache key.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class SubtileContext:
    """What a visitor may use while tracing one subtile (trace-time objects).

    ``tile_coord`` is the (m, n) index of the output tile, ``subtile`` the static (m, n)
    index of the subtile within it, ``coords`` a register tensor view of each fragment
    element's global (row, col) (for masking and vector loads), ``shape_mn`` the
    problem's dynamic (M, N), ``tidx`` the thread index within the warpgroup.
    """

    tile_coord: Any
    subtile: tuple[int, int]
    coords: Any
    shape_mn: Any
    tidx: Any


@attrs.frozen
class IdentityVisitor:
    """The plain GEMM: D = acc."""

    def smem_bytes(self) -> int:
        return 0

    def begin_tile(self, ctx: Any) -> None:
        return None

    def visit(self, ctx: SubtileContext, frag: Any) -> Any:
        return frag

    def end_tile(self, ctx: Any) -> None:
        return None
