"""Finalize: turn the per-tile partials a fused kernel wrote into the epilogue's results.

Sits in ``coda.runtime`` under :mod:`coda.runtime.epilogue_kernels`. Reductions and
running states (``TileReduce``, ``LogSumExp``, ``TargetSelect``) leave per-tile partials
(M x tiles or tiles x N); each primitive's ``finalize`` combines them (and applies its
``post``). :func:`plan` prepares that step once per launch plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..epilogue import Epilogue
from ..geometry import Problem
from ..primitives.base import Primitive


def _finalizing(epi: Epilogue) -> tuple[Primitive, ...]:
    return tuple(p for p in epi.primitives if type(p).finalize is not Primitive.finalize)


def plan(
    epi: Epilogue, ab_dtype: torch.dtype, tile: tuple[int, int], num_sms: int
) -> Callable[[dict, int, int, Mapping], None] | None:
    """A callable ``(out, m, n, given)`` that adds every finalized result to ``out`` (into
    the caller's buffer when ``given`` has one), or None when nothing needs finalizing."""
    prims = _finalizing(epi)
    if not prims:
        return None
    values = epi.values

    def run(out: dict, m: int, n: int, given: Mapping) -> None:
        problem = Problem(M=m, N=n, K=1)
        partials = dict(out)
        for p in prims:
            for name, t in p.finalize(partials, problem, values).items():
                dst = given.get(name)
                if dst is not None:
                    dst.copy_(t)
                    t = dst
                out[name] = t

    return run
