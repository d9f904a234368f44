"""coda.integrations._watch: what ``apply_coda`` read from a model, checked at every call.

Under ``coda.integrations.transformers`` (torch only). The fused stack reads the decoder
layers' weights by attribute and never calls the layers, their attention and MLP
modules, their projections or norms: a change made to those after ``apply_coda`` would
be ignored silently, so ``ModelWatch.problem()`` names it and the call runs the original
forward instead (or ``strict`` raises):

* a module replaced under the stack, a layer, its attention or its MLP (LoRA adapters
  or a quantized layer put in after patching, a new rotary embedding, another norm);
* a norm's eps changed;
* a hook on a module the fused stack does not call (forward, forward-pre or backward
  hooks, an instance-level ``forward`` such as accelerate's offloading wrapper), or a
  global module hook;
* weights (or the rotary embedding's ``inv_freq``) on the ``meta`` device (not
  materialized, or offloaded), or weights in a dtype the fused ops do not take.

Each call's check runs in C loops over references taken at ``apply_coda`` (each watched
module's children dict, each norm's ``__dict__``, each bypassed module's hook dicts and
``__dict__``), about 40 us a call for 32 layers on the CPU of this machine (it was 250 us
in plain Python loops); only a change found is then named in Python.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch
from torch import nn

__all__ = ["ModelWatch", "hooked"]

#: hook dicts of an ``nn.Module`` that a call of it would run
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
#: the weights' dtypes the fused stack runs in
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _eps_key(norm: nn.Module) -> str:
    return "variance_epsilon" if "variance_epsilon" in norm.__dict__ else "eps"


def _eps(norm: nn.Module) -> float | None:
    return norm.__dict__.get(_eps_key(norm))


def _wrapped(module: nn.Module) -> bool:
    """Whether ``module`` has an instance-level ``forward`` (accelerate's offloading
    wrapper, another library's patch)."""
    d = module.__dict__
    return "forward" in d or "_hf_hook" in d


class ModelWatch:
    """The modules and values ``apply_coda`` read from ``stack`` (its first
    ``num_layers`` layers), at ``path`` (e.g. ``"model."``) for messages."""

    def __init__(self, stack: nn.Module, path: str, num_layers: int) -> None:
        layers = list(stack.layers)[:num_layers]
        #: (name, module) whose children must stay the same modules
        owners: list[tuple[str, nn.Module]] = [(path.rstrip(".") or "the stack", stack)]
        owners.append((f"{path}layers", stack.layers))
        #: (name, module) the fused stack bypasses: their hooks would not run
        bypassed: list[tuple[str, nn.Module]] = []
        if isinstance(getattr(stack, "rotary_emb", None), nn.Module):
            bypassed.append((f"{path}rotary_emb", stack.rotary_emb))
        norms: list[tuple[str, nn.Module]] = []
        for i, layer in enumerate(layers):
            lp = f"{path}layers.{i}"
            parts = [(lp, layer), (f"{lp}.self_attn", layer.self_attn), (f"{lp}.mlp", layer.mlp)]
            owners += parts
            bypassed += parts
            for sub in ("self_attn", "mlp"):
                bypassed += [
                    (f"{lp}.{sub}.{n}", m)
                    for n, m in getattr(layer, sub).named_children()
                    if n.endswith("_proj")
                ]
            for n in ("input_layernorm", "post_attention_layernorm"):
                norms.append((f"{lp}.{n}", getattr(layer, n)))
        bypassed += norms
        norms.append((f"{path}norm", stack.norm))
        self._owners = [(name, m, tuple(m._modules.values())) for name, m in owners]
        self._bypassed = bypassed
        self._eps = [(name, m, _eps(m)) for name, m in norms]
        self._first_weight = layers[0].self_attn.q_proj if layers else None
        self._rotary = getattr(stack, "rotary_emb", None)
        # the same, flattened for a check in C loops (``problem``'s fast path): the
        # children dicts, the norms' dicts and eps keys, every hook dict (register_*_hook
        # adds to these dicts in place) and the bypassed modules' __dicts__
        self._children_dicts = [m._modules for _, m, _ in self._owners]
        self._children = [c for _, _, c in self._owners]
        self._eps_dicts = [m.__dict__ for _, m in norms]
        self._eps_keys = [_eps_key(m) for _, m in norms]
        self._eps_values = [e for _, _, e in self._eps]
        self._hook_dicts = [m.__dict__[h] for _, m in bypassed for h in _HOOKS if h in m.__dict__]
        self._dicts = [m.__dict__ for _, m in bypassed]

    def problem(self, final_norm: nn.Module | None = None) -> str | None:
        """Why a fused call would not compute what the model now does, or None.
        ``final_norm``: the stack's final norm when the call bypasses it too (the loss
        takes it over)."""
        changed = (
            list(map(tuple, map(dict.values, self._children_dicts))) != self._children
            or list(map(dict.get, self._eps_dicts, self._eps_keys)) != self._eps_values
            or any(self._hook_dicts)
            or any(map(operator.contains, self._dicts, repeat("forward")))
            or any(map(operator.contains, self._dicts, repeat("_hf_hook")))
        )
        if changed:
            return self._what_changed()
        if _global_hooks():
            return "global module hooks"
        if final_norm is not None and (hooked(final_norm) or _wrapped(final_norm)):
            return "hooks on the final norm"
        return self._weights_problem()

    def _what_changed(self) -> str:
        """The first change ``problem``'s fast check saw, named."""
        for name, module, children in self._owners:
            if tuple(module._modules.values()) != children:
                return (
                    f"a module under {name} was replaced after apply_coda (adapters or "
                    "quantized layers added since? revert and re-apply coda)"
                )
        for name, norm, eps in self._eps:
            if _eps(norm) != eps:
                return f"{name}'s eps changed after apply_coda ({eps} -> {_eps(norm)})"
        for name, module in self._bypassed:
            if _wrapped(module):
                return f"{name}'s forward is wrapped (offloading or another patch)"
            if hooked(module):
                return f"hooks on {name}"
        raise AssertionError("ModelWatch: a change seen but not found")  # pragma: no cover

    def _weights_problem(self) -> str | None:
        lin = self._first_weight
        if lin is None:
            return None
        w: Any = getattr(lin, "weight", None)
        if isinstance(w, torch.Tensor):
            if w.is_meta:
                return "weights on the meta device (not materialized, or offloaded)"
            if w.dtype not in _DTYPES:
                return f"weights in {str(w.dtype).removeprefix('torch.')}"
        freq = getattr(self._rotary, "inv_freq", None)
        if isinstance(freq, torch.Tensor) and freq.is_meta:
            return "rotary_emb.inv_freq on the meta device (not materialized)"
        return None


def hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` would run hooks of its own."""
    d = module.__dict__
    return any(d.get(h) for h in _HOOKS)


def _global_hooks() -> bool:
    """Whether any global module hook (``register_module_forward_hook`` and kin) is set."""
    m = torch.nn.modules.module
    return any(
        getattr(m, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )
