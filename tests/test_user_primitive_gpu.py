"""A user's own primitive, defined here (not in src), traced into the fused kernel and
fuzzed on the GPU with the same property as the built-ins (marker ``gpu``).

``SoftCap``: out = cap * tanh(x / cap) (Gemma-style logit soft-capping), written from
scratch on the ``Primitive`` base: reference, simulator hook and CuTeDSL ``trace``.
The docs page docs/write-your-own-primitive.md shows the same class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _hopper import HOPPER
from coda import Epilogue, LogSumExp, Primitive, TileStore, ValueSpec
from coda import math as cm
from coda.primitives import ReferenceEnv, Subtile
from coda.runtime.fused import unsupported
from coda.testing import Composer, epilogues, make_inputs

pytestmark = pytest.mark.gpu


@attrs.frozen
class SoftCap(Primitive):
    """out = cap * tanh(of / cap), elementwise; same kind and width as ``of``."""

    out: str
    of: str
    cap: float = 2.0

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.of,)

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.out,)

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        src = values[self.of]
        return (ValueSpec(self.out, src.kind, src.width),)

    def _apply(self, x):  # backend-polymorphic: torch tensors and CuTeDSL fragments
        return self.cap * cm.tanh(x * (1.0 / self.cap))

    def reference(self, env: ReferenceEnv) -> None:
        env.values[self.out] = self._apply(env.values[self.of])

    def visit(self, sub: Subtile, state: Any) -> None:
        sub.values[self.out] = self._apply(sub.values[self.of])

    def trace(self, ctx: Any, values: dict[str, Any], state: Any) -> None:
        values[self.out] = self._apply(values[self.of])


def softcap_factory(draw, c: Composer):
    of = c.pick(draw)
    return SoftCap(c.fresh("cap"), of, draw(st.sampled_from((1.0, 2.0, 30.0))))


def test_softcap_composes_and_is_fusable():
    epi = Epilogue().add(SoftCap("z", "acc")).add(TileStore("z", torch.float32))
    assert unsupported(epi) is None


@pytest.mark.skipif(not HOPPER, reason="needs an NVIDIA Hopper GPU")
def test_softcap_then_lse_on_gpu():
    from coda.testing.fuzz import check_example

    epi = Epilogue().add(SoftCap("z", "acc", 5.0)).add(LogSumExp("lse", of="z"))
    A, B, t = make_inputs(epi, 333, 1000, 256, torch.bfloat16, seed=1)
    assert not check_example(epi, A.cuda(), B.cuda(), t)["failed"]


@pytest.mark.skipif(not HOPPER, reason="needs an NVIDIA Hopper GPU")
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    epilogues(extra=[softcap_factory]),
    st.integers(1, 600),
    st.integers(1, 80),
    st.integers(1, 40),
)
def test_softcap_fuzzed_on_gpu(epi, m, n8, k8):
    from coda.runtime.fused import n_multiple
    from coda.testing.fuzz import check_example

    n = n_multiple(epi) * n8  # N fit for the epilogue's tensors (TMA rows, column pairs)
    A, B, t = make_inputs(epi, m, n, 8 * k8, torch.bfloat16, seed=m)
    t = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    record = check_example(epi, A.cuda(), B.cuda(), t)
    assert not record["failed"], record
