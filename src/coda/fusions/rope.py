"""coda.fusions.rope: RMSNorm + QKV projection + rotary embedding in one fused GEMM, forward
and backward, as one autograd custom op.

Sits on ``coda.fusions.epilogues``, ``coda.fusions.norm`` (the shared RMSNorm dgrad) and
``coda.fusions.layouts`` (weights and frequencies). The weight ``w_qkv`` is
[w_q; w_k; w_v] (Nq + 2 Nkv, H) with the q and k rows permuted inside each head so that
every rotary pair is adjacent (``layouts.qkv_weight``); ``freq`` holds one frequency per
column pair of the output, the heads' ``inv_freq`` for q and k and 0 for v
(``layouts.rope_frequencies``); ``positions`` one fp32 position per token (any position
ids: packed sequences, offsets). GQA is just the head counts in those two layouts.

Forward (1 GEMM): acc = h @ w_qkv.T; epilogue z = rstd * acc, y = rotate(z) by
pos * freq over adjacent pairs: (a, b) -> (a c - b s, b c + a s), c, s = cos, sin(angle);
the angle the exact product of the fp32 position and frequency (``ops.rope``; Hugging
Face rounds it to fp32, off by up to |pos freq| 2^-24 radians).

Backward from dqkv (2 GEMMs + 1 pass):

1. one pass (``run_map``): dzs = rotate^-1(rstd * dy) and rZdZ = <y, rstd * dy>
   (= rstd <z, dz>, the rotation being orthogonal). It cannot ride on a GEMM: the inverse
   rotation must come before the dgrad GEMM that consumes dz, and dy comes from
   attention's backward.
2. dgrad: acc = dzs @ w_qkv = rstd g; epilogue dx = acc * gamma - x rstd rZdZ / H and the
   dgamma column sums.
3. wgrad: dw_qkv = dzs.T @ h.

Saved: x, h, rstd, gamma, w_qkv, positions, freq (inputs) and the output qkv (which
attention keeps alive anyway: q, k, v are views of it).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from coda.fusions import _checks, epilogues
from coda.fusions._dispatch import (
    EagerOp,
    matmul,
    register_formula,
    run_epilogue,
    run_map,
    zero_filled,
)
from coda.fusions.norm import NormedStream, norm_dgrad

__all__ = ["qkv_rope", "rms_norm_qkv_rope", "rms_norm_qkv_rope_backward"]

F32 = torch.float32


def _rms_norm_qkv_rope_impl(
    x: torch.Tensor,
    h: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    w_qkv: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
) -> torch.Tensor:
    """qkv (M, Nq + 2 Nkv) = rotate(rmsnorm(x) * gamma @ w_qkv.T) (see the module doc)."""
    op = "rms_norm_qkv_rope"
    _checks.activation(op, "x", x)
    M, H = x.shape
    _checks.activation(op, "h", h, H)
    _checks.same_dtype(op, ("x", x), ("h", h), ("w_qkv", w_qkv))
    _checks.vector(op, "rstd", rstd, M, F32)
    _checks.vector(op, "gamma", gamma, H)
    _checks.vector(op, "positions", positions, M, F32)
    if w_qkv.dim() != 2 or w_qkv.shape[1] != H or w_qkv.shape[0] % 2:
        raise ValueError(f"{op}: w_qkv must be (even N, {H}); got {tuple(w_qkv.shape)}")
    _checks.vector(op, "freq", freq, w_qkv.shape[0] // 2, F32)
    if M == 0:  # no tokens
        return zero_filled(_fake(x, h, rstd, gamma, w_qkv, positions, freq))
    epi = epilogues.rope_forward(x.dtype)
    return run_epilogue(epi, h, w_qkv, rstd=rstd, pos=positions, freq=freq)["y"]


rms_norm_qkv_rope = custom_op("coda::rms_norm_qkv_rope", _rms_norm_qkv_rope_impl, mutates_args=())


@rms_norm_qkv_rope.register_fake
def _fake(x, h, rstd, gamma, w_qkv, positions, freq):
    return x.new_empty((x.shape[0], w_qkv.shape[0]))


def _rms_norm_qkv_rope_backward_impl(
    dqkv: torch.Tensor,
    qkv: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    w_qkv: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
    need_norm: bool,
    need_dw: bool,
) -> list[torch.Tensor]:
    """[dx, dgamma] if need_norm, then [dw_qkv] if need_dw."""
    if dqkv.shape[0] == 0:  # no tokens: zero weight gradients
        args = (dqkv, qkv, x, h, rstd, gamma, w_qkv, positions, freq, need_norm, need_dw)
        return zero_filled(_backward_fake(*args))
    epi = epilogues.rope_backward(x.dtype)
    s = run_map(epi, *dqkv.shape, dqkv, dy=dqkv, y=qkv, rstd=rstd, pos=positions, freq=freq)
    grads = []
    if need_norm:
        grads += norm_dgrad(s["dzs"], w_qkv, x, gamma, rstd, s["rzdz"])
    if need_dw:
        grads.append(matmul(s["dzs"].t(), h.t()))
    return grads


rms_norm_qkv_rope_backward = custom_op(
    "coda::rms_norm_qkv_rope_backward", _rms_norm_qkv_rope_backward_impl, mutates_args=()
)
_rms_norm_qkv_rope_backward = EagerOp(rms_norm_qkv_rope_backward, _rms_norm_qkv_rope_backward_impl)


@rms_norm_qkv_rope_backward.register_fake
def _backward_fake(dqkv, qkv, x, h, rstd, gamma, w_qkv, positions, freq, need_norm, need_dw):
    grads = [torch.empty_like(x), torch.empty_like(gamma)] if need_norm else []
    return grads + ([torch.empty_like(w_qkv)] if need_dw else [])


def _setup(ctx, inputs, output):
    x, h, rstd, gamma, w_qkv, positions, freq = inputs
    need = ctx.needs_input_grad
    ctx.flags = (need[0], need[3], need[4])
    ctx.save_for_backward(output, x, h, rstd, gamma, w_qkv, positions, freq)


def _backward(ctx, dqkv):
    need_dx, need_dgamma, need_dw = ctx.flags
    need_norm = need_dx or need_dgamma
    if not (need_norm or need_dw):
        return (None,) * 7
    saved = ctx.saved_tensors
    grads = iter(_rms_norm_qkv_rope_backward(dqkv.contiguous(), *saved, need_norm, need_dw))
    dx, dgamma = (next(grads), next(grads)) if need_norm else (None, None)
    dw = next(grads) if need_dw else None
    dx = dx if need_dx else None
    dgamma = dgamma if need_dgamma else None
    return dx, None, None, dgamma, dw, None, None


_backward = register_formula("coda::rms_norm_qkv_rope", _backward, _setup)
_rms_norm_qkv_rope = EagerOp(rms_norm_qkv_rope, _rms_norm_qkv_rope_impl, _setup, _backward)


def qkv_rope(
    stream: NormedStream,
    gamma: torch.Tensor,
    w_qkv: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) of shapes (M, heads, head_dim), views of the fused op's output: q and k
    rotated, in the interleaved head-dim order (``layouts.to_rotate_half`` gives HF's).
    ``positions``: (M,) position ids (any integer or float dtype; converted to fp32)."""
    _checks.stream("qkv_rope", stream)
    _checks.tensor("qkv_rope", "w_qkv", w_qkv)
    _checks.tensor("qkv_rope", "positions", positions)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if min(num_heads, num_kv_heads, head_dim) <= 0 or w_qkv.shape[0] != width:
        raise ValueError(
            f"qkv_rope: w_qkv has {w_qkv.shape[0]} rows, but num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads} and head_dim={head_dim} make "
            f"(num_heads + 2 num_kv_heads) head_dim = {width} (q, k, v stacked)"
        )
    qkv = _rms_norm_qkv_rope(stream.x, stream.h, stream.rstd, gamma, w_qkv, positions.to(F32), freq)
    nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((nq, nkv, nkv), dim=1)
    M = qkv.shape[0]
    return (
        q.view(M, num_heads, head_dim),
        k.view(M, num_kv_heads, head_dim),
        v.view(M, num_kv_heads, head_dim),
    )
