"""Named, representative epilogues: the ones coda's GPU tests, compile tests and the
epilogue-overhead benchmark share (so all three exercise the same compositions).

* ``residual_store``: x = acc + residual; store x.
* ``rmsnorm_fwd``: the deferred RMSNorm forward (DESIGN.md section 5): x = acc + residual,
  store x, store h = x * gamma, per-row sum of squares -> rstd.
* ``row_scale``: z = acc * r * alpha with a per-row vector (e.g. rstd) and a scalar.
* ``lse_target``: online log-sum-exp per row and the target logit, nothing M x N written
  (the LM-head cross-entropy forward).
* ``silu_max``: y = silu(acc) stored as fp16, and its per-row max.
"""

from __future__ import annotations

import torch

from coda.epilogue import Epilogue
from coda.primitives import (
    Elementwise,
    LogSumExp,
    ScalarLoad,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
)
from coda.primitives import math as cm

__all__ = ["EPILOGUES", "rstd_post"]

bf16 = torch.bfloat16


def rstd_post(total, n):
    """RMSNorm's rstd from a row's sum of squares over n columns."""
    return cm.rsqrt(total / n + 1e-6)


def _row_scale(a, r, s):
    return a * r * s


EPILOGUES: dict[str, Epilogue] = {
    "residual_store": Epilogue()
    .add(TileLoad("residual", bf16))
    .add(Elementwise("x", ops.add, ins=("acc", "residual")))
    .add(TileStore("x", bf16)),
    "rmsnorm_fwd": Epilogue()
    .add(TileLoad("residual", bf16))
    .add(Elementwise("x", ops.add, ins=("acc", "residual")))
    .add(TileStore("x", bf16))
    .add(VecLoad("gamma", per="col", dtype=bf16))
    .add(Elementwise("h", ops.mul, ins=("x", "gamma")))
    .add(TileStore("h", bf16))
    .add(TileReduce("rstd", of="x", op="sumsq", post=rstd_post)),
    "row_scale": Epilogue()
    .add(VecLoad("r", per="row", dtype=torch.float32))
    .add(ScalarLoad("alpha"))
    .add(Elementwise("z", _row_scale, ins=("acc", "r", "alpha")))
    .add(TileStore("z", bf16)),
    "lse_target": Epilogue().add(LogSumExp("lse", of="acc")).add(TargetSelect("logit", of="acc")),
    "silu_max": Epilogue()
    .add(Elementwise("y", cm.silu, ins=("acc",)))
    .add(TileStore("y", torch.float16))
    .add(TileReduce("mx", of="y", op="max")),
}
