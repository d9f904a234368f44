"""coda.nn.loss: the LM-head cross-entropy as a module, in Hugging Face conventions.

Sits on ``coda.fusions.cross_entropy.linear_cross_entropy`` (the op: logits never
materialized, forward or backward). ``LinearCrossEntropyLoss`` holds the loss options;
its forward takes the hidden states, the LM head weight (V, H) and the labels::

    loss_fn = LinearCrossEntropyLoss(shift=True)              # causal LM, labels -100
    loss = loss_fn(hidden_states, model.lm_head.weight, labels,
                   num_items_in_batch=num_items_in_batch)     # gradient accumulation

* ``shift=True`` shifts ``labels`` (position t predicts label t + 1, the last position
  ignored), as Hugging Face's ``ForCausalLMLoss``; pass ``shift_labels`` to give already
  shifted labels instead.
* ``num_items_in_batch``: the summed loss divided by it (the count of label tokens over
  all gradient-accumulation micro-batches), the Hugging Face fix for accumulation.
* ``norm_weight`` / ``norm_eps``: the final RMSNorm deferred into the loss. ``hidden``
  is then the un-normed residual stream x; the loss computes h = x * norm_weight and
  rstd = (mean x^2 + eps)^-1/2 (cheap, O(M H), differentiable) and scales the logits
  rows by rstd inside the GEMM epilogue, so gradients reach x and the norm weight.

* ``temperature``: the loss of ``logits / temperature`` (RL losses; per-token values with
  ``reduction="none"``), at no extra kernel cost. ``row_weight`` (a forward argument):
  per-token weights known before the forward (advantages, masks), shaped like the
  labels; a weighted scalar loss keeps the 3-GEMM gradient-in-forward path.
  ``return_entropy``: the forward returns (loss, per-token softmax entropy); "detached"
  (logged, no gradient) keeps the gradient-in-forward path, True (differentiable) takes
  the recompute one.

* ``weight`` may be the LM head module itself (an ``nn.Linear``, its bias used unless
  ``bias`` is given): under FSDP2 / FSDP1 / DeepSpeed ZeRO-3, where the head's weight is a
  shard outside the head's own forward, the loss then runs AS the head's forward
  (``coda.nn._sharding.call_through``), so the framework gathers the weight for it and
  reduces dW across ranks after the backward, as it does for the head's logits.
  A sharded weight passed as a tensor is refused with a ``TypeError``.

* ``grad_in_forward`` (None: automatic; see ``linear_cross_entropy``): in training the
  forward computes the loss and its gradients (3 logits-sized GEMMs, the backward only
  scales them); False keeps the recompute path (4 GEMMs, workspace independent of the
  vocabulary: the low-memory choice). ``chunk_size`` / ``chunk_rows`` size the chunks of
  the two paths.

Only the loss is fused here: evaluation and generation need real logits and keep the
model's own LM head (fuse the loss only when training with labels).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from coda.fusions.cross_entropy import linear_cross_entropy
from coda.nn._sharding import call_through, sharded

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(nn.Module):
    """Cross-entropy of ``hidden @ weight.T`` (+ options) against labels; see the module
    doc and ``coda.fusions.cross_entropy.linear_cross_entropy`` for every option."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: Literal["mean", "sum", "none"] = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        shift: bool = False,
        check: bool = False,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        grad_in_forward: bool | None = None,
        chunk_rows: int | None = None,
        return_entropy: bool | Literal["detached"] = False,
    ) -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):  # at construction, not the first call
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.temperature = temperature
        self.shift = shift
        self.check = check
        self.chunk_size = chunk_size
        self.grad_in_forward = grad_in_forward
        self.chunk_rows = chunk_rows
        self.return_entropy = return_entropy

    def extra_repr(self) -> str:
        keys = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "shift")
        keys += ("temperature",) if self.temperature != 1.0 else ()
        keys += ("grad_in_forward",) if self.grad_in_forward is not None else ()
        keys += ("return_entropy",) if self.return_entropy else ()
        keys += ("check",) if self.check else ()
        keys += tuple(k for k in ("chunk_size", "chunk_rows") if getattr(self, k) is not None)
        return ", ".join(f"{k}={getattr(self, k)!r}" for k in keys)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor | nn.Linear,
        labels: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        norm_weight: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
        row_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The loss (fp32; per token, shaped like the labels, with reduction="none"); with
        ``return_entropy`` the tuple (loss, entropy), the fp32 per-token entropy shaped like
        the labels (every position, ignored ones too).
        ``weight``: the (V, H) LM head weight, or the head module (see the module doc).
        ``row_weight``: per-token weights shaped like the labels (RL advantages, masks;
        shifted with ``labels``, taken as they are beside ``shift_labels``), see
        ``linear_cross_entropy``."""
        if (labels is None) == (shift_labels is None):
            raise ValueError("pass exactly one of labels and shift_labels")
        target = labels if shift_labels is None else shift_labels
        options = dict(
            target=target,
            bias=bias,
            num_items_in_batch=num_items_in_batch,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            shift=self.shift and shift_labels is None,
            row_weight=row_weight,
        )
        if isinstance(weight, nn.Module):
            if not isinstance(weight, nn.Linear):
                raise TypeError(
                    f"weight must be a tensor or the LM head nn.Linear; got {type(weight).__name__}"
                )
            if sharded(weight) is not None:  # gathered by the head's own hooks
                return call_through(weight, self._head_loss, hidden, **options)
            return self._head_loss(weight, hidden, **options)
        return self._loss(hidden, weight, **options)

    def _head_loss(self, head: nn.Linear, hidden: torch.Tensor, bias=None, **options):
        return self._loss(hidden, head.weight, **options, bias=head.bias if bias is None else bias)

    def _loss(
        self, hidden, weight, *, target, bias, num_items_in_batch, norm_weight, norm_eps, shift,
        row_weight,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        rstd = None
        if norm_weight is not None:
            if norm_weight.shape != hidden.shape[-1:]:
                raise ValueError(
                    f"norm_weight must have shape ({hidden.shape[-1]},), the hidden size of "
                    f"hidden {tuple(hidden.shape)}; got {tuple(norm_weight.shape)}"
                )
            x = hidden
            rstd = torch.rsqrt(x.float().pow(2).mean(-1) + norm_eps)
            hidden = x * norm_weight.to(x.dtype)
        return linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            bias=bias,
            num_items_in_batch=num_items_in_batch,
            rstd=rstd,
            temperature=self.temperature,
            shift=shift,
            check=self.check,
            chunk_size=self.chunk_size,
            grad_in_forward=self.grad_in_forward,
            chunk_rows=self.chunk_rows,
            row_weight=row_weight,
            return_entropy=self.return_entropy,
        )
