"""Shared helpers of the fusion CPU tests (tests/test_fusions_*.py): float64 inputs, fp32
leaves for coda's reference path, and the fp32 tolerance they are held to against
float64 textbook autograd."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coda.testing.tolerance import assert_close_to_reference

F32, F64 = torch.float32, torch.float64
TOL = 2.0**-15  # coda.testing.tolerance's fp32 tolerance


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def leaf(t, dtype=F32):
    return t.detach().to(dtype).requires_grad_()


def close(actual, truth, name):
    assert_close_to_reference(actual, truth, name=name, tol=TOL)


class ZeroFills(TorchDispatchMode):
    """Records (op, shape) of every tensor a zero / fill op makes inside the context: a
    backward that autograd feeds zero-filled gradients of unused outputs shows them."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if isinstance(out, torch.Tensor) and ("zero" in name or "fill" in name):
            self.shapes.append((name, tuple(out.shape)))
        return out
