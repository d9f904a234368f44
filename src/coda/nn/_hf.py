"""coda.nn._hf: reading Llama-style modules by attribute name (Hugging Face or look-alikes).

Sits under the ``from_hf`` constructors of ``coda.nn``. ``transformers`` is never imported:
any module with the attribute names of ``LlamaRMSNorm`` (``weight``, ``variance_epsilon``;
``torch.nn.RMSNorm``'s ``eps`` also works), ``LlamaMLP`` (``gate_proj``, ``up_proj``,
``down_proj``, ``act_fn``), ``LlamaAttention`` (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``head_dim``) and ``LlamaRotaryEmbedding`` (``inv_freq``,
``attention_scaling``) converts. What the fused ops cannot express raises ``ValueError``
naming the attribute (biases, another activation, scaled rotary outputs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["linear_weight", "norm_eps", "norm_weight", "require", "rope_inv_freq_of", "silu_act"]


def require(module: Any, *names: str) -> None:
    """Raise ``ValueError`` naming the attributes ``module`` lacks."""
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise ValueError(
            f"{type(module).__name__} has no attribute(s) {', '.join(missing)}: expected a "
            f"Llama-style module with {', '.join(names)}"
        )


def linear_weight(module: Any, name: str) -> torch.Tensor:
    """The (out, in) weight of the bias-free nn.Linear ``module.<name>``."""
    lin = getattr(module, name)
    if getattr(lin, "bias", None) is not None:
        raise ValueError(f"{type(module).__name__}.{name} has a bias; coda's fused ops have none")
    return lin.weight.detach()


def norm_weight(norm: Any) -> torch.Tensor:
    require(norm, "weight")
    return norm.weight.detach()


def norm_eps(norm: Any) -> float:
    """``variance_epsilon`` (Hugging Face) or ``eps`` (torch.nn.RMSNorm; None means the
    machine epsilon of the weight's dtype, as torch does)."""
    if hasattr(norm, "variance_epsilon"):
        return float(norm.variance_epsilon)
    if hasattr(norm, "eps"):
        eps = norm.eps
        return float(torch.finfo(norm.weight.dtype).eps if eps is None else eps)
    raise ValueError(f"{type(norm).__name__} has neither variance_epsilon nor eps")


def silu_act(mlp: Any) -> None:
    """Check that an MLP's activation (``act_fn``, if present) is SiLU: ``nn.SiLU``,
    ``F.silu``, or transformers' ``SiLUActivation`` (its ``ACT2FN["silu"]`` since 5.x)."""
    act = getattr(mlp, "act_fn", None)
    if act is None or isinstance(act, nn.SiLU) or act is F.silu:
        return
    if type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers"):
        return
    raise ValueError(f"{type(mlp).__name__}.act_fn is {act!r}; the fused MLP is SwiGLU (SiLU)")


def rope_inv_freq_of(rotary: Any) -> torch.Tensor:
    """``inv_freq`` of a rotary-embedding module; its ``attention_scaling`` must be 1."""
    require(rotary, "inv_freq")
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if scaling != 1.0:
        raise ValueError(
            f"{type(rotary).__name__}.attention_scaling is {scaling}; scaled cos/sin are not "
            "supported by the fused RoPE yet"
        )
    return rotary.inv_freq.detach().float()
