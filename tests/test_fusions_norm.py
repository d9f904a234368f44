"""coda.fusions.norm on CPU: the deferred RMSNorm (producer epilogue -> consumer row scale)
forward and every gradient against textbook unfused PyTorch autograd in float64.

The ops run their epilogues' ``reference`` on CPU, which computes in fp32 (the engine's
``Epilogue.reference`` accepts bf16/fp16/fp32 operands and evaluates in fp32); so the ops
run on fp32 inputs and are held to the fp32 tolerance against the float64 textbook, which
an algebra mistake misses by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _fusion_helpers import F32, F64, close, leaf, randn
from coda.fusions import linear_add_rms_norm, rms_norm_linear, rms_norm_stats
from coda.testing import examples


@st.composite
def shapes(draw):
    return dict(
        M=draw(st.integers(1, 70)),
        K=draw(st.integers(1, 40)),
        # H >= 8: at H = 1 or 2 the norm's backward cancels to ~eps-sized values (x / |x|
        # has a near-zero derivative), which fp32 cannot resolve; Llama has H >= 2048
        H=draw(st.integers(8, 48)),
        N=draw(st.integers(1, 40)),
        eps=draw(st.sampled_from([1e-5, 1e-6])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40))
@given(shapes())
def test_stats_match_textbook(s):
    g = torch.Generator().manual_seed(s["seed"])
    x, gamma = randn(g, s["M"], s["H"]), 1 + 0.2 * randn(g, s["H"])
    h, rstd = rms_norm_stats(x.float(), gamma.float(), s["eps"])
    close(h, x * gamma, "h")
    close(rstd, torch.rsqrt(x.pow(2).mean(1) + s["eps"]), "rstd")
    assert not h.requires_grad and not rstd.requires_grad


@settings(max_examples=examples(40))
@given(shapes())
def test_producer_then_consumer_fwd_bwd(s):
    """x = a @ w_o.T + residual; z = rmsnorm(x) * gamma @ w.T; loss uses z and x (the
    residual path), so every gradient (a, w_o, residual, gamma, w) is checked."""
    M, K, H, N, eps = s["M"], s["K"], s["H"], s["N"], s["eps"]
    g = torch.Generator().manual_seed(s["seed"])
    a, w_o, res = randn(g, M, K), randn(g, H, K, scale=K**-0.5), randn(g, M, H)
    gamma, w = 1 + 0.2 * randn(g, H), randn(g, N, H, scale=H**-0.5)
    rz, rx = randn(g, M, N), randn(g, M, H)

    t = [leaf(v, F64) for v in (a, w_o, res, gamma, w)]
    x_t = t[0] @ t[1].T + t[2]
    z_t = F.rms_norm(x_t, (H,), t[3], eps) @ t[4].T
    ((z_t * rz).sum() + (x_t * rx).sum()).backward()

    c = [leaf(v) for v in (a, w_o, res, gamma, w)]
    x, h, rstd = linear_add_rms_norm(c[0], c[1], c[2], c[3], eps)
    z = rms_norm_linear(x, h, rstd, c[3], c[4])
    ((z * rz.float()).sum() + (x * rx.float()).sum()).backward()

    close(x, x_t, "x")
    close(h, x_t * gamma, "h")
    close(rstd, torch.rsqrt(x_t.pow(2).mean(1) + eps), "rstd")
    close(z, z_t, "z")
    for name, mine, ref in zip(("a", "w_o", "residual", "gamma", "w"), c, t, strict=True):
        close(mine.grad, ref.grad, f"d{name}")


def test_frozen_weights_get_no_gradient():
    g = torch.Generator().manual_seed(1)
    a, w_o, res = randn(g, 9, 6).float(), randn(g, 10, 6).float(), leaf(randn(g, 9, 10))
    gamma, w = leaf(1 + 0.1 * randn(g, 10)), randn(g, 7, 10).float()
    x, h, rstd = linear_add_rms_norm(a, w_o, res, gamma, 1e-6)
    rms_norm_linear(x, h, rstd, gamma, w).sum().backward()
    assert res.grad is not None and gamma.grad is not None
    assert not w.requires_grad and w.grad is None and a.grad is None


def test_cast_of_dgamma_and_bf16_path():
    """bf16 activations and an fp32 gamma: outputs in bf16, dgamma in gamma's dtype."""
    g = torch.Generator().manual_seed(2)
    x = randn(g, 12, 16).to(torch.bfloat16)
    gamma = leaf(1 + 0.1 * randn(g, 16))
    w = randn(g, 8, 16, scale=0.25).to(torch.bfloat16).requires_grad_()
    h, rstd = rms_norm_stats(x, gamma, 1e-6)
    assert h.dtype == torch.bfloat16 and rstd.dtype == F32
    z = rms_norm_linear(x.requires_grad_(), h, rstd, gamma, w)
    z.float().sum().backward()
    assert z.dtype == torch.bfloat16 and gamma.grad.dtype == F32
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_float64_is_refused_with_a_clear_error():
    x = torch.randn(4, 8, dtype=F64)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        rms_norm_stats(x, torch.ones(8, dtype=F64), 1e-6)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_eps_must_be_non_negative_and_finite(eps):
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    with pytest.raises(ValueError, match="eps must be a non-negative finite float"):
        rms_norm_stats(x, torch.ones(8), eps)
    with pytest.raises(ValueError, match="eps must be a non-negative finite float"):
        linear_add_rms_norm(torch.randn(4, 6), w, x, torch.ones(8), eps)


def test_weights_and_streams_are_named_when_wrong():
    from coda.fusions import NormedStream, swiglu_mlp

    x = torch.randn(4, 8)
    h, rstd = rms_norm_stats(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm_linear: w must be an \(out_features, 8\)"):
        rms_norm_linear(x, h, rstd, torch.ones(8), torch.randn(6, 7))
    with pytest.raises(ValueError, match=r"linear_add_rms_norm: w must be an \(out_features, 6\)"):
        linear_add_rms_norm(torch.randn(4, 6), torch.randn(8, 5), x, torch.ones(8), 1e-6)
    with pytest.raises(TypeError, match="stream must be a coda.fusions.NormedStream"):
        swiglu_mlp((x, h, rstd), torch.ones(8), torch.randn(12, 8), torch.randn(8, 6),
                   torch.ones(8), 1e-6)  # fmt: skip
    assert isinstance(NormedStream(x, h, rstd).x, torch.Tensor)


def test_lists_are_refused_with_the_argument_named():
    """A list where a tensor goes (it is not converted): a TypeError naming the op and
    the argument, not an AttributeError from inside. (The custom ops themselves, called
    through the dispatcher, refuse it by their schema.)"""
    from coda.fusions import layouts, linear_add_normed, normed_stream, qkv_rope, swiglu_mlp

    x = torch.randn(4, 8)
    ones = torch.ones(8)
    with pytest.raises(TypeError, match="rms_norm_stats: x must be a torch.Tensor; got list"):
        normed_stream(x.tolist(), ones, 1e-6)
    with pytest.raises(TypeError, match="rms_norm_stats: gamma must be a torch.Tensor"):
        normed_stream(x, ones.tolist(), 1e-6)
    with pytest.raises(TypeError, match="linear_add_rms_norm: w must be a torch.Tensor"):
        linear_add_normed(torch.randn(4, 6), torch.randn(8, 6).tolist(), x, ones, 1e-6)
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'x'"):
        rms_norm_stats(x.tolist(), ones, 1e-6)
    s = normed_stream(x, ones, 1e-6)
    with pytest.raises(TypeError, match="rms_norm_swiglu_mlp: w_down must be a torch.Tensor"):
        swiglu_mlp(s, ones, torch.randn(12, 8), torch.randn(8, 6).tolist(), ones, 1e-6)
    freq = layouts.rope_frequencies(layouts.rope_inv_freq(2, 1e4), 2, 1, 2)
    with pytest.raises(TypeError, match="qkv_rope: w_qkv must be a torch.Tensor"):
        qkv_rope(s, ones, torch.randn(8, 8).tolist(), torch.arange(4), freq, 2, 1, 2)
    with pytest.raises(TypeError, match="qkv_rope: positions must be a torch.Tensor"):
        qkv_rope(s, ones, torch.randn(8, 8), [0, 1, 2, 3], freq, 2, 1, 2)


def test_normed_linear_layer_over_no_tokens():
    x = torch.randn(0, 8, requires_grad=True)
    gamma, w = torch.ones(8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    h, rstd = rms_norm_stats(x, gamma, 1e-6)
    z = rms_norm_linear(x, h, rstd, gamma, w)
    assert z.shape == (0, 6)
    z.sum().backward()
    assert x.grad.shape == (0, 8)
    assert torch.equal(w.grad, torch.zeros(6, 8)) and torch.equal(gamma.grad, torch.zeros(8))
