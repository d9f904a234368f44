"""coda.primitives.tileload: ``TileLoad``, an (M, N * width) input operand.

``TileLoad(name, dtype, width=1)`` binds input tensor ``name`` of shape (M, N * width)
(e.g. the residual stream, a saved activation, the interleaved gate/up operand of SwiGLU
backward at width 2) and defines an fp32 tile value of the same name. On the GPU it is a
TMA load of the subtile's box; out-of-bounds elements read as zeros.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import attrs
import torch

from coda.primitives._validators import float_dtype, new_name, to_fraction, width
from coda.primitives.base import Source
from coda.primitives.context import ReferenceEnv, Subtile
from coda.specs import TensorSpec, ValueSpec, dtype_name, width_note

__all__ = ["TileLoad"]


@attrs.frozen
class TileLoad(Source):
    """Load input tile ``name`` (M, N*width) of ``dtype`` as an fp32 tile value."""

    name: str = attrs.field(validator=new_name)
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=float_dtype)
    width: Fraction = attrs.field(default=Fraction(1), converter=to_fraction, validator=width)

    @property
    def label(self) -> str:
        w = width_note(self.width)
        return f"TileLoad({self.name!r}, {dtype_name(self.dtype)}{w})"

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        return (ValueSpec(self.name, "tile", self.width),)

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(self.name, "tile", self.dtype, self.width),)

    def reference(self, env: ReferenceEnv) -> None:
        env.values[self.name] = env.load(self.name, "tile")

    def visit(self, sub: Subtile, state: Any) -> None:
        sub.values[self.name] = sub.load_tile(self.name, self.width)

    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        values[self.name] = ctx.tile.loaded[self.name]
