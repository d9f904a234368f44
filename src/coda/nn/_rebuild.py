"""coda.nn._rebuild: tensors that autograd saves as a recipe, rebuilt in backward.

Sits under the modules of ``coda.nn`` (their weights cast under ``torch.autocast``,
``coda.nn._autocast``) and ``coda.integrations.transformers`` (the per-step layouts): one
mechanism for both. Weights made from a model's own parameters every forward (the
q|k|v weight, the interleaved gate/up weight: ``coda.fusions.layouts.assemble_*``; a
parameter cast to autocast's dtype) are saved by the fused ops for their dgrad GEMMs.
Kept alive from forward to backward they would cost one weight-sized tensor per layer
(1.2 GiB for a 16-layer H = 2048 model); ``rebuilt_when_saved`` instead saves the recipe
(the function and the parameters it reads) and makes the tensor again when the backward
unpacks it: a few tens of microseconds of copies per layer, no memory held.

It is a ``torch.autograd.graph.saved_tensors_hooks`` context that composes with hooks
already active (e.g. ``save_on_cpu``): tensors it does not know are handed to them. The
parameters are checked not to have changed in place between forward and backward (as
autograd checks saved tensors): a changed one raises instead of rebuilding from new values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch

# ``cast(w, dtype)``: ``w`` in ``dtype``, differentiably; a recipe's function for a weight
# cast to autocast's dtype is ``functools.partial(cast, dtype=...)``
from coda.fusions._dispatch import cast

__all__ = ["Recipe", "cast", "cast_as_recipe", "rebuilt_when_saved"]


def cast_as_recipe(w: torch.Tensor, dtype: torch.dtype, made: list) -> torch.Tensor:
    """``w`` cast to ``dtype`` (differentiably), recorded in ``made`` as ``(tensor, its
    function, its sources)`` for :func:`rebuilt_when_saved`: saved for backward, it is
    cast again from ``w`` there instead of held."""
    to_dtype = functools.partial(cast, dtype=dtype)
    t = to_dtype(w)
    made.append((t, to_dtype, (w,)))
    return t


class Recipe:
    """``fn(*sources)`` rebuilds a saved tensor; the sources' versions when it was saved."""

    __slots__ = ("fn", "sources", "versions")

    def __init__(self, fn: Callable[..., torch.Tensor], sources: Sequence[torch.Tensor]):
        self.fn, self.sources = fn, tuple(sources)
        self.versions = tuple(s._version for s in self.sources)

    def rebuild(self) -> torch.Tensor:
        if tuple(s._version for s in self.sources) != self.versions:
            raise RuntimeError(
                "coda: a parameter that a fused layer's saved weight is assembled from was "
                "modified in place between forward and backward"
            )
        with torch.no_grad():
            return self.fn(*(s.detach() for s in self.sources))


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.device, t.dtype, tuple(t.shape), tuple(t.stride()))


@contextlib.contextmanager
def rebuilt_when_saved(
    assembled: Sequence[tuple[torch.Tensor, Callable[..., torch.Tensor], Sequence[torch.Tensor]]],
) -> Iterator[None]:
    """Inside, a saved tensor that IS one of ``assembled``'s tensors (same storage, shape,
    strides) is saved as its recipe ``(fn, sources)`` and rebuilt on unpack. ``assembled``
    may grow inside (a list a caller appends to as it makes tensors: what it holds when a
    tensor is saved counts; it keeps them alive, so no other tensor takes their memory
    and their keys while the context lasts). No-op under ``torch.compile`` (its graph
    decides what to save)."""
    if torch.compiler.is_compiling():
        yield
        return
    recipes: dict = {}
    seen = 0  # how many of ``assembled`` are in ``recipes`` (their tensors stay alive in it)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor):
        nonlocal seen
        if seen < len(assembled):  # entries made since the last save
            for made, fn, srcs in assembled[seen:]:
                recipes[_key(made)] = (fn, srcs)
            seen = len(assembled)
        found = recipes.get(_key(t))
        if found is not None:
            return Recipe(*found)
        return outer_pack(t) if outer_pack is not None else t

    def unpack(x):
        if isinstance(x, Recipe):
            return x.rebuild()
        return outer_unpack(x) if outer_unpack is not None else x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
