"""coda.fusions.epilogues: every epilogue the fusions run, built from coda's primitives only.

Sits under the fusion ops (``norm``, ``swiglu``, ``rope``), which call these through
``coda.fusions._dispatch`` (fused kernel on CUDA, ``Epilogue.reference`` on CPU). Each
builder is cached on its arguments (dtypes, eps) and returns an ``Epilogue`` value, so one
configuration is one compiled kernel. Names of inputs/outputs are the keyword arguments
and the keys of the returned dict. Notation (docs/fusions.md): x the residual stream, h =
x * gamma, rstd = (mean x^2 + eps)^-1/2, z = rstd * (h W^T) the normed GEMM's output, dz
its gradient, ZdZ = <z, dz> per row.

Forward:

* ``residual_norm(dtype, gamma_dtype, eps)``: after acc = A W^T: x = acc + residual;
  store x, h = x * gamma; rstd from the row sum of squares of x (the producer of a
  deferred RMSNorm: attention out-projection, MLP down-projection).
* ``norm_stats(dtype, gamma_dtype, eps)``: the same without a GEMM (``run_map``): h and
  rstd of a given x (the first layer's input, the embeddings).
* ``row_scale(dtype)``: z = rstd * acc (a plain normed linear).
* ``swiglu_forward(dtype)``: gu = rstd * acc over interleaved (gate, up) columns; store gu
  (saved for backward) and y = silu(g) * u (width 1/2).
* ``rope_forward(dtype)``: z = rstd * acc, y = rotate(z) by pos * freq over adjacent
  column pairs; store y.

Backward:

* ``scaled_grad(dtype)`` (``run_map``): dzs = rstd * dz, rZdZ = sum z dzs.
* ``swiglu_backward(dtype)``: after acc = dY W_down (= dy, the gradient of SwiGLU's
  output): (dg, du) of rstd * dy from the saved gu (SwiGLU's backward is linear in dy, so
  they come out rstd-scaled: one multiply a pair instead of two); rZdZ = sum(g dg + u du);
  store them (width 2) and the recomputed y = silu(g) * u (for the down-projection's
  wgrad).
* ``rope_backward(dtype)`` (``run_map``): dys = rstd * dy, dzs = rotate^-1(dys);
  rZdZ = sum y dys (rotations are orthogonal, so <y, dy> = <z, dz>).
* ``norm_dgrad(dtype, gamma_dtype, residual)``: after acc = dzs W = rstd g:
  dx = acc * gamma - x * rstd * rZdZ / N (+ the residual stream's gradient ``dres``);
  dgamma = column sums of acc * x = sum_m g * x_hat.

The three backward producers hand ``norm_dgrad`` rZdZ = rstd * ZdZ (output ``rzdz``), not
ZdZ: each forms it from the rstd-scaled gradient it stores anyway, at no extra cost.
"""

from __future__ import annotations

import functools

import torch

from coda.epilogue import Epilogue
from coda.fusions._fns import RstdPost, norm_dx, norm_dx_residual
from coda.primitives import (
    Elementwise,
    ScalarLoad,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
)

__all__ = [
    "norm_dgrad",
    "norm_stats",
    "residual_norm",
    "rope_backward",
    "rope_forward",
    "row_scale",
    "scaled_grad",
    "swiglu_backward",
    "swiglu_forward",
]

f32 = torch.float32


def _rstd() -> VecLoad:
    return VecLoad("rstd", per="row", dtype=f32)


@functools.cache
def residual_norm(dtype: torch.dtype, gamma_dtype: torch.dtype, eps: float) -> Epilogue:
    return Epilogue(
        (
            TileLoad("residual", dtype),
            Elementwise("x", ops.add, ins=("acc", "residual")),
            TileStore("x", dtype),
            VecLoad("gamma", per="col", dtype=gamma_dtype),
            Elementwise("h", ops.mul, ins=("x", "gamma")),
            TileStore("h", dtype),
            TileReduce("rstd", of="x", op="sumsq", post=RstdPost(eps)),
        )
    )


@functools.cache
def norm_stats(dtype: torch.dtype, gamma_dtype: torch.dtype, eps: float) -> Epilogue:
    return Epilogue(
        (
            TileLoad("x", dtype),
            VecLoad("gamma", per="col", dtype=gamma_dtype),
            Elementwise("h", ops.mul, ins=("x", "gamma")),
            TileStore("h", dtype),
            TileReduce("rstd", of="x", op="sumsq", post=RstdPost(eps)),
        )
    )


@functools.cache
def row_scale(dtype: torch.dtype) -> Epilogue:
    return Epilogue(
        (_rstd(), Elementwise("z", ops.scale, ins=("acc", "rstd")), TileStore("z", dtype))
    )


@functools.cache
def swiglu_forward(dtype: torch.dtype) -> Epilogue:
    return Epilogue(
        (
            _rstd(),
            Elementwise("gu", ops.scale, ins=("acc", "rstd")),
            TileStore("gu", dtype),
            Elementwise("y", ops.swiglu, ins=("gu",), pairwise="reduce"),
            TileStore("y", dtype),
        )
    )


def _rope_vectors() -> tuple[VecLoad, VecLoad, VecLoad]:
    return (
        _rstd(),
        VecLoad("pos", per="row", dtype=f32),
        VecLoad("freq", per="col", dtype=f32, width="1/2"),
    )


@functools.cache
def rope_forward(dtype: torch.dtype) -> Epilogue:
    return Epilogue(
        (
            *_rope_vectors(),
            Elementwise("z", ops.scale, ins=("acc", "rstd")),
            Elementwise("y", ops.rope, ins=("z", "pos", "freq"), pairwise="map"),
            TileStore("y", dtype),
        )
    )


@functools.cache
def scaled_grad(dtype: torch.dtype) -> Epilogue:
    return Epilogue(
        (
            TileLoad("dz", dtype),
            TileLoad("z", dtype),
            _rstd(),
            Elementwise("dzs", ops.scale, ins=("dz", "rstd")),
            TileStore("dzs", dtype),
            Elementwise("rzdz_terms", ops.mul, ins=("z", "dzs")),
            TileReduce("rzdz", of="rzdz_terms", op="sum"),
        )
    )


@functools.cache
def swiglu_backward(dtype: torch.dtype) -> Epilogue:
    return Epilogue(
        (
            TileLoad("gu", dtype, width=2),
            _rstd(),
            Elementwise("dys", ops.scale, ins=("acc", "rstd")),
            Elementwise("dgu", ops.swiglu_backward, ins=("gu", "dys"), pairwise="map"),
            TileStore("dgu", dtype),
            Elementwise("rzdz_terms", ops.pair_products, ins=("gu", "dgu"), pairwise="map"),
            TileReduce("rzdz", of="rzdz_terms", op="sum"),
            Elementwise("y", ops.swiglu, ins=("gu",), pairwise="reduce"),
            TileStore("y", dtype),
        )
    )


@functools.cache
def rope_backward(dtype: torch.dtype) -> Epilogue:
    return Epilogue(
        (
            TileLoad("dy", dtype),
            TileLoad("y", dtype),
            *_rope_vectors(),
            Elementwise("dys", ops.scale, ins=("dy", "rstd")),
            Elementwise("dzs", ops.rope_inverse, ins=("dys", "pos", "freq"), pairwise="map"),
            TileStore("dzs", dtype),
            Elementwise("rzdz_terms", ops.mul, ins=("y", "dys")),
            TileReduce("rzdz", of="rzdz_terms", op="sum"),
        )
    )


@functools.cache
def norm_dgrad(dtype: torch.dtype, gamma_dtype: torch.dtype, residual: bool) -> Epilogue:
    ins = ("acc", "gamma", "x", "rstd", "rzdz", "inv_n")
    prims = [
        TileLoad("x", dtype),
        VecLoad("gamma", per="col", dtype=gamma_dtype),
        _rstd(),
        VecLoad("rzdz", per="row", dtype=f32),
        ScalarLoad("inv_n"),
    ]
    if residual:
        prims.append(TileLoad("dres", dtype))
        prims.append(Elementwise("dx", norm_dx_residual, ins=(*ins, "dres")))
    else:
        prims.append(Elementwise("dx", norm_dx, ins=ins))
    prims += [
        TileStore("dx", dtype),
        Elementwise("gx", ops.mul, ins=("acc", "x")),
        TileReduce("dgamma", of="gx", op="sum", per="col"),
    ]
    return Epilogue(tuple(prims))
