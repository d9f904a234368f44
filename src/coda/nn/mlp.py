"""coda.nn.mlp: ``FusedLlamaMLP``, the MLP half of a Llama decoder layer as one fused op.

Sits on ``coda.fusions.swiglu``. Holds the weights in PyTorch conventions: the RMSNorm
weight (``post_attention_layernorm``), the gate/up weight as ONE interleaved (2F, H)
nn.Linear-shaped parameter (row 2i = gate_proj row i, row 2i + 1 = up_proj row i,
converted once by ``from_hf``; ``gate_proj_weight`` / ``up_proj_weight`` give the HF
layout back) and the down-projection weight (H, F).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from coda.fusions import NormedStream, _checks, layouts, swiglu_mlp
from coda.nn import _hf
from coda.nn._autocast import autocast_dtype_over, run_cast

__all__ = ["FusedLlamaMLP"]


class FusedLlamaMLP(nn.Module):
    """``x + down(silu(n @ Wg.T) * (n @ Wu.T))`` with n = rmsnorm(x) * norm_weight, on a
    ``NormedStream`` whose caches were made with ``norm_weight`` / ``eps``; returns the
    stream with the next norm's caches (``next_norm_weight``, ``next_eps``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        eps: float = 1e-6,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.eps = float(eps)
        self.norm_weight = nn.Parameter(torch.ones(hidden_size, **kw))
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **kw))
        self.down_weight = nn.Parameter(torch.empty(hidden_size, intermediate_size, **kw))
        for w in (self.gate_up_weight, self.down_weight):
            nn.init.normal_(w, std=0.02)

    def extra_repr(self) -> str:
        hidden, inner = self.down_weight.shape
        return f"hidden_size={hidden}, intermediate_size={inner}, eps={self.eps}"

    def forward(
        self, stream: NormedStream, next_norm_weight: torch.Tensor, next_eps: float
    ) -> NormedStream:
        _checks.stream("FusedLlamaMLP", stream)
        if (dtype := autocast_dtype_over(self, stream.x)) is not None:  # AMP
            return run_cast(self, dtype, stream, next_norm_weight, next_eps)
        return swiglu_mlp(
            stream,
            self.norm_weight,
            self.gate_up_weight,
            self.down_weight,
            next_norm_weight,
            next_eps,
        )

    @property
    def gate_proj_weight(self) -> torch.Tensor:
        """gate_proj's (F, H) weight (a strided view of the interleaved parameter)."""
        return self.gate_up_weight[0::2]

    @property
    def up_proj_weight(self) -> torch.Tensor:
        """up_proj's (F, H) weight (a strided view of the interleaved parameter)."""
        return self.gate_up_weight[1::2]

    @classmethod
    def from_hf(cls, mlp: Any, norm: Any) -> FusedLlamaMLP:
        """From a ``LlamaMLP``-like module (``gate_proj``, ``up_proj``, ``down_proj``,
        SiLU ``act_fn``) and its ``LlamaRMSNorm``-like ``post_attention_layernorm``.
        Weights are copied (same dtype and device); the originals are left as they are."""
        _hf.require(mlp, "gate_proj", "up_proj", "down_proj")
        _hf.silu_act(mlp)
        gate, up = _hf.linear_weight(mlp, "gate_proj"), _hf.linear_weight(mlp, "up_proj")
        down = _hf.linear_weight(mlp, "down_proj")
        out = cls(
            gate.shape[1], gate.shape[0], _hf.norm_eps(norm), device=gate.device, dtype=gate.dtype
        )
        with torch.no_grad():
            out.norm_weight.copy_(_hf.norm_weight(norm))
            out.gate_up_weight.copy_(layouts.interleave_gate_up(torch.cat((gate, up))))
            out.down_weight.copy_(down)
        return out
