"""``coda.fusions._dispatch.cast``: ``t.to(dtype)``; with ``WIDEN_GRADIENTS`` its gradient
widens back by a map pass on a Hopper GPU (``widen``), and on the CPU (and every other
path ``widen`` declines) it gives the same values and gradients as ``t.to(dtype)``.
CPU; the map pass itself is tested in tests/test_cast_gpu.py."""

from __future__ import annotations

import pytest
import torch

from coda.fusions import _dispatch, linear_cross_entropy
from coda.nn import _rebuild


@pytest.fixture(autouse=True)
def widening(monkeypatch):
    """Every test here runs ``cast`` with its gradient widening switched on."""
    monkeypatch.setattr(_dispatch, "WIDEN_GRADIENTS", True)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cast_matches_to_in_values_and_gradient(low):
    torch.manual_seed(0)
    w = torch.randn(24, 16, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    g = torch.randn(24, 16).to(low)
    out = _dispatch.cast(w, low)
    expect = ref.to(low)
    assert out.dtype == low and torch.equal(out, expect)
    (out.float() * g.float()).sum().backward()
    (expect.float() * g.float()).sum().backward()
    assert w.grad.dtype == torch.float32
    assert torch.equal(w.grad, ref.grad)


def test_cast_is_plain_to_where_nothing_differs():
    w = torch.randn(8, 8)
    assert _dispatch.cast(w, torch.bfloat16).grad_fn is None  # no grad wanted
    p = torch.randn(8, 8, requires_grad=True)
    assert _dispatch.cast(p, torch.float32) is p  # the same dtype: .to returns t itself
    with torch.no_grad():
        assert _dispatch.cast(p, torch.bfloat16).grad_fn is None
    assert type(_dispatch.cast(p, torch.bfloat16).grad_fn).__name__ == "_CastBackward"


def test_widen_declines_off_hopper_and_for_what_the_map_pass_cannot_take():
    g = torch.randn(2048, 1024).to(torch.bfloat16)  # big enough, but on the CPU
    out = _dispatch.widen(g, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, g.float())
    assert _dispatch.widen(g, torch.float16).dtype == torch.float16  # only widening to fp32
    col = torch.randn(64).to(torch.bfloat16)
    assert torch.equal(_dispatch.widen(col, torch.float32), col.float())


def test_recipe_cast_and_autocast_operands_use_it():
    p = torch.randn(16, 8, requires_grad=True)
    assert type(_rebuild.cast(p, torch.bfloat16).grad_fn).__name__ == "_CastBackward"
    # the loss under autocast: its fp32 weight's gradient arrives through the same cast
    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    W = torch.randn(24, 8, requires_grad=True)
    t = torch.randint(0, 24, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, W, t)
    loss.backward()
    assert W.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    h2 = h.detach().clone().requires_grad_()
    W2 = W.detach().clone().requires_grad_()
    ref = linear_cross_entropy(h2.to(torch.bfloat16), W2.to(torch.bfloat16), t)
    ref.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(W.grad, W2.grad) and torch.equal(h.grad, h2.grad)


def test_an_unused_cast_leaves_the_gradient_none_as_to_does():
    p = torch.randn(8, 8, requires_grad=True)
    q = torch.randn(8, 8, requires_grad=True)
    out = (_dispatch.cast(p, torch.bfloat16), _dispatch.cast(q, torch.bfloat16))
    out[1].float().sum().backward()
    assert p.grad is None and q.grad is not None


def test_switched_off_cast_is_plain_to(monkeypatch):
    monkeypatch.setattr(_dispatch, "WIDEN_GRADIENTS", False)
    p = torch.randn(8, 8, requires_grad=True)
    assert type(_dispatch.cast(p, torch.bfloat16).grad_fn).__name__ == "ToCopyBackward0"
