"""coda.primitives.vecload: ``VecLoad`` and ``ScalarLoad``, broadcast inputs.

``VecLoad(name, per, dtype, width=1)`` binds an input vector and defines a value of the
same name that broadcasts over the tile:

* ``per="row"``: one entry per row, shape (M,), e.g. rstd or a per-token scale;
* ``per="col"``: one entry per column, shape (N * width,), e.g. gamma or a bias.

``ScalarLoad(name)`` binds a Python float passed at call time (e.g. a loss scale) and
defines a scalar value. (The design's VecLoad covers vectors only; runtime scalars need
the same broadcast-load machinery with zero dimensions, so they live here.)
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Literal

import attrs
import torch

from coda.errors import InvalidArgumentError
from coda.primitives._validators import float_dtype, new_name, one_of, to_fraction, width
from coda.primitives.base import Source
from coda.primitives.context import ReferenceEnv, Subtile
from coda.specs import TensorSpec, ValueSpec, dtype_name, width_note

__all__ = ["ScalarLoad", "VecLoad"]


@attrs.frozen
class VecLoad(Source):
    """Load vector ``name`` (per="row": (M,), per="col": (N*width,)) as a broadcast value."""

    name: str = attrs.field(validator=new_name)
    per: Literal["row", "col"] = attrs.field(validator=one_of("row", "col"))
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=float_dtype)
    width: Fraction = attrs.field(default=Fraction(1), converter=to_fraction, validator=width)

    def __attrs_post_init__(self) -> None:
        if self.per == "row" and self.width != 1:
            raise InvalidArgumentError(
                f"VecLoad({self.name!r}): per='row' vectors have one entry per row; "
                f"width applies to per='col' vectors only (got width {self.width})"
            )

    @property
    def label(self) -> str:
        w = width_note(self.width)
        return f"VecLoad({self.name!r}, per={self.per!r}, {dtype_name(self.dtype)}{w})"

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        return (ValueSpec(self.name, self.per, self.width),)

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(self.name, self.per, self.dtype, self.width),)

    def reference(self, env: ReferenceEnv) -> None:
        env.values[self.name] = env.load(self.name, self.per)

    def visit(self, sub: Subtile, state: Any) -> None:
        if self.per == "row":
            sub.values[self.name] = sub.load_row(self.name)
        else:
            sub.values[self.name] = sub.load_col(self.name, self.width)

    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        from coda.primitives import tracing

        view = ctx.view_of(self.name)
        axis = 0 if self.per == "row" else 1
        vec = ctx.extra(self.name)
        limit = view.shape_mn[axis]
        groups = tracing.same_index_groups(view.frag, axis)

        def load():
            return tracing.gather(view.layout, view.coords, vec, axis, limit, groups)

        # a row vector is the same for every subtile of a subtile row (a column vector
        # for every subtile of a subtile column): loaded once per band, not per subtile
        key = ("VecLoad", self.name, self.per, self.width)
        values[self.name] = ctx.per_band(key, axis, load)


@attrs.frozen
class ScalarLoad(Source):
    """Bind a Python float ``name`` passed at call time as a scalar value."""

    name: str = attrs.field(validator=new_name)

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        return (ValueSpec(self.name, "scalar"),)

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(self.name, "scalar", torch.float32),)

    def reference(self, env: ReferenceEnv) -> None:
        env.values[self.name] = env.load(self.name, "scalar")

    def visit(self, sub: Subtile, state: Any) -> None:
        sub.values[self.name] = sub.load_scalar(self.name)

    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        from coda.primitives import tracing

        values[self.name] = tracing.full(tracing.frag_layout(ctx), ctx.extra(self.name))
