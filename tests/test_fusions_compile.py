"""coda.fusions under the PyTorch stack, on CPU: ``torch.library.opcheck`` on every op
(forward and backward ops: schema, fake tensors, autograd registration, AOT dispatch with
dynamic shapes), and ``torch.compile(fullgraph=True)`` over a Llama-style block built
from the ops (no graph break, forward and gradients equal to eager, dynamic sequence
length without recompiling per length)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from coda.fusions import (
    NormedStream,
    layouts,
    linear_add_rms_norm,
    qkv_rope,
    rms_norm_linear,
    rms_norm_qkv_rope,
    rms_norm_stats,
    rms_norm_swiglu_mlp,
    swiglu_mlp,
)
from coda.fusions.norm import linear_backward, rms_norm_linear_backward
from coda.fusions.rope import rms_norm_qkv_rope_backward
from coda.fusions.swiglu import rms_norm_swiglu_mlp_backward

H, FFN, HEADS, KV_HEADS, D, EPS = 16, 24, 4, 2, 4, 1e-5


def weights(seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)

    def p(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=g)).requires_grad_(grad)

    nqkv = (HEADS + 2 * KV_HEADS) * D
    return dict(
        gamma_attn=p(H, scale=0.1, offset=1.0),
        w_qkv=p(nqkv, H, scale=H**-0.5),
        w_o=p(H, HEADS * D, scale=0.3),
        gamma_mlp=p(H, scale=0.1, offset=1.0),
        w_gate_up=p(2 * FFN, H, scale=H**-0.5),
        w_down=p(H, FFN, scale=FFN**-0.5),
        gamma_final=p(H, scale=0.1, offset=1.0),
        w_head=p(10, H, scale=H**-0.5),
    )


FREQ = layouts.rope_frequencies(layouts.rope_inv_freq(D, 10000.0), HEADS, KV_HEADS, D)


def block(x, positions, w):
    """Layer 0 of a Llama-style model (attention replaced by a plain reshape of q, which
    is not what is under test) and a normed head."""
    h, rstd = rms_norm_stats(x, w["gamma_attn"], EPS)
    q, k, v = qkv_rope(
        NormedStream(x, h, rstd),
        w["gamma_attn"],
        w["w_qkv"],
        positions,
        FREQ,
        HEADS,
        KV_HEADS,
        D,
    )
    attn = (q * k.repeat_interleave(HEADS // KV_HEADS, dim=1).sigmoid()).reshape(x.shape[0], -1)
    s = NormedStream(*linear_add_rms_norm(attn, w["w_o"], x, w["gamma_mlp"], EPS))
    s = swiglu_mlp(s, w["gamma_mlp"], w["w_gate_up"], w["w_down"], w["gamma_final"], EPS)
    return rms_norm_linear(s.x, s.h, s.rstd, w["gamma_final"], w["w_head"])


def run(fn, M, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).requires_grad_()
    positions = torch.randint(0, 100, (M,), generator=g)
    w = weights(seed)
    out = fn(x, positions, w)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), [x.grad] + [p.grad for p in w.values()]


def test_compile_fullgraph_matches_eager_with_dynamic_lengths():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for M in (7, 13, 20):
        out_c, grads_c = run(compiled, M, seed=M)
        frames.append(counter.frame_count)
        out_e, grads_e = run(block, M, seed=M)
        torch.testing.assert_close(out_c, out_e)
        for gc, ge in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(gc, ge)
    assert frames[0] == frames[-1]  # no recompile for a new sequence length


def test_no_graph_breaks():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, positions = torch.randn(9, H, generator=g), torch.arange(9)
    explanation = torch._dynamo.explain(block)(x, positions, weights())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def _inputs(M=11, grad=True):
    g = torch.Generator().manual_seed(1)

    def r(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=g)).requires_grad_(grad)

    x = r(M, H)
    gamma = r(H, scale=0.1, offset=1.0)
    h, rstd = rms_norm_stats(x.detach(), gamma.detach(), EPS)
    return x, gamma, h, rstd, r


def _forward_cases():
    x, gamma, h, rstd, r = _inputs()
    M = x.shape[0]
    w = weights()
    pos = torch.arange(M, dtype=torch.float32)
    return {
        "rms_norm_stats": (rms_norm_stats, (x, gamma, EPS)),
        "linear_add_rms_norm": (
            linear_add_rms_norm,
            (r(M, HEADS * D), w["w_o"], r(M, H), gamma, EPS),
        ),
        "rms_norm_linear": (rms_norm_linear, (x, h, rstd, gamma, w["w_head"])),
        "rms_norm_swiglu_mlp": (
            rms_norm_swiglu_mlp,
            (x, h, rstd, gamma, w["w_gate_up"], w["w_down"], w["gamma_final"], EPS),
        ),
        "rms_norm_qkv_rope": (rms_norm_qkv_rope, (x, h, rstd, gamma, w["w_qkv"], pos, FREQ)),
    }


def _backward_cases():
    x, gamma, h, rstd, r = _inputs(grad=False)
    M = x.shape[0]
    w = {k: v.detach() for k, v in weights().items()}
    pos = torch.arange(M, dtype=torch.float32)
    z = rms_norm_linear(x, h, rstd, gamma, w["w_head"])
    gu = rms_norm_swiglu_mlp(x, h, rstd, gamma, w["w_gate_up"], w["w_down"], gamma, EPS)[3]
    qkv = rms_norm_qkv_rope(x, h, rstd, gamma, w["w_qkv"], pos, FREQ)
    return {
        "linear_backward": (linear_backward, (r(M, H), r(M, HEADS * D), w["w_o"])),
        "linear_backward_dw_only": (linear_backward, (r(M, H), r(M, HEADS * D), None)),
        "rms_norm_linear_backward": (
            rms_norm_linear_backward,
            (r(*z.shape), z, x, h, rstd, gamma, w["w_head"], True, True),
        ),
        "rms_norm_swiglu_mlp_backward": (
            rms_norm_swiglu_mlp_backward,
            (r(M, H), x, h, rstd, gamma, w["w_gate_up"], w["w_down"], gu, True, True, False),
        ),
        "rms_norm_qkv_rope_backward": (
            rms_norm_qkv_rope_backward,
            (r(*qkv.shape), qkv, x, h, rstd, gamma, w["w_qkv"], pos, FREQ, False, True),
        ),
    }


@pytest.mark.parametrize("name", list(_forward_cases()))
def test_opcheck_forward_ops(name):
    op, args = _forward_cases()[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", list(_backward_cases()))
def test_opcheck_backward_ops(name):
    op, args = _backward_cases()[name]
    torch.library.opcheck(op, args)
