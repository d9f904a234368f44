"""``coda.fusions.cast_layouts.cast_gate_up``: AMP's fp32 gate / up weights cast into the
interleaved 16-bit layout, gradients back in fp32. CPU: the PyTorch composition it stands
for (values and gradients), and the map-pass path's plumbing (the interleaved tensor's
halves as the map pass's outputs and inputs) run with a stand-in map pass that computes
the epilogue's reference and writes the caller's buffers as the kernel does. The kernel
itself: tests/test_cast_layouts_gpu.py."""

from __future__ import annotations

import pytest
import torch

from coda.fusions import _dispatch, cast_layouts, layouts


def _reference(gate, up, dtype):
    return layouts.interleave_gate_up(torch.cat((gate, up)).to(dtype))


def _weights(F=24, H=16, seed=0):
    torch.manual_seed(seed)
    gate = torch.randn(F, H, requires_grad=True)
    up = torch.randn(F, H, requires_grad=True)
    return gate, up


def _check(gate, up, dtype):
    ref_g, ref_u = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = cast_layouts.cast_gate_up(gate, up, dtype)
    expect = _reference(ref_g, ref_u, dtype)
    assert out.dtype == dtype and torch.equal(out, expect)
    dy = torch.randn(out.shape).to(dtype)
    out.backward(dy)
    expect.backward(dy)
    for got, want in ((gate.grad, ref_g.grad), (up.grad, ref_u.grad)):
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, want)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cast_gate_up_is_the_cast_interleave_on_the_cpu(low):
    _check(*_weights(), low)


def _stand_in_map_pass(ran):
    def run_map(epi, M, N, like, outputs=None, **tensors):
        ran.append(sorted(tensors))
        A = torch.zeros(M, _dispatch.MAP_K, dtype=like.dtype)
        B = torch.zeros(N, _dispatch.MAP_K, dtype=like.dtype)
        got = dict(epi.reference(A, B, **tensors))
        for name, buf in (outputs or {}).items():
            assert buf.stride(1) == 1  # a row-major view, as the TMA needs
            buf.copy_(got[name])
            got[name] = buf
        return got

    return run_map


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_map_pass_path_writes_the_interleaved_halves(low, monkeypatch):
    ran = []
    monkeypatch.setattr(_dispatch, "run_map", _stand_in_map_pass(ran))
    monkeypatch.setattr(_dispatch, "uses_kernels", lambda t: True)
    monkeypatch.setattr(cast_layouts, "MIN_NUMEL", 1)
    _check(*_weights(F=40, H=24, seed=1), low)
    assert ran == [["gate", "up"], ["gate", "up"]]  # forward, then backward


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(32, 12), torch.randn(32, 12)),  # 12 % 8: not the TMA's rows
        lambda: (torch.randn(32, 16).t().contiguous().t(), torch.randn(32, 16)),  # strided
        lambda: (torch.randn(32, 16).bfloat16(), torch.randn(32, 16).bfloat16()),  # not fp32
        lambda: (torch.randn(32, 16), torch.randn(16, 32)),  # shapes differ
    ],
    ids=["cols", "strided", "not_fp32", "shapes"],
)
def test_declines_what_the_map_pass_cannot_take(make, monkeypatch):
    monkeypatch.setattr(_dispatch, "run_map", lambda *a, **k: pytest.fail("map pass ran"))
    monkeypatch.setattr(_dispatch, "uses_kernels", lambda t: True)
    monkeypatch.setattr(cast_layouts, "MIN_NUMEL", 1)
    gate, up = make()
    if gate.shape != up.shape:
        with pytest.raises(ValueError, match="equal 2-D shapes"):
            cast_layouts.cast_gate_up(gate, up, torch.bfloat16)
        return
    out = cast_layouts.cast_gate_up(gate, up, torch.bfloat16)
    assert torch.equal(out, _reference(gate, up, torch.bfloat16))


def test_small_weights_take_pytorchs_path(monkeypatch):
    monkeypatch.setattr(_dispatch, "run_map", lambda *a, **k: pytest.fail("map pass ran"))
    monkeypatch.setattr(_dispatch, "uses_kernels", lambda t: True)
    gate, up = _weights()
    assert gate.numel() < cast_layouts.MIN_NUMEL
    _check(gate, up, torch.bfloat16)
