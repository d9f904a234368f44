"""coda.nn.decoder: a Llama decoder stack over the fused ops.

Sits on ``coda.nn.attention`` and ``coda.nn.mlp``. The residual stream travels from GEMM
to GEMM as a ``NormedStream`` (x, h, rstd): each layer's attention output projection
produces the MLP norm's caches and each MLP down-projection the next layer's (the last
one the final norm's), so no RMSNorm runs as a kernel of its own except the first
layer's statistics of the embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from coda.fusions import NormedStream, _checks, normed_stream
from coda.nn import _hf
from coda.nn._autocast import autocast_dtype_over, run_cast
from coda.nn.attention import FusedLlamaAttention
from coda.nn.mlp import FusedLlamaMLP

__all__ = ["FusedLlamaDecoderLayer", "FusedLlamaStack"]


class FusedLlamaDecoderLayer(nn.Module):
    """``FusedLlamaAttention`` then ``FusedLlamaMLP``: stream in (caches of this layer's
    input norm), stream out (caches of ``next_norm_weight``)."""

    def __init__(self, attn: FusedLlamaAttention, mlp: FusedLlamaMLP) -> None:
        super().__init__()
        self.attn, self.mlp = attn, mlp

    @property
    def norm_weight(self) -> torch.Tensor:
        return self.attn.norm_weight

    @property
    def eps(self) -> float:
        return self.attn.eps

    def forward(
        self,
        stream: NormedStream,
        position_ids: torch.Tensor,
        next_norm_weight: torch.Tensor,
        next_eps: float,
    ) -> NormedStream:
        _checks.stream("FusedLlamaDecoderLayer", stream)
        if (dtype := autocast_dtype_over(self, stream.x)) is not None:  # AMP
            return run_cast(self, dtype, stream, position_ids, next_norm_weight, next_eps)
        stream = self.attn(stream, position_ids, self.mlp.norm_weight, self.mlp.eps)
        return self.mlp(stream, next_norm_weight, next_eps)

    @classmethod
    def from_hf(
        cls, layer: Any, rotary_emb: Any | None = None, rope_theta: float | None = None
    ) -> FusedLlamaDecoderLayer:
        """From a ``LlamaDecoderLayer``-like module (``self_attn``, ``mlp``,
        ``input_layernorm``, ``post_attention_layernorm``)."""
        _hf.require(layer, "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        attn = FusedLlamaAttention.from_hf(
            layer.self_attn, layer.input_layernorm, rotary_emb, rope_theta
        )
        return cls(attn, FusedLlamaMLP.from_hf(layer.mlp, layer.post_attention_layernorm))


class FusedLlamaStack(nn.Module):
    """The decoder layers and the final RMSNorm of a Llama model (embeddings and LM head
    excluded). ``forward(hidden_states (B, S, H), position_ids (B, S))`` returns the
    ``NormedStream`` of the last residual stream with the final norm's caches, what a
    fused LM head consumes; ``normed(stream)`` gives the final hidden states as
    ``LlamaModel`` returns them, (B*S, H)."""

    def __init__(
        self, layers: list[FusedLlamaDecoderLayer], norm_weight: torch.Tensor, eps: float
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm_weight = nn.Parameter(norm_weight.detach().clone())
        self.eps = float(eps)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> NormedStream:
        if (dtype := autocast_dtype_over(self, hidden_states)) is not None:  # AMP
            return run_cast(self, dtype, hidden_states, position_ids)
        n = len(self.layers)
        return self.run_layers(
            hidden_states,
            position_ids,
            lambda i: self.norm_weight if i == n else self.layers[i].norm_weight,
            lambda i, layer, *args: layer(*args),
        )

    def run_layers(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        norm_weight: Callable[[int], torch.Tensor],
        call: Callable[..., NormedStream],
    ) -> NormedStream:
        """The stack's forward with layer i's input-norm weight from ``norm_weight(i)``
        (``norm_weight(len(layers))``: the final norm's) and layer i run as ``call(i,
        layer, stream, position_ids, next_norm_weight, next_eps)``: how a caller supplies
        each layer's parameters just before it runs (``coda.integrations.transformers``
        assembles a layer's weights while the GPU runs the layer before)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        stream = normed_stream(x, norm_weight(0), self.layers[0].eps)
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            eps = self.eps if last else self.layers[i + 1].eps
            stream = call(i, layer, stream, position_ids, norm_weight(i + 1), eps)
        return stream

    @staticmethod
    def normed(stream: NormedStream) -> torch.Tensor:
        """rmsnorm(x) * gamma = rstd * h, in h's dtype (not differentiable: a cache)."""
        return (stream.h.float() * stream.rstd[:, None]).to(stream.h.dtype)

    @classmethod
    def from_hf(cls, model: Any) -> FusedLlamaStack:
        """From a ``LlamaModel``-like module (``layers``, ``norm``, ``rotary_emb``)."""
        _hf.require(model, "layers", "norm", "rotary_emb")
        layers = [FusedLlamaDecoderLayer.from_hf(ly, model.rotary_emb) for ly in model.layers]
        return cls(layers, _hf.norm_weight(model.norm), _hf.norm_eps(model.norm))
