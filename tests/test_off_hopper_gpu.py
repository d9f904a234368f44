"""coda on a GPU that is not a Hopper (marker ``gpu``; USERS.md item 15), simulated on a
Hopper GPU by reporting another compute capability (8.0, an A100's) to torch and to
coda's device checks.

There, the kernels' entry points raise a clear ``InputError`` before any launch; the
fused ops (``coda.fusions``, and the ``coda.nn`` modules built on them) run their
reference path on that GPU: the same epilogues' plain torch algebra, fp32 inside, which
no coda kernel takes part in (any kernel entry point would raise); and ``apply_coda``'s
patched model runs Hugging Face's own forward (the fallback reason ``NOT_HOPPER``), or
refuses to when ``strict``. The CPU twin of the reference path is CI itself.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper("needs an NVIDIA Hopper GPU (to simulate another one)")

import coda  # noqa: E402
import test_fusions_gpu as fusions_gpu  # noqa: E402
from coda.errors import InputError  # noqa: E402
from coda.fusions import linear_cross_entropy  # noqa: E402
from coda.runtime import checks  # noqa: E402

BF16 = torch.bfloat16


def _simulate_ampere(monkeypatch) -> None:
    """torch and coda see the GPU as sm_80 for the rest of the test."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(checks, "_kernel_devices", {})
    monkeypatch.setattr(checks, "_hopper_ok", {})


@pytest.fixture
def ampere(monkeypatch):
    _simulate_ampere(monkeypatch)


def test_kernel_entry_points_raise_before_any_launch(ampere):
    A = torch.randn(256, 128, device="cuda", dtype=BF16)
    B = torch.randn(192, 128, device="cuda", dtype=BF16)
    with pytest.raises(InputError, match=r"Hopper GPU \(sm_90\).*sm_80"):
        coda.gemm(A, B)
    assert not checks.kernels_run_on(A.device)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_runs_the_reference_path_on_the_gpu(ampere, reduction):
    """Loss and gradients on the GPU equal the CPU reference's on the same bf16 inputs
    (both the reference algebra, fp32 inside)."""
    g = torch.Generator().manual_seed(7)
    M, H, V = 300, 264, 1531
    h = (torch.randn(M, H, generator=g) / 2).to(BF16)
    W = (torch.randn(V, H, generator=g) / H**0.5).to(BF16)
    t = torch.randint(0, V, (M,), generator=g)
    t[:20] = -100
    up = torch.randn(M, generator=g) if reduction == "none" else torch.tensor(1.0)
    results = {}
    for device in ("cuda", "cpu"):
        hd, Wd = (x.to(device).requires_grad_() for x in (h, W))
        loss = linear_cross_entropy(hd, Wd, t.to(device), reduction=reduction, z_loss=1e-4)
        (loss * up.to(device)).sum().backward()
        results[device] = [x.detach().cpu().float() for x in (loss, hd.grad, Wd.grad)]
        assert loss.device.type == device and hd.grad.device.type == device
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_fused_block_ops_meet_the_float64_rule_on_the_reference_path(ampere, dtype):
    """The fusions' GPU tests, whose rule is the kernels' (err <= 2 x eager's in the same
    dtype + atol against float64), passed by the reference path on the GPU."""
    fusions_gpu.test_producer_and_normed_linear(300, 264, 520, 136, dtype)
    fusions_gpu.test_swiglu_mlp(300, 264, 344, dtype)
    fusions_gpu.test_qkv_rope(300, 264, 4, 2, 64, dtype)


def test_patched_model_runs_hugging_faces_forward(monkeypatch):
    pytest.importorskip("transformers")
    import test_integrations_transformers_gpu as hf_gpu  # (its import checks the real GPU)
    from coda.integrations.transformers import NOT_HOPPER, apply_coda

    _simulate_ampere(monkeypatch)
    mine, eager, _, _ = hf_gpu.trio("gqa_h256")
    mine.__dict__["_coda_patch"].revert()
    patch = apply_coda(mine)
    ids, labels = hf_gpu.batch(hf_gpu.CONFIGS["gqa_h256"]["vocab_size"])
    got, want = mine(ids, labels=labels), eager(ids, labels=labels)
    assert got.logits is not None  # Hugging Face's forward, logits and all
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    # both seams fell back: the causal LM's, then the decoder stack's inside its forward
    assert patch.calls == {"original": 2} and patch.fallbacks == {NOT_HOPPER: 2}
    patch.revert()
    strict = apply_coda(mine, strict=True)
    with pytest.raises(RuntimeError, match=NOT_HOPPER):
        mine(ids, labels=labels)
    strict.revert()
