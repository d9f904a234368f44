"""Named, representative epilogues: the ones coda's GPU tests, compile tests and the
epilogue-overhead benchmark share (so all three exercise the same compositions).

* ``residual_store``: x = acc + residual; store x.
* ``rmsnorm_fwd``: the deferred RMSNorm forward (DESIGN.md section 5): x = acc + residual,
  store x, store h = x * gamma, per-row sum of squares -> rstd.
* ``row_scale``: z = acc * r * alpha with a per-row vector (e.g. rstd) and a scalar.
* ``lse_target``: online log-sum-exp per row and the target logit, nothing M x N written
  (the LM-head cross-entropy forward).
* ``silu_max``: y = silu(acc) stored as fp16, and its per-row max.
* ``swiglu_fwd``: y = silu(g) * u over interleaved (gate, up) column pairs of acc; y has
  width 1/2 (M x N/2).
* ``swiglu_bwd``: dy = acc (width 1) and the saved interleaved gate/up (width 2): store
  (dg, du) interleaved (width 2) and the ZdZ row partial sum(g dg + u du).
* ``rope``: rotate adjacent column pairs by pos * freq (positions per row, frequencies
  per pair: a col vector of width 1/2), store the result.
* ``dgamma_colsum``: column sums over M of acc * x_hat (RMSNorm's dgamma partials) and
  a column max.
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
    "swiglu_fwd": Epilogue()
    .add(Elementwise("y", ops.swiglu, ins=("acc",), pairwise="reduce"))
    .add(TileStore("y", bf16)),
    "swiglu_bwd": Epilogue()
    .add(TileLoad("gu", bf16, width=2))
    .add(Elementwise("dgu", ops.swiglu_backward, ins=("gu", "acc"), pairwise="map"))
    .add(TileStore("dgu", bf16))
    .add(Elementwise("zdz_terms", ops.pair_products, ins=("gu", "dgu"), pairwise="map"))
    .add(TileReduce("zdz", of="zdz_terms", op="sum")),
    "rope": Epilogue()
    .add(VecLoad("pos", per="row", dtype=torch.float32))
    .add(VecLoad("freq", per="col", dtype=torch.float32, width="1/2"))
    .add(Elementwise("y", ops.rope, ins=("acc", "pos", "freq"), pairwise="map"))
    .add(TileStore("y", bf16)),
    "dgamma_colsum": Epilogue()
    .add(TileLoad("x_hat", bf16))
    .add(Elementwise("gx", ops.mul, ins=("acc", "x_hat")))
    .add(TileReduce("dgamma", of="gx", op="sum", per="col"))
    .add(TileReduce("colmax", of="acc", op="max", per="col")),
}
