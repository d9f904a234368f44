"""coda.fusions on a Hopper GPU (marker ``gpu``): the fused path of every op.

1. Every epilogue the fusions run (``coda.fusions.epilogues``) through
   ``coda.testing.fuzz.check_example``: outputs and partials NaN-poisoned, compared to a
   float64-accumulator reference with err(coda) <= 2 * err(eager) + 1e-3.
2. Every op, forward and backward, in bf16 on ragged shapes, against the textbook unfused
   math in float64 autograd: err(coda) <= 2 * err(eager bf16 autograd) + ATOL for every
   output and every gradient (inputs, weights, gamma).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.fusions import (  # noqa: E402
    NormedStream,
    epilogues,
    layouts,
    linear_add_rms_norm,
    qkv_rope,
    rms_norm_linear,
    rms_norm_stats,
    swiglu_mlp,
)
from coda.runtime.fused import n_multiple  # noqa: E402
from coda.testing.fuzz import check_example  # noqa: E402
from coda.testing.strategies import make_inputs  # noqa: E402
from coda.testing.tolerance import assert_close_to_reference  # noqa: E402

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
ATOL = 2e-3
EPS = 1e-5

EPILOGUES = {
    "residual_norm": epilogues.residual_norm(BF16, BF16, EPS),
    "residual_norm_f32_gamma": epilogues.residual_norm(BF16, F32, EPS),
    "norm_stats": epilogues.norm_stats(BF16, BF16, EPS),
    "row_scale": epilogues.row_scale(BF16),
    "swiglu_forward": epilogues.swiglu_forward(BF16),
    "rope_forward": epilogues.rope_forward(BF16),
    "scaled_grad": epilogues.scaled_grad(BF16),
    "swiglu_backward": epilogues.swiglu_backward(BF16),
    "rope_backward": epilogues.rope_backward(BF16),
    "norm_dgrad": epilogues.norm_dgrad(BF16, BF16, False),
    "norm_dgrad_residual": epilogues.norm_dgrad(BF16, F32, True),
}
SHAPES = [(300, 520, 264), (1000, 776, 136), (7, 16, 8), (4096, 1024, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_fusion_epilogue_fused_matches_reference(name, shape):
    epi = EPILOGUES[name]
    m, n, k = shape
    step = n_multiple(epi)
    n = -(-n // step) * step
    A, B, tensors = make_inputs(epi, m, n, k, BF16, seed=m + n + k)
    tensors = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in tensors.items()}
    record = check_example(epi, A.cuda(), B.cuda(), tensors)
    assert not record["failed"], record


def _rand(g, *shape, scale=1.0, offset=0.0):
    return offset + scale * torch.randn(*shape, generator=g, dtype=F64)


def _versions(*tensors, dtype=BF16):
    """(coda leaves, eager leaves, both in ``dtype``; float64 leaves) of the same values
    on cuda."""
    out = []
    for d in (dtype, dtype, F64):
        out.append([t.to("cuda", d).requires_grad_() for t in tensors])
    return out


def _check(name, mine, eager, truth):
    assert_close_to_reference(mine, truth, name=name, baseline=eager, atol=ATOL, floor=1.0)


def _grads_check(names, mine, eager, truth):
    for n, a, b, c in zip(names, mine, eager, truth, strict=True):
        _check(f"d{n}", a.grad, b.grad, c.grad)


# fp16 once per op, at its ragged shape (the ops' kernels in fp16 too)
@pytest.mark.parametrize(
    "M,K,H,N,dtype",
    [(300, 264, 520, 136, BF16), (1000, 136, 776, 264, BF16), (4096, 512, 1024, 512, BF16),
     (300, 264, 520, 136, F16)],
)  # fmt: skip
def test_producer_and_normed_linear(M, K, H, N, dtype):
    g = torch.Generator().manual_seed(M)
    vals = (
        _rand(g, M, K),
        _rand(g, H, K, scale=K**-0.5),
        _rand(g, M, H),
        _rand(g, H, scale=0.2, offset=1.0),
        _rand(g, N, H, scale=H**-0.5),
    )
    rz, rx = _rand(g, M, N).cuda(), _rand(g, M, H).cuda()
    mine, eager, truth = _versions(*vals, dtype=dtype)

    def textbook(a, w_o, res, gamma, w):
        x = a @ w_o.T + res
        return x, F.rms_norm(x, (H,), gamma, EPS) @ w.T

    for leaves in (eager, truth):
        x, z = textbook(*leaves)
        leaves.append((x, z))
        ((z * rz.to(z.dtype)).sum() + (x * rx.to(x.dtype)).sum()).backward()
    x, h, rstd = linear_add_rms_norm(*mine[:4], EPS)
    z = rms_norm_linear(x, h, rstd, mine[3], mine[4])
    ((z.float() * rz).sum() + (x.float() * rx).sum()).backward()
    _check("x", x, eager[5][0], truth[5][0])
    _check("z", z, eager[5][1], truth[5][1])
    _grads_check(("a", "w_o", "residual", "gamma", "w"), mine[:5], eager[:5], truth[:5])


@pytest.mark.parametrize(
    "M,H,Fd,dtype",
    [(300, 264, 344, BF16), (1000, 520, 1392, BF16), (4096, 1024, 2816, BF16),
     (300, 264, 344, F16)],
)  # fmt: skip
def test_swiglu_mlp(M, H, Fd, dtype):
    g = torch.Generator().manual_seed(M + 1)
    vals = (
        _rand(g, M, H),
        _rand(g, H, scale=0.2, offset=1.0),
        _rand(g, Fd, H, scale=H**-0.5),
        _rand(g, Fd, H, scale=H**-0.5),
        _rand(g, H, Fd, scale=Fd**-0.5),
    )
    gamma_next = _rand(g, H, scale=0.2, offset=1.0).to("cuda", dtype)
    r = _rand(g, M, H).cuda()
    mine, eager, truth = _versions(*vals, dtype=dtype)
    outs = {}
    for x, gamma, wg, wu, wd in (eager, truth):
        n = F.rms_norm(x, (H,), gamma, EPS)
        out = x + (F.silu(n @ wg.T) * (n @ wu.T)) @ wd.T
        (out * r.to(out.dtype)).sum().backward()
        outs[x.dtype] = out
    x, gamma, wg, wu, wd = mine
    w_gu = layouts.interleave_gate_up(torch.cat((wg, wu)).detach()).requires_grad_()
    h, rstd = rms_norm_stats(x, gamma, EPS)
    s = swiglu_mlp(NormedStream(x, h, rstd), gamma, w_gu, wd, gamma_next, EPS)
    (s.x.float() * r).sum().backward()
    _check("x_out", s.x, outs[dtype], outs[F64])
    dgate, dup = layouts.deinterleave_gate_up(w_gu.grad).chunk(2)
    wg.grad, wu.grad = dgate, dup
    _grads_check(("x", "gamma", "w_gate", "w_up", "w_down"), mine, eager, truth)


@pytest.mark.parametrize(
    "M,H,heads,kv_heads,D,dtype",
    [(300, 264, 4, 2, 64, BF16), (1000, 520, 8, 8, 64, BF16), (2048, 1024, 8, 2, 128, BF16),
     (300, 264, 4, 2, 64, F16)],
)  # fmt: skip
def test_qkv_rope(M, H, heads, kv_heads, D, dtype):
    g = torch.Generator().manual_seed(M + 2)
    vals = (
        _rand(g, M, H),
        _rand(g, H, scale=0.2, offset=1.0),
        _rand(g, heads * D, H, scale=H**-0.5),
        _rand(g, kv_heads * D, H, scale=H**-0.5),
        _rand(g, kv_heads * D, H, scale=H**-0.5),
    )
    positions = torch.randint(0, 32768, (M,), generator=g).cuda()
    inv_freq = layouts.rope_inv_freq(D, 500000.0).cuda()
    rs = [_rand(g, M, n, D).cuda() for n in (heads, kv_heads, kv_heads)]
    mine, eager, truth = _versions(*vals, dtype=dtype)
    # eager rotates by Hugging Face's angle (the product pos * inv_freq rounded to fp32);
    # the float64 truth by that product taken exactly, as coda's rope takes it (ops.rope)
    angles = {
        "eager": (positions.float()[:, None] * inv_freq[None, :]).double(),
        "truth": positions.double()[:, None] * inv_freq.double()[None, :],
    }

    def rot(t, which):
        emb = torch.cat((angles[which], angles[which]), dim=-1)
        c, s = emb.cos()[:, None, :].to(t.dtype), emb.sin()[:, None, :].to(t.dtype)
        x1, x2 = t.chunk(2, dim=-1)
        return t * c + torch.cat((-x2, x1), dim=-1) * s

    outs = {}
    for which, leaves in (("eager", eager), ("truth", truth)):
        x, gamma, wq, wk, wv = leaves
        n = F.rms_norm(x, (H,), gamma, EPS)
        q = rot((n @ wq.T).view(M, heads, D), which)
        k = rot((n @ wk.T).view(M, kv_heads, D), which)
        v = (n @ wv.T).view(M, kv_heads, D)
        sum((t * r.to(t.dtype)).sum() for t, r in zip((q, k, v), rs, strict=True)).backward()
        outs[x.dtype] = (q, k, v)
    x, gamma, wq, wk, wv = mine
    w_qkv = layouts.qkv_weight(wq, wk, wv, D).detach().requires_grad_()
    freq = layouts.rope_frequencies(inv_freq, heads, kv_heads, D)
    h, rstd = rms_norm_stats(x, gamma, EPS)
    q, k, v = qkv_rope(NormedStream(x, h, rstd), gamma, w_qkv, positions, freq, heads, kv_heads, D)
    q, k = layouts.to_rotate_half(q, D), layouts.to_rotate_half(k, D)
    sum((t.float() * r).sum() for t, r in zip((q, k, v), rs, strict=True)).backward()
    for i, name in enumerate("qkv"):
        _check(name, (q, k, v)[i], outs[dtype][i], outs[F64][i])
    wq.grad, wk.grad, wv.grad = layouts.split_qkv_weight(w_qkv.grad, heads, kv_heads, D)
    _grads_check(("x", "gamma", "w_q", "w_k", "w_v"), mine, eager, truth)


def test_block_forward_backward_is_bitwise_reproducible(deterministic_algorithms):
    """A Llama-style block (normed stream, q|k|v + RoPE, o-projection + residual + norm,
    SwiGLU MLP, the normed head) forward and backward twice: every output and gradient
    bitwise equal (the reductions combine per-tile partials in a fixed order; no split-K
    here), with torch.use_deterministic_algorithms(True) on, which no op refuses."""
    from coda.fusions import linear_add_normed, normed_stream

    deterministic_algorithms()
    M, H, Fd, heads, kv_heads, D, V = 1000, 520, 1392, 4, 2, 64, 776
    g = torch.Generator().manual_seed(5)

    def leaf(*shape, scale=1.0, offset=0.0):
        t = torch.randn(*shape, generator=g) * scale + offset
        return t.to("cuda", BF16).requires_grad_()

    x = leaf(M, H)
    g_attn, g_mlp, g_final = (leaf(H, scale=0.2, offset=1.0) for _ in range(3))
    w_qkv = leaf((heads + 2 * kv_heads) * D, H, scale=H**-0.5)
    w_o = leaf(H, heads * D, scale=(heads * D) ** -0.5)
    w_gu = leaf(2 * Fd, H, scale=H**-0.5)
    w_down = leaf(H, Fd, scale=Fd**-0.5)
    w_head = leaf(V, H, scale=H**-0.5)
    leaves = (x, g_attn, g_mlp, g_final, w_qkv, w_o, w_gu, w_down, w_head)
    positions = torch.arange(M, device="cuda")
    freq = layouts.rope_frequencies(layouts.rope_inv_freq(D, 500000.0), heads, kv_heads, D)
    r = torch.randn(M, V, generator=g).cuda()

    def step():
        stream = normed_stream(x, g_attn, EPS)
        q, k, v = qkv_rope(stream, g_attn, w_qkv, positions, freq.cuda(), heads, kv_heads, D)
        k = k.reshape(M, kv_heads, D).repeat_interleave(heads // kv_heads, 1)
        o = (q.reshape(M, heads, D) * k).reshape(M, -1)  # stand-in attention
        stream = linear_add_normed(o, w_o, stream.x, g_mlp, EPS)
        stream = swiglu_mlp(stream, g_mlp, w_gu, w_down, g_final, EPS)
        z = rms_norm_linear(stream.x, stream.h, stream.rstd, g_final, w_head)
        grads = torch.autograd.grad((z.float() * r).sum(), leaves)
        return (z, v, *grads)

    first, again = step(), step()
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
