"""coda.integrations.transformers: run a Hugging Face Llama model on coda with one call.

The top layer of coda (above ``coda.nn``; nothing imports it). ``transformers`` is not a
dependency: this module reads the model's modules by attribute name and imports
``transformers`` only to build its output classes when a patched forward runs.

``apply_coda(model)`` patches *instances* (never classes, never a copy of a Hugging Face
``forward`` body) at two stable seams:

* the decoder stack (``LlamaModel``, i.e. ``model.model``): its ``forward`` runs the
  embeddings, then ``coda.nn.FusedLlamaStack`` (the deferred-RMSNorm stream from GEMM to
  GEMM, causal SDPA, GQA), then the model's own final norm module, whenever the call is a
  plain one (no KV cache, no padding mask, see ``fusable``); any other call (generation
  with a cache, padding masks, ``output_hidden_states``...) runs the original forward.
* the causal LM (``LlamaForCausalLM``, i.e. ``model``): in training mode with ``labels``
  (or ``shift_labels``), the loss is ``coda.nn.LinearCrossEntropyLoss`` over the stack's
  residual stream with the final norm deferred into the loss (Hugging Face's shifted
  labels, -100 ignored, ``num_items_in_batch``); the logits are never materialized and
  ``logits`` is ``None``. When the call cannot run the fused stack (padding, gradient
  checkpointing, sharded layers...), the stack's original forward runs and the loss over
  its normed output is still fused. In eval mode, or without labels, the original forward
  runs and returns real logits (``generate()`` keeps working; USERS.md item 4). On a GPU
  that is not a Hopper both seams run the original forward (``NOT_HOPPER``).

Sharded weights (FSDP2 ``fully_shard``, DeepSpeed ZeRO-3; USERS.md item 3): the fused
stack reads the layers' weights by attribute and never calls the layers, so it runs only
where they are whole tensors gathered by no hook of their own (FSDP2 with the layers
inside the root unit); FSDP units at the layers make the stack fall back ("sharded
weights (...)"). The loss passes the ``lm_head`` module to ``LinearCrossEntropyLoss``,
which runs the loss inside the head's own call when the head is sharded, so the framework
gathers its weight and reduces dW.

Weights are the model's own parameters, shared, never copied: the fused modules are a
template on the ``meta`` device, called with ``torch.func.functional_call`` on tensors
read from the Hugging Face modules at every forward. The fused layouts (q/k rows permuted
so the rotary pairs are adjacent, gate/up interleaved) are assembled from ``q_proj`` /
``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj`` per forward by row copies
(``layouts.assemble_qkv`` / ``assemble_gate_up``; their backward writes each parameter's
gradient in one copy). The fused ops save them for backward only as a recipe, re-assembled
in backward (``coda.nn._rebuild``), so no weight-sized tensor per layer is held
from forward to backward. ``state_dict``, optimizers and checkpoints
see exactly the parameters they saw before.

``apply_coda`` returns a ``CodaPatch``: what was replaced, call counters (fused vs.
original, with the reason of every fallback) and ``revert()``, which restores the
instances' original ``forward``. It raises ``NothingMatchedError`` when the model has no
Llama-style decoder stack and ``UnsupportedModelError``, naming the config field or module
attribute, when the model computes something the fused ops do not (biases, another
activation, attention dropout, RoPE variants with runtime or scaled cos/sin, LoRA or
quantized projections, a custom loss function). PEFT models are unwrapped with
``get_base_model()``. Families: ``llama`` and ``mistral`` (Mistral's sliding window is
honoured by falling back to the original forward for sequences longer than the window).

Mixed precision (AMP: fp32 master weights under ``torch.autocast``): by default the stack's
original forward runs there (the loss stays fused); ``apply_coda(model,
fuse_autocast=True)`` runs the fused stack in autocast's dtype instead, each weight cast
per forward (and re-cast in backward from its recipe), its residual stream in that dtype:
a bf16 / fp16 model's numerics (docs/integrations.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from coda.fusions import layouts
from coda.fusions.cast_layouts import cast_gate_up
from coda.integrations._watch import ModelWatch, hooked
from coda.nn import (
    FusedLlamaAttention,
    FusedLlamaDecoderLayer,
    FusedLlamaMLP,
    FusedLlamaStack,
    LinearCrossEntropyLoss,
    _hf,
)
from coda.nn._autocast import autocast_dtype_against
from coda.nn._rebuild import cast, cast_as_recipe, rebuilt_when_saved
from coda.nn._sharding import shard_kind, sharded, unit, unwrapped_type
from coda.runtime.checks import kernels_run_on
from coda.specs import dtype_name

__all__ = [
    "SUPPORTED_FAMILIES",
    "SUPPORTED_ROPE_TYPES",
    "CodaPatch",
    "NothingMatchedError",
    "Replacement",
    "UnsupportedModelError",
    "apply_coda",
    "revert_coda",
    "rope_config",
]

#: ``config.model_type`` values whose decoder computes exactly what the fused stack does
SUPPORTED_FAMILIES = ("llama", "mistral")
#: RoPE types whose ``inv_freq`` is static and whose cos/sin are unscaled
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_FAMILY_NOTES = {
    "qwen2": "Qwen2Attention's q_proj/k_proj/v_proj always carry a bias (not a config field)",
    "qwen3": "Qwen3 normalizes q and k per head (q_norm, k_norm)",
    "gemma": "Gemma's RMSNorm scales by (1 + weight) and its MLP is GeGLU",
    "gemma2": "Gemma 2 softcaps attention and logits and has extra norms",
    "phi3": "Phi-3 fuses qkv_proj and gate_up_proj in its own layouts",
}

# arguments of the Llama forwards that the fused paths read or may ignore; any other
# argument given a value (flash-attention varlen kwargs, cache_position...) falls back
_KNOWN_ARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "past_key_values",
        "inputs_embeds",
        "use_cache",
        "labels",
        "shift_labels",
        "logits_to_keep",
        "return_dict",
        "num_items_in_batch",
        "output_attentions",
        "output_hidden_states",
    }
)


#: the projections the fused stack reads, by module name
_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


class UnsupportedModelError(ValueError):
    """The model computes something coda's fused ops do not; the message names every
    offending config field or module attribute."""


class NothingMatchedError(ValueError):
    """``apply_coda`` found no Llama-style decoder stack to patch."""


@dataclass(frozen=True)
class Replacement:
    """One patched seam: ``path`` of the module in the (unwrapped) model ('' = the model
    itself), its class, and what its ``forward`` now runs."""

    path: str
    module: str
    runs: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({self.module}).forward: {self.runs}"


def rope_config(rope_type: str, rope_theta: float, **params: Any) -> dict[str, Any]:
    """Config keyword arguments for a RoPE variant in the installed transformers'
    spelling: ``rope_parameters`` since 5.0, ``rope_scaling`` + ``rope_theta`` before,
    e.g. ``LlamaConfig(..., **rope_config("llama3", 5e5, factor=8.0, ...))``."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": rope_type, "rope_theta": rope_theta, **params}}
    return {"rope_scaling": {"rope_type": rope_type, **params}, "rope_theta": rope_theta}


def _rope_type(config: Any, rotary: Any) -> tuple[str, str]:
    """(the RoPE type the model runs, the config field that sets it). The rotary module's
    ``rope_type`` is authoritative (what the installed transformers read); the field is
    ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (4.x)."""
    kind = getattr(rotary, "rope_type", None)
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        if isinstance(params, Mapping):
            declared = params.get("rope_type", params.get("type"))
            if kind is None or declared == kind:
                return str(declared if declared is not None else "default"), field
    return str(kind if kind is not None else "default"), "rope_scaling"


def _config_problems(config: Any, rotary: Any) -> list[str]:
    problems = []
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        note = _FAMILY_NOTES.get(family)
        problems.append(
            f"config.model_type={family!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)})" + (f": {note}" if note else "")
        )
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            problems.append(f"config.{field}=True: the fused GEMMs add no bias")
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"config.hidden_act={act!r}: the fused MLP is SwiGLU (SiLU)")
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout:
        problems.append(f"config.attention_dropout={dropout}: the fused attention has none")
    kind, field = _rope_type(config, rotary)
    if kind not in SUPPORTED_ROPE_TYPES:
        problems.append(
            f"config.{field}['rope_type']={kind!r}: the fused RoPE implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (static frequencies, unscaled cos/sin)"
        )
    return problems


def _linear_problem(owner: Any, name: str, path: str) -> str | None:
    lin = getattr(owner, name, None)
    if lin is None:
        return f"{path}.{name} is missing"
    if unwrapped_type(lin) is not nn.Linear:
        return (
            f"{path}.{name} is a {type(lin).__module__}.{type(lin).__qualname__}, not a plain "
            "nn.Linear (LoRA adapters or quantized layers on the projections the fused ops "
            "read are not supported: merge the adapters first)"
        )
    if lin.bias is not None:
        return f"{path}.{name}.bias is set: the fused GEMMs add no bias"
    return None


@dataclass
class _Geometry:
    """What the fused template needs beyond the weights (read once, at apply time)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rotary_dim: int
    #: fp32, CPU: exactly what the model's rotary module holds; None until read (a model
    #: built on the meta device has none yet: read at its first fused call)
    inv_freq: torch.Tensor | None
    layer_eps: list[tuple[float, float]]
    final_eps: float
    rotary: Any = None

    def frequencies(self) -> torch.Tensor:
        """``inv_freq``, read from the rotary module the first time it is needed."""
        if self.inv_freq is None:
            self.inv_freq = self.rotary.inv_freq.detach().to("cpu", torch.float32).reshape(-1)
        return self.inv_freq


def _stack_problems(stack: Any, path: str, num_layers: int) -> tuple[list[str], _Geometry | None]:
    problems: list[str] = []
    layers = list(stack.layers)[:num_layers]
    if not layers:
        return [f"{path}layers is empty"], None
    rotary = getattr(stack, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        problems.append(f"{path}rotary_emb (a module with inv_freq) is missing")
    elif float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        problems.append(
            f"{path}rotary_emb.attention_scaling={float(rotary.attention_scaling)}: scaled "
            "cos/sin are not supported by the fused RoPE"
        )
    geometry, layer_eps = None, []
    for i, layer in enumerate(layers):
        lp = f"{path}layers.{i}"
        missing = [
            n
            for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
            if not hasattr(layer, n)
        ]
        if missing:
            problems.append(f"{lp} has no {', '.join(missing)}")
            continue
        attn, mlp = layer.self_attn, layer.mlp
        for owner, names, sub in ((attn, _ATTN_PROJ, "self_attn"), (mlp, _MLP_PROJ, "mlp")):
            problems += [p for n in names if (p := _linear_problem(owner, n, f"{lp}.{sub}"))]
        try:
            _hf.silu_act(mlp)
        except ValueError as e:
            problems.append(f"{lp}.mlp.act_fn: {e}")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if not (hasattr(getattr(layer, norm), "weight") and _has_eps(getattr(layer, norm))):
                problems.append(f"{lp}.{norm} is not an RMSNorm with weight and eps")
        if problems or not hasattr(attn, "head_dim"):
            if not hasattr(attn, "head_dim"):
                problems.append(f"{lp}.self_attn.head_dim is missing")
            continue
        D = int(attn.head_dim)
        dims = (
            attn.q_proj.in_features,
            attn.q_proj.out_features // D,
            attn.k_proj.out_features // D,
            D,
            mlp.gate_proj.out_features,
        )
        if geometry is None:
            geometry = dims
        elif dims != geometry:
            problems.append(
                f"{lp} has (hidden, heads, kv_heads, head_dim, intermediate)={dims}, "
                f"not {geometry} as layer 0"
            )
        layer_eps.append(
            (_hf.norm_eps(layer.input_layernorm), _hf.norm_eps(layer.post_attention_layernorm))
        )
    norm = getattr(stack, "norm", None)
    if norm is None or not hasattr(norm, "weight") or not _has_eps(norm):
        problems.append(f"{path}norm is not an RMSNorm with weight and eps")
    if problems or geometry is None:
        return problems, None
    H, heads, kv_heads, D, F = geometry
    if 2 * rotary.inv_freq.numel() != D:
        problems.append(
            f"{path}rotary_emb.inv_freq has {rotary.inv_freq.numel()} entries for head_dim "
            f"{D}: partial rotary (partial_rotary_factor) is not what Llama's attention applies"
        )
        return problems, None
    geo = _Geometry(H, heads, kv_heads, D, F, D, None, layer_eps, _hf.norm_eps(norm), rotary)
    if not rotary.inv_freq.is_meta:
        geo.frequencies()  # read now: what the model holds at apply_coda
    return problems, geo


def _has_eps(norm: Any) -> bool:
    return hasattr(norm, "variance_epsilon") or hasattr(norm, "eps")


def _template(geo: _Geometry, dtype: torch.dtype) -> FusedLlamaStack:
    """The fused stack with every parameter on ``meta`` (no memory): its forward runs
    through ``functional_call`` on the Hugging Face model's tensors."""
    kw = dict(device="meta", dtype=dtype)
    layers = []
    for eps_attn, eps_mlp in geo.layer_eps:
        attn = FusedLlamaAttention(
            geo.hidden,
            geo.heads,
            geo.kv_heads,
            geo.head_dim,
            rotary_dim=geo.rotary_dim,
            inv_freq=geo.frequencies(),
            eps=eps_attn,
            **kw,
        )
        mlp = FusedLlamaMLP(geo.hidden, geo.intermediate, eps_mlp, **kw)
        layers.append(FusedLlamaDecoderLayer(attn, mlp))
    return FusedLlamaStack(layers, torch.empty(geo.hidden, **kw), geo.final_eps)


def _is_stack(module: Any) -> bool:
    return isinstance(module, nn.Module) and all(
        hasattr(module, n) for n in ("embed_tokens", "layers", "norm")
    )


def _arguments(fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by name (``**kwargs`` flattened), bound to ``fn``'s signature;
    None when they do not bind (the original forward then raises its own error)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    out: dict[str, Any] = {}
    params = inspect.signature(fn).parameters
    for name, value in bound.arguments.items():
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif params[name].kind is inspect.Parameter.VAR_POSITIONAL:
            if value:  # arguments without names: nothing to read them by
                return None
        else:
            out[name] = value
    return out


class CodaPatch:
    """The result of ``apply_coda``: what was replaced (``replaced``), counters of the
    patched forwards (``calls``: ``fused_stack``, ``fused_loss``, ``original``) and the
    reason of every fallback to the original forward (``fallbacks``), and ``revert()``."""

    def __init__(
        self,
        model: nn.Module,
        stack: nn.Module,
        stack_path: str,
        causal_lm: nn.Module | None,
        geometry: _Geometry,
        *,
        fuse_loss: bool,
        strict: bool,
        fuse_autocast: bool = False,
    ) -> None:
        self.model = model
        self.family = str(getattr(getattr(model, "config", None), "model_type", None))
        self.fuse_loss = fuse_loss
        self.strict = strict
        self.fuse_autocast = fuse_autocast
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.active = False
        self._stack_path = stack_path
        self._geometry = geometry
        self._watch = ModelWatch(stack, stack_path, len(geometry.layer_eps))
        self._freq: dict[torch.device, torch.Tensor] = {}
        #: the fused stack's template per dtype it runs in (the weights' own; autocast's)
        self._templates: dict[torch.dtype, FusedLlamaStack] = {}
        self._loss = LinearCrossEntropyLoss(shift=True)
        self._patched: list[tuple[nn.Module, Any, Callable[..., Any]]] = []
        replaced = [
            Replacement(
                stack_path.rstrip("."),
                type(stack).__name__,
                f"coda.nn.FusedLlamaStack over {len(geometry.layer_eps)} layer(s) for plain "
                "calls (no KV cache or padding mask); the original forward otherwise",
            )
        ]
        if causal_lm is not None:
            replaced.append(
                Replacement(
                    "",
                    type(causal_lm).__name__,
                    "in training with labels: the fused stack (or, where a call cannot run "
                    "it, the stack's original forward) + coda.nn.LinearCrossEntropyLoss "
                    "(logits never materialized, returned as None); the original forward "
                    "(real logits) otherwise",
                )
            )
        self.replaced: tuple[Replacement, ...] = tuple(replaced)
        self._install(stack, _stack_forward)
        if causal_lm is not None:
            self._install(causal_lm, _causal_lm_forward)
        self.active = True

    # ---- patching -------------------------------------------------------------------
    def _install(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        previous = module.__dict__.get("forward")  # an instance-level forward, if any
        original = previous if previous is not None else type(module).forward.__get__(module)
        fn = _with_signature_of(fn, original)
        module.__dict__["forward"] = types.MethodType(fn, module)
        module.__dict__["_coda_patch"] = self
        self._patched.append((module, previous, fn))

    def original(self, module: nn.Module) -> Callable[..., Any]:
        """``module``'s forward as it was before ``apply_coda``."""
        for mod, previous, _ in self._patched:
            if mod is module:
                return previous if previous is not None else type(module).forward.__get__(module)
        raise KeyError(f"{type(module).__name__} is not patched by this CodaPatch")

    def revert(self) -> None:
        """Restore every patched instance's original ``forward`` (the model then runs
        exactly as before ``apply_coda``). Raises if already reverted, or if something
        replaced a patched ``forward`` after ``apply_coda``."""
        if not self.active:
            raise RuntimeError("this CodaPatch was already reverted")
        for module, _, fn in self._patched:
            current = module.__dict__.get("forward")
            if getattr(current, "__func__", None) is not fn:
                raise RuntimeError(
                    f"{type(module).__name__}.forward was replaced after apply_coda; "
                    "revert that patch first"
                )
        for module, previous, _ in reversed(self._patched):
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous
            del module.__dict__["_coda_patch"]
        self.active = False

    def __str__(self) -> str:
        lines = [f"coda patch of a {type(self.model).__name__} ({self.family}):"]
        lines += [f"  {r}" for r in self.replaced]
        return "\n".join(lines)

    __repr__ = __str__

    # ---- the fused paths ------------------------------------------------------------
    def fusable(
        self, stack: nn.Module, args: Mapping[str, Any], training: bool, inside_stack: bool = True
    ) -> str | None:
        """None when the call can run the fused stack, else the reason it cannot.
        ``inside_stack``: asked from within the stack's own ``__call__`` (its seam), where
        a sharding framework's hooks on the stack module have already run."""
        if args.get("past_key_values") is not None:
            return "past_key_values"
        config = getattr(stack, "config", None)
        use_cache = args.get("use_cache")
        if use_cache is None:
            use_cache = getattr(config, "use_cache", False)
        if use_cache and not training:
            return "use_cache"
        for flag in ("output_attentions", "output_hidden_states"):
            value = args.get(flag)
            if value if value is not None else getattr(config, flag, False):
                return flag
        for name, value in args.items():
            if name not in _KNOWN_ARGS and value is not None:
                return f"argument {name}"
        if training and any(  # the stack's flag or a layer's (every_n_layers sets them per layer)
            getattr(m, "gradient_checkpointing", False) for m in (stack, *stack.layers)
        ):
            return "gradient_checkpointing"
        ids, embeds = args.get("input_ids"), args.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            return "input_ids/inputs_embeds"  # the original raises its own error
        if (why := _device_problem(args)) is not None:
            return why
        x = ids if embeds is None else embeds
        if (why := _autocast_problem(stack, x, self.fuse_autocast)) is not None:
            return why
        seq = x.shape[1]
        window = getattr(config, "sliding_window", None)
        if window is not None and seq > int(window):
            return "sliding_window"
        mask = args.get("attention_mask")
        if mask is not None and not (
            isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())
        ):
            return "attention_mask"
        positions = args.get("position_ids")
        if mask is None and positions is not None and positions.shape[-1] > 1:
            # without a mask, transformers (>= 5) reads position ids that do not step by 1
            # as packed sequences and attends block-diagonally; the fused attention is
            # causal over the whole row
            if not bool((positions.diff(dim=-1) == 1).all()):
                return "position_ids (packed sequences)"
        if (why := self._sharding_problem(stack, inside_stack)) is not None:
            return why
        if inside_stack:
            return self._watch.problem()
        # from the causal LM's seam the stack's own call and its final norm are bypassed too
        if hooked(stack):
            return f"hooks on {self._stack_path.rstrip('.') or 'the stack'}"
        return self._watch.problem(final_norm=stack.norm)

    def _sharding_problem(self, stack: nn.Module, inside_stack: bool) -> str | None:
        """Why the fused stack cannot read the layers' weights now, or None. It reads them
        by attribute and never calls the layers, so no hook of a sharding framework runs
        for them: they must be whole local tensors (not DTensor / ZeRO-3 shards) and no
        module below the stack may be an FSDP unit (its hooks would neither gather its
        weights nor reduce their gradients). From the causal LM's seam the stack itself
        must not be a unit either. Nothing to check without torch.distributed."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        path = self._stack_path
        if not inside_stack and (why := unit(stack)) is not None:
            return f"sharded weights ({path.rstrip('.') or '<model>'} is {why})"
        for i, layer in enumerate(list(stack.layers)[: len(self._geometry.layer_eps)]):
            attn, mlp = layer.self_attn, layer.mlp
            modules = (
                ("", layer),
                (".self_attn", attn),
                (".mlp", mlp),
                (".input_layernorm", layer.input_layernorm),
                (".post_attention_layernorm", layer.post_attention_layernorm),
            )
            modules += tuple((f".self_attn.{n}", getattr(attn, n)) for n in _ATTN_PROJ)
            modules += tuple((f".mlp.{n}", getattr(mlp, n)) for n in _MLP_PROJ)
            for name, module in modules:
                if (why := unit(module)) is not None:
                    return f"sharded weights ({path}layers.{i}{name} is {why})"
            if (kind := shard_kind(attn.q_proj.weight)) is not None:
                return f"sharded weights ({path}layers.{i}.self_attn.q_proj.weight is {kind})"
        if (kind := shard_kind(stack.norm.weight)) is not None:
            return f"sharded weights ({path}norm.weight is {kind})"
        return None

    def _fallback(self, reason: str, training: bool) -> None:
        self.calls["original"] += 1
        self.fallbacks[reason] += 1
        if self.strict and training:
            hint = (
                "; apply_coda(..., fuse_autocast=True) runs the fused stack in autocast's "
                "dtype instead"
                if reason.startswith("autocast to") and not self.fuse_autocast
                else ""
            )
            raise RuntimeError(
                f"coda: a training forward fell back to the original forward ({reason}); "
                f"apply_coda(..., strict=False) allows it{hint}"
            )

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        freq = self._freq.get(device)
        if freq is None:
            g = self._geometry
            freq = layouts.rope_frequencies(g.frequencies(), g.heads, g.kv_heads, g.head_dim)
            freq = self._freq[device] = freq.to(device)
        return freq

    def fused_parameters(
        self, stack: nn.Module, device: torch.device, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """The template's parameters and buffers, read from ``stack``'s modules: the
        model's own tensors, and the fused q|k|v and gate/up layouts assembled from them
        (differentiable, so gradients reach the model's parameters); with ``dtype``, every
        weight cast to it (differentiably: the gradients arrive in the weights' dtype)."""
        return _StackTensors(stack, self._geometry, self._frequencies(device), dtype).all()

    def _template_for(self, dtype: torch.dtype) -> FusedLlamaStack:
        template = self._templates.get(dtype)
        if template is None:
            template = self._templates[dtype] = _template(self._geometry, dtype)
        return template

    def run_stack(self, stack: nn.Module, args: Mapping[str, Any]) -> torch.Tensor:
        """Embeddings + the fused decoder layers: the last residual stream (B, S, H),
        before the final norm."""
        embeds = args.get("inputs_embeds")
        if embeds is None:
            embeds = stack.embed_tokens(args["input_ids"])
        B, S, H = embeds.shape
        positions = args.get("position_ids")
        if positions is None:
            positions = torch.arange(S, device=embeds.device)[None]
        positions = positions.expand(B, S)
        # under torch.autocast over weights of another dtype (``fuse_autocast``: fusable
        # let it through): the whole stack in autocast's dtype, its weights cast per step
        dtype = _autocast_over(stack, embeds)
        tensors = _StackTensors(stack, self._geometry, self._frequencies(embeds.device), dtype)
        if dtype is not None:
            embeds = embeds.to(dtype)
        weights = stack.layers[0].self_attn.q_proj.weight.dtype
        template = self._template_for(weights if dtype is None else dtype)

        def call(i: int, layer: nn.Module, *inputs: Any) -> Any:
            # layer i's weights assembled now, while the GPU runs the layers before it
            return functional_call(layer, tensors.layer(i), inputs, strict=True)

        # the assembled layouts are saved by the fused ops as recipes, re-assembled in
        # backward (coda.nn._rebuild): no weight-sized tensor per layer kept
        with rebuilt_when_saved(tensors.made), _autocast_off(embeds, dtype is not None):
            stream = template.run_layers(embeds, positions, tensors.norm, call)
        return stream.x.view(B, S, H)


class _StackTensors:
    """The fused template's tensors read from a Hugging Face decoder stack, made when
    asked for, layer by layer: the model's own tensors, and the fused q|k|v and gate/up
    layouts assembled from them (differentiable, so gradients reach the model's
    parameters); with ``dtype``, every weight cast to it. ``made`` lists (tensor, its
    function, its sources) of each layout and cast, for ``rebuilt_when_saved``."""

    def __init__(
        self, stack: nn.Module, geometry: _Geometry, freq: torch.Tensor, dtype: torch.dtype | None
    ) -> None:
        self.stack, self.freq, self.dtype = stack, freq, dtype
        self.layers = list(stack.layers)[: len(geometry.layer_eps)]
        self.qkv = functools.partial(layouts.assemble_qkv, head_dim=geometry.head_dim)
        self.made: list = []
        self._norms: dict[int, torch.Tensor] = {}

    def _assemble(
        self,
        fn: Callable[..., torch.Tensor],
        *sources: torch.Tensor,
        cast_fn: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``fn(*sources)``; with ``dtype``, ``cast_fn(*sources, dtype=dtype)`` (the layout
        made and cast in one), or else ``fn`` over the sources cast first (the layouts' row
        copies in the small dtype)."""
        if self.dtype is not None and cast_fn is not None:
            fn = functools.partial(cast_fn, dtype=self.dtype)
        elif self.dtype is not None:
            fn = functools.partial(_cast_then, fn, self.dtype)
        t = fn(*sources)
        self.made.append((t, fn, sources))
        return t

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        # a cast weight is saved as a recipe too (autocast's weight cache keeps one)
        if self.dtype is None or w.dtype == self.dtype:
            return w
        return cast_as_recipe(w, self.dtype, self.made)

    def norm(self, i: int) -> torch.Tensor:
        """Layer ``i``'s input-norm weight (``i == len(layers)``: the final norm's)."""
        got = self._norms.get(i)
        if got is None:
            last = i == len(self.layers)
            w = self.stack.norm.weight if last else self.layers[i].input_layernorm.weight
            got = self._norms[i] = self._weight(w)
        return got

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors under ``FusedLlamaDecoderLayer``'s names."""
        attn, mlp = self.layers[i].self_attn, self.layers[i].mlp
        return {
            "attn.norm_weight": self.norm(i),
            "attn.qkv_weight": self._assemble(
                self.qkv, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
            ),
            "attn.o_weight": self._weight(attn.o_proj.weight),
            "attn.freq": self.freq,
            "mlp.norm_weight": self._weight(self.layers[i].post_attention_layernorm.weight),
            # interleaved: row 2i = gate_proj row i, row 2i + 1 = up_proj row i; under
            # AMP cast and interleaved by one map pass each way (cast_layouts)
            "mlp.gate_up_weight": self._assemble(
                layouts.assemble_gate_up,
                mlp.gate_proj.weight,
                mlp.up_proj.weight,
                cast_fn=cast_gate_up,
            ),
            "mlp.down_weight": self._weight(mlp.down_proj.weight),
        }

    def all(self) -> dict[str, torch.Tensor]:
        """The whole template's tensors (``FusedLlamaStack``'s names)."""
        params = {"norm_weight": self.norm(len(self.layers))}
        for i in range(len(self.layers)):
            params.update({f"layers.{i}.{k}": v for k, v in self.layer(i).items()})
        return params


def _with_signature_of(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of the patched forward ``fn`` (the same code: what dynamo skips for ``fn`` it
    skips for the copy) that reports ``original``'s signature to ``inspect.signature``.
    Callers read a model's arguments from it: Hugging Face's ``Trainer`` keeps only the
    dataset columns that ``model.forward`` names (``remove_unused_columns``, on by
    default), and a forward of ``(*args, **kwargs)`` would lose ``input_ids``."""
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__dict__.update(fn.__dict__)
    copy.__doc__, copy.__qualname__ = fn.__doc__, fn.__qualname__
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):  # no signature to report: the copy's own stands
        return copy
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    copy.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    return copy


#: The fallback reason of a call whose inputs are on a GPU where coda's kernels do not run.
NOT_HOPPER = "not a Hopper GPU"


def _device_problem(args: Mapping[str, Any]) -> str | None:
    """``NOT_HOPPER`` when the call's inputs are on a CUDA device that is not a Hopper GPU
    (Hugging Face's forward runs there: coda's ops would take their reference path, slower
    than it), else None (a Hopper GPU, or the CPU, where the fused modules run their
    reference path, as CI tests them)."""
    x = args.get("input_ids")
    x = args.get("inputs_embeds") if x is None else x
    if isinstance(x, torch.Tensor) and x.device.type == "cuda" and not kernels_run_on(x.device):
        return NOT_HOPPER
    return None


def _autocast_over(stack: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype when an enabled ``torch.autocast`` on ``x``'s device would cast
    the stack's weights (AMP: fp32 master weights; any dtype autocast casts to), else
    None."""
    return autocast_dtype_against(stack.layers[0].self_attn.q_proj.weight.dtype, x)


def _autocast_problem(stack: nn.Module, x: torch.Tensor, fuse: bool) -> str | None:
    """Why the fused stack does not run under an enabled ``torch.autocast``, or None.
    Over weights of another dtype than autocast's (AMP's fp32 master weights) it runs only
    when ``apply_coda(..., fuse_autocast=True)`` asked for it, and only to bf16 or fp16:
    it then casts every weight per step and keeps its residual stream in autocast's dtype,
    where Hugging Face's forward keeps an fp32 one. Otherwise Hugging Face's forward runs
    the layers (autocast casting their operands), and the loss stays fused
    (``linear_cross_entropy`` casts its operands as autocast does)."""
    dtype = _autocast_over(stack, x)
    if dtype is None or (fuse and dtype in (torch.bfloat16, torch.float16)):
        return None
    weight = stack.layers[0].self_attn.q_proj.weight.dtype
    return f"autocast to {dtype_name(dtype)} over {dtype_name(weight)} weights"


def _cast_then(fn: Callable[..., torch.Tensor], dtype: torch.dtype, *ws: torch.Tensor):
    """``fn`` over ``ws`` cast to ``dtype`` (how ``fuse_autocast`` assembles a layout)."""
    return fn(*(cast(w, dtype) for w in ws))


def _autocast_off(x: torch.Tensor, off: bool):
    """A context with autocast disabled on ``x``'s device when ``off`` (the fused stack
    runs in the dtype it was cast to), else a no-op."""
    return torch.autocast(x.device.type, enabled=False) if off else contextlib.nullcontext()


def _loss_problem(causal_lm: nn.Module) -> str | None:
    """None when the model's loss is Hugging Face's causal-LM cross-entropy, else the
    attribute that customizes it."""
    custom = causal_lm.__dict__.get("_loss_function")
    if custom is not None and getattr(custom, "__name__", None) != "ForCausalLMLoss":
        return "loss_function"
    if getattr(causal_lm, "loss_type", None) not in (None, "ForCausalLM"):
        return "loss_type"
    if unwrapped_type(causal_lm.lm_head) is not nn.Linear:
        return "lm_head"
    return None


def _head_problem(head: nn.Module) -> str | None:
    """Why the fused loss cannot read the LM head now, or None: weights it cannot take
    (meta, float64), or hooks / a wrapped forward that its direct read of the weight would
    skip (a sharded head is called through its own forward instead: ``sharded``)."""
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor) and shard_kind(w) is None:
        if w.is_meta:
            return "lm_head weight on the meta device"
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"lm_head weight in {dtype_name(w.dtype)}"
    if sharded(head) is None and (hooked(head) or "forward" in head.__dict__):
        return "hooks on lm_head"
    return None


def _return_dict(module: nn.Module, args: Mapping[str, Any]) -> bool:
    value = args.get("return_dict")
    if value is None:
        value = getattr(getattr(module, "config", None), "return_dict", True)
    return bool(value)


# Under torch.compile the two patched forwards below run eagerly, and only they
# (``recursive=False``): what they call, the fused stack, the loss and Hugging Face's own
# forward, is compiled as frames of its own. They are dispatchers that read and bump the
# patch's call counters, and a counter read inside a compiled frame becomes a guard on its
# value: a recompile on every call until dynamo's cache limit.
@torch.compiler.disable(recursive=False)
def _stack_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched forward of a ``LlamaModel`` instance (bound with ``types.MethodType``)."""
    patch: CodaPatch = self.__dict__["_coda_patch"]
    original = patch.original(self)
    named = _arguments(original, args, kwargs)
    reason = "arguments" if named is None else patch.fusable(self, named, self.training)
    if reason is not None:
        patch._fallback(reason, self.training)
        return original(*args, **kwargs)
    from transformers.modeling_outputs import BaseModelOutputWithPast

    hidden = self.norm(patch.run_stack(self, named))  # the model's own final norm
    patch.calls["fused_stack"] += 1
    out = BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=None)
    return out if _return_dict(self, named) else out.to_tuple()


@torch.compiler.disable(recursive=False)
def _causal_lm_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched forward of a ``LlamaForCausalLM`` instance: the fused loss in training
    with labels (over the fused stack, or over the stack's original forward when this
    call cannot run it fused), the original forward otherwise."""
    patch: CodaPatch = self.__dict__["_coda_patch"]
    original = patch.original(self)
    named = _arguments(original, args, kwargs)
    if named is None or not self.training or not patch.fuse_loss:
        return original(*args, **kwargs)
    labels, shift_labels = named.get("labels"), named.get("shift_labels")
    if labels is None and shift_labels is None:
        return original(*args, **kwargs)
    reason = _device_problem(named) or _loss_problem(self) or _head_problem(self.lm_head)
    if reason is not None:
        patch._fallback(reason, True)
        return original(*args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    stack = self.model
    loss_args = dict(shift_labels=shift_labels, num_items_in_batch=named.get("num_items_in_batch"))
    labels = labels if shift_labels is None else None
    extra: dict[str, Any] = {}
    if patch.fusable(stack, named, True, inside_stack=False) is None:
        x = patch.run_stack(stack, named)
        norm = stack.norm  # the final norm, deferred into the loss
        loss_args.update(norm_weight=norm.weight, norm_eps=_hf.norm_eps(norm))
        patch.calls["fused_stack"] += 1
    else:
        # the stack's original forward, called through its seam (which counts the
        # fallback, or refuses it when strict) and its module's hooks (a sharding
        # framework's gather); the loss over its normed output is still fused
        outputs = stack(**{k: v for k, v in named.items() if k not in _LOSS_ARGS})
        x = outputs[0]
        if isinstance(outputs, Mapping):
            fields = CausalLMOutputWithPast.__dataclass_fields__
            extra = {k: v for k, v in outputs.items() if k in fields and k != "last_hidden_state"}
    # the head module, not its weight: a sharded head runs the loss inside its own call
    loss = patch._loss(x, self.lm_head, labels, **loss_args)
    patch.calls["fused_loss"] += 1
    out = CausalLMOutputWithPast(loss=loss, logits=None, **extra)
    return out if _return_dict(self, named) else out.to_tuple()


#: arguments of the causal LM's forward that are its loss's, not the decoder stack's
_LOSS_ARGS = frozenset({"labels", "shift_labels", "logits_to_keep", "return_dict"})


def apply_coda(
    model: nn.Module, *, fuse_loss: bool = True, strict: bool = False, fuse_autocast: bool = False
) -> CodaPatch:
    """Patch a Hugging Face ``LlamaForCausalLM`` / ``MistralForCausalLM`` (or their
    ``*Model`` decoder stack, or a PEFT model wrapping one) to run on coda; see the module
    doc. ``fuse_loss=False`` keeps Hugging Face's loss (the stack is still fused).
    ``strict=True`` raises instead of falling back to the original forward in training.
    ``fuse_autocast=True``: under ``torch.autocast`` to bf16 / fp16 over weights of
    another dtype (AMP's fp32 master weights), run the fused stack in autocast's dtype,
    its weights cast once per forward (and again in backward, as recipes), its residual
    stream in that dtype: the numerics of a bf16 / fp16 model, not of Hugging Face's AMP
    forward (whose residual stream stays fp32). Off by default: the stack's original
    forward runs under such autocast (the loss stays fused).
    Returns the ``CodaPatch`` (``revert()`` undoes it)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not isinstance(base, nn.Module):
        raise NothingMatchedError(f"{type(model).__name__} is not an nn.Module")
    if isinstance(getattr(base, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        raise UnsupportedModelError(
            f"{type(base).__name__} is torch.compile's wrapper: apply coda to the model "
            "first, then compile it (apply_coda(model); model = torch.compile(model))"
        )
    if "_coda_patch" in base.__dict__:
        raise ValueError("this model is already patched by coda: revert the patch first")
    if _is_stack(base):
        stack, stack_path, causal_lm = base, "", None
    elif _is_stack(getattr(base, "model", None)):
        stack, stack_path = base.model, "model."
        causal_lm = base if hasattr(base, "lm_head") else None
    else:
        raise NothingMatchedError(
            f"no Llama-style decoder stack (a module with embed_tokens, layers and norm, as "
            f"the model itself or its .model) in {type(base).__name__}: nothing was patched"
        )
    if "_coda_patch" in stack.__dict__:
        raise ValueError(
            f"this model's decoder stack ({stack_path.rstrip('.') or type(stack).__name__}) is "
            "already patched by coda: revert that patch first"
        )
    config = getattr(base, "config", getattr(stack, "config", None))
    problems = _config_problems(config, getattr(stack, "rotary_emb", None))
    num_layers = int(getattr(config, "num_hidden_layers", len(stack.layers)))
    more, geometry = _stack_problems(stack, stack_path, num_layers)
    problems += more
    if causal_lm is not None and fuse_loss:
        if (reason := _loss_problem(causal_lm)) is not None:
            problems.append(
                f"{reason} is not Hugging Face's causal-LM cross-entropy over a plain "
                "nn.Linear head: apply_coda(..., fuse_loss=False) keeps the model's loss"
            )
    if problems or geometry is None:
        raise UnsupportedModelError(
            f"coda cannot run this {type(base).__name__}:\n  " + "\n  ".join(problems)
        )
    return CodaPatch(
        base,
        stack,
        stack_path,
        causal_lm,
        geometry,
        fuse_loss=fuse_loss,
        strict=strict,
        fuse_autocast=fuse_autocast,
    )


def revert_coda(model: nn.Module) -> None:
    """Undo ``apply_coda(model)`` (the same model, or its PEFT wrapper)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    patch = base.__dict__.get("_coda_patch")
    if patch is None:
        raise ValueError(f"this {type(base).__name__} is not patched by coda")
    patch.revert()
