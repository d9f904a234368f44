"""``coda.fusions.cast_layouts.cast_gate_up`` on a Hopper GPU (marker ``gpu``): the map
pass that casts fp32 gate / up weights into the interleaved 16-bit layout gives PyTorch's
casts and interleave bit for bit (rounding, overflow to infinity, NaN, signed zeros,
subnormals, ragged row counts), and its backward's map pass gives the fp32 gradients of
PyTorch's composition bit for bit."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.fusions import _dispatch, cast_layouts, layouts  # noqa: E402


def _special(t: torch.Tensor, values: list[float]) -> torch.Tensor:
    flat = t.view(-1)
    v = torch.tensor(values, device=t.device, dtype=t.dtype)
    flat[: v.numel()] = v
    flat[-v.numel() :] = v
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs compared as NaN (a payload may differ between conversions)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


FP32_SPECIALS = [
    float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-39, 1e38, 70000.0,
    1.00390625, 1.01171875, 3.0e-5, 65519.0, 65520.0,
]  # fmt: skip
LOW_SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-7, 6e-8, 65504.0]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1031, 1032), (4099, 2048), (2048, 4096)])
def test_cast_gate_up_is_pytorchs_cast_and_interleave_bit_for_bit(low, shape, monkeypatch):
    monkeypatch.setattr(cast_layouts, "MIN_NUMEL", 1 << 20)
    applied = []
    real = cast_layouts._CastGateUp.apply
    monkeypatch.setattr(cast_layouts._CastGateUp, "apply", lambda *a: applied.append(1) or real(*a))
    ran = []
    run_map = _dispatch.run_map
    monkeypatch.setattr(_dispatch, "run_map", lambda *a, **k: ran.append(1) or run_map(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    gate, up = (
        _special(
            torch.randn(shape, device="cuda", generator=gen) * 3, FP32_SPECIALS
        ).requires_grad_()
        for _ in range(2)
    )
    ref_g, ref_u = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = cast_layouts.cast_gate_up(gate, up, low)
    expect = layouts.assemble_gate_up(ref_g.to(low), ref_u.to(low))
    assert applied and ran == [1], "the map pass did not run"
    assert out.dtype == low and out.shape == (2 * shape[0], shape[1]) and out.is_contiguous()
    assert _same(out, expect)
    d = _special(torch.randn(out.shape, device="cuda", generator=gen).to(low), LOW_SPECIALS)
    out.backward(d)
    expect.backward(d)
    assert ran == [1, 1], "the backward's map pass did not run"
    for got, want in ((gate.grad, ref_g.grad), (up.grad, ref_u.grad)):
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert _same(got, want)


def test_small_or_misfit_weights_take_pytorchs_path(monkeypatch):
    monkeypatch.setattr(_dispatch, "run_map", lambda *a, **k: pytest.fail("map pass ran"))
    for gate, up in (
        (torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")),  # small
        (torch.randn(4096, 1028, device="cuda"), torch.randn(4096, 1028, device="cuda")),
    ):
        out = cast_layouts.cast_gate_up(gate, up, torch.bfloat16)
        assert torch.equal(out, layouts.assemble_gate_up(gate.bfloat16(), up.bfloat16()))
