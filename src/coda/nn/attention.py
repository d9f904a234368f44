"""coda.nn.attention: ``FusedLlamaAttention``, the attention half of a Llama decoder layer.

Sits on ``coda.fusions.rope`` and ``coda.fusions.norm``. Forward: input RMSNorm + QKV +
RoPE in one fused GEMM (``qkv_rope``), causal scaled-dot-product attention (PyTorch's
``scaled_dot_product_attention``, not fused), then the output projection + residual add
+ the next norm's caches in one fused GEMM (``linear_add_rms_norm``).

Weights in PyTorch conventions: ``norm_weight`` (``input_layernorm``), ``qkv_weight``
([q_proj; k_proj; v_proj] rows, q and k rows permuted inside each head so the rotary
pairs are adjacent: ``coda.fusions.layouts.qkv_weight``), ``o_weight`` (o_proj's, as
is); buffer ``freq`` (one rotary frequency per q|k|v column pair, 0 for v). q and k are
attended in the interleaved head-dim order: q . k is unchanged by a permutation applied
to both, and v (hence the output) is not permuted.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coda.fusions import NormedStream, _checks, layouts, linear_add_normed, qkv_rope
from coda.nn import _hf
from coda.nn._autocast import autocast_dtype_over, run_cast

__all__ = ["FusedLlamaAttention"]


def _positive_int(n: Any) -> bool:
    """Whether ``n`` is a positive integer (a Python or NumPy int, not a bool)."""
    try:
        return not isinstance(n, bool) and operator.index(n) > 0
    except TypeError:
        return False


class FusedLlamaAttention(nn.Module):
    """Causal self-attention of a Llama layer on a ``NormedStream`` (caches made with
    ``norm_weight`` / ``eps``); returns the stream after the residual add, with the next
    norm's caches. Tokens are the rows of ``stream.x`` in (batch, sequence) order; the
    batch shape comes from ``position_ids`` (B, S). No padding masks: causal only."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10000.0,
        rotary_dim: int | None = None,
        inv_freq: torch.Tensor | None = None,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, n in (("hidden_size", hidden_size), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):  # fmt: skip
            if not _positive_int(n):
                raise ValueError(f"FusedLlamaAttention: {name} must be a positive int; got {n!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads}")
        if rotary_dim is not None and not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(
                f"FusedLlamaAttention: rotary_dim must be even and in (0, head_dim={head_dim}] "
                f"(RoPE rotates pairs of a head's first rotary_dim features); got {rotary_dim}"
            )
        kw = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.eps = float(eps)
        nqkv = (num_heads + 2 * num_kv_heads) * head_dim
        self.norm_weight = nn.Parameter(torch.ones(hidden_size, **kw))
        self.qkv_weight = nn.Parameter(torch.empty(nqkv, hidden_size, **kw))
        self.o_weight = nn.Parameter(torch.empty(hidden_size, num_heads * head_dim, **kw))
        for w in (self.qkv_weight, self.o_weight):
            nn.init.normal_(w, std=0.02)
        if inv_freq is None:
            inv_freq = layouts.rope_inv_freq(self.rotary_dim, rope_theta)
        self._inv_freq = inv_freq.detach().to("cpu", torch.float32)  # the exact source
        self.register_buffer("freq", self._frequencies(device), persistent=False)

    def extra_repr(self) -> str:
        dims = f"hidden_size={self.o_weight.shape[0]}, num_heads={self.num_heads}, "
        dims += f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        rotary = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        return f"{dims}{rotary}, eps={self.eps}"

    def _frequencies(self, device: torch.device | str | None) -> torch.Tensor:
        freq = layouts.rope_frequencies(
            self._inv_freq, self.num_heads, self.num_kv_heads, self.head_dim
        )
        return freq if device is None else freq.to(device)

    def _apply(self, fn: Any, recurse: bool = True) -> FusedLlamaAttention:
        # module.to(dtype) casts floating buffers: rebuild the fp32 frequencies from their
        # fp32 source on the buffer's (possibly new) device, so no precision is lost
        super()._apply(fn, recurse)
        self.freq = self._frequencies(self.freq.device)
        return self

    def forward(
        self,
        stream: NormedStream,
        position_ids: torch.Tensor,
        next_norm_weight: torch.Tensor,
        next_eps: float,
    ) -> NormedStream:
        _checks.stream("FusedLlamaAttention", stream)
        if (dtype := autocast_dtype_over(self, stream.x)) is not None:  # AMP
            return run_cast(self, dtype, stream, position_ids, next_norm_weight, next_eps)
        B, S = position_ids.shape
        q, k, v = qkv_rope(
            stream,
            self.norm_weight,
            self.qkv_weight,
            position_ids.reshape(-1),
            self.freq,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        q, k, v = (t.view(B, S, t.shape[1], self.head_dim).transpose(1, 2) for t in (q, k, v))
        # GQA inside SDPA (no repeated k / v: no copies, nothing extra saved for backward)
        gqa = self.num_heads != self.num_kv_heads
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(B * S, self.num_heads * self.head_dim)
        return linear_add_normed(o, self.o_weight, stream.x, next_norm_weight, next_eps)

    @classmethod
    def from_hf(
        cls,
        attn: Any,
        norm: Any,
        rotary_emb: Any | None = None,
        rope_theta: float | None = None,
    ) -> FusedLlamaAttention:
        """From a ``LlamaAttention``-like module (``q_proj``, ``k_proj``, ``v_proj``,
        ``o_proj``, ``head_dim``) and its ``input_layernorm``. Frequencies: from
        ``rotary_emb.inv_freq`` (a ``LlamaRotaryEmbedding``, incl. Llama-3 scaled ones),
        else from ``rope_theta``, else from ``attn.config.rope_theta``."""
        _hf.require(attn, "q_proj", "k_proj", "v_proj", "o_proj", "head_dim")
        D = int(attn.head_dim)
        wq, wk, wv = (_hf.linear_weight(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        wo = _hf.linear_weight(attn, "o_proj")
        if rotary_emb is not None:
            inv_freq = _hf.rope_inv_freq_of(rotary_emb)
        else:
            theta = rope_theta
            if theta is None:
                theta = getattr(getattr(attn, "config", None), "rope_theta", None)
            if theta is None:
                raise ValueError("pass rotary_emb or rope_theta (attn.config has no rope_theta)")
            inv_freq = layouts.rope_inv_freq(D, float(theta))
        rotary_dim = 2 * inv_freq.numel()
        out = cls(
            wq.shape[1],
            wq.shape[0] // D,
            wk.shape[0] // D,
            D,
            rotary_dim=rotary_dim,
            inv_freq=inv_freq,
            eps=_hf.norm_eps(norm),
            device=wq.device,
            dtype=wq.dtype,
        )
        with torch.no_grad():
            out.norm_weight.copy_(_hf.norm_weight(norm))
            out.qkv_weight.copy_(layouts.qkv_weight(wq, wk, wv, D, rotary_dim))
            out.o_weight.copy_(wo)
        return out
