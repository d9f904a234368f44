"""coda.nn._sharding: weights that a data-parallel framework shards, and calls through
the module that owns them.

Sits in ``coda.nn`` (used by ``coda.nn.loss`` and ``coda.integrations``). FSDP2
(``fully_shard``), FSDP1 and DeepSpeed ZeRO-3 keep a module's parameters sharded outside
its forward and gather them in hooks that run around the module's ``__call__``; after
the backward the same hooks reduce the gradients across ranks. A fused op that reads
``module.weight`` by attribute outside that call sees a shard (a ``DTensor``, a flat
parameter or an empty ZeRO-3 placeholder), and a gradient that does not reach the
gathered parameter is never reduced (USERS.md item 3). ``call_through`` runs a function
AS the module's forward, inside those hooks; ``sharded`` says when that is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from coda.fusions._checks import shard_kind

try:  # torch.distributed is optional in some PyTorch builds
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - builds without torch.distributed
    _FSDPModule = None

__all__ = ["call_through", "shard_kind", "sharded", "unit", "unwrapped_type"]


def unit(module: nn.Module) -> str | None:
    """What sharding unit ``module`` is (an FSDP2 ``fully_shard`` unit, an FSDP1 wrapper):
    its parameters are gathered only inside its own ``__call__``; or None."""
    if _FSDPModule is not None and isinstance(module, _FSDPModule):
        return "an FSDP2 unit (fully_shard)"
    if type(module).__name__ == "FullyShardedDataParallel":
        return "an FSDP1 unit (FullyShardedDataParallel)"
    return None


def sharded(module: nn.Module) -> str | None:
    """Why ``module``'s own parameters are not whole local tensors outside its forward (a
    sharding ``unit``, or parameters that are shards), or None."""
    if (why := unit(module)) is not None:
        return why
    for p in module.parameters(recurse=False):
        if (kind := shard_kind(p)) is not None:
            return f"holds {kind}"
    return None


def unwrapped_type(module: nn.Module) -> type:
    """``module``'s class without FSDP2's wrapper (``fully_shard`` swaps a module's class
    for a subclass of ``FSDPModule`` and the original)."""
    cls = type(module)
    if _FSDPModule is not None and isinstance(module, _FSDPModule):
        bases = [b for b in cls.__bases__ if not issubclass(b, _FSDPModule)]
        if len(bases) == 1:
            return bases[0]
    return cls


def call_through(module: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(module, *args, **kwargs)`` run as ``module``'s forward, through
    ``module.__call__``: its pre-forward hooks gather sharded parameters (``module.weight``
    is then the whole tensor inside ``fn``), its post-forward hooks reshard them and
    register the backward hooks that regather them and reduce their gradients. The
    module's own ``forward`` (an instance-level one included) is restored afterwards.
    Forward hooks see ``fn``'s output."""
    previous = module.__dict__.get("forward")

    def forward(*a: Any, **kw: Any) -> Any:
        return fn(module, *a, **kw)

    module.__dict__["forward"] = forward
    try:
        return module(*args, **kwargs)
    finally:
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = previous
