"""coda.fusions.swiglu: the SwiGLU MLP of a Llama block in two fused GEMMs, forward and
backward, as one autograd custom op.

Sits on ``coda.fusions.epilogues`` and ``coda.fusions.norm`` (the shared RMSNorm dgrad).
The op takes the residual stream with its norm caches (``NormedStream``: x, h, rstd) and
returns the next one; the weights are nn.Linear-shaped, the gate/up weight *interleaved*
(row 2i = gate i, row 2i + 1 = up i; ``coda.fusions.layouts.interleave_gate_up`` converts
the concatenated [gate; up] layout once).

Forward (2 GEMMs):

1. gate/up: acc = h @ w_gate_up.T (M, 2F); epilogue gu = rstd * acc (stored: the one
   tensor saved for backward), y = silu(g) * u (M, F).
2. down: acc = y @ w_down.T (M, H); epilogue x_out = acc + x; h_out = x_out * gamma_next;
   rstd_out (the next RMSNorm's caches).

Backward from dx_out (4 GEMMs):

1. down dgrad: acc = dx_out @ w_down = dy (M, F); epilogue (dg, du) of rstd * dy from gu
   (so rstd-scaled: SwiGLU's backward is linear in dy), rZdZ = rstd ZdZ = sum(g dg + u du)
   of those (row partials); stores them (M, 2F) and the recomputed y.
2. down wgrad: dw_down = dx_out.T @ y.
3. gate/up dgrad: acc = (rstd dgu) @ w_gate_up = rstd g (M, H); epilogue
   dx = acc * gamma - x rstd rZdZ / H + dx_out (the residual path), dgamma column sums.
4. gate/up wgrad: dw_gate_up = (rstd dgu).T @ h.

Saved for backward: x, h, rstd, gamma, w_gate_up, w_down (all inputs, no copies) and gu
(M, 2F), an extra output of the op hidden by ``swiglu_mlp``; y and the gradients of the
hidden layer are recomputed or produced in the backward epilogues.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from coda.fusions import _checks, epilogues
from coda.fusions._dispatch import EagerOp, matmul, register_formula, run_epilogue, zero_filled
from coda.fusions.norm import NormedStream, norm_dgrad

__all__ = ["rms_norm_swiglu_mlp", "rms_norm_swiglu_mlp_backward", "swiglu_mlp"]

F32 = torch.float32


def _rms_norm_swiglu_mlp_impl(
    x: torch.Tensor,
    h: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gamma_next: torch.Tensor,
    eps_next: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_out, h_out, rstd_out, gu): x_out = x + mlp(rmsnorm(x) * gamma), the next norm's
    caches, and the saved gate/up activations gu (M, 2F) (see the module doc)."""
    op = "rms_norm_swiglu_mlp"
    _checks.activation(op, "x", x)
    M, H = x.shape
    _checks.activation(op, "h", h, H)
    _checks.same_dtype(op, ("x", x), ("h", h), ("w_gate_up", w_gate_up), ("w_down", w_down))
    _checks.vector(op, "rstd", rstd, M, F32)
    _checks.vector(op, "gamma", gamma, H)
    _checks.vector(op, "gamma_next", gamma_next, H)
    if w_gate_up.shape[1] != H or w_gate_up.shape[0] % 2:
        raise ValueError(f"{op}: w_gate_up must be (2F, {H}); got {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (H, w_gate_up.shape[0] // 2):
        raise ValueError(
            f"{op}: w_down must be ({H}, {w_gate_up.shape[0] // 2}); got {tuple(w_down.shape)}"
        )
    if M == 0:  # no tokens
        return zero_filled(_fake(x, h, rstd, gamma, w_gate_up, w_down, gamma_next, eps_next))
    up = run_epilogue(epilogues.swiglu_forward(x.dtype), h, w_gate_up, rstd=rstd)
    epi = epilogues.residual_norm(x.dtype, gamma_next.dtype, eps_next)
    down = run_epilogue(epi, up["y"], w_down, residual=x, gamma=gamma_next)
    return down["x"], down["h"], down["rstd"], up["gu"]


rms_norm_swiglu_mlp = custom_op(
    "coda::rms_norm_swiglu_mlp", _rms_norm_swiglu_mlp_impl, mutates_args=()
)


@rms_norm_swiglu_mlp.register_fake
def _fake(x, h, rstd, gamma, w_gate_up, w_down, gamma_next, eps_next):
    gu = x.new_empty((x.shape[0], w_gate_up.shape[0]))
    return torch.empty_like(x), torch.empty_like(x), torch.empty_like(rstd), gu


def _rms_norm_swiglu_mlp_backward_impl(
    dx_out: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gu: torch.Tensor,
    need_norm: bool,
    need_dw_gate_up: bool,
    need_dw_down: bool,
) -> list[torch.Tensor]:
    """[dx, dgamma] if need_norm, [dw_gate_up] if need_dw_gate_up, [dw_down] if
    need_dw_down (dx includes dx_out, the residual path)."""
    if dx_out.shape[0] == 0:  # no tokens: zero weight gradients
        flags = (need_norm, need_dw_gate_up, need_dw_down)
        return zero_filled(_backward_fake(dx_out, x, h, rstd, gamma, w_gate_up, w_down, gu, *flags))
    b = run_epilogue(epilogues.swiglu_backward(x.dtype), dx_out, w_down.t(), gu=gu, rstd=rstd)
    grads = []
    if need_norm:
        grads += norm_dgrad(b["dgu"], w_gate_up, x, gamma, rstd, b["rzdz"], dres=dx_out)
    if need_dw_gate_up:
        grads.append(matmul(b["dgu"].t(), h.t()))
    if need_dw_down:
        grads.append(matmul(dx_out.t(), b["y"].t()))
    return grads


rms_norm_swiglu_mlp_backward = custom_op(
    "coda::rms_norm_swiglu_mlp_backward", _rms_norm_swiglu_mlp_backward_impl, mutates_args=()
)
_rms_norm_swiglu_mlp_backward = EagerOp(
    rms_norm_swiglu_mlp_backward, _rms_norm_swiglu_mlp_backward_impl
)


@rms_norm_swiglu_mlp_backward.register_fake
def _backward_fake(
    dx_out, x, h, rstd, gamma, w_gate_up, w_down, gu, need_norm, need_dw_gate_up, need_dw_down
):
    grads = [torch.empty_like(x), torch.empty_like(gamma)] if need_norm else []
    grads += [torch.empty_like(w_gate_up)] if need_dw_gate_up else []
    return grads + ([torch.empty_like(w_down)] if need_dw_down else [])


def _setup(ctx, inputs, output):
    x, h, rstd, gamma, w_gate_up, w_down, _, _ = inputs
    need = ctx.needs_input_grad
    ctx.flags = (need[0], need[3], need[4], need[5])
    ctx.save_for_backward(x, h, rstd, gamma, w_gate_up, w_down, output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])
    # gradients of unused outputs (the caches, gu) arrive as None, not as zero-filled
    # tensors (gu's would be an M x 2F fill per layer per step)
    ctx.set_materialize_grads(False)


def _backward(ctx, dx_out, dh_out, drstd_out, dgu):
    need_dx, need_dgamma, need_dw_gate_up, need_dw_down = ctx.flags
    need_norm = need_dx or need_dgamma
    if dx_out is None or not (need_norm or need_dw_gate_up or need_dw_down):
        return (None,) * 8
    saved = ctx.saved_tensors
    grads = iter(
        _rms_norm_swiglu_mlp_backward(
            dx_out.contiguous(), *saved, need_norm, need_dw_gate_up, need_dw_down
        )
    )
    dx, dgamma = (next(grads), next(grads)) if need_norm else (None, None)
    dw_gate_up = next(grads) if need_dw_gate_up else None
    dw_down = next(grads) if need_dw_down else None
    dx = dx if need_dx else None
    dgamma = dgamma if need_dgamma else None
    return dx, None, None, dgamma, dw_gate_up, dw_down, None, None


_backward = register_formula("coda::rms_norm_swiglu_mlp", _backward, _setup)
_rms_norm_swiglu_mlp = EagerOp(rms_norm_swiglu_mlp, _rms_norm_swiglu_mlp_impl, _setup, _backward)


def swiglu_mlp(
    stream: NormedStream,
    gamma: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gamma_next: torch.Tensor,
    eps_next: float,
) -> NormedStream:
    """The fused MLP half of a Llama block: ``x + down(silu(n @ Wg.T) * (n @ Wu.T))`` with
    n = rmsnorm(x) * gamma, from and to a ``NormedStream`` (the next norm's caches use
    ``gamma_next``/``eps_next``). ``w_gate_up`` is interleaved (``layouts``)."""
    _checks.stream("swiglu_mlp", stream)
    x, h, rstd, _ = _rms_norm_swiglu_mlp(
        stream.x, stream.h, stream.rstd, gamma, w_gate_up, w_down, gamma_next, eps_next
    )
    return NormedStream(x, h, rstd)
