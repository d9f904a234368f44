"""coda.fusions._second_order: a fused op's gradients refuse a second derivative they lack.

Sits at the bottom of ``coda.fusions`` (on ``coda.not_differentiable``), under
``_dispatch.register_formula``, which wraps every fused op's backward formula with
:func:`refusing_second_order`.

The formulas are not differentiable in the ops' inputs (h, W, the residual stream, ...):
they run fused kernels and saved results. Under ``create_graph=True`` (a gradient
penalty, a Hessian-vector product) the gradients they return would carry no graph back
to those inputs, and a ``backward()`` through them would leave that part of the second
derivative out without a word. So, with grad mode on inside the formula (what
``create_graph=True`` turns on), each returned gradient passes through an identity
(:class:`_Guarded`) with one more input: a node
(``coda.not_differentiable.raising_in_backward``) whose own inputs are the formula's
saved tensors that require grad and a fresh leaf, and whose backward raises.
Differentiating a gradient towards anything its formula does not cover reaches that node
and raises a clear ``RuntimeError``; autograd prunes it where the derivative asked for
does not lead there, so what the formula does cover (the gradients as functions of the
upstream gradient, e.g. a loss scale that requires grad) stays differentiable. Without
grad mode (every ordinary ``backward()``) nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from coda.not_differentiable import raising_in_backward

__all__ = ["refusing_second_order"]


def _refusal(name: str) -> str:
    return (
        f"{name}: second derivatives with respect to the op's inputs are not "
        "implemented (its backward formula runs fused kernels and is not "
        "differentiable in them). The gradients taken with create_graph=True are "
        "differentiable only in the upstream gradient (torch.autograd.grad(..., "
        "inputs=...) towards what depends on it alone); use the unfused PyTorch ops "
        "for gradient penalties or Hessian-vector products."
    )


class _Guarded(torch.autograd.Function):
    """The identity on a gradient, tied to a refusing node: its backward passes
    the incoming gradient through and hands the refusing node a zero."""

    @staticmethod
    def forward(grad: torch.Tensor, refused: torch.Tensor) -> torch.Tensor:
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, grad.new_zeros(())


def _guarded(name: str, ctx: Any, out: Any) -> Any:
    """``out`` (a formula's gradient or tuple of them) with every tensor guarded."""
    grads = out if isinstance(out, tuple) else (out,)
    tensors = [g for g in grads if isinstance(g, torch.Tensor)]
    if not tensors:
        return out
    saved = [t for t in getattr(ctx, "saved_tensors", ()) if t is not None and t.requires_grad]
    marker = torch.zeros((), device=tensors[0].device, requires_grad=True)
    refused = raising_in_backward(_refusal(name), marker, saved)
    guarded = tuple(_Guarded.apply(g, refused) if isinstance(g, torch.Tensor) else g for g in grads)
    return guarded if isinstance(out, tuple) else guarded[0]


def refusing_second_order(name: str, backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward(ctx, *grads)`` whose results, when it runs in grad mode
    (``create_graph=True``), refuse to be differentiated towards the op's inputs (the
    module docstring); ``name``: the op, for the message."""

    @functools.wraps(backward)
    def call(ctx: Any, *grads: Any) -> Any:
        out = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return out
        return _guarded(name, ctx, out)

    return call
