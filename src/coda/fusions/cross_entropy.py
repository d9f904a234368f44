"""coda.fusions.cross_entropy: LM head + cross-entropy, forward and backward, logits never whole.

Sits in ``coda.fusions`` on ``ce_epilogues`` (the epilogues), ``ce_chunks`` (how V and
the rows are walked), ``ce_operands`` (checks), ``ce_fused`` (the gradient-in-forward op)
and ``_dispatch`` (fused kernel on CUDA, the epilogues' reference on CPU).

``linear_cross_entropy`` runs one of two paths (``_grad_in_forward`` picks):

**Gradient-in-forward** (default when autograd will want gradients of a scalar loss:
grad mode on, an input requiring grad, reduction "mean"/"sum", no differentiable entropy;
fp16 inputs with their gradients formed without the loss's 1 / denom,
``ce_fused.UNSCALED_DTYPES``):
``coda::lce_fused_loss`` (``ce_fused``) computes the loss and all gradients in the
forward over row chunks, 3 logits-sized GEMMs in all; its backward scales the saved
gradients by the loss's upstream gradient. Workspace: two row buffers and, with more than
one row chunk, an fp32 V x H dW accumulator. Per-row losses (reduction "none") take it
in ONE row chunk of every row (``per_row``), the backward's per-row upstream gradient
folded into the deferred dh / dW GEMMs' row factors: by default where that M x V row
buffer fits ``ce_chunks.GRAD_ROWS_BYTES``, at any size with ``grad_in_forward=True``.
``return_entropy="detached"`` keeps this path: the entropy, without a gradient, comes
from the same statistics' epilogue (``SoftmaxEntropy`` in place of ``LogSumExp``). So do
``return_lse`` / ``return_z_loss``: the forward's lse, differentiable through
``coda::lce_lse``, whose backward (the recompute path's gradient of lse) runs only where
they are differentiated.

**Recompute** (otherwise, or ``grad_in_forward=False``: any upstream gradient, per-row
losses of more rows, a differentiable entropy, fp16; the low-memory choice),
two custom ops:

* ``coda::lce_stats(h, W, target, bias, rstd, ...) -> (lse, zt, zsum, entropy)``: per
  row, the log-sum-exp of the logits z, the target logit z[target] (0 for ignored rows),
  the row sum of z (label smoothing only; zeros otherwise) and the entropy of softmax(z)
  (``return_entropy`` only; zeros otherwise), all fp32 (M,). One epilogue of
  the logits GEMM per vocabulary chunk (usually one chunk), chunks merged by logaddexp.
  Without autograd (no_grad, evaluation) only this op runs, whatever the path asked.
* ``coda::lce_stats_backward``: its autograd formula. Per vocabulary chunk c, the logits
  GEMM h @ W_c.T recomputes z and its epilogue writes dlogits_c = rstd * dL/ds (M x V_c,
  in h's dtype; plus the dbias / drstd reductions), then dh (+)= dlogits_c @ W_c (fp32
  accumulator across chunks) and dW[c] = dlogits_c.T @ h (ONE GEMM over all tokens,
  written once in W's dtype: no bf16 accumulation of dW, no V x H fp32 buffer). dW is
  skipped when W does not require grad, dh when h does not. 4 logits-sized GEMMs with
  the forward's; workspace independent of V.

On the recompute path ``linear_cross_entropy`` builds every loss option from the three
statistics with plain, differentiable torch ops on (M,) vectors (so autograd,
torch.compile and any upstream gradient work unchanged): nll = lse - zt, label smoothing
eps: (1 - eps) nll + eps (lse - zsum / V), z-loss: + z_loss * lse^2, ignored rows 0, then
the reduction. The gradient-in-forward op builds the same loss from the same statistics
per row chunk, and its gradients from their closed-form derivatives.

Logits: z = softcap(rstd * (h @ W.T) + bias), softcap(s) = cap * tanh(s / cap).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch.library import custom_op

from coda.fusions import _checks, ce_chunks, ce_fused
from coda.fusions._dispatch import (
    EagerOp,
    autocast_operands,
    matmul,
    register_formula,
    run_epilogue,
    uses_kernels,
)
from coda.fusions.ce_chunks import TMA_COLS, Chunk
from coda.fusions.ce_epilogues import grad_epilogue, stats_epilogue
from coda.fusions.ce_fused import lce_fused_loss, merge_entropy
from coda.fusions.ce_operands import check_operands, check_targets, local_targets

__all__ = ["lce_fused_loss", "lce_lse", "lce_stats", "lce_stats_backward", "linear_cross_entropy"]

F32 = torch.float32
Reduction = Literal["mean", "sum", "none"]


# ---- per-chunk operands ------------------------------------------------------------------


def _chunk_operands(
    c: Chunk, W: torch.Tensor, bias: torch.Tensor | None, mask: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The chunk's weight rows (a view; for the tail a zero-padded 8-row copy) and the
    tensors only some chunks bind: the bias slice (zero-padded for the tail) and, with
    ``mask``, the tail's 0/1 valid-column vector (the forward's masked epilogue)."""
    if not c.padded:
        extra = {} if bias is None else {"bias": bias[c.start : c.stop]}
        return W[c.start : c.stop], extra
    Wc = W.new_zeros((TMA_COLS, W.shape[1]))
    Wc[: c.cols] = W[c.start : c.stop]
    extra = {}
    if mask:
        extra["valid"] = torch.zeros(TMA_COLS, dtype=F32, device=W.device)
        extra["valid"][: c.cols] = 1.0
    if bias is not None:
        extra["bias"] = bias.new_zeros(TMA_COLS)
        extra["bias"][: c.cols] = bias[c.start : c.stop]
    return Wc, extra


# ---- the forward op ----------------------------------------------------------------------


def _lce_stats_impl(
    h: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    rstd: torch.Tensor | None,
    ignore_index: int,
    softcap: float | None,
    with_sum: bool,
    chunk_size: int,
    check: bool,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, zt, zsum, entropy), each fp32 (M,), of the logits z = softcap(rstd * h @ W.T
    + bias): log-sum-exp over V, z[target] (0 where target == ignore_index), sum over V
    (only with ``with_sum``; zeros otherwise) and the entropy of softmax(z), lse - E_p[z]
    (only with ``with_entropy``; zeros otherwise). Targets are range-checked on the
    reference path (the CPU, other GPUs), and on a Hopper GPU when ``check`` (a device
    sync). ``chunk_size`` 0: automatic (``ce_chunks``)."""
    check_operands(h, W, target, bias, rstd)
    M, V = h.shape[0], W.shape[0]
    if check or not uses_kernels(h):
        check_targets(target, V, ignore_index)
    if M == 0:  # no rows: no GEMM to run
        empty = h.new_zeros((0,), dtype=F32)
        return empty, empty.clone(), empty.clone(), empty.clone()
    valid = target != ignore_index
    n_partials = (4 if with_sum else 3) + (3 if with_entropy else 0)
    size = chunk_size or ce_chunks.stats_chunk_size(M, V, n_partials)
    lse = zt = zsum = None
    parts = []  # with_entropy: (lse, entropy) of each vocabulary chunk
    for c in ce_chunks.chunks(V, size):
        Wc, extra = _chunk_operands(c, W, bias, mask=True)
        epi = stats_epilogue(
            None if bias is None else bias.dtype, rstd is not None, softcap, with_sum, c.padded,
            with_entropy,
        )  # fmt: skip
        if rstd is not None:
            extra["rstd"] = rstd
        out = run_epilogue(epi, h, Wc, tloc=local_targets(target, valid, c.start, c.stop), **extra)
        if with_entropy:
            parts.append((out["lse"].clone(), out["ent"].clone()))
        if lse is None:
            # the GPU runtime returns results as views of one workspace with the partials:
            # copy the (M,) vectors out (outputs of a custom op must not alias each other,
            # and the saved lse must not keep the partials alive)
            lse, zt = out["lse"].clone(), out["zt"].clone()
            zsum = out["zsum"].clone() if with_sum else torch.zeros_like(lse)
        else:
            lse = torch.logaddexp(lse, out["lse"])
            zt = zt + out["zt"]
            if with_sum:
                zsum = zsum + out["zsum"]
    return lse, zt, zsum, merge_entropy(parts, lse)


lce_stats = custom_op("coda::lce_stats", _lce_stats_impl, mutates_args=())


@lce_stats.register_fake
def _(h, W, target, bias, rstd, ignore_index, softcap, with_sum, chunk_size, check,
      with_entropy=False):  # fmt: skip
    row = h.new_empty((h.shape[0],), dtype=F32)
    return row, torch.empty_like(row), torch.empty_like(row), torch.empty_like(row)


# ---- the backward op ---------------------------------------------------------------------


def _lce_stats_backward_impl(
    g_lse: torch.Tensor,
    g_zt: torch.Tensor,
    g_zsum: torch.Tensor,
    h: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    rstd: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    with_sum: bool,
    chunk_size: int,
    need_dh: bool,
    need_dW: bool,
    need_dbias: bool,
    need_drstd: bool,
    g_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The gradients asked for, in the order [dh, dW, dbias, drstd], of the statistics
    (lse, zt, zsum) under upstream gradients (g_lse, g_zt, g_zsum) (fp32 (M,) each) and,
    with ``g_entropy``, of the entropy under it (``entropy``: the forward's, per row)."""
    M, H = h.shape
    V = W.shape[0]
    if M == 0:  # no rows: zero gradients, no GEMM to run
        grads = [torch.zeros_like(h)] if need_dh else []
        grads += [torch.zeros_like(W)] if need_dW else []
        grads += [torch.zeros_like(bias)] if need_dbias else []
        grads += [torch.zeros_like(rstd)] if need_drstd else []
        return grads
    valid = target != ignore_index
    size = chunk_size or ce_chunks.grad_chunk_size(M, V, h.element_size())
    plan = ce_chunks.chunks(V, size)
    store = need_dh or need_dW
    dh = dh32 = dW = dbias = drstd = None
    if need_dh and len(plan) > 1:
        dh32 = torch.empty((M, H), dtype=F32, device=h.device)
    if need_dW:
        dW = torch.empty_like(W)
    if need_dbias:
        dbias = torch.empty((V,), dtype=F32, device=W.device)
    if need_drstd:
        drstd = torch.zeros((M,), dtype=F32, device=h.device)
    buf = None
    if store and uses_kernels(h):  # one dlogits buffer, reused by every chunk
        buf = torch.empty((M, max(c.gemm_cols for c in plan)), dtype=h.dtype, device=h.device)
    rows = {"lse": lse, "ga": g_lse, "gt": g_zt}
    if with_sum:
        rows["gs"] = g_zsum
    if rstd is not None:
        rows["rstd"] = rstd
    if g_entropy is not None:
        rows["ge"], rows["ent"] = g_entropy, entropy
    epi_args = (None if bias is None else bias.dtype, rstd is not None, softcap, with_sum)
    for i, c in enumerate(plan):
        Wc, extra = _chunk_operands(c, W, bias, mask=False)
        epi = grad_epilogue(
            h.dtype if store else None, *epi_args, need_dbias, need_drstd, g_entropy is not None
        )
        outputs = None if buf is None else {"dlogits": buf[:, : c.gemm_cols]}
        out = run_epilogue(
            epi, h, Wc, outputs, tloc=local_targets(target, valid, c.start, c.stop), **rows, **extra
        )
        if need_drstd:
            drstd += out["drstd"]
        if need_dbias:
            dbias[c.start : c.stop] = out["dbias"][: c.cols]
        if not store:
            continue
        dl = out["dlogits"]
        if need_dh:
            if dh32 is None:
                dh = matmul(dl, Wc.t())
            else:
                matmul(dl, Wc.t(), out=dh32, accumulate=i > 0)
        if need_dW:
            if c.padded:
                dW[c.start : c.stop] = matmul(dl.t(), h.t())[: c.cols]
            else:
                matmul(dl.t(), h.t(), out=dW[c.start : c.stop])
    if dh32 is not None:
        dh = dh32.to(h.dtype)
    grads = [dh] if need_dh else []
    grads += [dW] if need_dW else []
    grads += [dbias.to(bias.dtype)] if need_dbias else []
    grads += [drstd] if need_drstd else []
    return grads


lce_stats_backward = custom_op(
    "coda::lce_stats_backward", _lce_stats_backward_impl, mutates_args=()
)
_lce_stats_backward = EagerOp(lce_stats_backward, _lce_stats_backward_impl)


@lce_stats_backward.register_fake
def _(
    g_lse, g_zt, g_zsum, h, W, target, bias, rstd, lse, ignore_index, softcap, with_sum,
    chunk_size, need_dh, need_dW, need_dbias, need_drstd, g_entropy=None, entropy=None,
):  # fmt: skip
    grads = [torch.empty_like(h)] if need_dh else []
    grads += [torch.empty_like(W)] if need_dW else []
    grads += [torch.empty_like(bias)] if need_dbias else []
    grads += [torch.empty_like(rstd)] if need_drstd else []
    return grads


def _stats_setup(ctx, inputs, output) -> None:
    h, W, target, bias, rstd, ignore_index, softcap, with_sum, chunk_size, _, *entropy = inputs
    need = ctx.needs_input_grad
    ctx.flags = (need[0], need[1], bias is not None and need[3], rstd is not None and need[4])
    ctx.args = (ignore_index, softcap, with_sum, chunk_size)
    ctx.entropy = bool(entropy and entropy[0])
    ctx.save_for_backward(h, W, target, bias, rstd, output[0], output[3])


def _stats_backward(ctx, g_lse, g_zt, g_zsum, g_entropy):
    h, W, target, bias, rstd, lse, entropy = ctx.saved_tensors
    if not any(ctx.flags):
        return (None,) * 11
    zeros = torch.zeros_like(lse)
    g_lse = zeros if g_lse is None else g_lse.float().contiguous()
    g_zt = zeros if g_zt is None else g_zt.float().contiguous()
    g_zsum = zeros if g_zsum is None else g_zsum.float().contiguous()
    if not ctx.entropy or g_entropy is None:
        g_entropy = entropy = None
    else:  # dH/dz = -p (z - E_p[z])
        g_entropy = g_entropy.float().contiguous()
    grads = _lce_stats_backward(
        g_lse, g_zt, g_zsum, h, W, target, bias, rstd, lse, *ctx.args, *ctx.flags,
        g_entropy, entropy,
    )  # fmt: skip
    dh, dW, dbias, drstd = _by_flag(grads, ctx.flags)
    return dh, dW, None, dbias, drstd, None, None, None, None, None, None


def _by_flag(grads: list, flags: tuple[bool, ...]) -> list:
    """``lce_stats_backward``'s gradients (those asked for, in order) as [dh, dW, dbias,
    drstd], None where its flag is off."""
    it = iter(grads)
    return [next(it) if flag else None for flag in flags]


_stats_backward = register_formula("coda::lce_stats", _stats_backward, _stats_setup)
_lce_stats = EagerOp(lce_stats, _lce_stats_impl, _stats_setup, _stats_backward)


def _lce_lse_impl(
    lse: torch.Tensor,
    h: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    rstd: torch.Tensor | None,
    ignore_index: int,
    softcap: float | None,
) -> torch.Tensor:
    """The per-row log-sum-exp ``lse`` that the gradient-in-forward op computed (fp32
    (M,), no gradient there), as a differentiable function of (h, W, bias, rstd): the
    forward a copy; the backward, which runs only where the returned lse (or the z-loss
    built from it) is differentiated, the recompute path's gradient of lse under its
    upstream gradient (``lce_stats_backward``: the logits GEMM again, then the dh / dW
    GEMMs). Logged values cost nothing."""
    return lse.clone()


lce_lse = custom_op("coda::lce_lse", _lce_lse_impl, mutates_args=())


@lce_lse.register_fake
def _(lse, h, W, target, bias, rstd, ignore_index, softcap):
    return torch.empty_like(lse)


def _lse_setup(ctx, inputs, output) -> None:
    lse, h, W, target, bias, rstd, ignore_index, softcap = inputs
    need = ctx.needs_input_grad
    ctx.flags = (need[1], need[2], bias is not None and need[4], rstd is not None and need[5])
    ctx.args = (ignore_index, softcap)
    ctx.save_for_backward(h, W, target, bias, rstd, lse)


def _lse_backward(ctx, g_lse):
    if g_lse is None or not any(ctx.flags):
        return (None,) * 8
    h, W, target, bias, rstd, lse = ctx.saved_tensors
    zeros = torch.zeros_like(lse)
    grads = _lce_stats_backward(
        g_lse.float().contiguous(), zeros, zeros, h, W, target, bias, rstd, lse,
        *ctx.args, False, 0, *ctx.flags,
    )  # fmt: skip
    dh, dW, dbias, drstd = _by_flag(grads, ctx.flags)
    return None, dh, dW, None, dbias, drstd, None, None


_lse_backward = register_formula("coda::lce_lse", _lse_backward, _lse_setup)
_lce_lse = EagerOp(lce_lse, _lce_lse_impl, _lse_setup, _lse_backward)


# ---- the loss ----------------------------------------------------------------------------


def _shift(x: torch.Tensor, fill: float) -> torch.Tensor:
    """Causal-LM labels (and their per-token weights): position t predicts label t + 1;
    the last position gets ``fill`` (``ignore_index`` for labels: Hugging Face's
    ``ForCausalLMLoss``; h is used unshifted, so no copy of h). Sequences of length 0
    stay empty."""
    if x.shape[-1] == 0:
        return x
    return F.pad(x[..., 1:], (0, 1), value=fill)


def _check_tensors(h: object, W: object, target: object) -> None:
    """h (..., H), W (V, H) and target are tensors with H, V > 0 (the op's own checks
    name the rest; these would otherwise fail deep inside with an unrelated message)."""
    if isinstance(W, torch.nn.Module):
        raise TypeError(
            "linear_cross_entropy: W must be the LM head's weight tensor (V, H), not the "
            f"{type(W).__name__} module: pass W=lm_head.weight (and bias=lm_head.bias), or "
            "coda.nn.LinearCrossEntropyLoss()(hidden, lm_head, labels), which takes the module"
        )
    for name, t in (("h", h), ("W", W), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"linear_cross_entropy: {name} must be a tensor; got {type(t).__name__}"
            )
    if h.dim() < 1 or W.dim() != 2:
        raise ValueError(
            f"linear_cross_entropy: h must be (..., H) and W (V, H); got {tuple(h.shape)} "
            f"and {tuple(W.shape)}"
        )
    if W.shape[0] == 0 or W.shape[1] == 0:
        raise ValueError(
            f"linear_cross_entropy: W {tuple(W.shape)} has no classes or no features (V and H "
            f"must be positive)"
        )


def _reduce(
    rows: torch.Tensor,
    valid: torch.Tensor,
    reduction: str,
    num_items_in_batch: torch.Tensor | int | None,
    shape: torch.Size,
) -> torch.Tensor:
    if reduction == "none":
        return rows.reshape(shape)
    total = rows.sum()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    return total / valid.sum().clamp(min=1)  # all rows ignored: 0, not NaN


#: Why fp16 inputs take the recompute path with a bias that requires grad or with
#: ``ce_fused.DEFER_ONE_CHUNK`` off: the gradient-in-forward path forms fp16's gradients
#: without the loss's 1 / denom (``ce_fused.UNSCALED_DTYPES``: softmax / tokens, ~2e-9 at
#: 16k tokens and a 128k vocabulary, is under fp16's smallest subnormal, 6e-8, before a
#: GradScaler's scale arrives), and a sum over every row formed in fp16 there (dbias; dW
#: of one chunk not deferred) could overflow it.
FP16_WHY = (
    "an fp16 input with a bias that requires grad or ce_fused.DEFER_ONE_CHUNK off (dbias, "
    "or one chunk's dW, would be a sum over rows in fp16 without the 1 / denom)"
)


def _grad_in_forward(
    request: bool | None,
    reduction: str,
    entropy_grad: bool,
    inputs: tuple[torch.Tensor | None, ...],
    rows: tuple[int, int, int, int | None],
    weight_grad: bool = False,
) -> bool:
    """Whether this call runs the gradient-in-forward path (``ce_fused``): autograd will
    want gradients (grad mode on and an input requiring grad) and no differentiable
    entropy is returned (``entropy_grad``: ``return_entropy=True``; a returned lse or
    z-loss keeps this path, their gradients computed in the backward only where they are
    used, ``lce_lse``). A scalar loss (reduction "mean" / "sum") always can; per-row losses
    ("none") in ONE row chunk of all M rows (``rows`` = (M, V, bytes per element of the
    row buffer, chunk_rows)), where the backward's per-row upstream gradient scales the
    deferred GEMMs' rows (``ce_fused.per_row_problem`` says when it cannot): with
    ``request`` None where that M x V row buffer fits ``ce_chunks.GRAD_ROWS_BYTES``.
    ``weight_grad``: a scalar loss's ``row_weight`` requires grad (the weights are
    data on this path). fp16 inputs take it but with a bias that requires grad or
    ``ce_fused.DEFER_ONE_CHUNK`` off (``FP16_WHY``). ``request`` None:
    automatic; False: never; True: required (ValueError when the options forbid it; with
    nothing to differentiate it runs no gradient work either)."""
    forbidden = None
    M, V, elem_bytes, chunk_rows = rows
    bias = inputs[2]
    if inputs[0].dtype in ce_fused.UNSCALED_DTYPES and (
        not ce_fused.DEFER_ONE_CHUNK or (bias is not None and bias.requires_grad)
    ):
        forbidden = FP16_WHY
    elif entropy_grad:
        forbidden = "return_entropy=True (a differentiable entropy; 'detached' keeps the path)"
    elif weight_grad:
        forbidden = "a row_weight that requires grad (its gradient: the row losses)"
    elif reduction == "none":
        forbidden = ce_fused.per_row_problem()
        if forbidden is None and chunk_rows is not None and chunk_rows < M:
            forbidden = f"chunk_rows={chunk_rows} < {M} rows (one chunk of every row)"
        if forbidden is not None:
            forbidden = f'reduction="none" with {forbidden}'
    if request and forbidden is not None:
        raise ValueError(
            f"grad_in_forward=True needs one loss whose gradients the forward can compute: "
            f"a scalar one, or per-row losses in one row chunk; {forbidden} needs the "
            f"recompute path (grad_in_forward=None or False)"
        )
    if request is False or forbidden is not None:
        return False
    if request is None and reduction == "none":
        fits = M * ce_chunks.main_cols(V) * elem_bytes <= ce_chunks.GRAD_ROWS_BYTES
        if not fits:
            return False
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def _denominator(
    valid: torch.Tensor, reduction: str, num_items_in_batch: torch.Tensor | int | None
) -> torch.Tensor:
    """0-dim fp32 divisor of the summed row losses (as ``_reduce``): num_items_in_batch,
    1 for "sum" and "none" (the row losses themselves), the count of valid rows (at least
    1) for "mean"; no host sync."""
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            return num_items_in_batch.detach().to(device=valid.device, dtype=F32).reshape(())
        return torch.full((), num_items_in_batch, dtype=F32, device=valid.device)
    if reduction in ("sum", "none"):
        return torch.ones((), dtype=F32, device=valid.device)
    return valid.sum(dtype=F32).clamp_(min=1)


def _checked_weight(weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``row_weight`` checked against ``target``: a floating tensor of its shape, on its
    device (ValueError / TypeError before any work)."""
    if not weight.is_floating_point():
        raise TypeError(f"row_weight must be a floating tensor; got {weight.dtype}")
    if weight.shape != target.shape:
        raise ValueError(
            f"row_weight must be shaped like target {tuple(target.shape)} (one weight per "
            f"token); got {tuple(weight.shape)}"
        )
    if weight.device != target.device:
        raise ValueError(f"row_weight is on {weight.device} but target is on {target.device}")
    return weight


def _tempered(
    r: torch.Tensor | None,
    bias: torch.Tensor | None,
    cap: float | None,
    inv_t: float,
    h2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    """Row scale, bias and cap of ``logits / T`` (see ``linear_cross_entropy``): each
    times ``inv_t`` = 1 / T, the row scale made of ones when there is none."""
    if r is None:
        r = torch.full((h2.shape[0],), inv_t, dtype=torch.float32, device=h2.device)
    else:
        r = r * inv_t
    bias = None if bias is None else bias * inv_t
    return r, bias, None if cap is None else cap * inv_t


@autocast_operands("h", "W", "bias")
def linear_cross_entropy(
    h: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    rstd: torch.Tensor | None = None,
    temperature: float = 1.0,
    shift: bool = False,
    return_lse: bool = False,
    return_z_loss: bool = False,
    return_entropy: bool | Literal["detached"] = False,
    check: bool = False,
    chunk_size: int | None = None,
    grad_in_forward: bool | None = None,
    chunk_rows: int | None = None,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Cross-entropy of the logits ``softcap(rstd * (h @ W.T) + bias)`` against ``target``,
    without materializing the M x V logits.

    h: (..., H) hidden states (bf16/fp16 on the GPU; fp32 too on CPU); W: (V, H) LM head
    weight of h's dtype; target: (...) int64/int32 class indices, ``ignore_index`` rows
    contribute nothing. ``shift=True``: causal-LM labels (position t predicts target
    t + 1 along the last dim of ``target``; the last position is ignored).

    reduction: "mean" over non-ignored rows (0 when every row is ignored), "sum", or
    "none" (fp32 per-row losses shaped like ``target``, 0 for ignored rows; any upstream
    gradient). ``num_items_in_batch`` (Hugging Face gradient accumulation): the sum
    divided by it instead of the mean. label_smoothing: as ``F.cross_entropy``. z_loss:
    adds z_loss * lse^2 per non-ignored row. softcap: logits = cap * tanh(s / cap).
    bias: (V,). rstd: (...) per-row scale of the logits (a deferred final RMSNorm);
    differentiable like every other input. temperature: the loss of ``logits /
    temperature`` (sampling temperature of RL losses; label smoothing, z-loss and the
    returned lse see the tempered logits). It costs no kernel of its own: softcap(s) / T
    = (cap / T) tanh((s / T) / (cap / T)), so 1 / T scales the row scale (an fp32 vector
    of ones without rstd), the bias (in its dtype) and the cap. With softcap, the cap is
    compiled into the kernels: each distinct cap / T compiles its own.

    Returns the loss (fp32), or a tuple (loss, lse) / (loss, z_loss) / (loss, lse,
    z_loss) with ``return_lse`` (per-row log-sum-exp, shaped like ``target``) and
    ``return_z_loss`` (the z-loss term, reduced like the loss); ``return_entropy`` appends
    the per-row entropy of softmax(logits), -sum_j p_j log p_j (fp32, shaped like
    ``target``, every row, ignored ones too: RL losses mask it themselves), differentiable;
    ``return_entropy="detached"`` returns it without a gradient (``requires_grad``
    False: for logging and masks, as RL trainers use it under ``torch.no_grad``), which
    the gradient-in-forward path computes beside the loss in its statistics' epilogue.
    A differentiable entropy takes the recompute path; a returned lse or z-loss does not
    (their gradient, where they are differentiated, is the recompute path's backward of
    lse, run in the backward: 3 more logits-sized GEMMs; logged, they cost nothing).
    ``check``: range-check
    the targets on a Hopper GPU too (a device sync; always done on the reference path:
    the CPU, other GPUs).

    Two paths (docs/cross-entropy.md). ``grad_in_forward`` None (default): when autograd
    will want gradients (grad mode on, an input requiring grad) of a scalar loss
    ("mean"/"sum", no ``return_entropy=True``), the forward computes the loss
    AND the gradients over chunks of ``chunk_rows`` rows (3 logits-sized GEMMs; the
    backward only scales them: ``coda.fusions.ce_fused``); per-row losses ("none") the
    same in one chunk of every row, where the M x V row buffer fits
    ``ce_chunks.GRAD_ROWS_BYTES`` (the backward's per-row gradient scales the deferred
    dh and dW GEMMs' rows); otherwise the statistics op runs and the backward
    recomputes the logits chunk by chunk over the vocabulary (4 GEMMs with a backward).
    fp16 inputs form their gradients without the loss's 1 / denom there (a GradScaler's
    scale reaches them in the backward before they are rounded) and take the recompute
    path with a bias that requires grad (``FP16_WHY``). False: always the recompute
    path (the low-memory choice: its workspace does not grow with V x H). True: require
    gradient-in-forward (per-row losses at any size, an M x V buffer in h's dtype;
    ValueError when the options forbid it). ``chunk_size``:
    vocabulary columns per chunk of the recompute path (a multiple of 8; default: from
    ``ce_chunks.WORKSPACE_BYTES``).
    ``chunk_rows``: rows per chunk of the gradient-in-forward path (default:
    ``ce_chunks.grad_rows``, from ``ce_chunks.GRAD_ROWS_BYTES``).

    ``row_weight``: per-token weights (RL losses: advantages, masks), a float tensor
    shaped like ``target`` (shifted with it under ``shift=True``): each row's loss
    (z-loss and smoothing included) times its weight before the reduction ("mean" still
    divides by the count of non-ignored rows; ignored rows count 0 whatever their
    weight). A scalar loss with weights keeps the gradient-in-forward path (the weights
    join the per-row gradient coefficients: 3 GEMMs, row chunks, the usual workspace)
    unless the weights require grad (then the recompute path, which differentiates them).
    """
    _checks.whole_tensors(
        "linear_cross_entropy",
        "pass the LM head module instead, as coda.nn.LinearCrossEntropyLoss()(hidden, "
        "model.lm_head, labels): the loss then runs inside the head's forward, where FSDP / "
        "ZeRO-3 gather its weight and reduce its gradient across ranks",
        *(("h", h), ("W", W), ("target", target), ("bias", bias), ("rstd", rstd)),
        ("row_weight", row_weight),
    )
    _check_tensors(h, W, target)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    if num_items_in_batch is not None and reduction == "none":
        raise ValueError("num_items_in_batch divides a summed loss: use reduction 'mean'/'sum'")
    # a Python number is checked here (a tensor's value would need a device sync)
    if isinstance(num_items_in_batch, (int, float)) and not num_items_in_batch > 0:
        raise ValueError(
            f"num_items_in_batch must be positive (the count of target tokens the summed "
            f"loss is divided by); got {num_items_in_batch}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1]; got {label_smoothing}")
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a default float
    # argument arrives as a SymFloat, which math.isfinite cannot take (a graph break);
    # NaN fails the first comparison
    if softcap is not None and not (softcap > 0 and softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite float or None; got {softcap}")
    if not (z_loss >= 0 and z_loss < math.inf):
        raise ValueError(f"z_loss must be a non-negative finite float; got {z_loss}")
    if chunk_size is not None and (
        isinstance(chunk_size, (float, bool)) or chunk_size <= 0 or chunk_size % TMA_COLS
    ):
        raise ValueError(f"chunk_size must be a positive multiple of {TMA_COLS}; got {chunk_size}")
    if chunk_rows is not None and (isinstance(chunk_rows, (float, bool)) or chunk_rows <= 0):
        raise ValueError(f"chunk_rows must be a positive whole number of rows; got {chunk_rows}")
    if not (temperature > 0 and temperature < math.inf):
        raise ValueError(f"temperature must be a positive finite float; got {temperature}")
    for name, flag in (("shift", shift), ("return_lse", return_lse),
                       ("return_z_loss", return_z_loss), ("check", check)):  # fmt: skip
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False; got {flag!r}")
    if grad_in_forward is not None and not isinstance(grad_in_forward, bool):
        raise TypeError(f"grad_in_forward must be None, True or False; got {grad_in_forward!r}")
    if not (return_entropy is True or return_entropy is False or return_entropy == "detached"):
        raise ValueError(
            f"return_entropy must be True, False or 'detached'; got {return_entropy!r}"
        )
    detached_entropy = return_entropy == "detached"
    rows_at_once = (
        h.numel() // max(h.shape[-1], 1), W.shape[0],
        (ce_fused.ACC_STORE_DTYPE or h.dtype).itemsize, chunk_rows,
    )  # fmt: skip
    if row_weight is not None:
        row_weight = _checked_weight(row_weight, target)
    weighted = row_weight is not None and reduction != "none"
    fused = _grad_in_forward(
        grad_in_forward, reduction, return_entropy is True, (h, W, bias, rstd), rows_at_once,
        weighted and row_weight.requires_grad,
    )  # fmt: skip
    if shift:
        target = _shift(target, ignore_index)
        if row_weight is not None:
            row_weight = _shift(row_weight, 0.0)
    H, V = h.shape[-1], W.shape[0]
    if h.shape[:-1] != target.shape:
        raise ValueError(
            f"linear_cross_entropy: h is {tuple(h.shape)} but target is {tuple(target.shape)}; "
            f"h must be target's shape plus a hidden dimension"
        )
    shape = target.shape
    h2 = h.reshape(-1, H)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    # the kernels take W with unit inner stride (a transposed view: one copy here, the
    # gradient through it); strided vectors (bias, rstd) are copied by ``run_epilogue``
    if W.stride(-1) != 1:
        W = W.contiguous()
    t = target.reshape(-1)
    r = None
    if rstd is not None:
        if rstd.shape != shape:
            raise ValueError(
                f"rstd must be shaped like target {tuple(shape)}; got {tuple(rstd.shape)}"
            )
        r = rstd.reshape(-1).float()
    eps = float(label_smoothing)
    cap = None if softcap is None else float(softcap)
    if temperature != 1.0:
        r, bias, cap = _tempered(r, bias, cap, 1.0 / temperature, h2)
    valid = t != ignore_index
    w = None
    if row_weight is not None:
        w = torch.where(valid, row_weight.reshape(-1).float(), 0.0)
    if fused:
        denom = _denominator(valid, reduction, num_items_in_batch)
        need = (h.requires_grad, W.requires_grad, bias is not None and bias.requires_grad,
                rstd is not None and rstd.requires_grad)  # fmt: skip
        per_row = reduction == "none"
        want_lse = return_lse or return_z_loss
        out = ce_fused.fused_loss(
            h2, W, t, bias, r, denom, ignore_index, cap, eps, float(z_loss), chunk_rows or 0,
            check, *need, per_row, None if per_row else w, detached_entropy, want_lse,
        )  # fmt: skip
        loss = out[0]
        if per_row:
            loss = (loss if w is None else loss * w).reshape(shape)
        if not (want_lse or detached_entropy):
            return loss
        lse = None
        if want_lse:  # differentiable: its gradient in the backward, only where it is used
            lse = _lce_lse(out[10], h2, W, t, bias, r, ignore_index, cap)
        entropy = out[9] if detached_entropy else None
        return _with_extras(loss, lse, entropy, valid, w, shape, reduction, num_items_in_batch,
                            return_lse, return_z_loss, float(z_loss))  # fmt: skip
    lse, zt, zsum, entropy = _lce_stats(
        h2, W, t, bias, r, ignore_index, cap, eps > 0, chunk_size or 0, check,
        bool(return_entropy),
    )  # fmt: skip
    rows = lse - zt
    if eps > 0:
        rows = (1.0 - eps) * rows + eps * (lse - zsum / V)
    rows = torch.where(valid, rows, 0.0)
    if w is not None:  # each row's loss and z-loss term times its weight
        rows = rows * w
    if z_loss:
        rows = rows + _z_rows(lse, valid, w, float(z_loss))
    loss = _reduce(rows, valid, reduction, num_items_in_batch, shape)
    if return_entropy:
        entropy = entropy.detach() if detached_entropy else entropy
    else:
        entropy = None
    return _with_extras(loss, lse, entropy, valid, w, shape, reduction, num_items_in_batch,
                        return_lse, return_z_loss, float(z_loss))  # fmt: skip


def _z_rows(lse: torch.Tensor, valid: torch.Tensor, w: torch.Tensor | None, z_loss: float):
    """Each row's z-loss term z_loss * lse^2 (0 on ignored rows), times its weight."""
    zrows = torch.where(valid, z_loss * lse * lse, 0.0)
    return zrows if w is None else zrows * w


def _with_extras(
    loss, lse, entropy, valid, w, shape, reduction, num_items_in_batch, return_lse: bool,
    return_z_loss: bool, z_loss: float,
):  # fmt: skip
    """``loss``, or the tuple (loss[, lse][, z_loss][, entropy]) the options ask for: the
    per-row lse and entropy shaped like the targets, the z-loss term reduced like the loss
    (weights included)."""
    extras: list[torch.Tensor] = []
    if return_lse:
        extras.append(lse.reshape(shape))
    if return_z_loss:
        zrows = _z_rows(lse, valid, w, z_loss)
        extras.append(_reduce(zrows, valid, reduction, num_items_in_batch, shape))
    if entropy is not None:
        extras.append(entropy.reshape(shape))
    return (loss, *extras) if extras else loss
