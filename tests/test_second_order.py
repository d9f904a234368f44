"""Second derivatives through the fused ops (``coda.fusions._second_order``): a gradient
taken with ``create_graph=True`` refuses, with a clear error, to be differentiated
towards the inputs its backward formula is not differentiable in, instead of leaving
that part of the derivative out, and a backward without ``create_graph`` is untouched.
What the formulas do cover (the loss's gradients as functions of the upstream gradient)
stays differentiable: tests/test_cross_entropy_fused.py,
``test_create_graph_differentiates_through_the_upstream_gradient``. CPU (the reference
path runs the same formulas; tests/test_second_order_gpu.py: the kernels)."""

from __future__ import annotations

import pytest
import torch

from coda.fusions import (
    layouts,
    linear_add_normed,
    linear_cross_entropy,
    normed_stream,
    qkv_rope,
    rms_norm_linear,
    swiglu_mlp,
)

H, FFN, HEADS, KV_HEADS, D, EPS, M, V = 16, 24, 4, 2, 4, 1e-5, 12, 40
FREQ = layouts.rope_frequencies(layouts.rope_inv_freq(D, 10000.0), HEADS, KV_HEADS, D)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)

    def p(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=g)).requires_grad_()

    return dict(
        x=p(M, H),
        gamma=p(H, scale=0.1, offset=1.0),
        w=p(H, H, scale=H**-0.5),
        w_qkv=p((HEADS + 2 * KV_HEADS) * D, H, scale=H**-0.5),
        w_gate_up=p(2 * FFN, H, scale=H**-0.5),
        w_down=p(H, FFN, scale=FFN**-0.5),
        w_vocab=p(V, H, scale=H**-0.5),
        target=torch.randint(0, V, (M,), generator=g),
    )


#: one scalar per fused op with a backward formula, from x and the op's weight: (name of
#: the op in the error, function of the weights, the weight to differentiate too)
CASES = {
    "linear_add_rms_norm": (
        "coda::linear_add_rms_norm",
        lambda w: linear_add_normed(w["x"], w["w"], w["x"].sin(), w["gamma"], EPS).x.pow(3).sum(),
        "w",
    ),
    "rms_norm_linear": (
        "coda::rms_norm_linear",
        lambda w: (
            rms_norm_linear(*normed_stream(w["x"], w["gamma"], EPS), w["gamma"], w["w"])
            .pow(2)
            .sum()
        ),
        "w",
    ),
    "rms_norm_qkv_rope": (
        "coda::rms_norm_qkv_rope",
        lambda w: sum(
            t.pow(2).sum()
            for t in qkv_rope(
                normed_stream(w["x"], w["gamma"], EPS),
                w["gamma"],
                w["w_qkv"],
                torch.arange(M),
                FREQ,
                HEADS,
                KV_HEADS,
                D,
            )
        ),  # fmt: skip
        "w_qkv",
    ),
    "rms_norm_swiglu_mlp": (
        "coda::rms_norm_swiglu_mlp",
        lambda w: (
            swiglu_mlp(
                normed_stream(w["x"], w["gamma"], EPS),
                w["gamma"],
                w["w_gate_up"],
                w["w_down"],
                w["gamma"],
                EPS,
            )
            .x.pow(2)
            .sum()
        ),  # fmt: skip
        "w_down",
    ),
    "lce_fused_loss": (
        "coda::lce_fused_loss",
        lambda w: linear_cross_entropy(w["x"], w["w_vocab"], w["target"], grad_in_forward=True),
        "w_vocab",
    ),
    "lce_lse": (  # the log-sum-exp returned beside the loss, differentiated
        "coda::lce_lse",
        lambda w: (
            linear_cross_entropy(
                w["x"], w["w_vocab"], w["target"], grad_in_forward=True, return_lse=True
            )[1]
            .pow(2)
            .sum()
        ),
        "w_vocab",
    ),
    "lce_stats": (
        "coda::lce_stats",
        lambda w: linear_cross_entropy(w["x"], w["w_vocab"], w["target"], grad_in_forward=False),
        "w_vocab",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_gradient_penalty_through_a_fused_op_refuses(case):
    """``(loss + |dL/dx|^2).backward()`` would leave out the penalty's second derivative:
    it raises, naming the op, before any gradient is accumulated wrongly."""
    name, f, _ = CASES[case]
    w = _weights()
    (gx,) = torch.autograd.grad(f(w), w["x"], create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match=f"{name}: second derivatives with respect to"):
        (f(w) + gx.pow(2).sum()).backward()


@pytest.mark.parametrize("case", ["rms_norm_linear", "lce_fused_loss", "lce_stats"])
def test_asking_for_the_input_s_second_derivative_refuses_even_when_unused_is_allowed(case):
    """``torch.autograd.grad(penalty, weight, allow_unused=True)``: the formula's saved
    inputs tie the refusal to them, so it raises rather than answer None."""
    name, f, weight = CASES[case]
    w = _weights()
    gx, gw = torch.autograd.grad(f(w), (w["x"], w[weight]), create_graph=True)
    penalty = gx.pow(2).sum() + gw.pow(2).sum()
    with pytest.raises(RuntimeError, match=f"{name}: second derivatives"):
        torch.autograd.grad(penalty, w[weight], allow_unused=True)


@pytest.mark.parametrize("case", ["rms_norm_linear", "rms_norm_swiglu_mlp", "lce_stats"])
def test_a_backward_without_create_graph_is_untouched(case):
    """No grad mode in the formula: the gradients are plain tensors, no graph attached,
    and a second backward pass gives the same values."""
    _, f, weight = CASES[case]
    w = _weights()
    gx, gw = torch.autograd.grad(f(w), (w["x"], w[weight]))
    assert not gx.requires_grad and gx.grad_fn is None and gw.grad_fn is None
    w2 = _weights()
    gx2, gw2 = torch.autograd.grad(f(w2), (w2["x"], w2[weight]), create_graph=True)
    torch.testing.assert_close(gx2.detach(), gx)
    torch.testing.assert_close(gw2.detach(), gw)
