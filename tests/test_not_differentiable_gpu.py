"""coda's kernel calls refuse to be differentiated on a Hopper GPU (marker ``gpu``), with
the real kernels: ``coda.gemm`` and a fused ``Epilogue`` call on inputs that require grad
give the same values as under ``torch.no_grad()`` and an output whose backward raises
naming the call; ``out=`` / ``outputs=`` are refused before any launch; the fused ops
(here the SwiGLU MLP and the LM-head loss) still train: their internal kernel calls are
unguarded. The CPU twin (stand-in kernels): tests/test_not_differentiable.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

import coda  # noqa: E402
from coda.fusions import linear_cross_entropy, normed_stream, swiglu_mlp  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402

BF16 = torch.bfloat16


def _bf16(*shape, seed, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = (torch.randn(*shape, generator=g, device="cuda") * 0.1).to(BF16)
    return t.requires_grad_(requires_grad)


def test_gemm_on_inputs_that_require_grad():
    A, B = _bf16(300, 256, seed=1, requires_grad=True), _bf16(200, 256, seed=2)
    y = coda.gemm(A, B)
    with torch.no_grad():
        want = coda.gemm(A, B)
    assert y.requires_grad and not want.requires_grad and torch.equal(y, want)
    with pytest.raises(RuntimeError, match=r"coda\.gemm is not differentiable"):
        y.float().sum().backward()
    with pytest.raises(RuntimeError, match="out= arguments don't support"):
        coda.gemm(A, B, torch.empty(300, 200, dtype=BF16, device="cuda"))


def test_fused_epilogue_on_inputs_that_require_grad():
    epi = EPILOGUES["rmsnorm_fwd"]
    A, B = _bf16(300, 256, seed=3), _bf16(256, 256, seed=4)
    residual = _bf16(300, 256, seed=5)
    gamma = _bf16(256, seed=6, requires_grad=True)
    got = epi(A, B, residual=residual, gamma=gamma)
    with torch.no_grad():
        want = epi(A, B, residual=residual, gamma=gamma)
    assert set(got) == set(want)
    for name in got:
        assert got[name].requires_grad and torch.equal(got[name], want[name])
    with pytest.raises(RuntimeError, match="Epilogue call is not differentiable"):
        got["h"].float().sum().backward()
    with pytest.raises(RuntimeError, match="outputs= arguments don't support"):
        epi(A, B, residual=residual, gamma=gamma, outputs={"x": torch.empty_like(residual)})


def test_fused_ops_still_train():
    M, H, FFN, V = 300, 256, 704, 1000
    x = _bf16(M, H, seed=7, requires_grad=True)
    gamma = (1 + _bf16(H, seed=8)).requires_grad_()
    w_gate_up = _bf16(2 * FFN, H, seed=9, requires_grad=True)
    w_down = _bf16(H, FFN, seed=10, requires_grad=True)
    out = swiglu_mlp(normed_stream(x, gamma, 1e-5), gamma, w_gate_up, w_down, gamma, 1e-5)
    W = _bf16(V, H, seed=11, requires_grad=True)
    target = torch.randint(0, V, (M,), device="cuda")
    loss = linear_cross_entropy(out.x, W, target)
    loss.backward()
    for t in (x, gamma, w_gate_up, w_down, W):
        assert t.grad is not None and torch.isfinite(t.grad.float()).all()
        assert t.grad.float().abs().sum() > 0
