"""coda.fusions.ce_operands: argument checks and target vectors shared by both loss paths.

Sits under ``coda.fusions.cross_entropy`` (the recompute path and ``linear_cross_entropy``)
and ``coda.fusions.ce_fused`` (the gradient-in-forward path), above ``ce_chunks`` and
``ce_epilogues``. Checks raise before anything is launched; ``check_targets`` reads the
targets (a device sync on CUDA), so the ops run it on CPU always and on CUDA on request.
"""

from __future__ import annotations

import torch

from coda.errors import InputError
from coda.fusions._dispatch import uses_kernels
from coda.fusions.ce_chunks import TMA_COLS
from coda.fusions.ce_epilogues import TARGET_DTYPE
from coda.specs import FLOAT_DTYPES, INDEX_DTYPES, dtype_name

__all__ = ["check_operands", "check_targets", "local_targets"]

F32 = torch.float32
OP = "linear_cross_entropy"


def check_operands(
    h: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    rstd: torch.Tensor | None,
) -> None:
    """h (M, H) and W (V, H) of one float dtype, target (M,) int, bias (V,), rstd fp32
    (M,); on the GPU H a multiple of 8 (TMA moves rows of 16 bytes)."""
    if h.dim() != 2 or W.dim() != 2:
        raise ValueError(
            f"{OP}: h must be (M, H) and W (V, H); got {tuple(h.shape)}, {tuple(W.shape)}"
        )
    if h.shape[1] != W.shape[1]:
        raise ValueError(
            f"{OP}: h has H={h.shape[1]} features but W is {tuple(W.shape)}; W is the LM head "
            f"weight (V, H) as stored by nn.Linear"
        )
    if h.dtype not in FLOAT_DTYPES or h.dtype != W.dtype:
        raise TypeError(
            f"{OP}: h and W must share one dtype among bfloat16, float16, float32; got "
            f"{dtype_name(h.dtype)} and {dtype_name(W.dtype)}"
        )
    if h.dtype == torch.float32 and uses_kernels(h):
        raise TypeError(
            f"{OP}: on a Hopper GPU the fused kernels take bfloat16 or float16 h and W; got "
            f"float32 (cast them, or call under torch.autocast, which casts them as it casts "
            f"F.linear's operands)"
        )
    if target.dim() != 1 or target.shape[0] != h.shape[0] or target.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{OP}: target must be an int64/int32 vector of {h.shape[0]} entries; got "
            f"{tuple(target.shape)} {dtype_name(target.dtype)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != W.shape[0]):
        raise ValueError(f"{OP}: bias must have shape ({W.shape[0]},); got {tuple(bias.shape)}")
    if bias is not None and bias.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{OP}: bias must be bfloat16, float16 or float32; got {dtype_name(bias.dtype)}"
        )
    if rstd is not None and (rstd.shape != (h.shape[0],) or rstd.dtype != F32):
        raise ValueError(f"{OP}: rstd must be fp32 ({h.shape[0]},); got {tuple(rstd.shape)}")
    if uses_kernels(h) and h.shape[1] % TMA_COLS:
        raise InputError(
            f"{OP}: H={h.shape[1]} must be a multiple of {TMA_COLS} on the GPU (TMA moves rows "
            f"of 16 bytes); pad the hidden size (zero columns of h and W do not change the loss)"
        )


def check_targets(target: torch.Tensor, V: int, ignore_index: int) -> None:
    """InputError naming the first target that is neither a class nor ignore_index (reads
    the targets: a device sync on CUDA, so run only on request there)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise InputError(
            f"{OP}: target[{row}] = {int(target[row])} is not a class index "
            f"(0 <= target < V={V}) nor ignore_index={ignore_index} (the index counts the "
            f"tokens of target.reshape(-1), after shift)"
        )


def local_targets(target: torch.Tensor, valid: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """int32 targets local to the columns [start, stop): target - start inside, -1 elsewhere
    (ignored rows included), as the epilogues' ``tloc`` input."""
    inside = valid & (target >= start) & (target < stop)
    return torch.where(inside, target - start if start else target, -1).to(TARGET_DTYPE)
