"""The fused visitor: an ``Epilogue`` traced into ONE CuTeDSL visitor of the GEMM kernel.

Sits in ``coda.runtime`` between :class:`coda.Epilogue` (the composition) and
:mod:`coda.mainloop` (the kernel). :class:`FusedVisitor` implements the mainloop's
visitor protocol by calling every primitive's trace hooks in order, on each subtile:

* the M x N tensors of ``TileStore`` / ``TileLoad`` become the kernel's TMA stores and
  loads (``store_dtypes`` / ``load_dtypes``, in primitive order);
* every other bound tensor (row/col vectors, targets, per-tile partial outputs) and
  every runtime scalar travels in the kernel's ``extras`` tuple, in ``extras_specs``
  order, and a primitive reaches its own with ``ctx.extra(name)``.

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
from ..primitives.base import Primitive
from ..specs import TensorSpec


def unsupported(epi: Epilogue) -> str | None:
    """Why ``epi`` cannot be traced into the kernel today (None when it can)."""
    for p in epi.primitives:
        if type(p).trace is Primitive.trace:
            return f"{p.label} has no CuTeDSL trace (it defines only the reference/simulator)"
    return None


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


def _extra_specs(epi: Epilogue) -> tuple[TensorSpec, ...]:
    ins = tuple(s for s in epi.inputs if s.role != "tile")
    outs = tuple(s for s in epi.outputs if s.is_partials)
    return ins + outs


@attrs.frozen(cache_hash=True)
class FusedVisitor:
    """Mainloop visitor running ``epilogue`` (a frozen value: part of the cache key)."""

    epilogue: Epilogue

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
        return _extra_specs(self.epilogue)

    def _scratch(self, config: Any) -> tuple[dict[Primitive, int], int]:
        """(each primitive's first float in the shared scratch, the floats in all)."""
        out, at = {}, 0
        for p in self.epilogue.primitives:
            n = p.smem_floats(self.epilogue.values, config.tile_n)
            if n:
                out[p] = at
                at += n
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
        return tuple(out)

    # ---- mainloop visitor hooks ----------------------------------------------------------
    def begin_tile(self, tctx: Any) -> Any:
        from ..primitives.tracing import TraceTile

        index = {s.name: i for i, s in enumerate(self.extras_specs)}
        tile = TraceTile(
            mainloop=tctx,
            extras_index=index,
            specs=self.epilogue.values,
            scratch_offsets=self.scratch_offsets(tctx.config),
        )
        return tile, [p.trace_begin_tile(tile) for p in self.epilogue.primitives]

    def visit(self, ctx: Any, acc: Any, loaded: tuple, vstate: Any) -> tuple:
        from ..primitives.tracing import TraceSubtile

        tile, states = vstate
        tile.loaded = {p.name: v for p, v in zip(self.loads, loaded, strict=True)}
        tile.stored = {}
        sub = TraceSubtile(tile=tile, subtile=ctx.subtile, coords=ctx.coords)
        values: dict[str, Any] = {"acc": acc}
        for p, state in zip(self.epilogue.primitives, states, strict=True):
            p.trace(sub, values, state)
        return tuple(tile.stored[p.out] for p in self.stores)

    def end_tile(self, tctx: Any, vstate: Any) -> None:
        tile, states = vstate
        for p, state in zip(self.epilogue.primitives, states, strict=True):
            p.trace_end_tile(tile, state)
