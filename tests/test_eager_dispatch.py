"""Plain eager calls of the fusion ops skip the dispatcher (``coda.fusions._dispatch.EagerOp``)
and compute exactly what the custom ops compute; anything that must see the ops (a
dispatch mode, a compiler, fake tensors) still gets them. CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coda.fusions import (
    _dispatch,
    layouts,
    linear_add_normed,
    norm,
    normed_stream,
    qkv_rope,
    rope,
    swiglu,
    swiglu_mlp,
)

H, FFN, HEADS, KV_HEADS, D, EPS = 16, 24, 4, 2, 4, 1e-5
FREQ = layouts.rope_frequencies(layouts.rope_inv_freq(D, 10000.0), HEADS, KV_HEADS, D)
#: every EagerOp of the block, with the custom op it stands for
BLOCK_OPS = {
    "rms_norm_stats": norm._rms_norm_stats,
    "linear_add_rms_norm": norm._linear_add_rms_norm,
    "linear_backward": norm._linear_grads,
    "rms_norm_qkv_rope": rope._rms_norm_qkv_rope,
    "rms_norm_qkv_rope_backward": rope._rms_norm_qkv_rope_backward,
    "rms_norm_swiglu_mlp": swiglu._rms_norm_swiglu_mlp,
    "rms_norm_swiglu_mlp_backward": swiglu._rms_norm_swiglu_mlp_backward,
}


class Ops(TorchDispatchMode):
    """Records the names of the ops the dispatcher sees."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)

    def p(*shape, scale=1.0, offset=0.0):  # module weights: parameters
        return torch.nn.Parameter(offset + scale * torch.randn(*shape, generator=g))

    M = 12
    return dict(
        x=(torch.randn(M, H, generator=g)).requires_grad_(),
        gamma_attn=p(H, scale=0.1, offset=1.0),
        w_qkv=p((HEADS + 2 * KV_HEADS) * D, H, scale=H**-0.5),
        w_o=p(H, HEADS * D, scale=0.3),
        gamma_mlp=p(H, scale=0.1, offset=1.0),
        w_gate_up=p(2 * FFN, H, scale=H**-0.5),
        w_down=p(H, FFN, scale=FFN**-0.5),
        gamma_final=p(H, scale=0.1, offset=1.0),
    )


def _block(w):
    """Norm, QKV + RoPE, an attention stand-in, O projection into the stream, MLP."""
    x = w["x"]
    s = normed_stream(x, w["gamma_attn"], EPS)
    positions = torch.arange(x.shape[0])
    q, k, _ = qkv_rope(s, w["gamma_attn"], w["w_qkv"], positions, FREQ, HEADS, KV_HEADS, D)
    attn = (q * k.repeat_interleave(HEADS // KV_HEADS, dim=1).sigmoid()).reshape(x.shape[0], -1)
    s = linear_add_normed(attn, w["w_o"], x, w["gamma_mlp"], EPS)
    s = swiglu_mlp(s, w["gamma_mlp"], w["w_gate_up"], w["w_down"], w["gamma_final"], EPS)
    return s.x


def _forward_backward(w):
    out = _block(w)
    # gamma_final only makes the next norm's caches (no gradient through them)
    grads = torch.autograd.grad((out * out).sum(), list(w.values()), allow_unused=True)
    return out, grads


def test_block_ops_skip_the_dispatcher_and_match_the_custom_ops(monkeypatch):
    """A forward + backward of a block (its weights ``nn.Parameter``s, as in a module): in
    plain eager mode no coda custom op reaches the dispatcher (each EagerOp's op refuses
    to be called) and the outputs and every gradient equal, bitwise, those of the same
    block under a dispatch mode, where every op of the block (forward and backward ones)
    goes through the dispatcher."""
    w = _leaves()
    with Ops() as ops:
        out_op, grads_op = _forward_backward(w)
    seen = {name.split(".")[1] for name in ops.names if name.startswith("coda.")}
    assert seen == set(BLOCK_OPS)

    def refuse(*args, **kwargs):
        raise AssertionError("a custom op was called in a plain eager call")

    for eager in BLOCK_OPS.values():
        monkeypatch.setattr(eager, "op", refuse)
    out, grads = _forward_backward(w)
    torch.testing.assert_close(out, out_op, rtol=0, atol=0)
    for g, g_op in zip(grads, grads_op, strict=True):
        torch.testing.assert_close(g, g_op, rtol=0, atol=0)


def test_plain_eager_only_for_plain_tensors_outside_modes_and_compilers():
    x = torch.randn(3)
    assert _dispatch.plain_eager(x, torch.nn.Parameter(torch.ones(2)), 1.0, None)
    with Ops():
        assert not _dispatch.plain_eager(x)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not _dispatch.plain_eager(fake)

    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t):
        seen.append(_dispatch.plain_eager(t))
        return t + 1

    traced(x)
    assert seen == [False]


def test_an_op_without_a_formula_stays_the_op_where_autograd_would_record():
    """An EagerOp of an op with no autograd formula runs the implementation directly only
    where nothing requires grad; with an input that does (grad mode on) it calls the op,
    which then refuses the backward instead of returning a silently wrong gradient."""
    calls = []

    def impl(a: torch.Tensor) -> torch.Tensor:
        calls.append("impl")
        return a * 2

    def op(a):
        calls.append("op")
        return a * 2

    eager = _dispatch.EagerOp(op, impl)
    eager(torch.ones(2))
    eager(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        eager(torch.ones(2, requires_grad=True))
    assert calls == ["impl", "op", "impl"]


@pytest.mark.parametrize("given", [1, 2])
def test_missing_trailing_arguments_take_the_defaults(given):
    def impl(a: torch.Tensor, b: float = 2.0, c: bool = True) -> torch.Tensor:
        return a * b if c else a

    def op(*args):
        raise AssertionError("plain eager")

    eager = _dispatch.EagerOp(op, impl)
    args = (torch.ones(2), 3.0)[:given]
    torch.testing.assert_close(eager(*args), impl(*args))
