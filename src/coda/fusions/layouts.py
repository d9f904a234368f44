"""coda.fusions.layouts: one-time weight layout conversions and RoPE frequency vectors.

Sits beside the fusion ops (pure torch, no kernels): the fused epilogues act on *adjacent*
column pairs of a GEMM output, so the weights whose output columns pair up are permuted
once, when a model is converted, never per step.

* SwiGLU: the usual concatenated gate/up weight ``[gate; up]`` (2F, H) becomes the
  interleaved one, row 2i = gate row i, row 2i + 1 = up row i (``interleave_gate_up``), so
  the gate/up GEMM's columns (2i, 2i + 1) are (g_i, u_i).
* RoPE, Llama / Hugging Face convention ("rotate half"): inside each head of dim D the
  pairs are (i, i + D/2), i < D/2, rotated by pos * inv_freq[i]. Permuting the q and k
  rows of the projection inside each head to [0, D/2, 1, D/2 + 1, ...]
  (``rotate_half_permutation``) makes every pair adjacent: (2i, 2i + 1). q and k then come
  out of the fused op in this *interleaved* head-dim order. Attention is unchanged by it
  (q . k sums over the head dims, and q and k are permuted alike; v is never permuted);
  ``to_rotate_half`` gives back the Hugging Face order (e.g. for a KV cache shared with
  HF code). With ``rotary_dim < D`` (partial rotary) only the first ``rotary_dim`` dims
  pair up; the rest keep their place and get frequency 0 (no rotation).
* ``rope_frequencies``: one frequency per column pair of the whole q|k|v output: the
  head's ``inv_freq`` for q and k heads, 0 for v and for non-rotary dims (rotation by
  angle 0 is the identity), so "which columns rotate" is data, not kernel structure.
"""

from __future__ import annotations

import torch

__all__ = [
    "assemble_gate_up",
    "assemble_qkv",
    "deinterleave_gate_up",
    "from_rotate_half",
    "interleave_gate_up",
    "qkv_weight",
    "rope_frequencies",
    "rope_inv_freq",
    "rotate_half_permutation",
    "split_qkv_weight",
    "to_rotate_half",
]


def interleave_gate_up(w_gate_up: torch.Tensor) -> torch.Tensor:
    """[gate; up] (2F, ...) -> interleaved (2F, ...): row 2i = gate i, row 2i+1 = up i."""
    gate, up = w_gate_up.chunk(2, dim=0)
    return torch.stack((gate, up), dim=1).reshape(w_gate_up.shape).contiguous()


def deinterleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """The inverse of ``interleave_gate_up``: interleaved (2F, ...) -> [gate; up]."""
    return torch.cat((w[0::2], w[1::2]), dim=0).contiguous()


def rotate_half_permutation(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Indices p (head_dim,) with new[j] = old[p[j]] inside one head: the rotate-half pairs
    (i, i + rotary_dim/2) become adjacent (2i, 2i + 1); dims >= rotary_dim stay put."""
    rd = head_dim if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 < rd <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}]; got {rd}")
    half = torch.arange(rd // 2)
    pairs = torch.stack((half, half + rd // 2), dim=1).reshape(-1)
    return torch.cat((pairs, torch.arange(rd, head_dim)))


def _permute_heads(t: torch.Tensor, perm: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply ``perm`` inside every head along ``dim`` (a multiple of len(perm))."""
    d = perm.numel()
    dim = dim % t.dim()
    shape = t.shape
    heads = t.reshape(*shape[:dim], shape[dim] // d, d, *shape[dim + 1 :])
    return heads.index_select(dim + 1, perm.to(t.device)).reshape(shape)


def to_rotate_half(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """q or k from the fused op (interleaved pairs per head, last dim = heads * head_dim or
    head_dim) -> the Hugging Face rotate-half order."""
    perm = rotate_half_permutation(head_dim, rotary_dim)
    return _permute_heads(t, torch.argsort(perm), -1)


def from_rotate_half(
    t: torch.Tensor, head_dim: int, rotary_dim: int | None = None, dim: int = -1
) -> torch.Tensor:
    """Hugging Face rotate-half order -> interleaved pairs, along ``dim`` (e.g. dim=0 for
    the rows of a q_proj / k_proj weight)."""
    return _permute_heads(t, rotate_half_permutation(head_dim, rotary_dim), dim)


def qkv_weight(
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    head_dim: int,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """The fused op's (Nq + 2 Nkv, H) weight from nn.Linear-shaped q/k/v weights in the
    Hugging Face layout: q and k rows permuted per head (pairs adjacent), v as is."""
    w_q = from_rotate_half(w_q, head_dim, rotary_dim, dim=0)
    w_k = from_rotate_half(w_k, head_dim, rotary_dim, dim=0)
    return torch.cat((w_q, w_k, w_v), dim=0).contiguous()


def split_qkv_weight(
    w_qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``qkv_weight``: (w_q, w_k, w_v) in the Hugging Face layout."""
    nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
    w_q, w_k, w_v = w_qkv.split((nq, nkv, nkv), dim=0)
    perm = torch.argsort(rotate_half_permutation(head_dim, rotary_dim))
    return _permute_heads(w_q, perm, 0), _permute_heads(w_k, perm, 0), w_v.clone()


# ---- per-step assembly (differentiable, copies only) ----------------------------------------
# ``coda.integrations.transformers`` runs the fused stack on a Hugging Face model's own
# parameters, so the fused layouts are assembled from them every step. These two autograd
# functions do it with plain row copies (no index kernels): rows are moved as 8-byte words
# where the row size allows (bf16 rows of 4k elements: 4x fewer, fully vectorized copies),
# and their backward writes each source weight's gradient contiguously in one copy (no
# index_add, no strided gradient for AccumulateGrad to copy again). They save nothing.


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous rows) viewed as 8-byte words along its last dim when its rows
    allow it, else ``t``; the copies below move the same bytes either way."""
    row = t.shape[-1] * t.element_size()
    if t.is_contiguous() and row % 8 == 0 and t.data_ptr() % 8 == 0 and t.element_size() < 8:
        return t.view(torch.int64)
    return t


def _interleave_heads(dst: torch.Tensor, src: torch.Tensor, head_dim: int) -> None:
    """dst (heads * D, W) <- src with the rotate-half pairs adjacent inside each head:
    dst row 2i + p of a head = src row p * D/2 + i (``rotate_half_permutation``, full
    rotary)."""
    heads, half, width = src.shape[0] // head_dim, head_dim // 2, src.shape[-1]
    dst.view(heads, half, 2, width).copy_(src.view(heads, 2, half, width).transpose(1, 2))


def _deinterleave_heads(src: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of ``_interleave_heads`` into a new contiguous tensor."""
    heads, half, width = src.shape[0] // head_dim, head_dim // 2, src.shape[-1]
    out = src.new_empty(src.shape)
    out.view(heads, 2, half, width).copy_(src.view(heads, half, 2, width).transpose(1, 2))
    return out


def _same_words(*ts: torch.Tensor) -> bool:
    return all(_words(t).dtype == torch.int64 for t in ts)


class _AssembleQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_q, w_k, w_v, head_dim: int):  # type: ignore[override]
        nq, nkv = w_q.shape[0], w_k.shape[0]
        ctx.sizes, ctx.head_dim = (nq, nkv), head_dim
        out = w_q.new_empty((nq + 2 * nkv, w_q.shape[1]))
        words = _same_words(out, w_q, w_k, w_v)
        o = out.view(torch.int64) if words else out
        q, k, v = ((w.view(torch.int64) if words else w) for w in (w_q, w_k, w_v))
        _interleave_heads(o[:nq], q, head_dim)
        _interleave_heads(o[nq : nq + nkv], k, head_dim)
        o[nq + nkv :].copy_(v)
        return out

    @staticmethod
    def backward(ctx, d):  # type: ignore[override]
        (nq, nkv), D = ctx.sizes, ctx.head_dim
        d = d.contiguous()
        words = _same_words(d)
        w = d.view(torch.int64) if words else d
        back = (lambda t: t.view(d.dtype)) if words else (lambda t: t)
        need = ctx.needs_input_grad
        dq = back(_deinterleave_heads(w[:nq], D)) if need[0] else None
        dk = back(_deinterleave_heads(w[nq : nq + nkv], D)) if need[1] else None
        dv = d[nq + nkv :] if need[2] else None
        return dq, dk, dv, None


class _AssembleGateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        out = gate.new_empty((2 * gate.shape[0], gate.shape[1]))
        words = _same_words(out, gate, up)
        o = (out.view(torch.int64) if words else out).view(gate.shape[0], 2, -1)
        o[:, 0].copy_(gate.view(torch.int64) if words else gate)
        o[:, 1].copy_(up.view(torch.int64) if words else up)
        return out

    @staticmethod
    def backward(ctx, d):  # type: ignore[override]
        d = d.contiguous()
        words = _same_words(d)
        w = (d.view(torch.int64) if words else d).view(d.shape[0] // 2, 2, -1)
        grads = []
        for i, need in enumerate(ctx.needs_input_grad):
            g = w[:, i].contiguous() if need else None
            grads.append(g.view(d.dtype) if (g is not None and words) else g)
        return tuple(grads)


def assemble_qkv(w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, head_dim: int):
    """``qkv_weight(w_q, w_k, w_v, head_dim)`` (full rotary), differentiable, by row copies:
    what a per-step assembly from a Hugging Face model's parameters should call."""
    if w_q.shape[0] % head_dim or w_k.shape[0] % head_dim or head_dim % 2:
        raise ValueError(f"q/k rows must be whole heads of an even head_dim={head_dim}")
    w_q, w_k, w_v = (w.contiguous() for w in (w_q, w_k, w_v))
    return _AssembleQKV.apply(w_q, w_k, w_v, head_dim)


def assemble_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``interleave_gate_up(cat(gate, up))``, differentiable, by row copies."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gate and up must be equal 2-D shapes; got {gate.shape}, {up.shape}")
    return _AssembleGateUp.apply(gate.contiguous(), up.contiguous())


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Llama's default inverse frequencies (rotary_dim/2,) fp32, computed as Hugging Face
    does: 1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponent)


def rope_frequencies(
    inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """One fp32 frequency per column pair of the q|k|v output ((Nq + 2 Nkv) / 2,):
    ``inv_freq`` (rotary_dim/2,) per q and k head (then zeros for non-rotary dims), zeros
    for v."""
    inv_freq = inv_freq.detach().float().reshape(-1)
    half = head_dim // 2
    if inv_freq.numel() > half:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries; a head has {half} pairs")
    head = torch.zeros(half, dtype=torch.float32, device=inv_freq.device)
    head[: inv_freq.numel()] = inv_freq
    rotated = head.repeat(num_heads + num_kv_heads)
    return torch.cat((rotated, torch.zeros_like(head).repeat(num_kv_heads))).contiguous()
