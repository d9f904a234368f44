"""coda.primitives._blocks: turning what a user function returns into an fp32 block."""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["as_block"]


def as_block(result: Any, shape: tuple[int, ...], device: torch.device, who: str) -> torch.Tensor:
    """``result`` (a tensor broadcastable to ``shape``, or a Python number) as a contiguous
    fp32 tensor of exactly ``shape``; TypeError/ValueError naming ``who`` otherwise."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        return torch.full(shape, float(result), dtype=torch.float32, device=device)
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{who} returned {type(result).__name__}; expected a torch.Tensor")
    try:
        ok = torch.broadcast_shapes(tuple(result.shape), shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{who} returned shape {tuple(result.shape)}, which does not broadcast to the "
            f"value's shape {shape}"
        )
    return result.to(torch.float32).expand(shape).contiguous()
