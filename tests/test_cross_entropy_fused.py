"""The gradient-in-forward path of linear_cross_entropy (``coda.fusions.ce_fused``) on CPU.

* Its loss and every gradient (dh, dW, dbias, drstd) with every option (label smoothing,
  z-loss, softcap, bias, rstd, ignored rows, ragged V with V mod 8 != 0 and V < 8, one or
  many row chunks, num_items_in_batch) against the textbook float64 loss AND against the
  recompute path (``grad_in_forward=False``), both at fp32 accuracy.
* The automatic choice: which path runs (counted GEMM / epilogue calls: per row chunk one
  logits GEMM with its epilogue and one acc-free map pass; the dh and dW GEMMs of the one
  chunk, or of every chunk but the last, whose dh and dW GEMMs run in the backward with
  the upstream gradient in their epilogue; only those asked for), and that no gradient
  work runs without autograd.
* The gradients scale with any upstream gradient (in their dtypes, differentiable in the
  upstream gradient under ``create_graph``; one chunk: the saved gradients scaled, in
  place unless the graph is kept; several: no V x H scaling pass); dW over many row
  chunks is accumulated in fp32 and rounded once (with a V mod 8 tail too); the op's
  outputs have the inputs' dtypes; the row buffers (one by default: dlogits in place);
  ``run_map``'s cached zero operands.
* The bf16 stored-logit variants (``ACC_STORE_DTYPE``) against eager bf16 PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from _ce_helpers import (
    BF16,
    F32,
    F64,
    TOL,
    leaves,
    loss_and_grads,
    make,
    names,
    options,
    problems,
    reduce_rows,
    textbook,
    textbook_logits,
)
from _fusion_helpers import ZeroFills
from coda.fusions import _dispatch, ce_chunks, ce_fused
from coda.fusions import cross_entropy as ce
from coda.fusions.ce_epilogues import GRAD_SCALE, PARTIAL_SUM, TOTAL, scaled_total_epilogue
from coda.fusions.cross_entropy import linear_cross_entropy
from coda.testing import examples
from coda.testing.tolerance import assert_close_to_reference

SCALAR = ("mean", "sum")


def _floor(name: str) -> float:
    """The norm below which errors count as absolute: 0.1 for the loss, 1.0 for the
    gradients. The shifted softmax (the default gradient pass) rounds each exp(z - c)
    at |z - c| up to ~104 (``SHIFT_MARGIN`` 40 above the target's logit), relative
    errors up to ~2^-24 x 104 per entry in fp32; a gradient entry that is a cancelling
    sum of O(1) terms (H = 1, one row: dh = sum_v dlogits_v W_v = 0.02) keeps that error
    in absolute terms (3e-6 measured). bf16 on the GPU rounds R to 2^-8 anyway."""
    return 0.1 if name == "loss" else 1.0


def _run(p, dtype=F32, **kwargs):
    h, W, bias, rstd, target = make(p, dtype)
    return loss_and_grads(linear_cross_entropy, p, dtype, (h, W, bias, rstd), target, **kwargs)


@settings(max_examples=examples(250))
@given(p=problems(reductions=SCALAR))
def test_matches_textbook_and_the_recompute_path(p):
    fused = _run(p, grad_in_forward=True, chunk_rows=p["chunk_rows"])
    recompute = _run(p, grad_in_forward=False, chunk_size=p["chunk_size"])
    h, W, bias, rstd, target = make(p)
    truth = loss_and_grads(textbook, p, F64, (h, W, bias, rstd), target)
    for name, a, r, t in zip(names(p), fused, recompute, truth, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=_floor(name))
        f = _floor(name)
        assert_close_to_reference(a, r.double(), name=f"{name} vs recompute", tol=TOL, floor=f)


# ---- which path runs --------------------------------------------------------------------


class Calls:
    """Counts of the GEMM-class calls of both paths, split forward / backward."""

    def __init__(self, monkeypatch):
        self.log: list[str] = []
        for mod, tag in ((ce_fused, "fused"), (ce, "recompute")):
            for fn in ("run_epilogue", "run_map", "matmul"):
                if hasattr(mod, fn):
                    monkeypatch.setattr(mod, fn, self._wrap(getattr(mod, fn), f"{tag}.{fn}"))

    def _wrap(self, real, name):
        def counted(*args, **kwargs):
            self.log.append(name)
            return real(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.log:
            out[name] = out.get(name, 0) + 1
        self.log.clear()
        return out


def _inputs(M=20, H=16, V=43, grad=(True, True, False, False)):
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(M, H, generator=g),
        torch.randn(V, H, generator=g) / 4,
        0.1 * torch.randn(V, generator=g),
        0.5 + torch.rand(M, generator=g),
    ]
    for t, flag in zip(tensors, grad, strict=True):
        t.requires_grad_(flag)
    target = torch.randint(0, V, (M,), generator=g)
    target[::5] = -100
    return tensors, target


def _fused_counts(chunks, dh=True, dW=True, defer=True, shifted=False):
    """The forward's calls: per row chunk the logits GEMM (``run_epilogue``) and the map
    pass; the dh and dW GEMMs (``matmul``) of every chunk but the last (of the one
    chunk too when the last chunk's are not deferred: ``ce_fused.DEFER_ONE_CHUNK``
    off). ``shifted`` (``ce_fused.GRAD_PASS``): no gradient map pass, dh a GEMM with its
    row factor in the epilogue (``run_epilogue``), and dW's operand s * h a map pass
    (``run_map``) before its GEMM."""
    early = chunks - 1 if chunks > 1 or defer else 1
    if shifted:
        out = {"fused.run_epilogue": chunks + dh * early}
        if dW * early:
            out["fused.matmul"] = dW * early
            out["fused.run_map"] = dW * early
        return out
    out = {"fused.run_epilogue": chunks, "fused.run_map": chunks}
    gemms = (dh + dW) * early
    if gemms:
        out["fused.matmul"] = gemms
    return out


def _backward_counts(chunks, dh=True, dW=True, defer=True, shifted=False):
    """The backward's calls: the last row chunk's dh and dW GEMMs, each with the upstream
    gradient (and, with several chunks, the fp32 sum) in its epilogue
    (``scaled_total_epilogue``), on the ``shifted`` path dW's operand s * h a map pass
    before them; none with one chunk not deferred (the saved gradients are scaled)."""
    deferred = chunks > 1 or defer
    n = (dh + dW) if deferred else 0
    out = {"fused.run_epilogue": n} if n else {}
    if shifted and dW and deferred:
        out["fused.run_map"] = 1
    return out


@pytest.mark.parametrize("grad_pass", ["shifted", "map"])
def test_automatic_choice_runs_the_gradients_in_the_forward(monkeypatch, grad_pass):
    """Grad mode, h and W requiring grad, a mean loss: per row chunk of 8 rows (3 chunks
    of M = 20) the logits GEMM + epilogue (and with ``GRAD_PASS = "map"`` the map pass),
    the dh and dW GEMMs of the first two chunks: 3 logits-sized GEMMs per chunk in all,
    the last chunk's dh and dW in the backward. With one chunk of 64 rows, the same: the
    logits GEMM (and the map pass) in the forward, dh and dW in the backward."""
    assert ce_fused.GRAD_PASS == "auto"  # the default: shifted at these sizes
    monkeypatch.setattr(ce_fused, "GRAD_PASS", grad_pass)
    for rows, chunks in ((8, 3), (64, 1)):
        calls = Calls(monkeypatch)
        (h, W, b, r), target = _inputs()
        loss = linear_cross_entropy(h, W, target, chunk_rows=rows)
        assert calls.take() == _fused_counts(chunks, shifted=grad_pass == "shifted")
        loss.backward()
        assert calls.take() == _backward_counts(chunks, shifted=grad_pass == "shifted")
        assert h.grad is not None and W.grad is not None


@pytest.mark.parametrize(
    "grad",
    [
        (True, False, False, False),  # frozen head: dh only
        (False, True, False, False),  # frozen h: dW only
        (False, False, True, True),  # bias and rstd only: no GEMM after the map
    ],
)
def test_only_the_gradients_asked_for(monkeypatch, grad):
    calls = Calls(monkeypatch)
    (h, W, b, r), target = _inputs(grad=grad)
    loss = linear_cross_entropy(h, W, target, bias=b, rstd=r, chunk_rows=8)
    assert calls.take() == _fused_counts(3, dh=grad[0], dW=grad[1])
    loss.backward()
    assert calls.take() == _backward_counts(3, dh=grad[0], dW=grad[1])
    for t, flag in zip((h, W, b, r), grad, strict=True):
        assert (t.grad is not None) == flag


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(reduction="none", chunk_rows=8),
        dict(reduction="none", budget=20 * 40 * 4 - 1),
        dict(return_entropy=True),
        dict(grad_in_forward=False),
        dict(reduction="none", grad_in_forward=False),
    ],
    ids=["none_chunks", "none_over_budget", "return_entropy", "forced_off", "none_forced_off"],
)  # fmt: skip
def test_recompute_path_when_asked_or_needed(monkeypatch, kwargs):
    """A differentiable entropy, ``grad_in_forward=False``, and per-row losses that cannot
    take one row chunk of all M = 20 rows (smaller ``chunk_rows``, a 20 x 40 fp32 row
    buffer over ``GRAD_ROWS_BYTES``): the recompute path."""
    calls = Calls(monkeypatch)
    if "budget" in kwargs:
        monkeypatch.setattr(ce_chunks, "GRAD_ROWS_BYTES", kwargs.pop("budget"))
    (h, W, b, _), target = _inputs(grad=kwargs.pop("grad", (True, True, False, False)))
    if b.requires_grad:
        kwargs["bias"] = b
    out = linear_cross_entropy(h, W, target, chunk_size=16, **kwargs)
    assert calls.take() == {"recompute.run_epilogue": 4}  # vocabulary chunks 16, 16, 8, 3
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()  # per chunk: the recomputed logits GEMM, the dh and dW GEMMs
    assert calls.take() == {"recompute.run_epilogue": 4, "recompute.matmul": 8}


# ---- per-row losses -------------------------------------------------------------------------


@settings(max_examples=examples(150))
@given(p=problems(reductions=("none",)))
def test_per_row_losses_match_textbook_under_any_upstream_gradient(p):
    """reduction="none" with ``grad_in_forward=True``: one row chunk of every row, its
    dh and dW GEMMs in the backward with the per-row upstream gradient (drawn per row)
    folded into their row factors; loss and every gradient against the float64 textbook
    and the recompute path, with every option (both gradient passes: the shifted softmax
    where it applies, the map pass with a bias or with softcap and label smoothing
    together; dbias a g-weighted column sum of the stored dlogits in the backward)."""
    h, W, bias, rstd, target = make(p)
    truth = loss_and_grads(textbook, p, F64, (h, W, bias, rstd), target)
    recompute = _run(p, grad_in_forward=False, chunk_size=p["chunk_size"])
    fused = _run(p, grad_in_forward=True)
    for name, a, r, t in zip(names(p), fused, recompute, truth, strict=True):
        assert a.shape == t.shape, name
        f = _floor(name)
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=f)
        assert_close_to_reference(a, r.double(), name=f"{name} vs recompute", tol=TOL, floor=f)


@pytest.mark.parametrize("grad_pass", ["shifted", "map"])
def test_per_row_losses_take_one_chunk_and_three_gemms(monkeypatch, grad_pass):
    """Automatic: per-row losses whose M x V' row buffer fits ``GRAD_ROWS_BYTES`` take
    the gradient-in-forward path in one chunk (the forward's logits GEMM, the backward's
    dh and dW GEMMs: 3 logits-sized GEMMs, where the recompute path runs 4), the loss
    shaped like the targets, per row; ``grad_in_forward=True`` takes it whatever the
    buffer's size."""
    monkeypatch.setattr(ce_fused, "GRAD_PASS", grad_pass)
    shifted = grad_pass == "shifted"
    for budget, forced in ((ce_chunks.GRAD_ROWS_BYTES, None), (1, True)):
        monkeypatch.setattr(ce_chunks, "GRAD_ROWS_BYTES", budget)
        calls = Calls(monkeypatch)
        (h, W, _, _), target = _inputs()
        rows = linear_cross_entropy(
            h.reshape(4, 5, -1), W, target.reshape(4, 5), reduction="none",
            grad_in_forward=forced,
        )  # fmt: skip
        assert rows.shape == (4, 5) and rows.dtype == F32
        assert (rows.reshape(-1)[target == -100] == 0).all()
        assert calls.take() == _fused_counts(1, shifted=shifted)
        g = torch.linspace(-1.0, 2.0, 20).reshape(4, 5)
        dh, dW = torch.autograd.grad(rows, (h, W), g)
        assert calls.take() == _backward_counts(1, shifted=shifted) | (
            {} if shifted else {"fused.run_map": 1}  # the dW operand g * h
        )
        hd, Wd = leaves((h, W), F64)
        want = textbook(hd, Wd, target, reduction="none")
        wants = torch.autograd.grad(want, (hd, Wd), g.reshape(-1).double())
        assert_close_to_reference(rows.reshape(-1), want, name="loss", tol=TOL)
        for name, got, w in zip(("dh", "dW"), (dh, dW), wants, strict=True):
            assert_close_to_reference(got, w, name=name, tol=TOL)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_rows=8), "chunk_rows=8 < 20 rows"),
        (dict(defer=False), "DEFER_ONE_CHUNK"),
    ],
    ids=["chunk_rows", "not_deferred"],
)
def test_per_row_losses_refused_where_one_chunk_cannot_serve(monkeypatch, kwargs, match):
    """``grad_in_forward=True`` with per-row losses that one deferred row chunk cannot
    serve: a ValueError naming why, before any work."""
    calls = Calls(monkeypatch)
    (h, W, _, _), target = _inputs()
    if not kwargs.pop("defer", True):
        monkeypatch.setattr(ce_fused, "DEFER_ONE_CHUNK", False)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, W, target, reduction="none", grad_in_forward=True, **kwargs)
    assert calls.take() == {}


def test_per_row_losses_opcheck_and_no_double_backward_through_g(monkeypatch):
    """The op with ``per_row`` (and the backward's ``lce_weighted_colsum``) agrees with
    its fake implementation and autograd registration (opcheck); with a bias the backward
    runs the dh and dW GEMMs, the g * h map pass and one more map pass for dbias;
    differentiating the gradients with respect to the upstream gradient is refused with
    a clear error (the scalar loss supports it)."""
    (h, W, b, r), target = _inputs(grad=(True, True, True, True))
    for bias, smoothing in ((None, 0.0), (None, 0.1), (b.detach(), 0.1)):
        need = (True, True, bias is not None, True)
        args = (h.detach(), W.detach(), target, bias, r.detach(), torch.tensor(1.0), -100,
                None, smoothing, 1e-3, 0, False, *need, True)  # fmt: skip
        torch.library.opcheck(ce_fused.lce_fused_loss, args)
    dl, tail = torch.randn(20, 40), torch.randn(20, 3)
    weight = torch.randn(20)
    torch.library.opcheck(ce_fused.lce_weighted_colsum, (dl, tail, weight, 43))
    want = torch.cat([dl.T @ weight, tail.T @ weight])
    got = ce_fused.lce_weighted_colsum(dl, tail, weight, 43)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    calls = Calls(monkeypatch)
    rows = linear_cross_entropy(h, W, target, reduction="none", bias=b, rstd=r)
    assert calls.take() == {"fused.run_epilogue": 1, "fused.run_map": 1}
    rows.backward(torch.linspace(-1.0, 1.0, 20))
    assert calls.take() == {"fused.run_epilogue": 2, "fused.run_map": 2}
    assert b.grad is not None and r.grad is not None
    rows = linear_cross_entropy(h, W, target, reduction="none", rstd=r)
    g = torch.rand(20, requires_grad=True)
    with pytest.raises(RuntimeError, match="upstream gradient"):
        torch.autograd.grad(rows, (h, W), g, create_graph=True)


# ---- the entropy beside the loss (``return_entropy="detached"``) --------------------------------


def _with_detached_entropy(store: list):
    """``linear_cross_entropy`` returning the loss alone, its detached entropy kept in
    ``store``, for ``loss_and_grads``."""

    def run(h, W, target, **kwargs):
        loss, ent = linear_cross_entropy(h, W, target, return_entropy="detached", **kwargs)
        store.append(ent)
        return loss

    return run


def _textbook_entropy(p, h, W, bias, rstd):
    """Float64 per-row softmax entropy of the materialized logits of problem ``p``."""
    logits = textbook_logits(h, W, bias, rstd, p["softcap"], p["temperature"])
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("grad_pass", ["shifted", "map"])
@settings(max_examples=examples(150))
@given(p=problems())
def test_detached_entropy_beside_the_fused_loss(p, grad_pass):
    """``return_entropy="detached"`` keeps the gradient-in-forward path (scalar losses in
    row chunks, per-row losses in one): the per-row softmax entropy of the final logits
    (softcapped, tempered, every row, ignored ones too) against float64, not requiring
    grad, with the loss and every gradient unchanged (against the textbook), both
    gradient passes and every option (V mod 8 tails and V < 8 included)."""
    store: list = []
    kwargs = {} if p["reduction"] == "none" else dict(chunk_rows=p["chunk_rows"])
    h, W, bias, rstd, target = make(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce_fused, "GRAD_PASS", grad_pass)
        got = loss_and_grads(
            _with_detached_entropy(store), p, F32, (h, W, bias, rstd), target,
            grad_in_forward=True, **kwargs,
        )  # fmt: skip
    truth = loss_and_grads(textbook, p, F64, (h, W, bias, rstd), target)
    (ent,) = store
    assert not ent.requires_grad and ent.dtype == F32 and ent.shape == (p["M"],)
    want = _textbook_entropy(p, h, W, bias, rstd)
    assert_close_to_reference(ent, want, name="entropy", tol=TOL, floor=0.1)
    for name, a, t in zip(names(p), got, truth, strict=True):
        floor = _floor(name)
        if name == "loss" and p["row_weight"]:  # signed weights: a cancelling sum
            opts = {**options(p), "row_weight": options(p)["row_weight"].abs()}
            floor = max(floor, float(textbook(h, W, target, bias=bias, rstd=rstd, **opts).max()))
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=floor)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_detached_entropy_runs_no_extra_pass(monkeypatch, reduction):
    """The detached entropy costs no call: the same GEMM and map-pass counts as the loss
    alone (forward and backward), on the automatic path; under no_grad the statistics
    op's; ``return_entropy=True`` (differentiable) keeps the recompute path and
    ``grad_in_forward=True`` refuses it; other values are a ValueError."""
    calls = Calls(monkeypatch)
    (h, W, _, _), target = _inputs()
    kw = dict(reduction=reduction, chunk_rows=8 if reduction == "mean" else None)
    loss = linear_cross_entropy(h, W, target, **kw)
    plain_fwd = calls.take()
    torch.autograd.grad(loss.sum(), (h, W))
    plain_bwd = calls.take()
    loss, ent = linear_cross_entropy(h, W, target, return_entropy="detached", **kw)
    assert calls.take() == plain_fwd and plain_fwd.get("recompute.run_epilogue") is None
    torch.autograd.grad(loss.sum(), (h, W))
    assert calls.take() == plain_bwd
    assert not ent.requires_grad
    with torch.no_grad():
        _, ent_eval = linear_cross_entropy(h, W, target, return_entropy="detached", **kw)
    assert "fused.run_epilogue" not in calls.take()
    _, ent_grad = linear_cross_entropy(h, W, target, return_entropy=True, **kw)
    assert ent_grad.requires_grad and "fused.run_epilogue" not in calls.take()
    for other in (ent_eval, ent_grad.detach()):
        torch.testing.assert_close(other, ent, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="return_entropy"):
        linear_cross_entropy(h, W, target, return_entropy=True, grad_in_forward=True, **kw)
    with pytest.raises(ValueError, match="return_entropy must be"):
        linear_cross_entropy(h, W, target, return_entropy="detach", **kw)


def test_entropy_op_opcheck():
    """The op with ``entropy`` (its tenth output, no gradient) agrees with its fake
    implementation and autograd registration, scalar and per-row, with a V mod 8 tail."""
    (h, W, b, r), target = _inputs()
    for bias, per_row, rows in ((None, False, 8), (b.detach(), False, 0), (None, True, 0)):
        args = (h.detach(), W.detach(), target, bias, r.detach(), torch.tensor(1.0), -100,
                None, 0.1, 1e-3, rows, False, True, True, bias is not None, True, per_row,
                None, True)  # fmt: skip
        torch.library.opcheck(ce_fused.lce_fused_loss, args)
        assert ce_fused.lce_fused_loss(*args)[9].shape == (20,)


# ---- the returned lse and z-loss ------------------------------------------------------------


def _with_lse_and_z_loss(p, ups: list):
    """``linear_cross_entropy`` returning loss + the returned lse and z-loss under the
    upstream gradients ``ups`` (per-row for lse, a scalar or per-row for the z-loss): a
    function of all three outputs for ``loss_and_grads``."""

    def run(h, W, target, **kwargs):
        loss, lse, zl = linear_cross_entropy(
            h, W, target, return_lse=True, return_z_loss=True, **kwargs
        )
        g_lse, g_z = (u.to(lse.dtype) for u in ups)
        return loss + ((lse * g_lse).sum() + (zl * g_z).sum()) * torch.ones_like(loss)

    return run


@pytest.mark.parametrize("grad_pass", ["shifted", "map"])
@settings(max_examples=examples(100))
@given(p=problems())
def test_returned_lse_and_z_loss_keep_the_fused_path(p, grad_pass):
    """``return_lse`` / ``return_z_loss`` on the gradient-in-forward path: the lse (per row)
    and the z-loss term (reduced like the loss, weights included) against float64, and the
    gradients of a function of all three outputs (upstream gradients drawn on lse and the
    z-loss: their gradients come from ``coda::lce_lse``'s backward) against the textbook,
    every option, both gradient passes."""
    g = torch.Generator().manual_seed(p["seed"] + 3)
    z_shape = (p["M"],) if p["reduction"] == "none" else ()
    ups = [torch.randn(p["M"], generator=g, dtype=F64), torch.randn(z_shape, generator=g)]
    kwargs = {} if p["reduction"] == "none" else dict(chunk_rows=p["chunk_rows"])
    h, W, bias, rstd, target = make(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce_fused, "GRAD_PASS", grad_pass)
        got = loss_and_grads(
            _with_lse_and_z_loss(p, ups), p, F32, (h, W, bias, rstd), target,
            grad_in_forward=True, **kwargs,
        )  # fmt: skip

    def truth_fn(h, W, target, **opts):
        loss = textbook(h, W, target, **opts)
        lse = torch.logsumexp(
            textbook_logits(h, W, opts.get("bias"), opts.get("rstd"), p["softcap"],
                            p["temperature"]), -1,
        )  # fmt: skip
        valid = target != p["ignore_index"]
        zrows = torch.where(valid, p["z_loss"] * lse * lse, 0.0)
        if p["row_weight"]:
            zrows = zrows * torch.where(valid, options(p)["row_weight"], 0.0)
        zl = reduce_rows(zrows, valid, p["reduction"], p.get("num_items_in_batch"))
        total = (lse * ups[0]).sum() + (zl * ups[1].double()).sum()
        return loss + total * torch.ones_like(loss)

    truth = loss_and_grads(truth_fn, p, F64, (h, W, bias, rstd), target)
    for name, a, t in zip(names(p), got, truth, strict=True):
        floor = 1.0 if name == "loss" else _floor(name)  # the lse terms: O(1) each
        assert_close_to_reference(a, t, name=name, tol=TOL, floor=floor)


def test_logged_lse_and_z_loss_cost_no_gemm(monkeypatch):
    """A returned lse and z-loss that are only logged add no call to the gradient-in-forward
    path, forward or backward; differentiating the lse adds the recompute path's backward
    for it (the logits GEMM per vocabulary chunk, then its dh and dW GEMMs), once;
    ``coda::lce_lse`` passes opcheck."""
    calls = Calls(monkeypatch)
    (h, W, _, _), target = _inputs()
    loss = linear_cross_entropy(h, W, target, chunk_rows=8, z_loss=1e-3)
    plain_fwd = calls.take()
    torch.autograd.grad(loss, (h, W))
    plain_bwd = calls.take()
    loss, lse, zl = linear_cross_entropy(
        h, W, target, chunk_rows=8, z_loss=1e-3, return_lse=True, return_z_loss=True
    )
    assert calls.take() == plain_fwd and lse.requires_grad and zl.requires_grad
    torch.autograd.grad(loss, (h, W), retain_graph=True)
    assert calls.take() == plain_bwd
    torch.autograd.grad(loss + lse.mean(), (h, W))
    # V = 43: the chunk of 40 columns and the padded one of the 3-column tail
    extra = {"recompute.run_epilogue": 2, "recompute.matmul": 4}
    assert calls.take() == {k: plain_bwd.get(k, 0) + extra.get(k, 0) for k in plain_bwd | extra}
    args = (lse.detach(), h.detach(), W.detach(), target, None, None, -100, None)
    torch.library.opcheck(ce.lce_lse, args)


# ---- per-token weights ------------------------------------------------------------------------


def test_weighted_scalar_loss_keeps_the_gradient_in_forward_path(monkeypatch):
    """``row_weight`` on a mean loss: the forward's row chunks (3 of M = 20 in chunks of 8)
    with the weights in the per-row coefficients, the same GEMM counts as without them;
    loss and gradients against the float64 textbook (signed weights, NaN on ignored rows
    that must not leak); with ``shift=True`` the weights shift with the targets."""
    calls = Calls(monkeypatch)
    (h, W, _, _), target = _inputs()
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(20, generator=g)
    weight[target == -100] = float("nan")
    loss = linear_cross_entropy(h, W, target, chunk_rows=8, row_weight=weight)
    assert calls.take() == _fused_counts(3, shifted=True)
    dh, dW = torch.autograd.grad(loss, (h, W))
    hd, Wd = leaves((h, W), F64)
    want = textbook(hd, Wd, target, row_weight=weight.double())
    wants = torch.autograd.grad(want, (hd, Wd))
    for name, got, w in zip(("loss", "dh", "dW"), (loss, dh, dW), (want, *wants), strict=True):
        assert_close_to_reference(got, w, name=name, tol=TOL)
    # shift: position t predicts target t + 1 and carries weight t + 1
    h3, t3, w3 = h.reshape(4, 5, -1), target.reshape(4, 5), weight.reshape(4, 5)
    got = linear_cross_entropy(h3, W, t3, shift=True, row_weight=w3, reduction="sum")
    shifted_t = torch.nn.functional.pad(t3[:, 1:], (0, 1), value=-100).reshape(-1)
    shifted_w = torch.nn.functional.pad(w3[:, 1:], (0, 1)).reshape(-1).double()
    want = textbook(hd, Wd, shifted_t, row_weight=shifted_w, reduction="sum")
    assert_close_to_reference(got, want, name="shifted loss", tol=TOL)


def test_weights_that_require_grad_take_the_recompute_path(monkeypatch):
    """A ``row_weight`` that requires grad: the recompute path (its gradient is each
    row's loss over the divisor), equal to the textbook's; ``grad_in_forward=True``
    refuses it, and the op refuses such a weight itself."""
    calls = Calls(monkeypatch)
    (h, W, _, _), target = _inputs()
    weight = torch.rand(20, generator=torch.Generator().manual_seed(6)).requires_grad_()
    loss = linear_cross_entropy(h, W, target, chunk_size=64, row_weight=weight)
    assert calls.take() == {"recompute.run_epilogue": 2}
    dw, dh = torch.autograd.grad(loss, (weight, h))
    hd, Wd = leaves((h, W), F64)
    wd = weight.detach().double().requires_grad_()
    want = torch.autograd.grad(textbook(hd, Wd, target, row_weight=wd), (wd, hd))
    assert_close_to_reference(dw, want[0], name="dweight", tol=TOL)
    assert_close_to_reference(dh, want[1], name="dh", tol=TOL)
    with pytest.raises(ValueError, match="row_weight that requires grad"):
        linear_cross_entropy(h, W, target, row_weight=weight, grad_in_forward=True)
    args = (h.detach(), W.detach(), target, None, None, torch.tensor(1.0), -100, None, 0.0,
            0.0, 0, False, True, True, False, False, False, weight)  # fmt: skip
    with pytest.raises(ValueError, match="must not require grad"):
        ce_fused.lce_fused_loss(*args)


def test_returned_z_loss_is_weighted_like_the_loss():
    """With ``row_weight`` and ``return_z_loss`` (the recompute path) the returned z-loss
    term is reduced like the loss, weights included: loss - z_loss term = the weighted
    loss without z-loss."""
    (h, W, _, _), target = _inputs()
    weight = torch.rand(20, generator=torch.Generator().manual_seed(8))
    kw = dict(row_weight=weight, reduction="sum")
    loss, zl = linear_cross_entropy(h, W, target, z_loss=1e-2, return_z_loss=True, **kw)
    plain = linear_cross_entropy(h, W, target, **kw)
    torch.testing.assert_close(loss - zl, plain, rtol=1e-6, atol=1e-6)
    hd, Wd = leaves((h, W), F64)
    want = textbook(hd, Wd, target, z_loss=1e-2, row_weight=weight.double(), reduction="sum")
    assert_close_to_reference(loss, want, name="loss", tol=TOL)


@pytest.mark.parametrize(
    "weight,error,match",
    [
        (torch.ones(19), ValueError, "shaped like target"),
        (torch.ones(20, dtype=torch.int64), TypeError, "floating"),
        (torch.ones(20, device="meta"), ValueError, "meta"),
    ],
    ids=["shape", "dtype", "device"],
)
def test_bad_row_weight(weight, error, match):
    (h, W, _, _), target = _inputs()
    with pytest.raises(error, match=match):
        linear_cross_entropy(h, W, target, row_weight=weight)


def test_weighted_op_opcheck():
    (h, W, b, r), target = _inputs()
    weight = torch.randn(20, generator=torch.Generator().manual_seed(7))
    for bias, smoothing in ((None, 0.1), (b.detach(), 0.0)):
        args = (h.detach(), W.detach(), target, bias, r.detach(), torch.tensor(7.0), -100,
                None, smoothing, 1e-3, 8, False, True, True, bias is not None, True, False,
                weight)  # fmt: skip
        torch.library.opcheck(ce_fused.lce_fused_loss, args)


@pytest.mark.parametrize("bias", [False, True], ids=["shifted", "map_pass"])
def test_eager_calls_skip_the_dispatcher_and_match_the_custom_op(monkeypatch, bias):
    """Plain eager calls run ``lce_fused_loss``'s implementation and autograd formula
    through ``_FusedLoss`` (and ``lce_fused_finish``'s directly in the backward), not the
    custom ops: the same loss and gradients, bitwise, as through the custom ops, which
    calls under a dispatch mode (as fake tensors, ``make_fx`` and opcheck have) still
    take."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # records the ops the dispatcher sees
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    (h, W, b, r), target = _inputs(grad=(True, True, bias, True))
    W = torch.nn.Parameter(W.detach())  # an LM head's weight
    kw = dict(bias=b if bias else None, rstd=r, label_smoothing=0.1, z_loss=1e-3, chunk_rows=8)
    leaves = (h, W, b, r) if bias else (h, W, r)
    loss = linear_cross_entropy(h, W, target, **kw)
    grads = torch.autograd.grad(loss, leaves)
    with Ops() as ops:
        loss_op = linear_cross_entropy(h, W, target, **kw)
        grads_op = torch.autograd.grad(loss_op, leaves)
    assert "coda.lce_fused_loss.default" in ops.names
    assert "coda.lce_fused_finish.default" in ops.names
    torch.testing.assert_close(loss, loss_op, rtol=0, atol=0)
    for g, g_op in zip(grads, grads_op, strict=True):
        torch.testing.assert_close(g, g_op, rtol=0, atol=0)

    def refuse(*args, **kwargs):
        raise AssertionError("the custom op was called")

    monkeypatch.setattr(ce_fused.fused_loss, "op", refuse)
    monkeypatch.setattr(ce_fused._finish, "op", refuse)
    again = linear_cross_entropy(h, W, target, **kw)
    for g, g2 in zip(grads, torch.autograd.grad(again, leaves), strict=True):
        torch.testing.assert_close(g, g2, rtol=0, atol=0)


@pytest.mark.parametrize("grad_in_forward", [None, True])
def test_no_gradient_work_without_autograd(monkeypatch, grad_in_forward):
    """Under torch.no_grad, or with no input requiring grad (evaluation), only the
    statistics run, even when gradient-in-forward is asked for."""
    calls = Calls(monkeypatch)
    (h, W, _, _), target = _inputs()
    with torch.no_grad():
        a = linear_cross_entropy(h, W, target, chunk_size=64, grad_in_forward=grad_in_forward)
    stats_only = {"recompute.run_epilogue": 2}  # columns [0, 40) and the 3-column tail
    assert calls.take() == stats_only
    b = linear_cross_entropy(
        h.detach(), W.detach(), target, chunk_size=64, grad_in_forward=grad_in_forward
    )
    assert calls.take() == stats_only
    c = linear_cross_entropy(h, W, target, chunk_rows=64)
    torch.testing.assert_close(a, c.detach(), rtol=1e-6, atol=0)
    assert torch.equal(a, b)


# ---- the saved gradients ------------------------------------------------------------------


@pytest.mark.parametrize("rows", [7, 64], ids=["several_chunks", "one_chunk"])
def test_saved_gradients_scale_with_the_upstream_gradient(rows):
    """Any function of the loss: d f(loss) = f'(loss) * saved gradients; a second backward
    through a retained graph adds the same again."""
    (h, W, b, r), target = _inputs(grad=(True, True, True, True))
    opts = dict(label_smoothing=0.1, z_loss=1e-2, softcap=5.0)
    loss = linear_cross_entropy(h, W, target, bias=b, rstd=r, chunk_rows=rows, **opts)
    f = 3.0 * loss**2 - loss
    f.backward(retain_graph=True)
    first = [t.grad.clone() for t in (h, W, b, r)]
    f.backward()
    hd, Wd, bd, rd = leaves((h, W, b, r), F64)
    truth = textbook(hd, Wd, target, bias=bd, rstd=rd, **opts)
    wants = torch.autograd.grad(3.0 * truth**2 - truth, (hd, Wd, bd, rd))
    for name, got, again, want in zip(
        ("dh", "dW", "dbias", "drstd"), first, (h.grad, W.grad, b.grad, r.grad), wants,
        strict=True,
    ):  # fmt: skip
        assert_close_to_reference(got, want, name=name, tol=TOL)
        torch.testing.assert_close(again, 2 * got)


@pytest.mark.parametrize("V", [24, 27], ids=["V%8=0", "tail3"])
def test_many_row_chunks_round_dW_once(V, monkeypatch):
    """bf16 W, 40 row chunks: dW is accumulated in fp32 and rounded once (the backward's
    last dW GEMM adds the fp32 sum of the other chunks in its epilogue; the V mod 8 tail
    rows in torch), so it equals the one-chunk dW (one GEMM over all rows) within one
    bf16 rounding; a bf16 running sum over the chunks would drift by several."""
    calls = Calls(monkeypatch)
    g = torch.Generator().manual_seed(1)
    M, H = 40, 16
    h = torch.randn(M, H, generator=g).to(BF16)
    W = (torch.randn(V, H, generator=g) / 4).to(BF16)
    target = torch.randint(0, V, (M,), generator=g)
    grads = []
    for rows in (M, 1):
        hl, Wl = leaves((h, W), BF16)
        loss = linear_cross_entropy(hl, Wl, target, reduction="sum", chunk_rows=rows)
        grads.append(torch.autograd.grad(loss, Wl)[0])
        if rows == 1:  # the forward's 40 logits GEMMs (and on the shifted path the dh
            # GEMMs of 39 of them, row factors in their epilogue), the backward's dh and dW
            shifted = (M - 1) * (ce_fused.GRAD_PASS != "map")
            assert calls.take()["fused.run_epilogue"] == M + 2 + shifted
        else:
            calls.take()
    one, many = grads
    ulp = one.float().abs() * 2.0**-8 + 1e-30
    assert ((many.float() - one.float()).abs() <= ulp).all()
    running = torch.zeros_like(one)  # what bf16 accumulation gives: visibly worse
    for i in range(M):
        hl, Wl = leaves((h[i : i + 1], W), BF16)
        part = linear_cross_entropy(hl, Wl, target[i : i + 1], reduction="sum")
        running = running + torch.autograd.grad(part, Wl)[0]
    assert ((running.float() - one.float()).abs() > ulp).any()


def test_several_chunks_fold_the_upstream_gradient_into_the_backward_gemms(monkeypatch):
    """With several row chunks the backward scales only the small gradients (dbias,
    drstd) by a separate product: dh and dW come out of ``lce_fused_finish`` already
    times g (its GEMM epilogues), and equal g times the gradients of g = 1 (one bf16
    rounding apart: each is rounded once from fp32)."""
    seen = []
    real = ce_fused._scaled

    def spy(tensors, g, in_place=False):
        seen.append([None if t is None else tuple(t.shape) for t in tensors])
        return real(tensors, g, in_place)

    monkeypatch.setattr(ce_fused, "_scaled", spy)
    (h, W, b, r), target = _inputs(grad=(True, True, True, True))
    h16, W16 = (t.detach().to(BF16).requires_grad_() for t in (h, W))
    kw = dict(bias=b, rstd=r, chunk_rows=7)
    unit = torch.autograd.grad(linear_cross_entropy(h16, W16, target, **kw), (h16, W16))
    seen.clear()
    scaled = torch.autograd.grad(0.3 * linear_cross_entropy(h16, W16, target, **kw), (h16, W16))
    assert seen == [[(W.shape[0],), (h.shape[0],)]]  # dbias, drstd only
    for s, u in zip(scaled, unit, strict=True):
        want = 0.3 * u.float()
        ulp = want.abs() * 2.0**-7 + 1e-6
        assert s.dtype == BF16 and ((s.float() - want).abs() <= ulp).all()


def test_one_chunk_backward_scales_in_place_unless_the_graph_is_kept(monkeypatch):
    """One row chunk, not deferred (``ce_fused.DEFER_ONE_CHUNK`` off: dh and dW computed
    in the forward): a plain ``backward()`` scales the saved gradients in place and
    returns them (no new dh / dW allocated); a retained graph (a second backward will
    read them) and ``create_graph`` through the upstream gradient get new tensors. The
    values are the same either way (test_saved_gradients_scale_with_the_upstream_gradient)."""
    seen = []
    real = ce_fused._scaled

    def spy(tensors, g, in_place=False):
        seen.append(in_place)
        out = real(tensors, g, in_place)
        for t, o in zip(tensors, out, strict=True):
            if t is not None:
                assert (o.data_ptr() == t.data_ptr()) == in_place
        return out

    monkeypatch.setattr(ce_fused, "_scaled", spy)
    monkeypatch.setattr(ce_fused, "DEFER_ONE_CHUNK", False)
    (h, W, _, _), target = _inputs()
    loss = linear_cross_entropy(h, W, target, chunk_rows=64)
    (2 * loss).backward(retain_graph=True)
    first = h.grad.clone()
    (2 * loss).backward()
    assert seen == [False, True]
    torch.testing.assert_close(h.grad, 2 * first)
    g = torch.tensor(3.0, requires_grad=True)
    loss = linear_cross_entropy(h, W, target, chunk_rows=64)
    (dh,) = torch.autograd.grad(loss * g, h, create_graph=True)
    assert seen == [False, True, False]
    assert dh.requires_grad


def test_scaled_gradients_are_new_tensors_in_their_dtypes():
    """The backward's scaling (``torch._foreach_mul`` per dtype): each result is a new
    tensor of its input's dtype (inputs untouched, None kept) equal to t * g, with g in
    t's dtype."""
    g = torch.tensor(0.37)
    gen = torch.Generator().manual_seed(2)
    ts = [torch.randn(5, 3, generator=gen).to(BF16), None, torch.randn(7, generator=gen),
          torch.randn(4, generator=gen).to(BF16)]  # fmt: skip
    before = [None if t is None else t.clone() for t in ts]
    out = ce_fused._scaled(ts, g)
    for t, o, b in zip(ts, out, before, strict=True):
        if t is None:
            assert o is None
            continue
        assert o.dtype == t.dtype and o.shape == t.shape and o.data_ptr() != t.data_ptr()
        assert torch.equal(t, b)
        want = (t.float() * g.to(t.dtype).float()).to(t.dtype)
        torch.testing.assert_close(o, want, rtol=2.0**-8, atol=0)


@pytest.mark.parametrize("rows", [7, 64], ids=["several_chunks", "one_chunk"])
def test_create_graph_differentiates_through_the_upstream_gradient(rows):
    """With create_graph the gradients stay functions of the upstream gradient:
    d/ds <c, d(s loss)/dx> = <c, d loss/dx>."""
    (h, W, _, _), target = _inputs()
    loss = linear_cross_entropy(h, W, target, chunk_rows=rows)
    s = torch.tensor(2.0, requires_grad=True)
    dh, dW = torch.autograd.grad(s * loss, (h, W), create_graph=True)
    ch, cW = torch.randn_like(dh), torch.randn_like(dW)
    (ds,) = torch.autograd.grad((dh * ch).sum() + (dW * cW).sum(), s)
    loss = linear_cross_entropy(h, W, target, chunk_rows=rows)
    dh1, dW1 = torch.autograd.grad(loss, (h, W))
    torch.testing.assert_close(ds, (dh1 * ch).sum() + (dW1 * cW).sum())


@pytest.mark.parametrize("partial", [False, True], ids=["dh", "dW_sum"])
def test_scaled_total_epilogue_scales_and_rounds_once(partial):
    """The backward's last row chunk on the dW GEMM's transposed operands: total =
    g * (acc [+ fp32 partial sum]) rounded once to the output dtype, g a column vector."""
    gen = torch.Generator().manual_seed(3)
    dl = torch.randn(6, 16, generator=gen).to(BF16)  # (rows, V') dlogits
    h = torch.randn(6, 8, generator=gen).to(BF16)  # (rows, H)
    extra = {GRAD_SCALE: torch.full((8,), 0.7)}
    want = dl.float().T @ h.float()
    if partial:
        extra[PARTIAL_SUM] = torch.randn(16, 8, generator=gen)
        want = want + extra[PARTIAL_SUM]
    out = scaled_total_epilogue(BF16, partial).reference(dl.t(), h.t(), **extra)
    assert out[TOTAL].dtype == BF16
    torch.testing.assert_close(out[TOTAL], (0.7 * want).to(BF16), rtol=0, atol=0)


@pytest.mark.parametrize("row_scale", [False, True], ids=["", "row_scale"])
@pytest.mark.parametrize("rank", [False, True], ids=["", "rank1"])
@pytest.mark.parametrize("partial", [False, True], ids=["", "partial"])
def test_split_k_finish_is_the_scaled_epilogue(row_scale, rank, partial):
    """A backward GEMM whose K ``coda.gemm`` would split (``ce_fused._split_config``: dh
    of a few hundred rows, K = V) sums A @ B.T into fp32 and finishes in torch
    (``_finish_split``): the same values, rounded once, as ``scaled_total_epilogue`` on
    the unsplit GEMM, for every combination of its row scale, rank-1 term and fp32
    partial sum."""
    from coda.fusions.ce_epilogues import RANK_COL, RANK_ROW, ROW_SCALE

    gen = torch.Generator().manual_seed(5)
    A = torch.randn(7, 40, generator=gen).to(BF16)  # (rows, V') shifted softmax R
    B = torch.randn(24, 40, generator=gen).to(BF16)  # W[:V'].t() as (H, V')
    tensors = {GRAD_SCALE: torch.randn(24, generator=gen)}
    kw = {}
    if row_scale:
        tensors[ROW_SCALE] = kw["row_scale"] = torch.rand(7, generator=gen) + 0.5
    if rank:
        tensors[RANK_ROW], tensors[RANK_COL] = kw["rank"] = (
            torch.randn(7, generator=gen), torch.randn(24, generator=gen)
        )  # fmt: skip
    if partial:
        tensors[PARTIAL_SUM] = kw["partial"] = torch.randn(7, 24, generator=gen)
    want = scaled_total_epilogue(BF16, partial, row_scale, rank).reference(A, B, **tensors)
    out = torch.empty(7, 24, dtype=BF16)
    ce_fused._finish_split(A.float() @ B.float().T, out, tensors[GRAD_SCALE], **kw)
    torch.testing.assert_close(out, want[TOTAL], rtol=0, atol=0)


def test_split_config_only_where_the_output_leaves_the_gpu_idle():
    """The heuristic's fp32 split-K config for dh of a short last row chunk (K = V), and
    none for a full one (its tiles keep half the clusters busy or more) or a short K."""
    from coda.mainloop.config import choose_config

    def split(m, n, k):
        return ce_fused._split_config_cached(m, n, k, 132, False)

    assert split(256, 2048, 128256) == choose_config(256, 2048, 128256, 132, split_ok=True)
    assert split(256, 2048, 128256).split_k > 1
    assert split(512, 2048, 128256).split_k > 1
    assert split(1024, 2048, 128256) is None  # 64 tiles of 128 x 128 on 66 clusters
    # 2048-row chunks (the default at these V): their tiles fill half the GPU or more
    assert split(2048, 2048, 128256) is None
    assert split(2048, 4096, 128256) is None
    assert split(256, 2048, 512) is None


def test_row_buffers_one_in_place_by_default():
    """dlogits overwrite the stored acc when both have h's dtype (one row buffer); an fp32
    stored acc gets a second buffer; nothing stores dlogits without dh or dW."""
    acc, dl = ce_fused.row_buffers(4, 16, BF16, BF16, True, "cpu")
    assert dl is acc and acc.shape == (4, 16) and acc.dtype == BF16
    acc, dl = ce_fused.row_buffers(4, 16, F32, BF16, True, "cpu")
    assert acc.dtype == F32 and dl.dtype == BF16 and dl.data_ptr() != acc.data_ptr()
    acc, dl = ce_fused.row_buffers(4, 16, BF16, BF16, False, "cpu")
    assert dl is None


def test_run_map_reuses_read_only_zero_operands(monkeypatch):
    """``run_map``'s zero-GEMM operands are slices of one cached zero buffer per (device,
    dtype), grown when too short and never written; the results are those of fresh
    zeros."""
    from coda import Epilogue, TileLoad, TileStore

    monkeypatch.setattr(_dispatch, "_ZEROS", {})
    seen = []
    real = _dispatch.run_epilogue

    def spy(epi, A, B, *args, **kwargs):
        seen.append((A, B))
        return real(epi, A, B, *args, **kwargs)

    monkeypatch.setattr(_dispatch, "run_epilogue", spy)
    epi = Epilogue((TileLoad("x", F32), TileStore("x", F32, name="y")))
    like = torch.empty(1, dtype=BF16)
    gen = torch.Generator().manual_seed(4)
    for M, N in ((3, 5), (2, 4), (7, 30), (30, 1)):
        x = torch.randn(M, N, generator=gen)
        out = _dispatch.run_map(epi, M, N, like, x=x)
        assert torch.equal(out["y"], x)
    buf = _dispatch._ZEROS[(like.device, BF16)]
    assert buf.shape == (30, _dispatch.MAP_K) and not buf.any()
    for (A, B), (M, N) in zip(seen, ((3, 5), (2, 4), (7, 30), (30, 1)), strict=True):
        assert A.shape == (M, _dispatch.MAP_K) and B.shape == (N, _dispatch.MAP_K)
        assert A.dtype == B.dtype == BF16 and not A.any() and not B.any()
    # once grown, later calls share the one buffer: no allocation per call
    A, B = seen[-1]
    assert A.data_ptr() == B.data_ptr() == buf.data_ptr()
    _dispatch.run_map(epi, 2, 3, torch.empty(1, dtype=F32), x=torch.zeros(2, 3))
    assert _dispatch._ZEROS[(like.device, F32)].dtype == F32


def test_output_dtypes_and_shapes():
    (h, W, b, r), target = _inputs(grad=(True, True, True, True))
    hb, Wb, bb = (t.detach().to(BF16).requires_grad_() for t in (h, W, b))
    rr = r.detach().requires_grad_()
    loss = linear_cross_entropy(hb, Wb, target, bias=bb, rstd=rr, chunk_rows=6)
    assert loss.dtype == F32 and loss.shape == ()
    loss.backward()
    for leaf in (hb, Wb, bb, rr):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape


def test_num_items_as_tensor_int_and_float():
    (h, W, _, _), target = _inputs()
    losses = [
        linear_cross_entropy(h, W, target, num_items_in_batch=n, chunk_rows=9)
        for n in (13, 13.0, torch.tensor(13), torch.tensor([13.0]))
    ]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=0, atol=0)
    hd, Wd = leaves((h, W), F64)
    want = textbook(hd, Wd, target, num_items_in_batch=13)
    torch.testing.assert_close(losses[0].double(), want, rtol=1e-6, atol=0)


# ---- bf16 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("acc_dtype", [None, F32], ids=["acc_bf16", "acc_fp32"])
@settings(max_examples=examples(60))
@given(p=problems(reductions=SCALAR))
def test_bf16_no_worse_than_eager_bf16(p, acc_dtype):
    """bf16 h and W, the GPU rule: err <= 2 err(eager bf16) + atol against float64, with
    the logits stored in bf16 (the default: their statistics taken from the same rounded
    values) or in fp32 (``ACC_STORE_DTYPE``)."""
    p = {**p, "bias": False, "rstd": False, "M": max(p["M"], 8), "H": max(p["H"], 8)}
    old = ce_fused.ACC_STORE_DTYPE
    ce_fused.ACC_STORE_DTYPE = acc_dtype
    try:
        ours = _run(p, BF16, grad_in_forward=True, chunk_rows=p["chunk_rows"])
    finally:
        ce_fused.ACC_STORE_DTYPE = old
    h, W, _, _, target = make(p, BF16)
    truth = loss_and_grads(textbook, p, F64, (h, W, None, None), target)
    eager = loss_and_grads(textbook, p, BF16, (h, W, None, None), target)
    for name, a, t, b in zip(("loss", "dh", "dW"), ours, truth, eager, strict=True):
        assert_close_to_reference(a, t, name=name, baseline=b, atol=2e-3, floor=1e-2)


def test_backward_materializes_no_zero_gradients_for_the_saved_gradient_outputs():
    """dh, dW, dbias, drstd are outputs of the fused op that nobody differentiates: the
    backward must not get (V x H for dW) zero-filled gradients for them."""

    (h, W, b, r), target = _inputs()
    loss = linear_cross_entropy(h, W, target, chunk_rows=8)
    fills = ZeroFills()
    with fills:
        loss.backward()
    assert fills.shapes == []
    assert h.grad is not None and W.grad is not None


def test_defer_one_chunk_option(monkeypatch):
    """``ce_fused.DEFER_ONE_CHUNK`` (on by default): with one row chunk too, the forward
    runs the logits GEMM and the map pass only, the backward the dh and dW GEMMs with
    the upstream gradient folded in; off, the forward runs dh and dW too and the
    backward scales them. The gradients agree (fp32: one rounding of g apart), and the
    op agrees with its fake implementation either way (opcheck)."""
    calls = Calls(monkeypatch)
    (h, W, b, r), target = _inputs(grad=(True, True, True, True))
    opts = dict(bias=b, rstd=r, chunk_rows=64, label_smoothing=0.1)
    assert ce_fused.DEFER_ONE_CHUNK
    monkeypatch.setattr(ce_fused, "DEFER_ONE_CHUNK", False)
    want = torch.autograd.grad(0.7 * linear_cross_entropy(h, W, target, **opts), (h, W, b, r))
    assert calls.take() == {**_fused_counts(1, defer=False)}
    monkeypatch.setattr(ce_fused, "DEFER_ONE_CHUNK", True)
    loss = linear_cross_entropy(h, W, target, **opts)
    assert calls.take() == {"fused.run_epilogue": 1, "fused.run_map": 1}
    got = torch.autograd.grad(0.7 * loss, (h, W, b, r))
    assert calls.take() == {"fused.run_epilogue": 2}
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-7)
    hd, Wd, bd, rd = (t.detach() for t in (h, W, b, r))
    args = (hd, Wd, target, bd, rd, torch.tensor(17.0), -100, None, 0.1, 0.0, 64, False)
    torch.library.opcheck(ce_fused.lce_fused_loss, (*args, True, True, True, True))
    monkeypatch.setattr(ce_fused, "DEFER_ONE_CHUNK", False)
    torch.library.opcheck(ce_fused.lce_fused_loss, (*args, True, True, True, True))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_stats_pass_option(monkeypatch, dtype):
    """``ce_fused.STATS_PASS = "map"``: per row chunk the logits GEMM runs plain
    (``matmul``) and the statistics come from a map pass over the acc it stored, then the
    gradient's map pass: the same loss and gradients as the default (statistics in the
    logits GEMM's epilogue, of the same rounded acc), with every option on; an unknown
    value is refused."""
    calls = Calls(monkeypatch)
    (h, W, b, r), target = _inputs(grad=(True, True, True, True))
    h, W, b = (t.detach().to(dtype).requires_grad_() for t in (h, W, b))  # rstd stays fp32
    opts = dict(bias=b, rstd=r, chunk_rows=8, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
    assert ce_fused.STATS_PASS == "auto" and not ce_fused.stats_by_map(20, 43, 16)
    want = torch.autograd.grad(0.7 * linear_cross_entropy(h, W, target, **opts), (h, W, b, r))
    calls.take()
    monkeypatch.setattr(ce_fused, "STATS_PASS", "map")
    loss = linear_cross_entropy(h, W, target, **opts)
    chunks = 3  # 20 rows in chunks of 8
    fwd = calls.take()
    assert fwd["fused.run_map"] == 2 * chunks and "fused.run_epilogue" not in fwd
    assert fwd["fused.matmul"] == chunks + 2 * (chunks - 1)
    got = torch.autograd.grad(0.7 * loss, (h, W, b, r))
    for g_, w_ in zip(got, want, strict=True):
        assert g_.dtype == w_.dtype
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-6)
    hd, Wd, bd, rd = (t.detach() for t in (h, W, b, r))
    args = (hd, Wd, target, bd, rd, torch.tensor(17.0), -100, 20.0, 0.1, 1e-3, 8, False)
    torch.library.opcheck(ce_fused.lce_fused_loss, (*args, True, True, True, True))
    monkeypatch.setattr(ce_fused, "STATS_PASS", "gemm")
    with pytest.raises(ValueError, match="STATS_PASS"):
        linear_cross_entropy(h, W, target, **opts)


def test_stats_pass_auto_rule(monkeypatch):
    """ "auto" takes the statistics by a map pass exactly for long-running logits GEMMs
    (``LONG_RUN_FLOPS``) with H >= ``STATS_MAP_MIN_K`` (the measured break-even)."""
    V = 128256
    assert ce_fused.stats_by_map(8192, V, 8192) and ce_fused.stats_by_map(16384, V, 8192)
    assert not ce_fused.stats_by_map(8192, V, 4096)  # long-running, but H below the bound
    assert not ce_fused.stats_by_map(2048, V, 2048)
    assert not ce_fused.stats_by_map(128, 32000, 8192)  # H at the bound, a short GEMM
    monkeypatch.setattr(ce_fused, "STATS_PASS", "epilogue")
    assert not ce_fused.stats_by_map(16384, V, 8192)
    monkeypatch.setattr(ce_fused, "STATS_PASS", "map")
    assert ce_fused.stats_by_map(128, 32000, 2048)
