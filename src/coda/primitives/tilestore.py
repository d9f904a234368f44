"""coda.primitives.tilestore: ``TileStore``, an (M, N * width) output.

``TileStore(value, dtype, name=None)`` writes tile value ``value`` into a new output
tensor ``name`` (default: the value's name) of shape (M, N * width) and ``dtype``; the
value itself stays fp32 for later primitives (only the stored copy is rounded). On the GPU:
registers -> shared memory -> TMA store, which clips the out-of-bounds part of the box.
Any number of stores may appear in an epilogue.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from coda.errors import KindError
from coda.primitives._validators import float_dtype, read_name
from coda.primitives.base import Primitive
from coda.primitives.context import ReferenceEnv, Subtile
from coda.specs import TensorSpec, ValueSpec, check_name

__all__ = ["TileStore"]


def _optional_name(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        check_name(value, "TileStore.name")


@attrs.frozen
class TileStore(Primitive):
    """Store tile value ``value`` as output ``name`` (default: ``value``) of ``dtype``."""

    value: str = attrs.field(validator=read_name)
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=float_dtype)
    name: str | None = attrs.field(default=None, validator=_optional_name)

    @property
    def out(self) -> str:
        """The output tensor's name."""
        return self.name if self.name is not None else self.value

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.value,)

    @property
    def writes(self) -> tuple[str, ...]:
        return ()

    @property
    def label(self) -> str:
        if self.out == self.value:
            return f"TileStore({self.value!r})"
        return f"TileStore({self.value!r} -> {self.out!r})"

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        spec = values[self.value]
        if spec.kind != "tile":
            raise KindError(
                f"{self.label}: {self.value!r} is a {spec.describe()}; only tile values "
                "can be stored (combine it with a tile value in an Elementwise first)"
            )
        return ()

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        width = values[self.value].width
        return (TensorSpec(self.out, "tile", self.dtype, width, direction="out"),)

    def reference(self, env: ReferenceEnv) -> None:
        env.outputs[self.out] = env.values[self.value].to(self.dtype)

    def visit(self, sub: Subtile, state: Any) -> None:
        sub.store(self.out, sub.values[self.value], sub.specs[self.value].width)

    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        ctx.tile.stored[self.out] = values[self.value]
