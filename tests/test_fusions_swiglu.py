"""coda.fusions.swiglu on CPU: the fused SwiGLU MLP block (norm + gate/up + SwiGLU + down +
residual + next norm) forward and every gradient against textbook unfused PyTorch
autograd in float64 (concatenated gate/up weights, F.rms_norm, F.silu). The ops compute
in fp32 on CPU (``Epilogue.reference``), held to the fp32 tolerance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _fusion_helpers import F64, ZeroFills, close, leaf, randn
from coda.fusions import NormedStream, layouts, linear_add_rms_norm, rms_norm_stats, swiglu_mlp
from coda.testing import examples


@st.composite
def problems(draw):
    return dict(
        M=draw(st.integers(1, 60)),
        H=draw(st.integers(8, 40)),
        F=draw(st.integers(1, 48)),
        eps=draw(st.sampled_from([1e-5, 1e-6])),
        eps_next=draw(st.sampled_from([1e-5, 1e-6])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def textbook(x, gamma, w_gate, w_up, w_down, eps):
    n = F.rms_norm(x, (x.shape[1],), gamma, eps)
    return x + (F.silu(n @ w_gate.T) * (n @ w_up.T)) @ w_down.T


@settings(max_examples=examples(40))
@given(problems())
def test_swiglu_mlp_fwd_bwd(p):
    M, H, Fd, eps = p["M"], p["H"], p["F"], p["eps"]
    g = torch.Generator().manual_seed(p["seed"])
    x, gamma = randn(g, M, H), 1 + 0.2 * randn(g, H)
    w_gate, w_up = randn(g, Fd, H, scale=H**-0.5), randn(g, Fd, H, scale=H**-0.5)
    w_down, gamma_next = randn(g, H, Fd, scale=Fd**-0.5), 1 + 0.2 * randn(g, H)
    r = randn(g, M, H)

    t = [leaf(v, F64) for v in (x, gamma, w_gate, w_up, w_down)]
    out_t = textbook(*t, eps)
    (out_t * r).sum().backward()

    xc, gc, wdc = leaf(x), leaf(gamma), leaf(w_down)
    wguc = leaf(layouts.interleave_gate_up(torch.cat((w_gate, w_up))))
    h, rstd = rms_norm_stats(xc, gc, eps)
    out = swiglu_mlp(NormedStream(xc, h, rstd), gc, wguc, wdc, gamma_next.float(), p["eps_next"])
    (out.x * r.float()).sum().backward()

    close(out.x, out_t, "x_out")
    close(out.h, out_t * gamma_next, "h_out")
    close(out.rstd, torch.rsqrt(out_t.pow(2).mean(1) + p["eps_next"]), "rstd_out")
    close(xc.grad, t[0].grad, "dx")
    close(gc.grad, t[1].grad, "dgamma")
    dgate, dup = layouts.deinterleave_gate_up(wguc.grad).chunk(2)
    close(dgate, t[2].grad, "dw_gate")
    close(dup, t[3].grad, "dw_up")
    close(wdc.grad, t[4].grad, "dw_down")
    assert not out.h.requires_grad and not out.rstd.requires_grad


def test_interleave_round_trip_and_layout():
    w = torch.arange(12.0).reshape(6, 2)  # gate rows 0-2, up rows 3-5
    inter = layouts.interleave_gate_up(w)
    assert inter[:, 0].tolist() == [0.0, 6.0, 2.0, 8.0, 4.0, 10.0]
    assert torch.equal(layouts.deinterleave_gate_up(inter), w)


def test_frozen_mlp_weights_skip_their_gradients():
    g = torch.Generator().manual_seed(3)
    x, gamma = leaf(randn(g, 10, 16)), leaf(1 + 0.1 * randn(g, 16))
    w_gu, w_down = randn(g, 24, 16, scale=0.25).float(), randn(g, 16, 12, scale=0.3).float()
    h, rstd = rms_norm_stats(x, gamma, 1e-6)
    out = swiglu_mlp(NormedStream(x, h, rstd), gamma, w_gu, w_down, gamma.detach(), 1e-6)
    out.x.sum().backward()
    assert x.grad is not None and gamma.grad is not None
    assert w_gu.grad is None and w_down.grad is None


def test_unused_outputs_get_no_zero_filled_gradients():
    """The caches (h, rstd) and gu are outputs nobody differentiates: autograd must not
    materialize zero gradients for them (an M x 2F fill per layer per step for gu)."""
    M, H, Fd = 16, 8, 12
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=g).requires_grad_()
    a = torch.randn(M, H, generator=g).requires_grad_()
    gamma = torch.ones(H)
    w_o = torch.randn(H, H, generator=g).requires_grad_()
    w_gu = torch.randn(2 * Fd, H, generator=g).requires_grad_()
    w_d = torch.randn(H, Fd, generator=g).requires_grad_()
    x1, h1, r1 = linear_add_rms_norm(a, w_o, x, gamma, 1e-6)
    out = swiglu_mlp(NormedStream(x1, h1, r1), gamma, w_gu, w_d, gamma, 1e-6)
    fills = ZeroFills()
    with fills:
        out.x.sum().backward()
    assert fills.shapes == []
    assert all(t.grad is not None for t in (x, a, w_o, w_gu, w_d))
