"""The host code of a repeated fused call, generated once per (launch plan, M, N).

Sits under :mod:`coda.runtime.epilogue_kernels`, which keeps one of these per call
signature. Everything a cached call does is known once the plan and the problem size
are: which outputs to allocate (shapes, dtypes), which partials and counters the stream
scratch lends, the order of the kernel's argument tuples, whether a finalize follows, and
which names the call returns. :func:`bind` writes that down as ONE straight-line Python
function (no loops, no per-call dictionaries of names, no branches but the base-pointer
check) and compiles it with ``exec``, the way ``attrs`` and ``dataclasses`` write their
``__init__``. The generated source is kept on the function (``__coda_source__``) for
reading and tests.

The function takes ``(A, B, tensors)`` and returns the call's result dictionary, or
``None`` when a base pointer breaks TMA's 16-byte rule (the caller then takes the full
path, which names the tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

#: (A, B, tensors) -> results, or None when the base-pointer check fails
BoundCall = Callable[[torch.Tensor, torch.Tensor, Mapping[str, Any]], "dict | None"]


def bind(
    *,
    kernel: Callable,
    device: torch.device,
    allocated: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
    partials: tuple[str, ...],
    counters: bool,
    lend: Callable[[], tuple[Mapping[str, torch.Tensor], torch.Tensor | None]] | None,
    store_names: tuple[str, ...],
    load_names: tuple[str, ...],
    tile_inputs: tuple[str, ...],
    extras: tuple[tuple[str, bool, bool], ...],
    finalize: Callable[[dict], None] | None,
    returned: tuple[str, ...],
) -> BoundCall:
    """The straight-line call. ``allocated``: (name, shape, dtype) of each output made
    per call; ``partials``: names of the per-tile partials ``lend()`` hands out (with the
    arrival counters when ``counters``); ``extras``: (name, is_output, is_scalar) in the
    kernel's order; ``finalize(out, counters)`` runs after the kernel with every output
    by name and the lent counters (None without ``counters``);
    ``returned``: the names of the result dictionary."""
    env: dict[str, Any] = {"empty": torch.empty, "kernel": kernel, "device": device}
    lines = ["def call(A, B, t):"]
    inputs: dict[str, str] = {}

    def tensor(name: str) -> str:
        if name not in inputs:
            inputs[name] = f"i{len(inputs)}"
            lines.append(f"    {inputs[name]} = t[{name!r}]")
        return inputs[name]

    ptrs = ["A.data_ptr()", "B.data_ptr()"] + [f"{tensor(n)}.data_ptr()" for n in tile_inputs]
    lines.append(f"    if ({' | '.join(ptrs)}) & 15:")
    lines.append("        return None")
    outputs: dict[str, str] = {}
    for i, (name, shape, dtype) in enumerate(allocated):
        env[f"d{i}"] = dtype
        dims = ", ".join(str(int(s)) for s in shape)
        outputs[name] = f"o{i}"
        lines.append(f"    o{i} = empty({dims}, dtype=d{i}, device=device)")
    if partials or counters:
        env["lend"] = lend
        lines.append("    p, c = lend()")
        for name in partials:
            outputs[name] = f"p[{name!r}]"
    args = []
    for name, is_out, scalar in extras:
        if scalar:
            args.append(f"float(t[{name!r}])")
        else:
            args.append(outputs[name] if is_out else tensor(name))
    if counters:
        args.append("c")

    def tup(items: list[str]) -> str:
        return "(" + "".join(f"{x}, " for x in items) + ")"

    stores = [outputs[n] for n in store_names]
    loads = [tensor(n) for n in load_names]
    lines.append(f"    kernel(A, B, {tup(stores)}, {tup(loads)}, {tup(args)})")
    if finalize is not None:
        env["finalize"] = finalize
        everything = ", ".join(f"{n!r}: {v}" for n, v in outputs.items())
        lines.append(f"    out = {{{everything}}}")
        lines.append(f"    finalize(out, {'c' if counters else 'None'})")
        lines.append("    return {" + ", ".join(f"{n!r}: out[{n!r}]" for n in returned) + "}")
    else:
        lines.append("    return {" + ", ".join(f"{n!r}: {outputs[n]}" for n in returned) + "}")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<coda bound call>", "exec"), env)  # noqa: S102 -- see module docstring
    fn = env["call"]
    fn.__coda_source__ = source
    return fn


def signature_of(inputs: tuple[tuple[str, bool], ...]) -> Callable[..., tuple | None]:
    """The call-signature function of an epilogue whose inputs are ``inputs`` ((name,
    is_scalar) each): ``sig(epi, config, A, B, tensors)`` returns the tuple that
    identifies a call -- the epilogue, config, and for A, B and each input tensor its
    type, shape, strides, dtype and device; for a scalar its type -- or None when the
    call cannot be identified cheaply (a name missing or extra, a non-tensor where a
    tensor goes): the full checks then name the problem. Written out per epilogue, as
    the bound call is, so a call pays no loop over its inputs."""
    env: dict[str, Any] = {}
    lines = [
        "def sig(epi, config, A, B, t):",
        f"    if len(t) != {len(inputs)}:",
        "        return None",
    ]
    lines.append("    try:")
    parts = ["epi", "config"]
    for x in ("A", "B"):
        parts += [f"type({x})", f"{x}.shape", f"{x}.stride()", f"{x}.dtype", f"{x}.device"]
    for i, (name, scalar) in enumerate(inputs):
        lines.append(f"        i{i} = t[{name!r}]")
        if scalar:
            parts.append(f"type(i{i})")
        else:
            parts += [f"type(i{i})", f"i{i}.shape", f"i{i}.stride()", f"i{i}.dtype", f"i{i}.device"]
    lines.append("        return (" + ", ".join(parts) + ",)")
    lines.append("    except (KeyError, AttributeError, TypeError):")
    lines.append("        return None")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<coda call signature>", "exec"), env)  # noqa: S102 -- see module docstring
    fn = env["sig"]
    fn.__coda_source__ = source
    return fn
