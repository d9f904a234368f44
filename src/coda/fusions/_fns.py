"""coda.fusions._fns: the named ``Elementwise`` / ``TileReduce.post`` functions of the fusions.

Module-level functions and attrs value callables (never lambdas), so the epilogues built
from them are equal across calls (one compiled kernel each) and have stable disk-cache
keys. Written with operators and ``coda.primitives.math``: they run in the reference
(torch) and in the fused kernel (CuTeDSL) alike.
"""

from __future__ import annotations

from typing import Any

import attrs

from coda.primitives import math as cm

__all__ = ["RstdPost", "norm_dx", "norm_dx_residual"]


@attrs.frozen
class RstdPost:
    """RMSNorm's rstd from a row's sum of squares over n columns: rsqrt(total / n + eps)."""

    eps: float = attrs.field(converter=float)
    __name__ = "rstd"

    def __call__(self, total: Any, n: int) -> Any:
        return cm.rsqrt(total / n + self.eps)


def norm_dx(acc: Any, gamma: Any, x: Any, rstd: Any, rzdz: Any, inv_n: Any) -> Any:
    """RMSNorm backward in the dgrad epilogue, with acc = (rstd dz) W = rstd g and
    rzdz = rstd ZdZ (the producers form it from the rstd-scaled gradient):
    dx = rstd (g gamma - x rstd ZdZ / N) = acc gamma - x (rstd rZdZ / N)."""
    return acc * gamma - x * (rstd * rzdz * inv_n)


def norm_dx_residual(
    acc: Any, gamma: Any, x: Any, rstd: Any, rzdz: Any, inv_n: Any, dres: Any
) -> Any:
    """``norm_dx`` plus the gradient arriving through the residual stream."""
    return acc * gamma - x * (rstd * rzdz * inv_n) + dres
