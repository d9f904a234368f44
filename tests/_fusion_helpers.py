"""Shared helpers of the fusion CPU tests (tests/test_fusions_*.py): float64 inputs, fp32
leaves for coda's reference path, and the fp32 tolerance they are held to against
float64 textbook autograd."""

from __future__ import annotations

import torch

from coda.testing.tolerance import assert_close_to_reference

F32, F64 = torch.float32, torch.float64
TOL = 2.0**-15  # coda.testing.tolerance's fp32 tolerance


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def leaf(t, dtype=F32):
    return t.detach().to(dtype).requires_grad_()


def close(actual, truth, name):
    assert_close_to_reference(actual, truth, name=name, tol=TOL)
