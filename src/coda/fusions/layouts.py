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
