"""linear_cross_entropy under the PyTorch stack, on CPU: ``torch.library.opcheck`` on its
three custom ops (schema, fake tensors, autograd registration, AOT dispatch), and
``torch.compile(fullgraph=True)`` of a loss with every option on both paths (the
recompute one: with a returned lse; the gradient-in-forward one: a scalar loss, and
per-row losses under a per-row upstream gradient, with a detached entropy too), no graph
break, values and gradients equal to eager, a new sequence length without recompiling."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs

from coda.fusions.cross_entropy import (
    lce_fused_loss,
    lce_stats,
    lce_stats_backward,
    linear_cross_entropy,
)

H, V = 16, 43


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(V, H, generator=g) / 4).requires_grad_()
    bias = (0.1 * torch.randn(V, generator=g)).requires_grad_()
    return W, bias


def loss_fn(h, rstd, W, bias, labels):
    """A causal-LM loss with every option: shift, deferred norm, bias, softcap, label
    smoothing, z-loss, temperature, returned lse and entropy (folded into the result so
    they carry a gradient)."""
    loss, lse, ent = linear_cross_entropy(
        h, W, labels, rstd=rstd, bias=bias, softcap=20.0, label_smoothing=0.1,
        z_loss=1e-3, shift=True, return_lse=True, return_entropy=True, chunk_size=16,
        temperature=0.8,
    )  # fmt: skip
    return loss + 1e-3 * lse.mean() - 1e-2 * ent.mean()


def fused_loss_fn(h, rstd, W, bias, labels):
    """The same options as a scalar loss (no returned lse): the gradient-in-forward path,
    over row chunks of 4 rows, with num_items_in_batch."""
    return linear_cross_entropy(
        h, W, labels, rstd=rstd, bias=bias, softcap=20.0, label_smoothing=0.1,
        z_loss=1e-3, shift=True, num_items_in_batch=11, chunk_rows=4, temperature=0.8,
    )  # fmt: skip


def per_row_loss_fn(h, rstd, W, bias, labels):
    """Per-row losses (reduction "none", no bias: the gradient-in-forward path in one row
    chunk) under a per-row upstream gradient: a nonlinear function of the row losses."""
    rows = linear_cross_entropy(
        h, W, labels, rstd=rstd, softcap=20.0, label_smoothing=0.1, z_loss=1e-3,
        shift=True, reduction="none", temperature=0.8,
    )  # fmt: skip
    return (rows * rows).sum()


def entropy_masked_loss_fn(h, rstd, W, bias, labels):
    """Per-row losses with the detached entropy as data (``return_entropy="detached"``,
    the gradient-in-forward path): the loss of the tokens whose entropy is above the
    batch's mean (a high-entropy token mask of RL losses), plus the logged mean entropy
    (no gradient)."""
    rows, ent = linear_cross_entropy(
        h, W, labels, rstd=rstd, softcap=20.0, shift=True, reduction="none",
        temperature=0.8, label_smoothing=0.0, z_loss=1e-3, return_entropy="detached",
    )  # fmt: skip
    mask = (ent > ent.mean()).to(rows.dtype)
    return (rows * mask).sum() + ent.mean()


def fused_extras_fn(h, rstd, W, bias, labels):
    """A scalar loss returning its lse and z-loss, both differentiated (the
    gradient-in-forward path: the extras keep it, their gradients from ``coda::lce_lse``'s
    backward)."""
    loss, lse, zl = linear_cross_entropy(
        h, W, labels, rstd=rstd, bias=bias, softcap=20.0, z_loss=1e-3, shift=True,
        label_smoothing=0.0, chunk_rows=4, temperature=0.8, return_lse=True, return_z_loss=True,
    )  # fmt: skip
    return loss + 1e-2 * lse.mean() + zl


def run(fn, T, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T, H, generator=g).requires_grad_()
    rstd = (0.5 + torch.rand(2, T, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (2, T), generator=g)
    labels[0, :2] = -100
    W, bias = _params(seed)
    out = fn(h, rstd, W, bias, labels)
    out.backward()
    return out.detach(), [h.grad, rstd.grad, W.grad, bias.grad]


OPS = {
    loss_fn: "lce_stats",
    fused_loss_fn: "lce_fused_loss",
    per_row_loss_fn: "lce_fused_loss",
    entropy_masked_loss_fn: "lce_fused_loss",
    fused_extras_fn: "lce_fused_loss",
}


@pytest.mark.parametrize(
    "fn",
    list(OPS),
    ids=["recompute", "grad_in_forward", "per_row", "detached_entropy", "lse_z_loss"],
)
def test_compile_fullgraph_matches_eager_with_dynamic_lengths(fn):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    graphs = EagerAndRecordGraphs()

    def backend(gm, example_inputs):
        graphs(gm, example_inputs)
        return counter(gm, example_inputs)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)
    frames = []
    for T in (5, 9, 14):
        out_c, grads_c = run(compiled, T, seed=T)
        frames.append(counter.frame_count)
        out_e, grads_e = run(fn, T, seed=T)
        torch.testing.assert_close(out_c, out_e)
        for gc, ge in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(gc, ge)
    assert frames[0] == frames[-1] == 1  # one graph, no recompile for a new length
    code = graphs.graphs[0].code
    assert f"coda.{OPS[fn]}" in code
    assert ("lce_fused_loss" in code) == (OPS[fn] == "lce_fused_loss")


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "deferred_norm"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_with_default_arguments_across_lengths(monkeypatch, reduction, norm):
    """``torch.compile(fullgraph=True, dynamic=True)`` of the call with every option at its
    default (a default float arrives as a SymFloat under dynamic=True: the argument checks
    must take it), equal to eager; the compiled frames do not grow with new lengths, but
    per-row losses recompile once where the row count crosses the budget of their
    one-chunk path (``ce_chunks.GRAD_ROWS_BYTES``: here 20 rows of 40 fp32 columns).
    ``norm``: with the deferred final norm's rstd (the shifted softmax's drstd = h . dh /
    rstd in the traced backward, whose eager row slices must not guard on the length)."""
    from coda.fusions import ce_chunks

    monkeypatch.setattr(ce_chunks, "GRAD_ROWS_BYTES", 20 * 40 * 4)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def fn(h, W, t):
        rstd = torch.rsqrt(h.float().pow(2).mean(-1) + 1e-6) if norm else None
        out = linear_cross_entropy(h, W, t, reduction=reduction, rstd=rstd)
        return (out * out).sum()

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    W, _ = _params()
    frames = []
    for M in (10, 14, 18, 30, 40, 12):
        g = torch.Generator().manual_seed(M)
        h = torch.randn(M, H, generator=g).requires_grad_()
        t = torch.randint(0, V, (M,), generator=g)
        got = compiled(h, W, t)
        (dh,) = torch.autograd.grad(got, h)
        want = fn(h, W, t)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(dh, torch.autograd.grad(want, h)[0])
        frames.append(counter.frame_count)
    assert frames[:3] == [frames[0]] * 3 and frames[3:] == [frames[3]] * 3
    assert frames[3] == frames[0] + (reduction == "none")


@pytest.mark.parametrize(
    "reduction,grad_in_forward,op",
    [
        ("mean", None, "lce_fused_loss"),
        ("sum", True, "lce_fused_loss"),
        ("mean", False, "lce_stats"),
        ("none", None, "lce_fused_loss"),
        ("none", False, "lce_stats"),
    ],
)
def test_no_graph_breaks(reduction, grad_in_forward, op):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    h, labels = torch.randn(3, 7, H, generator=g), torch.randint(0, V, (3, 7), generator=g)
    W, _ = _params()
    explanation = torch._dynamo.explain(linear_cross_entropy)(
        h, W, labels, shift=True, reduction=reduction, num_items_in_batch=None, z_loss=1e-4,
        grad_in_forward=grad_in_forward,
    )  # fmt: skip
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    code = explanation.graphs[0].code
    assert f"coda.{op}" in code and ("lce_fused_loss" in code) == (op == "lce_fused_loss")


def _stats_args(grad=True):
    g = torch.Generator().manual_seed(2)
    M = 13
    h = torch.randn(M, H, generator=g).requires_grad_(grad)
    W, bias = _params()
    W.requires_grad_(grad)
    bias.requires_grad_(grad)
    rstd = (0.5 + torch.rand(M, generator=g)).requires_grad_(grad)
    target = torch.randint(0, V, (M,), generator=g)
    target[3] = -100
    return h, W, target, bias, rstd


def _fused(h, W, target, bias, rstd, denom, options, rows, need):
    """An opcheck case of ``lce_fused_loss``: options (softcap, label smoothing, z-loss),
    rows per chunk, the four need_* flags."""
    args = (h, W, target, bias, rstd, torch.tensor(denom), -100, *options, rows, False)
    return lce_fused_loss, (*args, *(bool(n) for n in need))


def _cases():
    h, W, target, bias, rstd = _stats_args()
    hd, Wd, _, bd, rd = (t.detach() for t in (h, W, target, bias, rstd))
    stats = lce_stats(hd, Wd, target, bd, rd, -100, 5.0, True, 16, False, True)
    lse, ent = stats[0], stats[3]
    g = torch.Generator().manual_seed(3)
    gl, gt, gs, ge = (torch.randn(13, generator=g) for _ in range(4))
    backward_all = (gl, gt, gs, hd, Wd, target, bd, rd, lse, -100, 5.0, True, 16) + (True,) * 4
    return {
        "stats": (lce_stats, (h, W, target, bias, rstd, -100, 5.0, True, 16, False)),
        "stats_plain": (lce_stats, (h, W, target, None, None, -100, None, False, 0, False)),
        "stats_entropy": (lce_stats, (h, W, target, bias, rstd, -100, 5.0, True, 16, False, True)),
        "backward_all": (lce_stats_backward, backward_all),
        # the entropy's upstream gradient and the forward's entropy (return_entropy)
        "backward_entropy": (lce_stats_backward, (*backward_all, ge, ent)),
        "backward_dh_only": (
            lce_stats_backward,
            (
                gl,
                gt,
                gs,
                hd,
                Wd,
                target,
                None,
                None,
                lse,
                -100,
                None,
                False,
                0,
                True,
                False,
                False,
                False,
            ),
        ),  # fmt: skip
        # the gradient-in-forward op: every gradient, several row chunks, the V mod 8 tail
        "fused_all": _fused(h, W, target, bias, rstd, 12.0, (5.0, 0.1, 1e-3), 5, (1, 1, 1, 1)),
        "fused_dh_only": _fused(h, Wd, target, None, None, 12.0, (None, 0.0, 0.0), 0, (1, 0, 0, 0)),
        "fused_rstd_only": _fused(
            hd, Wd, target, None, rstd, 1.0, (None, 0.0, 0.0), 8, (0, 0, 0, 1)
        ),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(name):
    op, args = _cases()[name]
    torch.library.opcheck(op, args)
