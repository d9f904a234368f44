"""coda.primitives.base: the ``Primitive`` contract every epilogue step fulfils.

A primitive is an ``attrs`` frozen class: its fields are its whole configuration, so value
equality and hashing come for free and are the compile-cache key of an ``Epilogue`` later
(never write ``__eq__`` by hand). Callable fields (an Elementwise ``fn``) compare by
identity: two different lambdas are two different primitives, the same function object is
the same primitive.

A primitive has four faces, one per stage of its life:

1. **Dataflow (build time)**: ``reads`` / ``writes`` (value names), ``infer`` (the specs of
   the values it writes, given the specs of everything defined so far; raises an
   ``EpilogueError`` subclass when its inputs do not fit), ``tensors`` (the input and
   output tensors it binds), ``n_alignment`` (what N must be a multiple of).
2. **Semantics**: ``reference(env)`` on whole tensors, in eager PyTorch. This *is* the
   meaning of the primitive.
3. **Tile simulator**: ``begin_tile(tile) -> state``, ``visit(sub, state)`` once per
   subtile (row-major inside the tile), ``end_tile(tile, state)`` (write per-tile partials),
   then ``finalize(partials, problem, specs)`` once after the last tile (combine partials
   into the final outputs). This is exactly the schedule of the fused GPU kernel, on CPU tensors.
4. **CuTeDSL**: ``trace_begin_tile(tile) -> state``, ``trace(ctx, values, state)`` per
   subtile and ``trace_end_tile(tile, state)`` emit the same computation into the fused
   visitor of the GEMM kernel, on register fragments of one subtile (see
   ``coda.primitives.tracing``). They sit next to the simulator hooks in every kind; the
   base ``trace`` raises ``NotImplementedError`` (a primitive without it cannot be fused).
   ``masks_edges`` says whether ``trace`` masks elements outside M x N: the kernel then
   traces the tile's epilogue apart for the tiles inside M x N, without the masks.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from coda.geometry import Problem
from coda.primitives.context import ReferenceEnv, Subtile, Tile
from coda.specs import TensorSpec, ValueSpec

__all__ = ["COL_LANES", "Primitive", "Source", "ZeroOutside"]

#: Threads that finalize one column result in the epilogue's finalize kernel for short
#: columns (``coda.runtime.finalize.lanes`` picks per problem size; a warp holds
#: 32 / lanes consecutive columns; see ``Primitive.trace_finalize``). With one
#: thread per column a 16384-row problem's column (128 tiles) was a chain of 16 rounds
#: of 8 loads on a grid of only N threads: 8.8 us per column result at N = 2048 (H100).
COL_LANES = 8


class ZeroOutside(frozenset):
    """The values a fused kernel holds as exact zeros outside M x N
    (``coda.runtime.fused.zero_outside``), as the frozenset of those zero at every element
    outside M x N, plus two wider sets for reductions that drop the other direction's
    edge anyway:

    * ``past_n``: zero in the columns past N of every row inside M (what a per-row sum
      needs: rows past M are never written). Besides the set's values, an elementwise
      result of them and of row vectors or scalars (one value per row inside M) is, when
      its function maps zeros to zeros whatever those are, e.g. ``rstd * dz``.
    * ``past_m``: zero in the rows past M of every column inside N (a per-column sum),
      the same with column vectors.

    Membership (``name in zero``) is the strict set, so a primitive that only knows a
    frozenset reads it as before."""

    past_n: frozenset[str]
    past_m: frozenset[str]

    def __new__(cls, both=(), past_n=(), past_m=()):
        self = super().__new__(cls, both)
        self.past_n = frozenset(past_n) | self
        self.past_m = frozenset(past_m) | self
        return self

    def __reduce__(self):
        return (type(self), (frozenset(self), self.past_n, self.past_m))


@attrs.frozen
class Primitive(abc.ABC):
    """Base class of every epilogue primitive (see the module doc for the contract).

    Subclass it with ``@attrs.frozen`` and implement ``reads``, ``writes``, ``infer``,
    ``reference`` and ``visit``; override ``tensors``, ``begin_tile``, ``end_tile`` and
    ``finalize`` when the primitive binds tensors or carries state across subtiles.
    """

    # ---- dataflow ----------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def reads(self) -> tuple[str, ...]:
        """Names of the values this primitive reads, in argument order."""

    @property
    @abc.abstractmethod
    def writes(self) -> tuple[str, ...]:
        """Names of the values this primitive defines (may be empty)."""

    @abc.abstractmethod
    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        """Specs of ``writes`` (same order), given the specs of all values defined so far
        (every name in ``reads`` is present). Raise an ``EpilogueError`` subclass if the
        inputs do not fit (wrong kind, width mismatch...)."""

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        """The tensors this primitive binds: inputs the caller passes (direction "in") and
        outputs it returns (direction "out", partials included). A method, not a property,
        because an output's width follows the value it stores or reduces."""
        return ()

    def n_alignment(self, values: Mapping[str, ValueSpec]) -> int:
        """N must be a multiple of this for the primitive to make sense (e.g. 2 for a
        column pair split); tile and subtile widths too."""
        return 1

    def check_tensors(
        self,
        tensors: Mapping[str, Any],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> None:
        """Validate the *contents* of this primitive's bound inputs (their shapes and dtypes
        are already checked against ``tensors()``), e.g. that targets are valid column
        indices; raise ``coda.errors.InputError``. Called before evaluation by
        ``Epilogue.reference`` and ``coda.simulate``. Most primitives have nothing to check."""
        return None

    @property
    def label(self) -> str:
        """Short human name used in error messages, e.g. ``TileStore('x')``: the values it
        writes; for one that writes none (a user primitive producing only outputs), its
        string fields when it is an attrs class (``RowAbsMax(name='amax', of='acc')``),
        else what it reads."""
        cls = type(self).__name__
        if self.writes:
            return f"{cls}({', '.join(repr(n) for n in self.writes)})"
        if attrs.has(type(self)):
            named = [
                f"{a.name}={getattr(self, a.name)!r}"
                for a in attrs.fields(type(self))
                if isinstance(getattr(self, a.name), str)
            ]
            if named:
                return f"{cls}({', '.join(named)})"
        return f"{cls}(reads {', '.join(repr(n) for n in self.reads)})"

    # ---- semantics ---------------------------------------------------------------------
    @abc.abstractmethod
    def reference(self, env: ReferenceEnv) -> None:
        """Whole-tensor semantics in eager PyTorch: read ``env.values`` / ``env.tensors``,
        put written values into ``env.values`` (fp32, 2-D layout) and outputs into
        ``env.outputs`` (per-tile partials too when ``env.tile`` is set)."""

    # ---- tile simulator hooks ----------------------------------------------------------
    def begin_tile(self, tile: Tile) -> Any:
        """Called at the start of each tile; returns this primitive's per-tile state
        (``None`` for stateless primitives)."""
        return None

    @abc.abstractmethod
    def visit(self, sub: Subtile, state: Any) -> None:
        """Run on one subtile: read ``sub.values``, write this primitive's values into
        ``sub.values``, update ``state`` in place, store through ``sub.store``."""

    def end_tile(self, tile: Tile, state: Any) -> None:
        """Called after the last subtile of a tile: write per-tile partials from ``state``
        (``tile.write_row_partial`` / ``write_col_partial``). Stateless: nothing to do."""
        return None

    def finalize(
        self,
        partials: Mapping[str, torch.Tensor],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> dict[str, torch.Tensor]:
        """After the last tile: combine this primitive's partial outputs (``partials``, by
        name) into its final outputs; ``specs`` are the epilogue's value specs. Primitives
        without partials have nothing to finalize."""
        return {}

    # ---- CuTeDSL -----------------------------------------------------------------------
    def smem_floats(self, values: Mapping[str, ValueSpec], tile_n: int) -> int:
        """fp32 words of shared-memory scratch the trace needs (e.g. to combine the 4
        warps of a warpgroup in a column reduction) for output tiles ``tile_n`` columns
        wide; reached in the trace through ``tile.scratch_for(self)``. Default: none."""
        return 0

    def masks_edges(self, zero_outside: frozenset[str]) -> bool:
        """True when ``trace`` masks elements outside M x N (``tracing.masked``), given
        the values known to be 0 there (``zero_outside``): the kernel then traces the
        epilogue twice, once for tiles inside M x N, where ``ctx.tile.interior`` is
        True and the masks can go (``tracing.masked(..., interior=...)``), and once for
        the edge tiles. Default: False."""
        return False

    def trace_begin_tile(self, tile: Any) -> Any:
        """Trace-time twin of ``begin_tile``: emit per-tile setup, return the per-tile
        state (Python objects holding DSL values; ``None`` for stateless primitives).
        ``tile`` is a ``coda.primitives.tracing.TraceTile``."""
        return None

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        """Emit this primitive into the fused CuTeDSL visitor, on one subtile: read and
        write ``values`` (fp32 ``TensorSSA`` fragments of the subtile, vectors broadcast),
        update ``state``; ``ctx`` is a ``coda.primitives.tracing.TraceSubtile``. The twin
        of ``visit``; kinds that cannot be fused yet keep this default."""
        raise NotImplementedError(
            f"{type(self).__name__} has no CuTeDSL trace: it runs in Epilogue.reference and "
            "coda.simulate only; implement trace() to fuse it into the GEMM kernel"
        )

    def trace_end_tile(self, tile: Any, state: Any) -> None:
        """Trace-time twin of ``end_tile`` (write what is left of the per-tile state)."""
        return None

    #: True when ``trace`` is right for a *runtime* subtile column: in a rolled epilogue
    #: (``GemmConfig.rolled_epilogue``) each 64-row band's subtiles run in a runtime loop
    #: over one copy of the traced code, so ``ctx.subtile[1]`` is a DSL integer, a value
    #: traced in one subtile is not defined in the next, and state carried across the
    #: band's subtiles lives in registers set up before the loop (``trace_begin_band``,
    #: e.g. ``tracing.BandRows``). ``ctx.subtile[0]`` (the band) stays a Python int.
    #: False (the default) keeps a kernel with this primitive unrolled.
    rollable: ClassVar[bool] = False

    def trace_begin_band(self, ctx: Any, state: Any, rolled: bool) -> None:
        """Before the subtiles of 64-row band ``ctx.subtile[0]`` (``ctx``: a
        ``TraceSubtile`` of the band's first subtile): set up state carried across the
        band (``rolled``: its subtiles run in a runtime loop). Default: nothing."""
        return None

    def trace_end_band(self, ctx: Any, state: Any) -> None:
        """After the last subtile of band ``ctx.subtile[0]``: write the band's state out
        (e.g. per-row partials). Default: nothing."""
        return None

    #: True when ``trace_finalize`` emits this primitive's ``finalize`` on the GPU: in the
    #: GEMM kernel itself (the last tile of a row or column of tiles finalizes it) or in
    #: the epilogue's finalize kernel (one small launch after the GEMM for all of them);
    #: primitives without it are finalized by their torch ``finalize`` instead.
    traces_finalize: ClassVar[bool] = False

    def trace_finalize(self, fin: Any) -> None:
        """Trace-time twin of ``finalize`` for one result element: read this primitive's
        partials and write its result at ``fin.row`` or, for column results, at
        ``fin.col``. A row is finalized by ``fin.lanes`` neighbouring threads (a power of
        two up to 32 in the finalize kernel, ``coda.runtime.finalize.lanes``; 1 in the GEMM
        kernel): stride over the row's tiles from ``fin.lane`` by ``fin.lanes`` and
        combine with ``tracing.lanes_allreduce``; a column by ``fin.col_lanes`` threads
        (a power of two up to 32 in the finalize kernel, 1 in the GEMM kernel): stride
        from ``fin.col_lane`` and combine with
        ``tracing.col_lanes_allreduce`` (``tracing.finalize_col_reduce`` does both; a
        primitive that ignores the lanes is still right, each of them writing the same
        value). Guard on ``fin.row < M`` and ``fin.col < N * width`` (the other kind of
        result gets an index out of range). ``fin`` is a
        ``coda.primitives.tracing.TraceFinalize``. Only called when ``traces_finalize``
        is True."""
        raise NotImplementedError(f"{type(self).__name__} has no trace_finalize")


@attrs.frozen
class Source(Primitive):
    """A primitive that reads no value and writes exactly one, named by its ``name`` field
    (the loads and ``OneHot``): ``reads`` and ``writes`` follow from that."""

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.name,)  # type: ignore[attr-defined]
