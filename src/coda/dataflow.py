"""coda.dataflow: build-time analysis of a chain of primitives (used by ``Epilogue``).

``analyze(primitives)`` walks the chain once, in order, starting from the predefined value
``acc`` (the GEMM's fp32 accumulator, a width-1 tile), and either raises the most specific
``EpilogueError`` subclass with a message naming the offending primitive
(``primitives[i]``) or returns a ``Dataflow``: the spec of every value, the input and
output tensors, and N's required alignment.

Rules checked, in this order for each primitive:

1. it is a ``Primitive``;
2. every read names a value defined by an earlier primitive: otherwise
   ``UseBeforeDefinitionError`` (defined later, or a finalized reduction/state result) or
   ``UnknownValueError`` (with close matches and the list of defined values);
3. ``infer`` accepts the inputs' kinds and widths (``KindError``, ``WidthMismatchError``,
   ``ArityError`` come from the primitive) and returns specs for exactly its ``writes``;
4. bound tensors: an input name bound twice must have the same role, dtype and width
   (``BindingConflictError``); outputs are unique and never shadow an input
   (``DuplicateNameError``);
5. written values are new (``DuplicateNameError``; values are single-assignment).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from coda.errors import (
    BindingConflictError,
    DuplicateNameError,
    EpilogueError,
    UnknownValueError,
    UseBeforeDefinitionError,
)
from coda.primitives.base import Primitive
from coda.specs import TensorSpec, ValueSpec, check_name, dtype_name, width_str

__all__ = ["ACC", "Dataflow", "analyze"]

#: The predefined value: the GEMM accumulator, fp32, (M, N).
ACC = ValueSpec("acc", "tile", 1)


@attrs.frozen
class Dataflow:
    """The result of ``analyze``: everything known about an epilogue before any tensor."""

    values: Mapping[str, ValueSpec]
    producers: Mapping[str, int]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    bindings: tuple[tuple[TensorSpec, ...], ...]
    n_alignment: int


def _where(i: int, p: Primitive) -> str:
    return f"primitives[{i}] {p.label}"


def _binding(spec: TensorSpec) -> str:
    shape = spec.describe().split(": ", 1)[1]
    if spec.role not in ("tile", "col") or spec.width == 1:
        return shape
    return f"{shape}, width {width_str(spec.width)}"


def _unknown_read(
    i: int,
    p: Primitive,
    name: str,
    values: Mapping[str, ValueSpec],
    later: Mapping[str, int],
    outputs: Mapping[str, tuple[TensorSpec, int]],
    primitives: Sequence[Primitive],
) -> EpilogueError:
    here = _where(i, p)
    if name in later:
        k = later[name]
        return UseBeforeDefinitionError(
            f"{here} reads {name!r} before it is produced: it is defined later, by "
            f"{_where(k, primitives[k])}. Move the producer before the reader."
        )
    if name in outputs:
        spec, k = outputs[name]
        if spec.role in ("row", "col") or spec.is_partials:
            return UseBeforeDefinitionError(
                f"{here} reads {name!r}, the result of {_where(k, primitives[k])}: it is "
                "finalized after the last tile, so no primitive of the same epilogue can "
                f"read it. Pass it to the next GEMM's epilogue (VecLoad({name!r}, "
                f"per={spec.role!r}, dtype=torch.{dtype_name(spec.dtype)}))."
            )
        return UnknownValueError(
            f"{here} reads {name!r}, which is an output tensor of "
            f"{_where(k, primitives[k])}, not a value; read the stored value instead."
        )
    defined = ", ".join(values)
    close = difflib.get_close_matches(name, list(values), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return UnknownValueError(
        f"{here} reads unknown value {name!r}.{hint} Values defined before it: {defined}."
    )


def analyze(primitives: Sequence[Primitive]) -> Dataflow:
    """Validate a chain of primitives and compute its dataflow (see the module doc)."""
    values: dict[str, ValueSpec] = {"acc": ACC}
    producers: dict[str, int] = {"acc": -1}
    inputs: dict[str, tuple[TensorSpec, int]] = {}
    outputs: dict[str, tuple[TensorSpec, int]] = {}
    bindings: list[tuple[TensorSpec, ...]] = []
    later: dict[str, int] = {}
    for i, p in enumerate(primitives):
        if not isinstance(p, Primitive):
            raise TypeError(
                f"primitives[{i}] is {type(p).__name__} {p!r}; an Epilogue chains "
                "coda.primitives.Primitive instances"
            )
        for attr in ("reads", "writes"):  # a bare string would read as its characters
            if isinstance(getattr(p, attr), str):
                raise EpilogueError(
                    f"{_where(i, p)}: {attr} must be a tuple of value names; got the string "
                    f"{getattr(p, attr)!r} (write ({getattr(p, attr)!r},))"
                )
        for name in p.writes:
            later.setdefault(name, i)
    n_alignment = 1
    for i, p in enumerate(primitives):
        here = _where(i, p)
        for name in p.reads:
            if name not in values:
                raise _unknown_read(
                    i,
                    p,
                    name,
                    values,
                    {n: k for n, k in later.items() if k > i},
                    outputs,
                    primitives,
                )
        inferred = p.infer(values)
        if isinstance(inferred, ValueSpec):
            raise EpilogueError(
                f"{here}: infer() must return a tuple of ValueSpecs, one per written value; "
                f"got a single ValueSpec (a bug in {type(p).__name__}: return (spec,))"
            )
        new = tuple(inferred)
        if tuple(s.name for s in new) != tuple(p.writes):
            raise EpilogueError(
                f"{here}: infer() returned specs for {[s.name for s in new]} but the "
                f"primitive writes {list(p.writes)} (a bug in {type(p).__name__})"
            )
        bound = tuple(p.tensors({**values, **{s.name: s for s in new}}))
        for spec in bound:
            if spec.direction == "in":
                check_name(spec.name, f"{here}: input tensor name")
                if spec.is_partials:
                    raise EpilogueError(
                        f"{here} binds input tensor {spec.name!r} with role {spec.role!r}: "
                        "per-tile partials are outputs (a reduction's scratch), never inputs"
                    )
                if spec.name in outputs:
                    _, k = outputs[spec.name]
                    raise DuplicateNameError(
                        f"{here} binds input tensor {spec.name!r}, but that name is already "
                        f"an output of {_where(k, primitives[k])}"
                    )
                if spec.name in inputs and inputs[spec.name][0] != spec:
                    prev, k = inputs[spec.name]
                    raise BindingConflictError(
                        f"tensor {spec.name!r} is bound twice with different specs: as "
                        f"{_binding(prev)} by {_where(k, primitives[k])}, and as "
                        f"{_binding(spec)} by {here}"
                    )
                inputs.setdefault(spec.name, (spec, i))
            else:
                if spec.name in outputs:
                    _, k = outputs[spec.name]
                    raise DuplicateNameError(
                        f"{here} writes output {spec.name!r}, which "
                        f"{_where(k, primitives[k])} already writes; give one a different "
                        "name (e.g. TileStore(value, dtype, name=...))"
                    )
                if spec.name in inputs:
                    _, k = inputs[spec.name]
                    raise DuplicateNameError(
                        f"{here} writes output {spec.name!r}, the name of an input tensor "
                        f"bound by {_where(k, primitives[k])}"
                    )
                outputs[spec.name] = (spec, i)
        for spec in new:
            check_name(spec.name, f"{here}: value name")
            if spec.name in values:
                k = producers[spec.name]
                by = (
                    "predefined (the GEMM accumulator)"
                    if k < 0
                    else (f"already defined by {_where(k, primitives[k])}")
                )
                raise DuplicateNameError(
                    f"{here} defines value {spec.name!r}, which is {by}; values are "
                    "single-assignment, pick a new name"
                )
            values[spec.name] = spec
            producers[spec.name] = i
        bindings.append(bound)
        n_alignment = math.lcm(n_alignment, p.n_alignment(values))
    for spec in values.values():
        n_alignment = math.lcm(n_alignment, spec.width.denominator)
    for spec, _ in outputs.values():
        n_alignment = math.lcm(n_alignment, spec.width.denominator)
    return Dataflow(
        values=MappingProxyType(values),
        producers=MappingProxyType(producers),
        inputs=tuple(s for s, _ in inputs.values()),
        outputs=tuple(s for s, _ in outputs.values()),
        bindings=tuple(bindings),
        n_alignment=n_alignment,
    )
