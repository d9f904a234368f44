"""Second derivatives through the fused kernels on a Hopper GPU (marker ``gpu``): the same
refusal as tests/test_second_order.py checks on the CPU, here with the formulas running
coda's kernels (bf16): a gradient penalty through the LM-head loss or the SwiGLU MLP
raises, naming the op, and the loss's gradients stay differentiable in a loss scale."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.fusions import linear_cross_entropy, normed_stream, swiglu_mlp  # noqa: E402

BF16 = torch.bfloat16
M, H, FFN, V = 300, 256, 704, 1000


def _leaf(*shape, scale=1.0, offset=0.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = offset + scale * torch.randn(*shape, generator=g, device="cuda")
    return t.to(BF16).requires_grad_()


def test_loss_penalty_refuses_and_scale_stays_differentiable():
    h, W = _leaf(M, H, seed=1), _leaf(V, H, scale=H**-0.5, seed=2)
    target = torch.randint(0, V, (M,), device="cuda")
    s = torch.tensor(1.5, device="cuda", requires_grad=True)
    dh, dW = torch.autograd.grad(
        s * linear_cross_entropy(h, W, target, grad_in_forward=True), (h, W), create_graph=True
    )
    ch, cW = torch.randn_like(dh), torch.randn_like(dW)
    (ds,) = torch.autograd.grad((dh.float() * ch).sum() + (dW.float() * cW).sum(), s)
    dh1, dW1 = torch.autograd.grad(linear_cross_entropy(h, W, target, grad_in_forward=True), (h, W))
    want = (dh1.float() * ch).sum() + (dW1.float() * cW).sum()
    torch.testing.assert_close(ds, want, rtol=2e-2, atol=1e-3)
    dh, _ = torch.autograd.grad(
        linear_cross_entropy(h, W, target, grad_in_forward=True), (h, W), create_graph=True
    )
    with pytest.raises(RuntimeError, match="coda::lce_fused_loss: second derivatives"):
        dh.float().pow(2).sum().backward()


def test_mlp_penalty_refuses():
    x = _leaf(M, H, seed=3)
    gamma = _leaf(H, scale=0.1, offset=1.0, seed=4)
    w_gate_up = _leaf(2 * FFN, H, scale=H**-0.5, seed=5)
    w_down = _leaf(H, FFN, scale=FFN**-0.5, seed=6)
    out = swiglu_mlp(normed_stream(x, gamma, 1e-5), gamma, w_gate_up, w_down, gamma, 1e-5)
    (dx,) = torch.autograd.grad(out.x.float().pow(2).sum(), x, create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="coda::rms_norm_swiglu_mlp: second derivatives"):
        torch.autograd.grad(dx.float().pow(2).sum(), w_down)
