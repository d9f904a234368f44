"""Operand layouts for tests and benchmarks: the same matrix, stored another way.

Sits in ``coda.testing``. A training step runs each ``nn.Linear`` GEMM in three operand
layouts (``coda.matmul.LAYOUTS``): forward ``X @ W.T`` (A and B K-major), dgrad
``dY @ W`` (B N-major) and wgrad ``dY.T @ X`` (A M-major, B N-major). :func:`as_major`
gives a tensor with the same values whose other dimension is contiguous, the way such
operands arrive (a transposed view of a contiguous tensor), with the leading dimension
padded to 16 bytes so ragged sizes stay legal for TMA.
"""

from __future__ import annotations

import torch

#: (A major, B major) per layout name, as in ``coda.matmul.LAYOUTS``
LAYOUTS = {"fwd": ("k", "k"), "dgrad": ("k", "n"), "wgrad": ("m", "n"), "mk": ("m", "k")}


def as_major(t: torch.Tensor, contiguous_dim: int) -> torch.Tensor:
    """``t`` (2-D) re-stored so that dimension ``contiguous_dim`` (0 or 1) has stride 1 and
    the other stride is padded to a multiple of 16 bytes; values unchanged."""
    if contiguous_dim == 1:
        rows, cols = t.shape
        pad = -(-cols * t.element_size() // 16) * 16 // t.element_size()
        buf = torch.empty(rows, pad, dtype=t.dtype, device=t.device)
        buf[:, :cols] = t
        return buf[:, :cols]
    return as_major(t.t(), 1).t()


def operands(A: torch.Tensor, B: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, K) and B (N, K) stored in ``layout`` (a key of :data:`LAYOUTS`)."""
    a_major, b_major = LAYOUTS[layout]
    return as_major(A, 1 if a_major == "k" else 0), as_major(B, 1 if b_major == "k" else 0)
