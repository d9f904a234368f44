"""coda.primitives.onehot: ``OneHot``, a tile value comparing global columns to row targets.

Sits beside ``state.py`` (whose ``TargetSelect`` picks one column per row) in the
primitive layer. ``OneHot(name, target="target")`` binds an integer row vector
``target`` (M,) and defines the fp32 tile value

    name[m, n] = 1.0 if n == target[m] else 0.0        (n a column of the width-w value)

for every in-bounds element. It reads no value: it is the one-hot matrix of the targets,
produced tile by tile where it is used, never stored. Any integer is a valid target: a
target outside [0, N * w) (a negative sentinel, a column of another GEMM's chunk) gives an
all-zero row. This is what the cross-entropy backward needs: its gradient
``softmax - onehot`` is recomputed per V chunk, with chunk-local targets, in the epilogue
of the logits GEMM (``coda.fusions.cross_entropy``).

On the GPU (``trace``) each thread loads the target of each of its rows once per band of
subtiles (-1 when it is not below the value's column count) and compares it with the
global column of each of its fragment elements; out-of-bounds elements give 0 with no
per-element bounds check.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import attrs
import torch

from coda.primitives._validators import index_dtype, new_name, to_fraction, width
from coda.primitives.base import Source
from coda.primitives.context import ReferenceEnv, Subtile
from coda.specs import TensorSpec, ValueSpec, width_note

__all__ = ["OneHot"]


@attrs.frozen
class OneHot(Source):
    """Tile value ``name`` (width ``width``): 1 where the column is ``target[row]``, else 0."""

    name: str = attrs.field(validator=new_name)
    target: str = attrs.field(default="target", validator=new_name)
    target_dtype: torch.dtype = attrs.field(default=torch.int64, validator=index_dtype)
    width: Fraction = attrs.field(default=Fraction(1), converter=to_fraction, validator=width)

    @property
    def label(self) -> str:
        w = width_note(self.width)
        return f"OneHot({self.name!r} = column == {self.target}{w})"

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        return (ValueSpec(self.name, "tile", self.width),)

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(self.target, "row", self.target_dtype),)

    # ---- semantics ---------------------------------------------------------------------
    def reference(self, env: ReferenceEnv) -> None:
        cols = env.problem.cols(self.width)
        t = env.tensors[self.target].to(torch.int64).reshape(-1, 1)
        n = torch.arange(cols, device=t.device).reshape(1, -1)
        env.values[self.name] = (n == t).to(torch.float32)

    def visit(self, sub: Subtile, state: Any) -> None:
        t = sub.load_row(self.target)  # (sm, 1) int64; out-of-bounds rows read -1
        hit = (sub.col_index(self.width) == t) & sub.mask(self.width)
        sub.values[self.name] = hit.to(torch.float32)

    # ---- CuTeDSL ------------------------------------------------------------------------
    rollable = True  # nothing it traces depends on the subtile's column

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        import cutlass.cute as cute

        from coda.primitives import tracing

        v = ctx.view(self.width)
        target = ctx.extra(self.target)
        hot = cute.make_rmem_tensor(v.layout, tracing.Float32)
        for r in v.frag.rows:

            def load(r=r):
                row = tracing.row_of(ctx, r)
                # -1 for rows past M and for targets past the last column (the sentinel
                # -1 itself is never a column either): no element out of bounds can match,
                # so the comparison needs no per-element bounds mask
                want = tracing.load_index(target, row, ctx.shape_mn[0], -1)
                return tracing.index_below(want, v.shape_mn[1])

            want = ctx.per_band(("onehot", self.target, r, self.width), 0, load)  # per band
            for i in v.frag.row_members(r):
                hot[i] = tracing.select_eq(v.coords[i][1], want, tracing.Float32(1.0))
        values[self.name] = hot.load()
