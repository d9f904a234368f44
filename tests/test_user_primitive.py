"""A user's own primitives, defined here (not in src), compose with the built-in ones and
pass the same property: simulator == reference == independent float64 formulation.

* ``Clamp``: an Elementwise-like primitive written from scratch on the ``Primitive`` base.
* ``RowAbsMax``: a brand-new reduction kind (per-row max |x|, e.g. FP8 scaling factors)
  with its own per-tile state, partials and finalize.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings

from _independent import evaluate, register
from coda import Elementwise, Epilogue, Primitive, TileLoad, TileStore, ValueSpec, ops, simulate
from coda.errors import KindError
from coda.primitives import ReferenceEnv, Subtile, Tile
from coda.specs import TensorSpec
from coda.testing import Case, Composer, cases, check_case, examples


@attrs.frozen
class Clamp(Primitive):
    """out = min(max(of, lo), hi), elementwise; same kind and width as ``of``."""

    out: str
    of: str
    lo: float = -0.5
    hi: float = 0.5

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.of,)

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.out,)

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        src = values[self.of]
        return (ValueSpec(self.out, src.kind, src.width),)

    def reference(self, env: ReferenceEnv) -> None:
        env.values[self.out] = env.values[self.of].clamp(self.lo, self.hi)

    def visit(self, sub: Subtile, state: Any) -> None:
        sub.values[self.out] = sub.values[self.of].clamp(self.lo, self.hi)


@attrs.frozen
class RowAbsMax(Primitive):
    """Output ``name`` (M,) = max_n |of[m, n]|, via per-tile partials (M, n_tiles_n)."""

    name: str
    of: str

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.of,)

    @property
    def writes(self) -> tuple[str, ...]:
        return ()

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        if values[self.of].kind != "tile":
            raise KindError(f"RowAbsMax reduces tiles, {self.of!r} is not one")
        return ()

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec(self.name, "row", torch.float32, direction="out"),
            TensorSpec(f"{self.name}.partials", "partials_row", torch.float32, direction="out"),
        )

    def reference(self, env: ReferenceEnv) -> None:
        a = env.values[self.of].abs()
        env.outputs[self.name] = a.amax(1)
        if env.tile is not None:
            tc = int(env.tile[1] * env.specs[self.of].width)
            env.outputs[f"{self.name}.partials"] = torch.stack(
                [a[:, j : j + tc].amax(1) for j in range(0, a.shape[1], tc)], dim=1
            )

    def begin_tile(self, tile: Tile) -> torch.Tensor:
        return tile.full_rows(0.0)  # |x| >= 0: 0 is the identity of this max

    def visit(self, sub: Subtile, state: torch.Tensor) -> None:
        w = sub.specs[self.of].width
        a = torch.where(sub.mask(w), sub.values[self.of].abs(), 0.0)
        rows = sub.local_rows()
        state[rows] = torch.maximum(state[rows], a.amax(1))

    def end_tile(self, tile: Tile, state: torch.Tensor) -> None:
        tile.write_row_partial(f"{self.name}.partials", state)

    def finalize(self, partials, problem, specs) -> dict[str, torch.Tensor]:
        return {self.name: partials[f"{self.name}.partials"].amax(1)}


# ---- independent float64 formulations ---------------------------------------------------
def clamp64(p, values, tensors, outputs, M, N, tile, specs):
    x = values[p.of]
    values[p.out] = torch.minimum(
        torch.maximum(x, torch.tensor(p.lo, dtype=x.dtype)), torch.tensor(p.hi, dtype=x.dtype)
    )


def absmax64(p, values, tensors, outputs, M, N, tile, specs):
    a = values[p.of].abs()
    outputs[p.name] = a.max(dim=1).values
    tc = int(tile[1] * specs[p.of].width)
    cols = [a[:, j * tc : (j + 1) * tc].max(dim=1).values for j in range(-(-N // tile[1]))]
    outputs[f"{p.name}.partials"] = torch.stack(cols, dim=1)


register(Clamp, clamp64)
register(RowAbsMax, absmax64)


# ---- factories: how the strategies draw them ------------------------------------------
def clamp_factory(draw, c: Composer) -> Primitive:
    return Clamp(c.fresh("clamp"), c.pick(draw, ("tile", "row", "col")))


def absmax_factory(draw, c: Composer) -> Primitive:
    return RowAbsMax(c.fresh("amax"), c.pick(draw))


@settings(max_examples=examples(120))
@given(cases(extra=[clamp_factory, absmax_factory]))
def test_user_primitives_pass_the_property(case: Case) -> None:
    assert any(isinstance(p, (Clamp, RowAbsMax)) for p in case.epilogue)
    check_case(case, truth=evaluate)


def test_user_primitive_composes_by_hand_and_is_a_value():
    A = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    B = torch.randn(36, 16, generator=torch.Generator().manual_seed(1))
    epi = Epilogue().add(
        Clamp("c", "acc", -1.0, 2.0), TileStore("c", torch.float32), RowAbsMax("amax", "acc")
    )
    assert epi == Epilogue().add(
        Clamp("c", "acc", -1.0, 2.0), TileStore("c", torch.float32), RowAbsMax("amax", "acc")
    )
    assert Clamp("c", "acc") != Clamp("c", "acc", hi=0.25)
    ref = epi.reference(A, B, tile=(16, 16))
    sim = simulate(epi, A, B, tile=(16, 16), subtile=(8, 8))
    acc = A.double() @ B.double().T
    torch.testing.assert_close(ref["c"].double(), acc.clamp(-1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sim["c"], ref["c"])
    torch.testing.assert_close(sim["amax"].double(), acc.abs().amax(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sim["amax.partials"], ref["amax.partials"])
    assert ref["amax.partials"].shape == (50, 3)


def test_user_primitive_without_trace_cannot_be_fused():
    from coda.runtime.fused import unsupported

    with pytest.raises(NotImplementedError, match="has no CuTeDSL trace"):
        Clamp("c", "acc").trace(None, {}, None)
    epi = Epilogue().add(Clamp("c", "acc")).add(TileStore("c", torch.float32))
    assert "has no CuTeDSL trace" in unsupported(epi)


def test_a_user_primitive_that_masks_edges_gets_the_interior_trace():
    """``Primitive.masks_edges`` is how a user's primitive asks the kernel to trace the
    tile epilogue apart for tiles inside M x N (``TileContext.interior``): False by
    default, so a primitive that says nothing keeps one trace, masks and all."""
    from coda.runtime.fused import FusedVisitor

    @attrs.frozen
    class MaskingClamp(Clamp):
        def masks_edges(self, zero_outside: frozenset[str]) -> bool:
            return self.of not in zero_outside

    plain = Epilogue().add(Clamp("c", "acc"), TileStore("c", torch.float32))
    assert not FusedVisitor(plain).splits_interior
    masking = Epilogue().add(MaskingClamp("c", "acc"), TileStore("c", torch.float32))
    # acc is 0 outside M x N: this primitive's own rule says no mask is needed there
    assert not FusedVisitor(masking).splits_interior
    over_load = Epilogue().add(
        TileLoad("x", torch.bfloat16),
        Elementwise("s", ops.sigmoid, ins=("x",)),  # 0.5 outside M x N
        MaskingClamp("c", "s"),
        TileStore("c", torch.float32),
    )
    assert FusedVisitor(over_load).splits_interior
