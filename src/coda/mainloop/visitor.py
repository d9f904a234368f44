"""The epilogue-visitor hook protocol of the PingPong mainloop.

Sits under ``coda.mainloop`` between the fixed GEMM kernel and whatever runs in its
epilogue. A visitor is a frozen value (it is part of the kernel's compile-cache key) that
declares the resources it needs and emits CuTeDSL through three hooks, called at trace
time by the kernel's epilogue driver:

* resources: ``store_dtypes`` (one M x N output per entry, written through shared memory
  and TMA stores), ``load_dtypes`` (one M x N operand per entry, loaded through TMA into
  a shared-memory ring by a dedicated producer warp, ahead of the epilogue), optional
  ``store_widths`` / ``load_widths`` (1/2, 1 or 2 per entry: the tensor is M x N*w and
  its fragments follow :mod:`coda.mainloop.fragment`'s order; 1 when absent), optional
  ``store_accumulate`` (one flag per stored tensor: True adds the subtile into global
  memory with a TMA reduce-add, ``out += value``, instead of overwriting it; the output
  is never read by the kernel, so this costs no extra pass),
  ``smem_bytes(config)`` (scratch for cross-warp reductions, shared by the two consumer
  warpgroups, whose epilogues take turns; one copy per warpgroup with
  ``concurrent_epilogues``);
* ``begin_tile(tctx) -> state`` once per output tile;
* ``visit(ctx, acc, loaded, state) -> stores`` per subtile: ``acc`` is the fp32
  accumulator fragment (a ``TensorSSA``), ``loaded`` one fp32 fragment per
  ``load_dtypes`` entry; it returns one fp32 fragment per ``store_dtypes`` entry;
* ``end_tile(tctx, state)`` after the last subtile;
* optional ``begin_band(ctx, state, rolled)`` / ``end_band(ctx, state, rolled)`` around each
  64-row band of subtiles (``ctx``: the band's first subtile); with ``rollable`` True a
  visitor may be run rolled (``GemmConfig.rolled_epilogue``): a band's subtiles in a
  runtime loop over one copy of ``visit``'s code, ``ctx.subtile[1]`` then a DSL integer
  and state carried across the band set up in ``begin_band``;
* optional ``after_tile(tctx)``, once the warpgroup has handed the epilogue's
  shared memory and store path to the other warpgroup: work that needs neither (e.g.
  finalizing results from global partials) overlaps the other's epilogue there. It gets
  no per-tile state: it is traced once per tile, outside the branch of a visitor with
  ``splits_interior`` (whose tile epilogue, ``begin_tile`` to ``end_tile``, is traced
  twice: once with ``tctx.interior`` True, for the tiles inside M x N, once for the
  edge tiles).

Extra global tensors and scalars (vectors, partial outputs, runtime floats) travel in the
kernel's ``extras`` tuple and reach the hooks as ``ctx.extras``; the visitor reads and
writes them directly from registers. A plain GEMM is :class:`AccStore`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class TileContext:
    """Trace-time facts about the tile being visited (device values are DSL values).

    ``tile_coord``: (m, n) tile index; ``shape_mn``: the problem's (M, N); ``extras``:
    the extra tensors/scalars; ``frag``: the :class:`coda.mainloop.fragment.Fragment`
    geometry helper of this warpgroup; ``scratch``: the visitor's shared memory (an fp32
    tensor) or None; ``barrier``: a named barrier over the 128 threads of the warpgroup.
    ``clocks``: for a visitor with ``wants_clocks`` (a profiling hook), two SM clocks
    (``clock64``): when this warpgroup was ready for the tile's mainloop (it reached its
    tensor-core turn; the read is issued with the turn's barrier, whose blocking is
    deferred, so it does not wait for the turn) and when its last WGMMA completed; a map
    pass (no mainloop) gives its epilogue's start twice. None otherwise. A visitor that
    also ``wants_waits`` gets three more: the k-loop's cycles after its first k-tile in
    its A/B stage waits, its WGMMA issue and its WGMMA waits (0 for a map pass).
    ``interior``: True when this trace of the epilogue runs only for tiles that lie
    inside M x N (a visitor with ``splits_interior`` is traced twice, once for those
    tiles, with no bounds checks to make, and once for the edge tiles).
    """

    tile_coord: Any
    shape_mn: Any
    extras: Any
    frag: Any
    scratch: Any
    barrier: Any
    config: Any
    clocks: Any = None
    interior: bool = False


@attrs.frozen
class SubtileContext:
    """``TileContext`` plus the (m, n) subtile index (m static; n static unless the
    epilogue is rolled) and the fragment's global coordinates (``coords[i]`` is the
    (row, col) of fragment element i)."""

    tile: TileContext
    subtile: tuple[int, int]
    coords: Any


@attrs.frozen
class AccStore:
    """The plain GEMM: D = acc (or D += acc with ``accumulate``), stored as ``dtype``."""

    dtype: torch.dtype = torch.bfloat16
    accumulate: bool = False

    @property
    def store_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.dtype,)

    @property
    def store_accumulate(self) -> tuple[bool, ...]:
        return (self.accumulate,)

    @property
    def load_dtypes(self) -> tuple[torch.dtype, ...]:
        return ()

    def smem_bytes(self, config: Any) -> int:
        return 0

    def begin_tile(self, tctx: TileContext) -> None:
        return None

    def visit(self, ctx: SubtileContext, acc: Any, loaded: tuple, state: Any) -> tuple:
        return (acc,)

    def end_tile(self, tctx: TileContext, state: Any) -> None:
        return None
