"""Shared helpers of the cross-entropy CPU tests (tests/test_cross_entropy*.py): the
textbook loss in float64, hypothesis-drawn problems, their inputs, and a runner that
returns the loss and every gradient of one loss function."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
TOL = 2e-5  # normwise relative, fp32 computation against float64
NAMES = ("loss", "dh", "dW", "dbias", "drstd")


def textbook_logits(h, W, bias=None, rstd=None, softcap=None, temperature=1.0):
    """The materialized logits: softcap(rstd * (h @ W.T) + bias) / temperature."""
    logits = h @ W.T
    if rstd is not None:
        logits = logits * rstd[:, None]
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def textbook(h, W, target, *, bias=None, rstd=None, softcap=None, label_smoothing=0.0,
             z_loss=0.0, ignore_index=-100, reduction="mean", num_items_in_batch=None,
             temperature=1.0, row_weight=None):  # fmt: skip
    """The unfused loss, written from the definitions (h: (M, H), target: (M,)); the row
    losses times ``row_weight`` (0 on ignored rows) before the reduction."""
    logits = textbook_logits(h, W, bias, rstd, softcap, temperature)
    rows = F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing,
    )  # fmt: skip
    valid = target != ignore_index
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(logits, -1) ** 2 * valid
    if row_weight is not None:
        rows = rows * torch.where(valid, row_weight.to(rows.dtype), 0.0)
    return reduce_rows(rows, valid, reduction, num_items_in_batch)


def reduce_rows(rows, valid, reduction="mean", num_items_in_batch=None):
    """The loss's reduction of per-row values: as they are ("none"), their sum over
    ``num_items_in_batch``, their sum, or their mean over the valid rows (0 with none)."""
    if reduction == "none":
        return rows
    if num_items_in_batch is not None:
        return rows.sum() / num_items_in_batch
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)


@st.composite
def problems(draw, reductions=("mean", "sum", "none"), max_V=90):
    """A loss problem: shape, options, chunking of both paths, ignored rows, a seed."""
    M = draw(st.integers(1, 48))
    reduction = draw(st.sampled_from(reductions))
    items = None
    if reduction != "none":
        items = draw(st.sampled_from([None, None, 7, 30.0]))
    return dict(
        M=M,
        H=draw(st.integers(1, 24)),
        V=draw(st.integers(1, max_V)),
        chunk_size=draw(st.one_of(st.none(), st.sampled_from([8, 16, 24, 40, 64]))),
        chunk_rows=draw(st.one_of(st.none(), st.sampled_from([1, 3, 8, 16]))),
        bias=draw(st.booleans()),
        rstd=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, None, 1.5, 30.0])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),
        z_loss=draw(st.sampled_from([0.0, 0.0, 1e-2])),
        temperature=draw(st.sampled_from([1.0, 1.0, 0.7, 2.0])),
        reduction=reduction,
        num_items_in_batch=items,
        ignore_index=draw(st.sampled_from([-100, -1, 0])),
        ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        row_weight=draw(st.sampled_from([False, False, True])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(p, dtype=F32):
    """Inputs of problem ``p`` as float64 masters (h, W, bias, rstd), rounded through
    ``dtype``, and the targets."""
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
    out = {k: p[k] for k in keys}
    if p.get("num_items_in_batch") is not None:
        out["num_items_in_batch"] = p["num_items_in_batch"]
    if p.get("temperature", 1.0) != 1.0:
        out["temperature"] = p["temperature"]
    if p.get("row_weight"):
        out["row_weight"] = row_weights(p)
    return out


def row_weights(p):
    """Per-row weights of problem ``p`` (signed, like RL advantages; NaN on ignored rows,
    which must not leak into the loss)."""
    g = torch.Generator().manual_seed(p["seed"] + 2)
    w = torch.randn(p["M"], generator=g, dtype=F64)
    return torch.where(make(p)[-1] == p["ignore_index"], float("nan"), w)


def upstream(p):
    """The upstream gradient: drawn per row for reduction "none", else None (ones)."""
    if p["reduction"] != "none":
        return None
    return torch.randn(p["M"], generator=torch.Generator().manual_seed(p["seed"] + 1))


def loss_and_grads(fn, p, dtype, inputs, target, **kwargs):
    """(loss, dh, dW[, dbias][, drstd]) of ``fn`` on leaves of ``dtype`` made from
    ``inputs`` (h, W, bias, rstd; None entries skipped)."""
    ins = leaves(inputs, dtype)
    loss = fn(ins[0], ins[1], target, bias=ins[2], rstd=ins[3], **options(p), **kwargs)
    up = upstream(p)
    grad = torch.ones_like(loss) if up is None else up.to(loss.dtype)
    wrt = [t for t in ins if t is not None]
    return (loss, *torch.autograd.grad(loss, wrt, grad))


def names(p):
    """The names of ``loss_and_grads``' results for problem ``p``."""
    skip = {"dbias"} if not p["bias"] else set()
    skip |= {"drstd"} if not p["rstd"] else set()
    return [n for n in NAMES if n not in skip]
