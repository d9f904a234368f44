"""coda.nn: nn.Modules over ``coda.fusions`` for Llama-style models.

Sits above ``coda.fusions`` (and below integrations). Modules hold weights in PyTorch
conventions (nn.Linear-shaped (out, in) weights, RMSNorm weights) and convert from
Hugging Face Llama modules (or any module with their attribute names) with ``from_hf``;
``transformers`` is not a dependency.

* ``FusedLlamaAttention``: input norm + QKV + RoPE (one fused GEMM), causal SDPA, output
  projection + residual + next norm caches (one fused GEMM).
* ``FusedLlamaMLP``: post-attention norm + gate/up + SwiGLU (one fused GEMM), down
  projection + residual + next norm caches (one fused GEMM).
* ``FusedLlamaDecoderLayer``, ``FusedLlamaStack``: layers and the whole decoder stack.
* ``LinearCrossEntropyLoss``: the LM head + cross-entropy, logits never materialized.
"""

from coda.nn.attention import FusedLlamaAttention
from coda.nn.decoder import FusedLlamaDecoderLayer, FusedLlamaStack
from coda.nn.loss import LinearCrossEntropyLoss
from coda.nn.mlp import FusedLlamaMLP

__all__ = [
    "FusedLlamaAttention",
    "FusedLlamaDecoderLayer",
    "FusedLlamaMLP",
    "FusedLlamaStack",
    "LinearCrossEntropyLoss",
]
