"""coda.fusions.linear_cross_entropy on CPU: loss and every gradient (dh, dW, dbias, drstd)
of every option against textbook eager PyTorch (``F.cross_entropy`` on float64 logits).

On CPU the op runs its epilogues' ``reference`` (fp32 inside) chunk by chunk over the
vocabulary exactly as the GPU does (chunk sizes are drawn, ragged V and the padded V mod 8
tail included), so fp32 inputs are held to fp32 accuracy against float64: an algebra
mistake misses by orders of magnitude. bf16 inputs are held to the GPU rule (error at most
twice eager bf16 PyTorch's, plus a small atol).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.errors import InputError
from coda.fusions import cross_entropy as ce
from coda.fusions.cross_entropy import linear_cross_entropy
from coda.testing import examples
from coda.testing.tolerance import assert_close_to_reference

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
TOL = 2e-5  # normwise relative, fp32 computation against float64


def textbook(h, W, target, *, bias=None, rstd=None, softcap=None, label_smoothing=0.0,
             z_loss=0.0, ignore_index=-100, reduction="mean", num_items_in_batch=None):  # fmt: skip
    """The unfused loss, written from the definitions (h: (M, H), target: (M,))."""
    logits = h @ W.T
    if rstd is not None:
        logits = logits * rstd[:, None]
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    rows = F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing,
    )  # fmt: skip
    valid = target != ignore_index
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(logits, -1) ** 2 * valid
    if reduction == "none":
        return rows
    if num_items_in_batch is not None:
        return rows.sum() / num_items_in_batch
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)


@st.composite
def problems(draw):
    M = draw(st.integers(1, 48))
    V = draw(st.integers(1, 90))
    return dict(
        M=M,
        H=draw(st.integers(1, 24)),
        V=V,
        chunk_size=draw(st.one_of(st.none(), st.sampled_from([8, 16, 24, 40, 64]))),
        bias=draw(st.booleans()),
        rstd=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, None, 1.5, 30.0])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),
        z_loss=draw(st.sampled_from([0.0, 0.0, 1e-2])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        ignore_index=draw(st.sampled_from([-100, -1, 0])),
        ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(p, dtype=F32):
    """Inputs of problem ``p`` as float64 masters (h, W, bias, rstd) and targets."""
    g = torch.Generator().manual_seed(p["seed"])
    M, H, V = p["M"], p["H"], p["V"]
    h = torch.randn(M, H, generator=g, dtype=F64)
    W = torch.randn(V, H, generator=g, dtype=F64) * (2.0 / max(H, 1) ** 0.5)
    bias = torch.randn(V, generator=g, dtype=F64) if p["bias"] else None
    rstd = 0.5 + torch.rand(M, generator=g, dtype=F64) if p["rstd"] else None
    low = 1 if p["ignore_index"] == 0 else 0
    target = torch.randint(low, max(V, low + 1), (M,), generator=g)
    target[torch.rand(M, generator=g) < p["ignored"]] = p["ignore_index"]
    if V == 1 and p["ignore_index"] == 0:
        target.fill_(0)  # the only class is the ignored one
    cast = [None if t is None else t.to(dtype).to(F64) for t in (h, W, bias, rstd)]
    return (*cast, target)


def leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


def options(p):
    keys = ("softcap", "label_smoothing", "z_loss", "ignore_index", "reduction")
    return {k: p[k] for k in keys}


def run_both(p, dtype=F32):
    """(coda outputs, float64 textbook outputs): the loss, then dh, dW, dbias, drstd."""
    h, W, bias, rstd, target = make(p, dtype)
    upstream = None
    if p["reduction"] == "none":
        upstream = torch.randn(p["M"], generator=torch.Generator().manual_seed(p["seed"] + 1))
    out = []
    for prec, fn in ((dtype, _coda), (F64, textbook)):
        ins = leaves((h, W, bias, rstd), prec)
        extra = {"chunk_size": p["chunk_size"]} if fn is _coda else {}
        loss = fn(ins[0], ins[1], target, bias=ins[2], rstd=ins[3], **options(p), **extra)
        grad = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
        wrt = [t for t in ins if t is not None]
        grads = torch.autograd.grad(loss, wrt, grad)
        out.append((loss, *grads))
    return out


def _coda(h, W, target, *, rstd=None, **kw):
    return linear_cross_entropy(h, W, target, rstd=rstd, **kw)


@settings(max_examples=examples(250))
@given(problems())
def test_loss_and_gradients_match_textbook(p):
    coda, truth = run_both(p)
    names = ["loss", "dh", "dW", "dbias", "drstd"]
    names = [n for n in names if not (n == "dbias" and not p["bias"])]
    names = [n for n in names if not (n == "drstd" and not p["rstd"])]
    for name, a, t in zip(names, coda, truth, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=0.1)


@settings(max_examples=examples(60))
@given(problems())
def test_bf16_no_worse_than_eager_bf16(p):
    """bf16 h and W: err(coda) <= 2 err(eager bf16) + atol against float64 (the GPU rule;
    the dlogits chunks are stored in bf16 here as on the GPU)."""
    p = {**p, "bias": False, "rstd": False, "M": max(p["M"], 8), "H": max(p["H"], 8)}
    coda, truth = run_both(p, BF16)
    h, W, _, _, target = make(p, BF16)
    hb, Wb = leaves((h, W), BF16)
    eager = textbook(hb, Wb, target, **options(p))
    up = torch.ones_like(eager)
    if p["reduction"] == "none":
        up = torch.randn(p["M"], generator=torch.Generator().manual_seed(p["seed"] + 1))
    base = (eager, *torch.autograd.grad(eager, (hb, Wb), up.to(BF16)))
    for name, a, t, b in zip(("loss", "dh", "dW"), coda, truth, base, strict=True):
        assert_close_to_reference(a, t, name=name, baseline=b, atol=2e-3, floor=1e-2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing,zl", [(0.0, 0.0), (0.1, 1e-3)])
def test_all_ignored_batch_is_zero_without_nan(reduction, smoothing, zl):
    torch.manual_seed(0)
    h = torch.randn(12, 16, requires_grad=True)
    W = torch.randn(40, 16, requires_grad=True)
    target = torch.full((12,), -100)
    loss = linear_cross_entropy(
        h, W, target, reduction=reduction, label_smoothing=smoothing, z_loss=zl, chunk_size=16
    )
    assert torch.equal(loss, torch.zeros_like(loss))
    dh, dW = torch.autograd.grad(loss, (h, W), torch.ones_like(loss))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dW, torch.zeros_like(dW))


def test_none_reduction_takes_any_upstream_gradient():
    """Per-token losses with a real backward: gradient of sum(w * loss) for drawn w,
    including negative weights, equals the textbook's (not a precomputed scalar grad)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(30, 12, generator=g, dtype=F64)
    W = torch.randn(50, 12, generator=g, dtype=F64) / 3
    target = torch.randint(0, 50, (30,), generator=g)
    target[::4] = -100
    w = torch.randn(30, generator=g, dtype=F64)
    results = []
    for fn, dt in ((linear_cross_entropy, F32), (textbook, F64)):
        hl, Wl = leaves((h, W), dt)
        loss = fn(hl, Wl, target, reduction="none", label_smoothing=0.05)
        assert loss.shape == (30,) and (loss[::4] == 0).all()
        results.append((loss, *torch.autograd.grad((loss * w.to(dt)).sum(), (hl, Wl))))
    for name, a, t in zip(("loss", "dh", "dW"), *results, strict=True):
        assert_close_to_reference(a, t, name=name, tol=TOL)


def _hf_causal_lm_loss(logits, labels, num_items_in_batch=None, ignore_index=-100):
    """Hugging Face's ForCausalLMLoss, restated: shift, fp32 cross-entropy, sum / items."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=ignore_index, reduction=reduction,
    )  # fmt: skip
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _batch(seed, B=8, T=11, H=16, V=37):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g)
    W = torch.randn(V, H, generator=g) / 4
    labels = torch.randint(0, V, (B, T), generator=g)
    for b in range(B):  # a different number of ignored tokens per sample
        labels[b, : b + 1] = -100
    return h, W, labels


def test_shift_matches_hugging_face_causal_lm_loss():
    h, W, labels = _batch(0)
    for items in (None, 50):
        hl, Wl = leaves((h, W), F32)
        ours = linear_cross_entropy(hl, Wl, labels, shift=True, num_items_in_batch=items)
        ho, Wo = leaves((h, W), F32)
        theirs = _hf_causal_lm_loss(ho @ Wo.T, labels, items)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        ours_g = torch.autograd.grad(ours, (hl, Wl))
        theirs_g = torch.autograd.grad(theirs, (ho, Wo))
        for a, b in zip(ours_g, theirs_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_parity():
    """(batch 8, GA 1) and (batch 1, GA 8) with num_items_in_batch give the same loss and
    gradients; averaging per micro-batch (the silent bug) would not."""
    h, W, labels = _batch(1)
    items = int((F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())
    hl, Wl = leaves((h, W), F32)
    full = linear_cross_entropy(hl, Wl, labels, shift=True, num_items_in_batch=items)
    full.backward()
    hm, Wm = leaves((h, W), F32)
    total = torch.zeros(())
    naive = torch.zeros(())
    for b in range(8):
        micro = linear_cross_entropy(
            hm[b : b + 1], Wm, labels[b : b + 1], shift=True, num_items_in_batch=items
        )
        micro.backward()
        total += micro.detach()
        naive += linear_cross_entropy(h[b : b + 1], W, labels[b : b + 1], shift=True) / 8
    torch.testing.assert_close(total, full.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(hm.grad, hl.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(Wm.grad, Wl.grad, rtol=1e-5, atol=1e-7)
    assert abs(float(naive) - float(full.detach())) > 1e-3  # the per-micro-batch mean differs


def test_return_lse_and_z_loss():
    g = torch.Generator().manual_seed(5)
    h, W = torch.randn(2, 9, 8, generator=g), torch.randn(21, 8, generator=g)
    target = torch.randint(0, 21, (2, 9), generator=g)
    target[0, 3] = -100
    loss, lse, zl = linear_cross_entropy(
        h, W, target, z_loss=1e-2, return_lse=True, return_z_loss=True, chunk_size=8
    )
    logits = (h.double() @ W.double().T).reshape(18, 21)
    want_lse = logits.logsumexp(-1).reshape(2, 9)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    valid = target != -100
    torch.testing.assert_close(
        zl.double(), (1e-2 * want_lse**2 * valid).sum() / valid.sum(), rtol=1e-5, atol=0
    )
    want = textbook(h.double().reshape(18, 8), W.double(), target.reshape(18), z_loss=1e-2)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=0)


def test_frozen_head_skips_dW(monkeypatch):
    """W without requires_grad: no dW GEMM runs (one GEMM per chunk, for dh), W.grad None."""
    calls = []
    real = ce.matmul

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ce, "matmul", counting)
    h = torch.randn(10, 16, requires_grad=True)
    W = torch.randn(40, 16)
    target = torch.randint(0, 40, (10,))
    linear_cross_entropy(h, W, target, chunk_size=16).backward()
    assert W.grad is None and h.grad is not None
    assert len(calls) == 3  # chunks [0,16) [16,32) [32,40): dh only
    calls.clear()
    W.requires_grad_()
    linear_cross_entropy(h, W, target, chunk_size=16).backward()
    assert len(calls) == 6 and W.grad is not None


def test_out_of_range_targets_raise_on_cpu():
    h, W = torch.randn(4, 8), torch.randn(10, 8)
    for bad in (10, -3):
        target = torch.tensor([1, bad, -100, 2])
        with pytest.raises(InputError, match=rf"target\[1\] = {bad} is not a class index"):
            linear_cross_entropy(h, W, target)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reduction="avg"), "reduction"),
        (dict(reduction="none", num_items_in_batch=3), "num_items_in_batch"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(softcap=0.0), "softcap"),
        (dict(chunk_size=12), "multiple of 8"),
    ],
)
def test_bad_arguments(kwargs, match):
    h, W, target = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, W, target, **kwargs)


def test_shape_and_dtype_errors():
    h, W, target = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="hidden dimension"):
        linear_cross_entropy(h, W, target[:3])
    with pytest.raises(ValueError, match="H=8 features"):
        linear_cross_entropy(h, torch.randn(10, 7), target)
    with pytest.raises(TypeError, match="share one dtype"):
        linear_cross_entropy(h, W.double(), target)
    with pytest.raises(ValueError, match="int64/int32"):
        linear_cross_entropy(h, W, target.float())
