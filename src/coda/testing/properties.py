"""coda.testing.properties: the property coda's suite checks, ready for users' cases.

``check_case(case)`` runs a drawn ``Case`` through ``Epilogue.reference`` and the tile
simulator and asserts they agree: same output names, shapes and dtypes, every element
written (no NaN), values within the output dtype's tolerance. Pass ``truth`` (a function
``(epilogue, A, B, tensors, tile) -> {name: float64 tensor}``, your independent
formulation) to also hold both to it. Use it inside a hypothesis test::

    @given(cases(extra=[my_factory]))
    def test_mine(case):
        check_case(case)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from coda.epilogue import Epilogue
from coda.simulator import simulate
from coda.testing.strategies import Case
from coda.testing.tolerance import assert_close_to_reference, tolerance

__all__ = ["CaseResult", "check_case"]

Truth = Callable[
    [Epilogue, torch.Tensor, torch.Tensor, Mapping[str, Any], tuple[int, int]],
    Mapping[str, torch.Tensor],
]


@attrs.frozen
class CaseResult:
    """The outputs of one checked case: reference, simulator, and truth (if given)."""

    reference: dict[str, torch.Tensor]
    simulated: dict[str, torch.Tensor]
    truth: Mapping[str, torch.Tensor] | None


def check_case(
    case: Case,
    *,
    truth: Truth | None = None,
    oob_fill: float = math.nan,
    floor: float = 1.0,
) -> CaseResult:
    """Assert simulate == reference (== truth) for ``case``; see the module doc.

    ``floor``: errors are relative to max(max|expected|, floor); the strategies draw O(1)
    values, so 1 keeps cancellation to ~0 from reading as a large relative error.
    """
    epi = case.epilogue
    A, B, tensors = case.inputs()
    ref = epi.reference(A, B, tile=case.tile, **tensors)
    sim = simulate(epi, A, B, tile=case.tile, subtile=case.subtile, oob_fill=oob_fill, **tensors)
    names = [s.name for s in epi.outputs]
    assert list(ref) == names, f"reference outputs {list(ref)} != declared {names}"
    assert list(sim) == names, f"simulator outputs {list(sim)} != declared {names}"
    expected = truth(epi, A, B, tensors, case.tile) if truth is not None else None
    if expected is not None:
        assert set(expected) == set(names), f"truth gives {sorted(expected)}, not {names}"
    for name in names:
        r, s = ref[name], sim[name]
        assert (s.dtype, s.shape) == (r.dtype, r.shape), (
            f"{name}: simulator {tuple(s.shape)} {s.dtype} vs reference {tuple(r.shape)} {r.dtype}"
        )
        assert not torch.isnan(s).any(), (
            f"{name}: NaN in the simulator's output (an element no tile wrote, or an "
            "out-of-bounds element leaking through a missing mask)"
        )
        tol = tolerance(r.dtype)
        assert_close_to_reference(
            s, r, name=f"{name}: simulator vs reference", tol=tol, floor=floor
        )
        if expected is not None:
            t = expected[name]
            assert_close_to_reference(
                r, t, name=f"{name}: reference vs truth", tol=tol, floor=floor
            )
            assert_close_to_reference(
                s, t, name=f"{name}: simulator vs truth", tol=tol, floor=floor
            )
    return CaseResult(ref, sim, expected)
