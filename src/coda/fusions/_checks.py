"""coda.fusions._checks: argument checks shared by the fusion ops (clear errors up front).

The ops run on bf16/fp16/fp32 tensors (fp32 inside every epilogue, on both paths);
GEMM operands share one dtype; every activation is 2-D (tokens, features); every tensor
is a whole local one (not a shard of FSDP2 / DTensor, FSDP1 or DeepSpeed ZeRO-3).
"""

from __future__ import annotations

import torch

from coda.specs import FLOAT_DTYPES, dtype_name

try:  # torch.distributed is optional in some PyTorch builds
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    _DTensor = None

__all__ = [
    "activation",
    "epsilon",
    "same_dtype",
    "shard_kind",
    "stream",
    "tensor",
    "vector",
    "weight",
    "whole_tensors",
]


def shard_kind(t: torch.Tensor) -> str | None:
    """What kind of shard ``t`` is (a ``DTensor``: FSDP2 or tensor parallelism; a DeepSpeed
    ZeRO-3 parameter not gathered now; an FSDP1 flat parameter), or None for a whole local
    tensor (a ZeRO-3 parameter inside its module's forward, where DeepSpeed gathered it,
    included: ZeRO-3 reduces gradients in hooks on the parameter itself)."""
    if _DTensor is not None and isinstance(t, _DTensor):
        return "a DTensor (FSDP2 fully_shard or tensor parallelism)"
    if getattr(t, "ds_id", None) is not None:
        status = getattr(getattr(t, "ds_status", None), "name", None)
        if status != "AVAILABLE":
            return "a DeepSpeed ZeRO-3 partitioned parameter (not gathered)"
    if getattr(t, "_is_flat_param", False):
        return "an FSDP1 flat parameter"
    return None


def whole_tensors(op: str, hint: str, *named: tuple[str, torch.Tensor | None]) -> None:
    """Every given tensor of ``named`` is a whole local tensor, not a shard: the kernels
    read whole operands, and a gradient computed from a gathered copy outside the sharding
    framework's hooks would never be reduced across ranks. ``hint``: what to do instead."""
    for name, t in named:
        if t is not None and (kind := shard_kind(t)) is not None:
            raise TypeError(f"{op}: {name} is {kind}, not a whole local tensor; {hint}")


def tensor(op: str, name: str, t: object) -> None:
    """``t`` is a ``torch.Tensor`` (a list or an array is not converted)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")


def activation(op: str, name: str, t: torch.Tensor, cols: int | None = None) -> None:
    """``t`` is a 2-D bf16/fp16/fp32 (tokens, features) tensor (with ``cols`` features)."""
    tensor(op, name, t)
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D (tokens, features); got {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} must be bfloat16, float16 or float32 (epilogues compute in fp32 and "
            f"store in these); got {dtype_name(t.dtype)}"
        )
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{op}: {name} must have {cols} columns; got {tuple(t.shape)}")


def same_dtype(op: str, *named: tuple[str, torch.Tensor]) -> None:
    """All of ``named`` share the first one's dtype (GEMM operands, stored streams)."""
    for name, t in named:
        tensor(op, name, t)
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: {name} is {dtype_name(t.dtype)} but {first_name} is "
                f"{dtype_name(first.dtype)}; they must match"
            )


def vector(op: str, name: str, t: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> None:
    """``t`` is a 1-D tensor of ``n`` entries (of ``dtype`` when given)."""
    tensor(op, name, t)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{op}: {name} must have shape ({n},); got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {dtype_name(dtype)}; got {dtype_name(t.dtype)}")
    if dtype is None and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be bfloat16, float16 or float32; got {t.dtype}")


def epsilon(op: str, eps: float) -> None:
    """An RMSNorm's ``eps`` is a non-negative finite float (comparisons, not
    ``math.isfinite``: under ``torch.compile(dynamic=True)`` it may be a SymFloat; NaN
    fails the first)."""
    if not (eps >= 0 and eps < float("inf")):
        raise ValueError(f"{op}: eps must be a non-negative finite float; got {eps}")


def weight(op: str, name: str, w: torch.Tensor, in_features: int) -> None:
    """``w`` is a 2-D (out_features, in_features) weight, nn.Linear's layout."""
    tensor(op, name, w)
    if w.dim() != 2 or w.shape[1] != in_features:
        raise ValueError(
            f"{op}: {name} must be an (out_features, {in_features}) weight (nn.Linear's "
            f"layout); got {tuple(w.shape)}"
        )


def stream(op: str, s: object) -> None:
    """``s`` is a ``coda.fusions.NormedStream`` (x with its norm's caches h and rstd)."""
    if not all(hasattr(s, f) for f in ("x", "h", "rstd")):
        raise TypeError(
            f"{op}: stream must be a coda.fusions.NormedStream (x with its RMSNorm caches: "
            f"normed_stream(x, gamma, eps) makes one); got {type(s).__name__}"
        )
