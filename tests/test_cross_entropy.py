"""coda.fusions.linear_cross_entropy on CPU: loss and every gradient (dh, dW, dbias, drstd)
of every option against textbook eager PyTorch (``F.cross_entropy`` on float64 logits).

On CPU the op runs its epilogues' ``reference`` (fp32 inside) chunk by chunk exactly as
the GPU does (vocabulary chunks of the recompute path and row chunks of the
gradient-in-forward path are drawn, ragged V and the V mod 8 tail included), so fp32
inputs are held to fp32 accuracy against float64: an algebra mistake misses by orders of
magnitude. bf16 inputs are held to the GPU rule (error at most twice eager bf16
PyTorch's, plus a small atol). Each property runs on both paths: the recompute path
forced (``grad_in_forward=False``) and the automatic choice (tests/test_cross_entropy_fused.py
covers the gradient-in-forward path's own properties).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from _ce_helpers import (
    BF16,
    F16,
    F32,
    F64,
    TOL,
    leaves,
    loss_and_grads,
    make,
    names,
    options,
    problems,
    textbook,
    textbook_logits,
    upstream,
)
from coda.errors import InputError
from coda.fusions import cross_entropy as ce
from coda.fusions.cross_entropy import linear_cross_entropy
from coda.testing import examples
from coda.testing.tolerance import assert_close_to_reference

PATHS = {"recompute": dict(grad_in_forward=False), "auto": {}}


def run_both(p, dtype=F32, **kwargs):
    """(coda outputs, float64 textbook outputs): the loss, then dh, dW[, dbias][, drstd]."""
    h, W, bias, rstd, target = make(p, dtype)
    chunks = {"chunk_size": p["chunk_size"], "chunk_rows": p["chunk_rows"]}
    ours = loss_and_grads(linear_cross_entropy, p, dtype, (h, W, bias, rstd), target,
                          **chunks, **kwargs)  # fmt: skip
    truth = loss_and_grads(textbook, p, F64, (h, W, bias, rstd), target)
    return ours, truth


@pytest.mark.parametrize("path", list(PATHS))
@settings(max_examples=examples(250))
@given(p=problems())
def test_loss_and_gradients_match_textbook(p, path):
    """Both paths: the recompute one forced, and the automatic choice (gradient-in-forward
    for "mean"/"sum", the recompute path for "none")."""
    coda, truth = run_both(p, **PATHS[path])
    for name, a, t in zip(names(p), coda, truth, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=0.1)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", list(PATHS))
@settings(max_examples=examples(60))
@given(p=problems())
def test_16bit_no_worse_than_eager_16bit(p, path, dtype):
    """bf16 / fp16 h and W: err(coda) <= 2 err(eager in that dtype) + atol against
    float64 (the GPU rule; the dlogits chunks, and on the gradient-in-forward path the
    stored logits, are rounded to the dtype here as on the GPU). fp16's gradient-in-forward
    path forms its gradients without the 1 / denom (``ce_fused.UNSCALED_DTYPES``) on the
    map pass (an earlier version on the shifted softmax returned dh = 0 and a NaN dW)."""
    p = {**p, "bias": False, "rstd": False, "M": max(p["M"], 8), "H": max(p["H"], 8)}
    coda, truth = run_both(p, dtype, **PATHS[path])
    h, W, _, _, target = make(p, dtype)
    hb, Wb = leaves((h, W), dtype)
    eager = textbook(hb, Wb, target, **options(p))
    up = upstream(p)
    up = torch.ones_like(eager) if up is None else up.to(dtype)
    base = (eager, *torch.autograd.grad(eager, (hb, Wb), up))
    # atol: one unit in the last place of the dtype at the largest output (the bottom of
    # its binade): both results are rounded to it at least twice (the logits or dlogits,
    # then the GEMM's output), each within a rounding of the truth, so at small shapes
    # eager's rounding can land on the right value where coda's lands one ulp off
    # (2^-7 relative: bf16 dW at M = H = 8, V = 66, temperature 2: 0.00666 against
    # eager's 0.00216)
    ulp = 2.0**-7 if dtype == BF16 else 2.0**-10
    for name, a, t, b in zip(("loss", "dh", "dW"), coda, truth, base, strict=True):
        assert_close_to_reference(a, t, name=name, baseline=b, atol=ulp, floor=1e-2)


@pytest.mark.parametrize(
    "opts",
    [{}, {"chunk_rows": 512}, {"grad_in_forward": False}],
    ids=["one_chunk", "four_chunks", "recompute"],
)
def test_fp16_under_a_loss_scale_no_worse_than_eager_fp16(opts):
    """fp16 training scales the loss (``torch.amp.GradScaler``) so that the dlogits,
    softmax / tokens, stay inside fp16's range: here 1 / (16000 x 2048) ~ 3e-8, under
    fp16's smallest subnormal, unscaled. With the loss times 2^16 and the gradients
    divided back, coda's gradients stay within 2 x eager fp16's error against float64:
    on the gradient-in-forward path (one row chunk, deferred; four, the first three's dh
    rows and fp32 dW sum formed in the forward), which forms them without the 1 / denom
    and multiplies it in with the scale in the backward, and on the recompute path,
    which forms the dlogits in the backward with the scale in them."""
    g = torch.Generator().manual_seed(11)
    M, H, V, scale = 2048, 64, 16000, 2.0**16
    h = torch.randn(M, H, generator=g).to(F16)
    W = (torch.randn(V, H, generator=g) / H**0.25).to(F16)
    target = torch.randint(0, V, (M,), generator=g)
    target[::9] = -100
    results = {}
    for key, fn, dtype in (
        ("coda", lambda a, b, t: linear_cross_entropy(a, b, t, **opts), F16),
        # eager fp16 as autocast runs it: fp16 logits, the loss in fp32
        ("eager", lambda a, b, t: F.cross_entropy((a @ b.T).float(), t), F16),
        ("truth", lambda a, b, t: textbook(a, b, t), F64),
    ):
        a, b = leaves((h, W), dtype)
        loss = fn(a, b, target)
        grads = torch.autograd.grad(loss.float() * scale, (a, b))  # as GradScaler.scale
        results[key] = (loss, *(x.double() / scale for x in grads))
    for i, name in enumerate(("loss", "dh", "dW")):
        coda, eager, truth = (results[k][i] for k in ("coda", "eager", "truth"))
        assert torch.isfinite(coda).all() and coda.abs().sum() > 0, name
        assert_close_to_reference(coda, truth, name=name, baseline=eager, atol=1e-4, floor=1e-3)


def test_fp16_gradient_in_forward_without_the_denominator(monkeypatch):
    """fp16 takes the gradient-in-forward path on the map pass (the shifted softmax,
    exp(z - c) over e^-47..e^64, is never chosen for fp16), the op's gradients formed
    without the 1 / denom (dh rows of earlier chunks: rows of W's size) and the backward
    multiplying it in, as the recompute path computes them; a bias that requires grad or
    ``DEFER_ONE_CHUNK`` off sends it to the recompute path (grad_in_forward=True: a
    ValueError that says why)."""
    from coda.fusions import ce_fused

    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, 16, generator=g, dtype=F16, requires_grad=True)
    W = torch.randn(40, 16, generator=g, dtype=F16, requires_grad=True)
    bias = torch.randn(40, generator=g, dtype=F16)
    target = torch.tensor([0, 3, -100, 7, 39, 1, -100, 2])
    got = {}
    for path in (True, False):
        loss = linear_cross_entropy(h, W, target, bias=bias, grad_in_forward=path, chunk_rows=3)
        got[path] = (loss, *torch.autograd.grad(loss, (h, W)))
    for a, b in zip(got[True], got[False], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=1e-4)
    out = ce_fused.lce_fused_loss(
        h.detach(), W.detach(), target, bias, None, torch.tensor(6.0), -100, None,
        0.0, 0.0, 3, False, True, True, False, False,
    )  # fmt: skip
    # dh of the rows before the last chunk (3 of 3, 3 of 2): without the 1 / 6
    torch.testing.assert_close(out[1].float(), got[True][1][:6].float() * 6, rtol=4e-3, atol=1e-3)
    assert not ce_fused.shifted_ok(F16, False, None, 0.0, True, True, False)
    assert ce_fused.shifted_ok(BF16, False, None, 0.0, True, True, False)
    with pytest.raises(ValueError, match="fp16 input with a bias that requires grad"):
        linear_cross_entropy(h, W, target, bias=bias.requires_grad_(), grad_in_forward=True)
    monkeypatch.setattr(ce_fused, "DEFER_ONE_CHUNK", False)
    with pytest.raises(ValueError, match="fp16 input"):
        linear_cross_entropy(h, W, target, grad_in_forward=True)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_autocast_casts_the_operands_as_linear_does(dtype):
    """Under ``torch.autocast`` (the CPU's here; the same rule on CUDA) fp32 h and an fp32
    weight (AMP's master weights) are cast to autocast's dtype, as F.linear's operands
    are: the loss and gradients equal those of the call on explicitly cast operands, the
    gradients arrive in fp32, and torch.compile(fullgraph=True) under autocast gives the
    same values."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(64, 32, generator=g, requires_grad=True)
    W = torch.nn.Parameter(torch.randn(300, 32, generator=g) / 6)
    bias = torch.nn.Parameter(torch.randn(300, generator=g) / 4)
    target = torch.randint(0, 300, (64,), generator=g)
    target[::5] = -100

    def loss_fn(h, W, bias):
        return linear_cross_entropy(h, W, target, bias=bias, z_loss=1e-3, label_smoothing=0.1)

    def run(fn, *leaves, autocast):
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = fn(*leaves)
        return (loss, *torch.autograd.grad(loss, leaves))

    def by_keyword(h, W, bias):
        return linear_cross_entropy(
            h=h, W=W, target=target, bias=bias, z_loss=1e-3, label_smoothing=0.1
        )

    ours = run(loss_fn, h, W, bias, autocast=True)
    cast = [t.detach().to(dtype).requires_grad_() for t in (h, W, bias)]
    explicit = run(loss_fn, *cast, autocast=False)
    compiled = run(torch.compile(loss_fn, fullgraph=True), h, W, bias, autocast=True)
    keywords = run(by_keyword, h, W, bias, autocast=True)
    assert all(t.dtype == F32 for t in ours)
    for a, b, c, d in zip(ours, explicit, compiled, keywords, strict=True):
        assert torch.equal(a, b.float()) and torch.equal(a, c) and torch.equal(a, d)


@pytest.mark.parametrize("path", list(PATHS))
def test_backward_inside_the_autocast_block_gives_the_same_gradients(path):
    """``loss.backward()`` called inside the ``torch.autocast`` block (PyTorch advises
    against it, users do it): on CPU tensors the backward formulas run on the calling
    thread, with autocast on; they run it off (``_dispatch.register_formula``), so the
    gradients equal those of a backward outside the block (before: an InputError, the
    fp32 partial sums cast to bf16)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(48, 32, generator=g, requires_grad=True)
    W = torch.nn.Parameter(torch.randn(200, 32, generator=g) / 6)
    target = torch.randint(0, 200, (48,), generator=g)
    target[::7] = -100
    grads = []
    for inside in (False, True):
        with torch.autocast("cpu", dtype=BF16):
            loss = linear_cross_entropy(h, W, target, **PATHS[path])
            if inside:
                grads.append(torch.autograd.grad(loss, (h, W)))
        if not inside:
            grads.append(torch.autograd.grad(loss, (h, W)))
    for a, b in zip(*grads, strict=True):
        assert a.dtype == F32 and torch.equal(a, b)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_gives_zero_loss_and_zero_gradients(path, reduction):
    """No rows at all (a rank with no tokens): the loss is 0 ("none": shape (0,)), every
    gradient zeros of its input's shape, lse and z-loss empty / 0; before this rule the
    gradient-in-forward backward returned a (0,) dW and the recompute path ran an empty
    GEMM."""
    h = torch.zeros(0, 16, dtype=BF16, requires_grad=True)
    W = torch.randn(40, 16, dtype=BF16, requires_grad=True)
    bias = torch.randn(40, dtype=BF16, requires_grad=True)
    rstd = torch.ones(0, requires_grad=True)
    loss, lse, zl = linear_cross_entropy(
        h, W, torch.zeros(0, dtype=torch.long), bias=bias, rstd=rstd, reduction=reduction,
        label_smoothing=0.1, z_loss=1e-3, return_lse=True, return_z_loss=True, **PATHS[path],
    )  # fmt: skip
    assert lse.shape == (0,) and torch.equal(loss, torch.zeros_like(loss))
    assert loss.shape == ((0,) if reduction == "none" else ())
    grads = torch.autograd.grad(loss.sum() + zl.sum(), (h, W, bias, rstd), allow_unused=True)
    for x, dx in zip((h, W, bias, rstd), grads, strict=True):
        assert dx is None or (dx.shape == x.shape and not dx.any())


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


def _entropy_textbook(h, W, target, bias, rstd, *, softcap=None, temperature=1.0, **opts):
    """Float64 loss and per-row softmax entropy of the materialized logits."""
    logp = torch.log_softmax(textbook_logits(h, W, bias, rstd, softcap, temperature), -1)
    loss = textbook(
        h, W, target, bias=bias, rstd=rstd, softcap=softcap, temperature=temperature, **opts
    )
    return loss, -(logp.exp() * logp).sum(-1)


ENTROPY_CASES = {
    "plain": {},
    "softcap": dict(softcap=5.0),
    "tempered_smoothing": dict(temperature=0.7, label_smoothing=0.1),
    "bias_rstd_zloss": dict(bias=True, rstd=True, z_loss=1e-3),
    "none": dict(reduction="none"),
}


@pytest.mark.parametrize("case", list(ENTROPY_CASES))
def test_return_entropy_and_its_gradients_match_textbook(case):
    """``return_entropy``: the per-row entropy of softmax(logits) (of the final logits:
    softcapped, tempered) with logits far from 0, and every gradient under upstream
    gradients on both the loss and the entropy, against float64; several vocabulary
    chunks with the V mod 8 tail (V = 37, chunks of 8); ignored rows keep their entropy."""
    opts = dict(ENTROPY_CASES[case])
    use_bias, use_rstd = opts.pop("bias", False), opts.pop("rstd", False)
    g = torch.Generator().manual_seed(11)
    M, H, V = 23, 16, 37
    h = torch.randn(M, H, generator=g, dtype=F64)
    W = torch.randn(V, H, generator=g, dtype=F64)
    W[0] += 3.0  # logits around 12 for one class: far from 0, a confident softmax
    bias = torch.randn(V, generator=g, dtype=F64) if use_bias else None
    rstd = torch.rand(M, generator=g, dtype=F64) + 0.5 if use_rstd else None
    target = torch.randint(0, V, (M,), generator=g)
    target[3] = -100
    up = torch.randn(M, generator=g, dtype=F64)
    up_loss = torch.randn(M if opts.get("reduction") == "none" else (), generator=g, dtype=F64)

    def grads(fn, dtype):
        xs = [t if t is None else t.to(dtype).requires_grad_() for t in (h, W, bias, rstd)]
        loss, ent = fn(*xs)
        ((loss * up_loss.to(dtype)).sum() + (ent * up.to(dtype)).sum()).backward()
        return [loss, ent] + [x.grad for x in xs if x is not None]

    ours = grads(
        lambda *x: linear_cross_entropy(
            x[0], x[1], target, bias=x[2], rstd=x[3], return_entropy=True, chunk_size=8, **opts
        ),
        F32,
    )
    truth = grads(lambda *x: _entropy_textbook(x[0], x[1], target, x[2], x[3], **opts), F64)
    names = ["loss", "entropy", "dh", "dW"] + ["dbias", "drstd"] * use_bias
    for name, a, t in zip(names, ours, truth, strict=True):
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=0.1)
    assert float(truth[1][3].detach()) > 0 and float(ours[1][3].detach()) > 0  # ignored row


def test_return_entropy_order_and_path():
    """Outputs in the order (loss, lse, z_loss, entropy); the entropy takes the recompute
    path (its own gradient), so grad_in_forward=True refuses it."""
    g = torch.Generator().manual_seed(12)
    h, W = torch.randn(5, 8, generator=g), torch.randn(19, 8, generator=g)
    target = torch.randint(0, 19, (5,), generator=g)
    out = linear_cross_entropy(
        h, W, target, return_lse=True, return_z_loss=True, return_entropy=True
    )
    assert len(out) == 4
    logp = torch.log_softmax(h.double() @ W.double().T, -1)
    torch.testing.assert_close(out[3].double(), -(logp.exp() * logp).sum(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1].double(), (h.double() @ W.double().T).logsumexp(-1))
    with pytest.raises(ValueError, match="return_entropy"):
        linear_cross_entropy(
            h, W.requires_grad_(), target, return_entropy=True, grad_in_forward=True
        )


def test_frozen_head_skips_dW(monkeypatch):
    """Recompute path, W without requires_grad: no dW GEMM runs (one GEMM per chunk, for
    dh), W.grad None."""
    calls = []
    real = ce.matmul

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ce, "matmul", counting)
    h = torch.randn(10, 16, requires_grad=True)
    W = torch.randn(40, 16)
    target = torch.randint(0, 40, (10,))
    linear_cross_entropy(h, W, target, chunk_size=16, grad_in_forward=False).backward()
    assert W.grad is None and h.grad is not None
    assert len(calls) == 3  # chunks [0,16) [16,32) [32,40): dh only
    calls.clear()
    W.requires_grad_()
    linear_cross_entropy(h, W, target, chunk_size=16, grad_in_forward=False).backward()
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
        (dict(softcap=float("inf")), "positive finite"),
        (dict(z_loss=-1e-3), "z_loss"),
        (dict(z_loss=float("nan")), "z_loss"),
        (dict(num_items_in_batch=0), "num_items_in_batch must be positive"),
        (dict(num_items_in_batch=-2.0), "num_items_in_batch must be positive"),
        (dict(chunk_rows=2.5), "whole number"),
        (dict(chunk_size=16.0), "multiple of 8"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(chunk_size=12), "multiple of 8"),
        (dict(chunk_rows=0), "chunk_rows"),
        (dict(reduction="none", grad_in_forward=True, chunk_rows=2), "chunk_rows=2 < 4"),
        (dict(return_entropy=True, grad_in_forward=True), "grad_in_forward=True"),
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
    with pytest.raises(TypeError, match="bias must be bfloat16, float16 or float32"):
        linear_cross_entropy(h, W, target, bias=torch.randn(10).double())
    with pytest.raises(ValueError, match=r"h must be \(\.\.\., H\)"):
        linear_cross_entropy(torch.tensor(1.0), W, target)
    for empty in (torch.randn(0, 8), torch.randn(10, 0)):
        with pytest.raises(ValueError, match="V and H must be positive"):
            linear_cross_entropy(h[:, : empty.shape[1]], empty, target)


def test_argument_types():
    h, W, target = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"W=lm_head.weight"):
        linear_cross_entropy(h, torch.nn.Linear(8, 10), target)
    with pytest.raises(TypeError, match="shift must be True or False"):
        linear_cross_entropy(h, W, target, shift="yes")
    with pytest.raises(TypeError, match="grad_in_forward must be None, True or False"):
        linear_cross_entropy(h, W, target, grad_in_forward="x")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_shift_over_empty_sequences(reduction):
    """(B, 0, H) with shift=True: no tokens, as without shift (a zero loss, or an empty
    (B, 0) one), and a zero gradient."""
    h = torch.randn(2, 0, 8, requires_grad=True)
    target = torch.zeros(2, 0, dtype=torch.long)
    loss = linear_cross_entropy(h, torch.randn(10, 8), target, shift=True, reduction=reduction)
    assert loss.shape == ((2, 0) if reduction == "none" else ())
    if reduction != "none":
        assert loss.item() == 0.0
        loss.backward()
        assert h.grad.shape == h.shape
