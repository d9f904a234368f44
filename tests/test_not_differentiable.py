"""coda's kernel calls (``coda.gemm``, ``Epilogue.__call__``) refuse to be differentiated
instead of dropping gradients without a word (``coda.not_differentiable``), while the
fusions' internal calls stay unguarded. CPU: the guard itself, and the two entry points
with their kernel paths replaced by stand-ins (the GPU twin runs the real kernels:
tests/test_not_differentiable_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import coda
import coda.epilogue as epilogue_module
import coda.matmul as matmul_module
from coda import Elementwise, Epilogue, TileStore, VecLoad, ops
from coda.not_differentiable import tied

EPI = (
    Epilogue()
    .add(VecLoad("s", per="row", dtype=torch.float32))
    .add(Elementwise("y", ops.mul, ins=("acc", "s")))
    .add(TileStore("y", torch.float32))
)


def test_tied_output_keeps_its_values_and_raises_in_backward_naming_the_call():
    a = torch.randn(3, 4, requires_grad=True)
    out = torch.randn(3, 5)
    got = tied("coda.gemm", out, (a, torch.ones(2)))
    assert got.requires_grad and torch.equal(got, out)
    with pytest.raises(RuntimeError, match=r"coda\.gemm is not differentiable.*no_grad"):
        got.sum().backward()


@pytest.fixture
def fake_kernels(monkeypatch):
    """The fused runner and the plain GEMM replaced by their math (no GPU needed)."""
    calls = []

    def runner(epi, A, B, tensors, config=None, outputs=None, check_contents=False):
        calls.append("epilogue")
        return {k: v.detach() for k, v in epi.reference(A.detach(), B.detach(), **tensors).items()}

    def gemm(A, B, out=None, out_dtype=None, accumulate=False, config=None, allow_split=True):
        calls.append("gemm")
        return (A.detach().float() @ B.detach().float().T).to(A.dtype)

    monkeypatch.setattr(epilogue_module, "_runner", runner)
    monkeypatch.setattr(matmul_module, "gemm_unguarded", gemm)
    return calls


def test_gemm_output_refuses_backward_when_an_input_requires_grad(fake_kernels):
    A, B = torch.randn(8, 16, requires_grad=True), torch.randn(4, 16)
    y = coda.gemm(A, B)
    torch.testing.assert_close(y, A.detach() @ B.T)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=r"coda\.gemm is not differentiable"):
        (y * 2).sum().backward()
    with torch.no_grad():
        assert not coda.gemm(A, B).requires_grad
    assert not coda.gemm(A.detach(), B).requires_grad
    assert fake_kernels == ["gemm"] * 3


def test_gemm_refuses_out_when_an_input_requires_grad(fake_kernels):
    A, B = torch.randn(8, 16), torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="out= arguments don't support automatic"):
        coda.gemm(A, B, torch.empty(8, 4))
    assert fake_kernels == []  # refused before any launch


def test_epilogue_outputs_refuse_backward_when_an_input_requires_grad(fake_kernels):
    A, B = torch.randn(8, 16), torch.randn(4, 16)
    s = torch.full((8,), 2.0, requires_grad=True)  # a row scale
    got = EPI(A, B, s=s)
    torch.testing.assert_close(got["y"], (A @ B.T) * 2)
    with pytest.raises(RuntimeError, match="Epilogue call is not differentiable"):
        got["y"].sum().backward()
    with pytest.raises(RuntimeError, match="outputs= arguments don't support automatic"):
        EPI(A, B, s=s, outputs={"y": torch.empty(8, 4)})
    with torch.no_grad():
        assert not EPI(A, B, s=s)["y"].requires_grad
    # the fusions' path runs the kernel unguarded (their ops carry their own formulas)
    assert not epilogue_module.run_fused(EPI, A, B, {"s": s})["y"].requires_grad
    assert fake_kernels == ["epilogue"] * 3
