"""coda.primitives.elementwise: ``Elementwise``, math on values, element by element.

``Elementwise(out, fn, ins=("acc",))`` defines value ``out = fn(*ins)``. Inputs of kind
tile and col must share one width; row vectors and scalars broadcast. The output is a tile
if any input is a tile (or rows meet columns), else a col / row vector / scalar.

**Pairwise** (``pairwise="reduce"`` or ``"map"``): the pair width W is the largest width
among the inputs with columns. Every input at width W is split into two arguments, its
even columns then its odd columns (adjacent pairs: 0-1, 2-3, ...); inputs at width W/2,
row vectors and scalars are passed whole. ``"reduce"``: ``fn`` returns one value, the
output has width W/2 (SwiGLU: ``y = silu(g) * u``). ``"map"``: ``fn`` returns a 2-tuple
(even, odd) interleaved back into an output of width W (RoPE, SwiGLU backward).
Declaring reduce/map up front lets widths be checked at build time without calling ``fn``.

``fn`` is backend-polymorphic: write it with operators and ``coda.primitives.math``.
Equality: two Elementwise are equal iff their fields are; a callable compares by identity,
so two separately written lambdas make different primitives (an honest, if conservative,
cache key). Prefer named functions (``coda.primitives.ops``) for reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import attrs
import torch

from coda.errors import ArityError, InvalidArgumentError, KindError, WidthMismatchError
from coda.primitives._blocks import as_block
from coda.primitives._validators import (
    arity_mismatch,
    is_callable,
    new_name,
    read_names,
    to_names,
)
from coda.primitives.base import Primitive
from coda.primitives.context import ReferenceEnv, Subtile
from coda.specs import WIDTHS, ValueSpec, width_str

__all__ = ["Elementwise"]


def _to_pairwise(value: Any) -> str | None:
    if value is None or value is False:
        return None
    if value in ("reduce", "map"):
        return value
    raise InvalidArgumentError(
        "Elementwise.pairwise must be False/None, 'reduce' (fn returns one value, output "
        "width W/2) or 'map' (fn returns (even, odd), output width W); got " + repr(value)
    )


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@attrs.frozen
class Elementwise(Primitive):
    """``out = fn(*ins)`` element by element (see the module doc for widths and pairs)."""

    out: str = attrs.field(validator=new_name)
    fn: Callable[..., Any] = attrs.field(validator=is_callable)
    ins: tuple[str, ...] = attrs.field(default=("acc",), converter=to_names, validator=read_names)
    pairwise: str | None = attrs.field(default=None, converter=_to_pairwise)

    @property
    def reads(self) -> tuple[str, ...]:
        return self.ins

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.out,)

    @property
    def label(self) -> str:
        pair = f", pairwise={self.pairwise!r}" if self.pairwise else ""
        return f"Elementwise({self.out!r} = {_fn_name(self.fn)}({', '.join(self.ins)}){pair})"

    # ---- dataflow ----------------------------------------------------------------------
    def _pair_width(self, specs: Mapping[str, ValueSpec]) -> Fraction:
        return max(specs[n].width for n in self.ins if specs[n].has_cols)

    def _splits(self, specs: Mapping[str, ValueSpec]) -> tuple[bool, ...]:
        """For each input: is it split into (even, odd) arguments?"""
        if self.pairwise is None:
            return tuple(False for _ in self.ins)
        w = self._pair_width(specs)
        return tuple(specs[n].has_cols and specs[n].width == w for n in self.ins)

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        specs = [values[n] for n in self.ins]
        with_cols = [s for s in specs if s.has_cols]
        listing = ", ".join(f"{s.name!r} ({s.describe()})" for s in specs)
        if self.pairwise is None:
            widths = {s.width for s in with_cols}
            if len(widths) > 1:
                raise WidthMismatchError(
                    f"{self.label}: inputs with columns must share one width, got {listing}. "
                    "Row vectors and scalars broadcast; to combine widths W and W/2 use "
                    "pairwise='reduce' or 'map'."
                )
            out_width = widths.pop() if widths else Fraction(1)
        else:
            if not with_cols:
                raise KindError(
                    f"{self.label}: pairwise={self.pairwise!r} needs at least one tile or "
                    f"col input to split into column pairs; got {listing}"
                )
            w = max(s.width for s in with_cols)
            for s in with_cols:
                if s.width not in (w, w / 2):
                    raise WidthMismatchError(
                        f"{self.label}: pairwise inputs must have the pair width "
                        f"{width_str(w)} (split into even/odd columns) or half of it "
                        f"{width_str(w / 2)} (one per pair); {s.name!r} has width "
                        f"{width_str(s.width)}"
                    )
            out_width = w if self.pairwise == "map" else w / 2
            if out_width not in WIDTHS:
                raise WidthMismatchError(
                    f"{self.label}: pairwise 'reduce' of width-{width_str(w)} inputs would "
                    f"produce width {width_str(out_width)}; supported widths are 1/2, 1, 2"
                )
        kinds = {s.kind for s in specs}
        if "tile" in kinds or {"row", "col"} <= kinds:
            kind = "tile"
        elif "col" in kinds:
            kind = "col"
        elif "row" in kinds:
            kind = "row"
        else:
            kind = "scalar"
        self._check_arity(values)
        width = out_width if kind in ("tile", "col") else Fraction(1)
        return (ValueSpec(self.out, kind, width),)

    def _check_arity(self, values: Mapping[str, ValueSpec]) -> None:
        splits = self._splits(values)
        n_args = sum(2 if s else 1 for s in splits)
        if (mismatch := arity_mismatch(self.fn, n_args)) is None:
            return
        params, e = mismatch
        detail = ""
        if any(splits):
            split = [n for n, s in zip(self.ins, splits, strict=True) if s]
            detail = f" (pairwise: {', '.join(map(repr, split))} pass even and odd columns)"
        raise ArityError(
            f"{self.label}: {_fn_name(self.fn)}({params}) cannot take the {n_args} "
            f"argument(s) that ins={self.ins!r} produce{detail}: {e}"
        )

    def n_alignment(self, values: Mapping[str, ValueSpec]) -> int:
        if self.pairwise is None:
            return 1
        w = self._pair_width(values)
        # smallest k such that k * w is an even integer: pairs never straddle the edge
        return next(k for k in (1, 2, 4, 8) if (k * w) % 2 == 0)

    # ---- evaluation (shared by reference and simulator) --------------------------------
    def evaluate(
        self,
        values: Mapping[str, torch.Tensor],
        specs: Mapping[str, ValueSpec],
        shape: tuple[int, int],
    ) -> torch.Tensor:
        """Apply ``fn`` to 2-D fp32 blocks of the inputs; ``shape`` is the output block's
        shape. The same code runs on whole tensors and on subtiles."""
        args: list[torch.Tensor] = []
        for name, split in zip(self.ins, self._splits(specs), strict=True):
            v = values[name]
            if split:
                args += [v[:, 0::2], v[:, 1::2]]
            else:
                args.append(v)
        result = self.fn(*args)
        device = args[0].device
        if self.pairwise != "map":
            self._check_elementwise(result, args)
            return as_block(result, shape, device, self.label)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(
                f"{self.label}: pairwise='map' fn must return a 2-tuple (even, odd); "
                f"got {type(result).__name__}"
            )
        for r in result:
            self._check_elementwise(r, args)
        half = (shape[0], shape[1] // 2)
        even, odd = (as_block(r, half, device, self.label) for r in result)
        return torch.stack((even, odd), dim=-1).reshape(shape)

    def _check_elementwise(self, result: Any, args: list[torch.Tensor]) -> None:
        """A tensor result has its inputs' broadcast shape: ``fn`` acts element by
        element. (A reduction inside ``fn``, e.g. ``a - a.amax(1, keepdim=True)``, would
        reduce over whatever block it is given: the whole tensor here, one subtile in the
        kernel; TileReduce is the primitive for that.)"""
        if not isinstance(result, torch.Tensor):
            return
        want = torch.broadcast_shapes(*(a.shape for a in args))
        if result.shape != want:
            raise ValueError(
                f"{self.label} returned shape {tuple(result.shape)} from inputs of "
                f"shape {tuple(want)}; an Elementwise fn must act element by element (a "
                "reduction inside it would cover one subtile in the kernel: use TileReduce)"
            )

    def reference(self, env: ReferenceEnv) -> None:
        shape = env.shape(env.specs[self.out])
        env.values[self.out] = self.evaluate(env.values, env.specs, shape)

    def visit(self, sub: Subtile, state: Any) -> None:
        shape = sub.shape_of(sub.specs[self.out])
        sub.values[self.out] = self.evaluate(sub.values, sub.specs, shape)

    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        from coda.primitives import tracing

        specs = ctx.specs
        if self.pairwise is None:
            view = ctx.view_of(self.out)
            args = [
                values[n] if specs[n].has_cols else tracing.broadcast(ctx, values[n], view.width)
                for n in self.ins
            ]
            values[self.out] = tracing.as_fragment(self.fn(*args), view.layout)
            return
        args = [
            (values[n], specs[n], split)
            for n, split in zip(self.ins, self._splits(specs), strict=True)
        ]
        width = self._pair_width(specs)
        values[self.out] = tracing.pairwise(ctx, self.fn, self.pairwise, args, width)
