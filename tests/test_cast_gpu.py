"""``coda.fusions._dispatch.widen`` / ``cast`` on a Hopper GPU (marker ``gpu``): the map
pass that widens a 16-bit weight gradient to fp32 gives PyTorch's cast bit for bit
(infinities, NaN, signed zeros and subnormals included, ragged row counts), runs where
it should and steps aside where the TMA cannot take the tensor; ``cast``'s gradient
through it equals ``.to``'s."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.fusions import _dispatch  # noqa: E402


def _special(low: torch.dtype, m: int, n: int) -> torch.Tensor:
    g = torch.randn(m, n, device="cuda").to(low)
    flat = g.view(-1)
    tiny = torch.finfo(low).tiny
    specials = torch.tensor(
        [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, tiny / 4, -tiny / 8, 65504.0],
        device="cuda",
    ).to(low)
    flat[: specials.numel()] = specials
    flat[-specials.numel() :] = specials
    return g


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs compared as NaN (a payload may differ between conversions)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1031, 1032), (4099, 2048), (2048, 8192)])
def test_widen_is_the_cast_bit_for_bit_by_a_map_pass(low, shape, monkeypatch):
    monkeypatch.setattr(_dispatch, "WIDEN_MIN_NUMEL", 1 << 20)  # the kernel, at every size
    ran = []
    run_map = _dispatch.run_map
    monkeypatch.setattr(_dispatch, "run_map", lambda *a, **k: ran.append(1) or run_map(*a, **k))
    g = _special(low, *shape)
    out = _dispatch.widen(g, torch.float32)
    assert ran, "the map pass did not run"
    assert out.dtype == torch.float32 and out.shape == g.shape and out.is_contiguous()
    assert _same_values(out, g.to(torch.float32))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2048, 1028, device="cuda").bfloat16(),  # 1028 % 8 != 0
        lambda: torch.randn(2048, 2048, device="cuda").bfloat16().t(),  # column-major
        lambda: torch.randn(2048, 4096, device="cuda").bfloat16()[:, :2048],  # padded rows
        lambda: torch.randn(2048 * 2048 + 1, device="cuda").bfloat16()[1:].view(2048, 2048),
        lambda: torch.randn(512, 512, device="cuda").bfloat16(),  # under WIDEN_MIN_NUMEL
    ],
    ids=["cols_not_8", "transposed", "row_stride", "misaligned", "small"],
)
def test_widen_steps_aside_where_the_map_pass_cannot_take_it(make, monkeypatch):
    ran = []
    monkeypatch.setattr(_dispatch, "run_map", lambda *a, **k: ran.append(1))
    g = make()
    out = _dispatch.widen(g, torch.float32)
    assert not ran
    assert _same_values(out, g.to(torch.float32))


def test_cast_gradient_through_the_map_pass_equals_to(monkeypatch):
    monkeypatch.setattr(_dispatch, "WIDEN_GRADIENTS", True)
    monkeypatch.setattr(_dispatch, "WIDEN_MIN_NUMEL", 1 << 20)
    torch.manual_seed(0)
    w = torch.randn(3072, 2048, device="cuda", requires_grad=True)
    x = torch.randn(4096, 2048, device="cuda").bfloat16()
    dy = torch.randn(4096, 3072, device="cuda").bfloat16()
    ref = w.detach().clone().requires_grad_()
    (x @ _dispatch.cast(w, torch.bfloat16).t()).backward(dy)
    (x @ ref.to(torch.bfloat16).t()).backward(dy)
    assert w.grad.dtype == torch.float32
    assert torch.equal(_bits(w.grad), _bits(ref.grad))
