"""coda.nn._autocast: the fused modules under ``torch.autocast`` over parameters of another
dtype (AMP: fp32 master weights, bf16 or fp16 compute).

Sits under the modules of ``coda.nn`` (``FusedLlamaStack``, ``FusedLlamaDecoderLayer``,
``FusedLlamaAttention``, ``FusedLlamaMLP``). The fused ops take one dtype per GEMM and do
not cast, so a module called under autocast to bf16 / fp16 with parameters in another
dtype runs, as autocast does for ``nn.Linear``: every floating parameter cast to
autocast's dtype (differentiably: the gradients reach the parameters in their own
dtype), the floating inputs cast too (a ``NormedStream``'s x and h; its rstd stays
fp32), the body with autocast off. Its residual stream is then in autocast's dtype: the
numerics of a bf16 / fp16 model (Hugging Face's AMP forward keeps an fp32 residual
stream). The cast weights that the fused ops save for their backward are saved as
recipes and cast again when the backward needs them (``coda.nn._rebuild``, as the
Hugging Face seam's ``fuse_autocast`` does): no cast copy of the weights is held from
forward to backward, where autocast's own casts of ``nn.Linear`` weights are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from coda.fusions import NormedStream
from coda.fusions._dispatch import SIXTEEN_BIT, autocast_dtype
from coda.nn._rebuild import cast_as_recipe, rebuilt_when_saved

__all__ = ["autocast_dtype_against", "autocast_dtype_over", "run_cast"]


def autocast_dtype_against(weights: torch.dtype, x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype when an enabled ``torch.autocast`` on ``x``'s device (the CPU's or
    CUDA's) would cast weights of dtype ``weights`` (to whatever dtype it casts to), else
    None (no autocast, or weights already in its dtype)."""
    dtype = autocast_dtype(x)
    return None if dtype is None or dtype == weights else dtype


def autocast_dtype_over(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype when an enabled ``torch.autocast`` on ``x``'s device casts to
    bf16 / fp16 and ``module``'s floating parameters are in another dtype, else None (no
    autocast, another autocast dtype, or parameters already in its dtype)."""
    weights = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    dtype = None if weights is None else autocast_dtype_against(weights, x)
    return dtype if dtype in SIXTEEN_BIT else None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, NormedStream):
        return NormedStream(value.x.to(dtype), value.h.to(dtype), value.rstd)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def run_cast(module: nn.Module, dtype: torch.dtype, *args: Any) -> Any:
    """``module(*args)`` with its floating parameters and inputs cast to ``dtype`` and
    autocast off on the inputs' device (the module's own forward, called again: autocast
    is off there); the cast parameters saved for backward as recipes."""
    made: list = []
    params = {
        name: cast_as_recipe(p, dtype, made) if p.is_floating_point() and p.dtype != dtype else p
        for name, p in module.named_parameters()
    }
    inputs = tuple(_cast(a, dtype) for a in args)
    first = next(a for a in args if isinstance(a, (torch.Tensor, NormedStream)))
    device = (first.x if isinstance(first, NormedStream) else first).device.type
    with rebuilt_when_saved(made), torch.autocast(device, enabled=False):
        return functional_call(module, params, inputs)
