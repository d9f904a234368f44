"""coda.fusions.norm: residual + RMSNorm deferred across two GEMMs, as autograd custom ops.

Sits on ``coda.fusions.epilogues`` (the epilogues) and ``_dispatch`` (fused kernel on
CUDA, reference on CPU). The residual stream travels between ops as a ``NormedStream``
(x, h, rstd): x the stream, h = x * gamma and rstd = (mean x^2 + eps)^-1/2 its norm
statistics, produced in the epilogue of the GEMM that writes x. A consumer computes
``rmsnorm(x) * gamma @ W.T = rstd * (h @ W.T)`` by scaling its GEMM's rows by rstd.

Ops (namespace ``coda``; all tensors 2-D (tokens, features)), each called through its
``_dispatch.EagerOp`` (no dispatcher in plain eager calls), and by the stream-level
``normed_stream(x, gamma, eps)`` and ``linear_add_normed(a, w, residual, gamma, eps)``
(both -> ``NormedStream``):

* ``rms_norm_stats(x, gamma, eps) -> (h, rstd)``: the statistics of a given stream (the
  first layer's input); no GEMM (``run_map``).
* ``linear_add_rms_norm(a, w, residual, gamma, eps) -> (x, h, rstd)``: the producer,
  x = a @ w.T + residual with h and rstd in the same epilogue. Backward: dx flows to
  residual as is, da = dx @ w, dw = dx.T @ a (plain GEMMs). Saved: a, w.
* ``rms_norm_linear(x, h, rstd, gamma, w) -> z``: a normed linear layer (the consumer in
  its plainest form), z = rstd * (h @ w.T). Backward (ZdZ trick): one pass gives
  dzs = rstd * dz and rZdZ = <z, dzs> = rstd ZdZ; the dgrad GEMM dzs @ w ends with
  dx = acc * gamma - x * rstd * rZdZ / H and the dgamma column sums; dw = dzs.T @ h.
  Saved: x, h, rstd, gamma, w and the output z.

h and rstd are *caches* of functions of (x, gamma): consumers take x and gamma as their
differentiable inputs and return no gradient for h and rstd, which the producing ops mark
non-differentiable (they come back with ``requires_grad=False``; differentiate through x
and gamma, never through a cache).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.library import custom_op

from coda.fusions import _checks, epilogues
from coda.fusions._dispatch import (
    EagerOp,
    matmul,
    register_formula,
    run_epilogue,
    run_map,
    zero_filled,
)

__all__ = [
    "NormedStream",
    "linear_add_normed",
    "linear_add_rms_norm",
    "linear_backward",
    "norm_dgrad",
    "normed_stream",
    "rms_norm_linear",
    "rms_norm_stats",
]

F32 = torch.float32


class NormedStream(NamedTuple):
    """The residual stream x with its RMSNorm caches h = x * gamma and rstd (fp32, (M,))."""

    x: torch.Tensor
    h: torch.Tensor
    rstd: torch.Tensor


def _empty_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=F32)


def norm_dgrad(
    dzs: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    rzdz: torch.Tensor,
    dres: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dgamma) of a normed GEMM from its rstd-scaled output gradient dzs (M, N), its
    weight w (N, H) and rZdZ = rstd ZdZ (M,): the dgrad GEMM dzs @ w with the RMSNorm
    backward in its epilogue (plus ``dres``, the residual stream's own gradient, when
    given). dgamma is returned in gamma's dtype."""
    epi = epilogues.norm_dgrad(x.dtype, gamma.dtype, dres is not None)
    extra = {} if dres is None else {"dres": dres}
    out = run_epilogue(
        epi, dzs, w.t(), x=x, gamma=gamma, rstd=rstd, rzdz=rzdz, inv_n=1.0 / x.shape[1], **extra
    )
    return out["dx"], out["dgamma"].to(gamma.dtype)


# ---- rms_norm_stats ---------------------------------------------------------------------


def _rms_norm_stats_impl(
    x: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x * gamma, rstd) of the stream x (M, H); both non-differentiable caches."""
    _checks.activation("rms_norm_stats", "x", x)
    _checks.epsilon("rms_norm_stats", eps)
    _checks.vector("rms_norm_stats", "gamma", gamma, x.shape[1])
    if x.shape[0] == 0:  # no tokens
        return zero_filled(_empty_stats(x))
    out = run_map(epilogues.norm_stats(x.dtype, gamma.dtype, eps), *x.shape, x, x=x, gamma=gamma)
    return out["h"], out["rstd"]


rms_norm_stats = custom_op("coda::rms_norm_stats", _rms_norm_stats_impl, mutates_args=())


@rms_norm_stats.register_fake
def _(x, gamma, eps):
    return _empty_stats(x)


def _stats_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the caches


def _stats_backward(ctx, dh, drstd):
    return None, None, None


_stats_backward = register_formula("coda::rms_norm_stats", _stats_backward, _stats_setup)
_rms_norm_stats = EagerOp(rms_norm_stats, _rms_norm_stats_impl, _stats_setup, _stats_backward)


# ---- linear_add_rms_norm (the producer) -------------------------------------------------


def _linear_add_rms_norm_impl(
    a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = a @ w.T + residual, with the next RMSNorm's caches h = x * gamma and rstd."""
    op = "linear_add_rms_norm"
    _checks.activation(op, "a", a)
    _checks.weight(op, "w", w, a.shape[1])
    _checks.activation(op, "residual", residual, w.shape[0])
    _checks.same_dtype(op, ("a", a), ("w", w), ("residual", residual))
    _checks.vector(op, "gamma", gamma, w.shape[0])
    _checks.epsilon(op, eps)
    if a.shape[0] == 0:  # no tokens
        return zero_filled(_producer_fake(a, w, residual, gamma, eps))
    epi = epilogues.residual_norm(a.dtype, gamma.dtype, eps)
    out = run_epilogue(epi, a, w, residual=residual, gamma=gamma)
    return out["x"], out["h"], out["rstd"]


linear_add_rms_norm = custom_op(
    "coda::linear_add_rms_norm", _linear_add_rms_norm_impl, mutates_args=()
)


@linear_add_rms_norm.register_fake
def _producer_fake(a, w, residual, gamma, eps):
    x = a.new_empty((a.shape[0], w.shape[0]))
    return (x, *_empty_stats(x))


def _linear_backward_impl(
    dy: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor | None
) -> list[torch.Tensor]:
    """The gradients of y = a @ w.T that are asked for: [da = dy @ w] if w is given (da
    needs w), then [dw = dy.T @ a] if a is given (dw needs a); plain GEMMs."""
    grads = []
    if w is not None:
        grads.append(matmul(dy, w.t()))
    if a is not None:
        grads.append(matmul(dy.t(), a.t()))
    return grads


linear_backward = custom_op("coda::linear_backward", _linear_backward_impl, mutates_args=())
_linear_grads = EagerOp(linear_backward, _linear_backward_impl)


@linear_backward.register_fake
def _(dy, a, w):
    grads = []
    if w is not None:
        grads.append(dy.new_empty((dy.shape[0], w.shape[1])))
    if a is not None:
        grads.append(a.new_empty((dy.shape[1], a.shape[1])))
    return grads


def _producer_setup(ctx, inputs, output):
    a, w, _, _, _ = inputs
    need_da, need_dw, need_dres = ctx.needs_input_grad[:3]
    ctx.flags = (need_da, need_dw, need_dres)
    ctx.save_for_backward(a if need_dw else None, w if need_da else None)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the caches


def _producer_backward(ctx, dx, dh, drstd):
    need_da, need_dw, need_dres = ctx.flags
    if dx is None:  # x unused: every gradient is zero
        return None, None, None, None, None
    a, w = ctx.saved_tensors  # a saved only for dw, w only for da
    dx = dx.contiguous()
    grads = iter(_linear_grads(dx, a, w) if (need_da or need_dw) else ())
    da = next(grads) if need_da else None
    dw = next(grads) if need_dw else None
    return da, dw, (dx if need_dres else None), None, None


_producer_backward = register_formula(
    "coda::linear_add_rms_norm", _producer_backward, _producer_setup
)
_linear_add_rms_norm = EagerOp(
    linear_add_rms_norm, _linear_add_rms_norm_impl, _producer_setup, _producer_backward
)


# ---- rms_norm_linear (a consumer) -------------------------------------------------------


def _rms_norm_linear_impl(
    x: torch.Tensor, h: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """z = rmsnorm(x) * gamma @ w.T, computed as rstd * (h @ w.T) from the caches."""
    op = "rms_norm_linear"
    _checks.activation(op, "x", x)
    _checks.activation(op, "h", h, x.shape[1])
    _checks.weight(op, "w", w, x.shape[1])
    _checks.same_dtype(op, ("x", x), ("h", h), ("w", w))
    _checks.vector(op, "rstd", rstd, x.shape[0], F32)
    _checks.vector(op, "gamma", gamma, x.shape[1])
    if x.shape[0] == 0:  # no tokens
        return zero_filled(_linear_fake(x, h, rstd, gamma, w))
    return run_epilogue(epilogues.row_scale(h.dtype), h, w, rstd=rstd)["z"]


rms_norm_linear = custom_op("coda::rms_norm_linear", _rms_norm_linear_impl, mutates_args=())


@rms_norm_linear.register_fake
def _linear_fake(x, h, rstd, gamma, w):
    return h.new_empty((h.shape[0], w.shape[0]))


def _rms_norm_linear_backward_impl(
    dz: torch.Tensor,
    z: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    w: torch.Tensor,
    need_norm: bool,
    need_dw: bool,
) -> list[torch.Tensor]:
    """[dx, dgamma] if need_norm, then [dw] if need_dw."""
    if dz.shape[0] == 0:  # no tokens: zero weight gradients
        return zero_filled(_linear_backward_fake(dz, z, x, h, rstd, gamma, w, need_norm, need_dw))
    s = run_map(epilogues.scaled_grad(dz.dtype), *dz.shape, dz, dz=dz, z=z, rstd=rstd)
    grads = []
    if need_norm:
        grads += norm_dgrad(s["dzs"], w, x, gamma, rstd, s["rzdz"])
    if need_dw:
        grads.append(matmul(s["dzs"].t(), h.t(), out_dtype=w.dtype))
    return grads


rms_norm_linear_backward = custom_op(
    "coda::rms_norm_linear_backward", _rms_norm_linear_backward_impl, mutates_args=()
)
_rms_norm_linear_backward = EagerOp(rms_norm_linear_backward, _rms_norm_linear_backward_impl)


@rms_norm_linear_backward.register_fake
def _linear_backward_fake(dz, z, x, h, rstd, gamma, w, need_norm, need_dw):
    grads = [torch.empty_like(x), torch.empty_like(gamma)] if need_norm else []
    return grads + ([torch.empty_like(w)] if need_dw else [])


def _linear_setup(ctx, inputs, output):
    x, h, rstd, gamma, w = inputs
    need = ctx.needs_input_grad
    ctx.flags = (need[0], need[3], need[4])
    ctx.save_for_backward(x, h, rstd, gamma, w, output)


def _linear_backward(ctx, dz):
    need_dx, need_dgamma, need_dw = ctx.flags
    x, h, rstd, gamma, w, z = ctx.saved_tensors
    need_norm = need_dx or need_dgamma
    if not (need_norm or need_dw):
        return None, None, None, None, None
    grads = iter(
        _rms_norm_linear_backward(dz.contiguous(), z, x, h, rstd, gamma, w, need_norm, need_dw)
    )
    dx, dgamma = (next(grads), next(grads)) if need_norm else (None, None)
    dw = next(grads) if need_dw else None
    return (dx if need_dx else None), None, None, (dgamma if need_dgamma else None), dw


_linear_backward = register_formula("coda::rms_norm_linear", _linear_backward, _linear_setup)


# ---- stream-level calls -------------------------------------------------------------------


def normed_stream(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> NormedStream:
    """The stream x (M, H) with its RMSNorm caches (``rms_norm_stats``)."""
    return NormedStream(x, *_rms_norm_stats(x, gamma, eps))


def linear_add_normed(
    a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float
) -> NormedStream:
    """The stream x = a @ w.T + residual with the next RMSNorm's caches
    (``linear_add_rms_norm``)."""
    return NormedStream(*_linear_add_rms_norm(a, w, residual, gamma, eps))
