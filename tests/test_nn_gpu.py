"""coda.nn's modules on a Hopper GPU (marker ``gpu``) under AMP: fp32 parameters under
``torch.autocast`` (``coda.nn._autocast``) run the fused kernels in autocast's dtype and
give the same stream, bitwise, as the module cast to that dtype and called outside
autocast; every gradient arrives in fp32, the cast module's gradient cast up. (Their
numerics against float64 are tested through the Hugging Face seam:
tests/test_integrations_transformers_gpu.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.fusions import layouts  # noqa: E402
from coda.nn import (  # noqa: E402
    FusedLlamaAttention,
    FusedLlamaDecoderLayer,
    FusedLlamaMLP,
    FusedLlamaStack,
)


def stack(H=256, F=704, heads=4, kv=2, D=64, layers=2):
    torch.manual_seed(0)
    inv = layouts.rope_inv_freq(D, 10000.0)
    made = []
    for _ in range(layers):
        attn = FusedLlamaAttention(H, heads, kv, D, inv_freq=inv, eps=1e-5, device="cuda")
        made.append(FusedLlamaDecoderLayer(attn, FusedLlamaMLP(H, F, 1e-5, device="cuda")))
    return FusedLlamaStack(made, 1 + 0.1 * torch.randn(H, device="cuda"), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stack_under_autocast_is_the_cast_stack(dtype):
    fused = stack()
    cast = copy.deepcopy(fused).to(dtype)
    B, S, H = 2, 197, 256
    x = torch.randn(B, S, H, device="cuda")
    positions = torch.arange(S, device="cuda")[None].expand(B, S)
    r = torch.randn(B * S, H, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        got = fused(x, positions)
    want = cast(x.to(dtype), positions)
    assert got.x.dtype == dtype and got.rstd.dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for s in (got, want):
        ((s.rstd[:, None] * s.h.float() + s.x.float()) * r).sum().backward()
    ref = dict(cast.named_parameters())
    for name, p in fused.named_parameters():
        if ref[name].grad is None:  # the final norm's weight: h is only its cache
            assert p.grad is None, name
            continue
        assert p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, ref[name].grad.float()), name
