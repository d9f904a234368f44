"""linear_cross_entropy fused on the GPU (marker ``gpu``; needs Hopper).

Loss and gradients (dh, dW, dbias, drstd) of every option against float64 (the textbook
math on the bf16 inputs): err(coda) <= 2 * err(eager bf16 PyTorch) + atol, eager being
the unfused bf16 pipeline (bf16 logits, then the loss). Vocabulary sizes of real models
(ragged: 50257 is odd), chunked and unchunked. Peak memory: the workspace (peak minus the
gradient buffers) stays under the bound of ``coda.fusions.ce_chunks``, far below M x V.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an NVIDIA Hopper GPU", allow_module_level=True)

from coda.errors import InputError  # noqa: E402
from coda.fusions import ce_chunks  # noqa: E402
from coda.fusions.cross_entropy import linear_cross_entropy  # noqa: E402
from coda.testing.tolerance import assert_close_to_reference  # noqa: E402

BF16, F64 = torch.bfloat16, torch.float64
GiB = 2**30


def textbook(h, W, target, bias=None, rstd=None, softcap=None, label_smoothing=0.0,
             z_loss=0.0, reduction="mean"):  # fmt: skip
    logits = h @ W.T
    if rstd is not None:
        logits = logits * rstd[:, None].to(logits.dtype)
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    rows = F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)
    valid = target != -100
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(logits.float(), -1).to(rows.dtype) ** 2 * valid
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / valid.sum().clamp(min=1)


def inputs(M, H, V, seed, bias=False, rstd=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(M, H, device="cuda", generator=g).to(BF16)
    W = (torch.randn(V, H, device="cuda", generator=g) * 2 / H**0.5).to(BF16)
    b = (0.5 * torch.randn(V, device="cuda", generator=g)).to(BF16) if bias else None
    r = (0.5 + torch.rand(M, device="cuda", generator=g)) if rstd else None
    target = torch.randint(0, V, (M,), device="cuda", generator=g)
    target[torch.rand(M, device="cuda", generator=g) < 0.2] = -100
    return h, W, b, r, target


def grads_of(fn, tensors, target, dtype, upstream, **opts):
    # rstd stays fp32 (the op's contract) except in the float64 truth
    dtypes = (dtype, dtype, dtype, F64 if dtype == F64 else torch.float32)
    leaves = [
        None if t is None else t.detach().to(d).requires_grad_()
        for t, d in zip(tensors, dtypes, strict=True)
    ]
    h, W, b, r = leaves
    loss = fn(h, W, target, bias=b, rstd=r, **opts)
    wrt = [t for t in leaves if t is not None]
    up = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
    return (loss, *torch.autograd.grad(loss, wrt, up))


def _coda(h, W, target, chunk_size=None, **opts):
    return linear_cross_entropy(h, W, target, chunk_size=chunk_size, **opts)


OPTIONS = {
    "plain": {},
    "smoothing_zloss": dict(label_smoothing=0.1, z_loss=1e-4),
    "softcap": dict(softcap=30.0),
    "bias_rstd": dict(bias=True, rstd=True),
    "all_none": dict(
        bias=True, rstd=True, softcap=15.0, label_smoothing=0.05, z_loss=1e-4, reduction="none"
    ),
}
SHAPES = [(512, 256, 1000), (300, 264, 50257), (1000, 512, 32000), (257, 128, 151936)]


@pytest.mark.parametrize("chunk_size", [None, 4096])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_matches_float64_no_worse_than_eager_bf16(name, shape, chunk_size):
    opts = dict(OPTIONS[name])
    bias, rstd = opts.pop("bias", False), opts.pop("rstd", False)
    M, H, V = shape
    tensors = inputs(M, H, V, seed=M + V, bias=bias, rstd=rstd)
    target = tensors[-1]
    tensors = tensors[:-1]
    upstream = None
    if opts.get("reduction") == "none":
        upstream = torch.randn(M, device="cuda")
    ours = grads_of(_coda, tensors, target, BF16, upstream, chunk_size=chunk_size, **opts)
    truth = grads_of(textbook, tensors, target, F64, upstream, **opts)
    eager = grads_of(textbook, tensors, target, BF16, upstream, **opts)
    names = ["loss", "dh", "dW"] + (["dbias"] if bias else []) + (["drstd"] if rstd else [])
    for n, a, t, e in zip(names, ours, truth, eager, strict=True):
        assert torch.isfinite(a).all(), n
        assert_close_to_reference(a, t, name=n, baseline=e, atol=1e-3, floor=1e-3)


def test_frozen_head_all_ignored_and_checked_targets():
    h, W, _, _, target = inputs(256, 128, 1000, seed=1)
    hl = h.clone().requires_grad_()
    loss = linear_cross_entropy(hl, W, target)
    loss.backward()
    assert hl.grad is not None and W.grad is None
    ignored = torch.full_like(target, -100)
    hl.grad = None
    loss = linear_cross_entropy(hl, W.requires_grad_(), ignored)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not hl.grad.any() and not W.grad.any()
    bad = target.clone()
    bad[7] = 1000
    with pytest.raises(InputError, match=r"target\[7\] = 1000"):
        linear_cross_entropy(h, W, bad, check=True)


def test_workspace_stays_far_below_the_logits():
    """M = 8192, H = 2048, V = 128256 (Llama 3): forward + backward; the peak above the
    inputs, minus the gradients dh and dW that any implementation returns, stays under
    the stated bound: WORKSPACE_BYTES (the dlogits chunk) + 4 M H (the fp32 dh
    accumulator) + 1/16 of the budget (per-chunk partials) + 64 MiB (row vectors,
    allocator rounding); the bf16 logits alone would be M V 2 = 1.96 GiB."""
    M, H, V = 8192, 2048, 128256
    h, W, _, _, target = inputs(M, H, V, seed=0)
    h.requires_grad_()
    W.requires_grad_()
    linear_cross_entropy(h, W, target).backward()  # compile and warm up
    h.grad = W.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(h, W, target)
    dh, dW = torch.autograd.grad(loss, (h, W))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = dh.numel() * dh.element_size() + dW.numel() * dW.element_size()
    workspace = peak - grads
    bound = ce_chunks.WORKSPACE_BYTES * (1 + 1 / 16) + 4 * M * H + 64 * 2**20
    assert workspace <= bound, (workspace / GiB, bound / GiB)
    assert workspace <= M * V * 2 / 4
