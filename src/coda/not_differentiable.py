"""coda.not_differentiable: the results of coda's kernel calls refuse to be differentiated.

Sits at the bottom of coda (torch only); the public kernel calls use it:
``coda.gemm`` (:mod:`coda.matmul`) and ``Epilogue.__call__`` (:mod:`coda.epilogue`). Their
kernels have no backward formula (``coda.fusions`` and ``coda.nn`` are the autograd ops).
Left alone, an output of theirs would simply not require grad, whatever its inputs, and a
training step that used one would leave the inputs' gradients out without a word, the
worst failure a training op can have. So, as PyTorch does for an op without a derivative,
when grad mode is on and an input requires grad each output is tied to a node whose
backward raises a ``RuntimeError`` naming the call (:func:`tied`): the forward runs as
before, and only a backward that reaches the output fails. Writing into caller tensors
(``out=``, ``outputs=``) with such inputs is refused at once, as PyTorch refuses ``out=``
arguments under autograd (:func:`refuse_out`). With grad mode off (``torch.no_grad()``,
inference) or no input requiring grad, nothing changes. ``coda.fusions`` calls the
unguarded paths: its ops run the kernels inside their own autograd formulas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["raising_in_backward", "refuse_out", "tied"]


def _message(name: str) -> str:
    return (
        f"{name} is not differentiable: its output came from a coda kernel that has no "
        "backward formula, and backward reached it. Run it under torch.no_grad() (or on "
        ".detach()ed inputs) where no gradient is wanted; for training use the autograd "
        "ops of coda.fusions / coda.nn (or the PyTorch ops the kernel fuses)."
    )


class _Raises(torch.autograd.Function):
    """The identity on ``out`` (as a view), tied to ``inputs``; its backward raises
    ``RuntimeError(message)``."""

    @staticmethod
    def forward(message: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        raise RuntimeError(ctx.message)


def raising_in_backward(message: str, out: torch.Tensor, inputs: Iterable[Any]) -> torch.Tensor:
    """``out`` (a view of it) requiring grad through a node tied to those of ``inputs``
    that require grad, whose backward raises ``RuntimeError(message)``: the one mechanism
    behind :func:`tied` and ``coda.fusions``' refusal of second derivatives."""
    req = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return _Raises.apply(message, out, *req)


def tied(name: str, out: torch.Tensor, inputs: Iterable[Any]) -> torch.Tensor:
    """``out`` (a view of it) requiring grad through a node whose backward raises, naming
    the call ``name``, tied to those of ``inputs`` that require grad."""
    return raising_in_backward(_message(name), out, inputs)


def refuse_out(name: str, argument: str) -> None:
    """The ``RuntimeError`` for caller-owned outputs when an input requires grad."""
    raise RuntimeError(
        f"{name}: {argument} arguments don't support automatic differentiation, but one of "
        "the arguments requires grad (the kernel has no backward formula). Run it under "
        "torch.no_grad() (or on .detach()ed inputs), or use the autograd ops of "
        "coda.fusions / coda.nn."
    )
