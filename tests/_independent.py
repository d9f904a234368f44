"""An independent float64 evaluator of epilogues, written for the tests only.

It shares nothing with coda's ``reference`` or simulator code but the public fields of
the primitives and the user's ``fn``s (which *are* the program): pairs are split with a
reshape instead of strided slicing, partials are computed with explicit loops over tiles,
reductions and log-sum-exp run in float64, targets are picked row by row.

``evaluate(epi, A, B, tensors, tile)`` returns {output name: float64 tensor} (with partials
when ``tile`` is given). Tests register evaluators for their own primitive classes with
``register(cls, fn)``; fn(p, values, tensors, outputs, M, N, tile) mutates values/outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

from coda import (
    Elementwise,
    LogSumExp,
    ScalarLoad,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
)

F64 = torch.float64
_REGISTRY: dict[type, Callable[..., None]] = {}


def register(cls: type, fn: Callable[..., None]) -> None:
    _REGISTRY[cls] = fn


def _cols(N: int, w: Fraction) -> int:
    c = N * Fraction(w)
    assert c.denominator == 1
    return int(c)


def _elementwise(p: Elementwise, values: dict, specs: dict, M: int, N: int) -> None:
    args: list[torch.Tensor] = []
    pair_w = None
    if p.pairwise:
        pair_w = max(specs[n].width for n in p.ins if specs[n].kind in ("tile", "col"))
    for n in p.ins:
        v = values[n]
        s = specs[n]
        if pair_w is not None and s.kind in ("tile", "col") and s.width == pair_w:
            pairs = v.reshape(v.shape[0], v.shape[1] // 2, 2)
            args += [pairs[..., 0], pairs[..., 1]]
        else:
            args.append(v)
    out = p.fn(*args)
    spec = specs[p.out]
    rows = M if spec.kind in ("tile", "row") else 1
    cols = _cols(N, spec.width) if spec.kind in ("tile", "col") else 1
    if p.pairwise == "map":
        even, odd = (
            torch.broadcast_to(torch.as_tensor(o, dtype=F64), (rows, cols // 2)) for o in out
        )
        values[p.out] = torch.stack([even, odd], dim=2).reshape(rows, cols)
    else:
        values[p.out] = torch.broadcast_to(torch.as_tensor(out, dtype=F64), (rows, cols)).to(F64)


def _row_partials(v: torch.Tensor, N: int, tn: int, w: Fraction, fold: Callable) -> torch.Tensor:
    """partials[m, j] = fold(v[m, columns of tile j]) by an explicit loop over tiles."""
    tc = int(tn * w)
    n_t = math.ceil(N / tn)
    cols = []
    for j in range(n_t):
        cols.append(fold(v[:, j * tc : min((j + 1) * tc, v.shape[1])]))
    return torch.stack(cols, dim=1)


def _col_partials(v: torch.Tensor, tm: int, fold: Callable) -> torch.Tensor:
    M = v.shape[0]
    return torch.stack(
        [fold(v[i * tm : min((i + 1) * tm, M)].T) for i in range(math.ceil(M / tm))], dim=0
    )


def evaluate(
    epi: Any, A: torch.Tensor, B: torch.Tensor, tensors: dict, tile: tuple | None = None
) -> dict[str, torch.Tensor]:
    M, N = A.shape[0], B.shape[0]
    specs = dict(epi.values)
    values: dict[str, torch.Tensor] = {"acc": A.to(F64) @ B.to(F64).T}
    outputs: dict[str, torch.Tensor] = {}
    for p in epi:
        if type(p) in _REGISTRY:
            _REGISTRY[type(p)](p, values, tensors, outputs, M, N, tile, specs)
        elif isinstance(p, TileLoad):
            values[p.name] = tensors[p.name].to(F64)
        elif isinstance(p, VecLoad):
            t = tensors[p.name].to(F64)
            values[p.name] = t[:, None] if p.per == "row" else t[None, :]
        elif isinstance(p, ScalarLoad):
            values[p.name] = torch.full((1, 1), float(tensors[p.name]), dtype=F64)
        elif isinstance(p, Elementwise):
            _elementwise(p, values, specs, M, N)
        elif isinstance(p, TileStore):
            outputs[p.out] = values[p.value].clone()
        elif isinstance(p, TileReduce):
            v = values[p.of]
            if p.op == "sumsq":
                v = v * v
            fold = (lambda x: x.max(dim=1).values) if p.op == "max" else (lambda x: x.sum(1))
            if p.per == "row":
                total, n = fold(v), v.shape[1]
            else:
                total, n = fold(v.T), M
            if p.post is not None:
                total = torch.broadcast_to(
                    torch.as_tensor(p.post(total, n), dtype=F64), total.shape
                )
            outputs[p.name] = total
            if tile is not None:
                w = specs[p.of].width
                outputs[f"{p.name}.partials"] = (
                    _row_partials(v, N, tile[1], w, fold)
                    if p.per == "row"
                    else _col_partials(v, tile[0], fold)
                )
        elif isinstance(p, LogSumExp):
            v = values[p.of]
            outputs[p.name] = torch.logsumexp(v, dim=1)
            if tile is not None:
                w = specs[p.of].width
                pm = _row_partials(v, N, tile[1], w, lambda x: x.max(dim=1).values)
                ps = []
                for j in range(pm.shape[1]):
                    tc = int(tile[1] * w)
                    block = v[:, j * tc : (j + 1) * tc]
                    ps.append(torch.exp(block - pm[:, j : j + 1]).sum(1))
                outputs[f"{p.name}.partials_max"] = pm
                outputs[f"{p.name}.partials_sumexp"] = torch.stack(ps, dim=1)
        elif isinstance(p, TargetSelect):
            v = values[p.of]
            t = tensors[p.target]
            picked = torch.zeros(M, dtype=F64)
            n_t = math.ceil(N / tile[1]) if tile is not None else 1
            partials = torch.zeros(M, n_t, dtype=F64)
            tc = int(tile[1] * specs[p.of].width) if tile is not None else v.shape[1]
            for m in range(M):
                c = int(t[m])
                if c == p.ignore_index:
                    continue
                picked[m] = v[m, c]
                partials[m, c // tc] = v[m, c]
            outputs[p.name] = picked
            if tile is not None:
                outputs[f"{p.name}.partials"] = partials
        else:
            raise TypeError(f"no independent evaluator for {type(p).__name__}; register one")
    return outputs
