"""coda.fusions: Transformer fusions built only from ``Epilogue`` + primitives + the GEMM.

Sits above ``coda.runtime`` and below ``coda.nn`` (nothing in coda below imports it).
Every op is a ``torch.library`` custom op (namespace ``coda``) with a fake implementation
and an autograd formula, so ``torch.compile(fullgraph=True)`` keeps it whole (plain
eager calls skip the dispatcher: ``_dispatch.EagerOp``); on a Hopper
GPU it runs the fused kernels, on any other device (the CPU, other GPUs) the same
epilogues' ``reference`` there (see ``_dispatch``).

* ``NormedStream`` (x, h, rstd): the residual stream with its deferred RMSNorm caches.
* ``norm``: ``rms_norm_stats`` / ``normed_stream`` (caches of a given stream),
  ``linear_add_rms_norm`` / ``linear_add_normed`` (a GEMM that adds into the stream and
  produces the next norm's caches), ``rms_norm_linear`` (a normed linear layer).
* ``swiglu``: ``rms_norm_swiglu_mlp`` / ``swiglu_mlp``: norm + gate/up + SwiGLU + down +
  residual + next norm.
* ``rope``: ``rms_norm_qkv_rope`` / ``qkv_rope``: norm + QKV + rotary embedding.
* ``cross_entropy``: ``linear_cross_entropy``, the LM head + cross-entropy loss (forward
  and backward) without materializing the logits (docs/cross-entropy.md).
* ``layouts``: the one-time weight conversions (interleaved gate/up, rotate-half pairs
  made adjacent) and RoPE frequency vectors.
* ``epilogues``: the epilogues themselves.

See docs/fusions.md for the dataflow of a Llama block and the algebra.
"""

from coda.fusions import epilogues, layouts
from coda.fusions.cross_entropy import linear_cross_entropy
from coda.fusions.norm import (
    NormedStream,
    linear_add_normed,
    linear_add_rms_norm,
    normed_stream,
    rms_norm_linear,
    rms_norm_stats,
)
from coda.fusions.rope import qkv_rope, rms_norm_qkv_rope
from coda.fusions.swiglu import rms_norm_swiglu_mlp, swiglu_mlp

__all__ = [
    "NormedStream",
    "epilogues",
    "layouts",
    "linear_add_normed",
    "linear_add_rms_norm",
    "linear_cross_entropy",
    "normed_stream",
    "qkv_rope",
    "rms_norm_linear",
    "rms_norm_qkv_rope",
    "rms_norm_stats",
    "rms_norm_swiglu_mlp",
    "swiglu_mlp",
]
