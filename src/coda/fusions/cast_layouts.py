"""coda.fusions.cast_layouts: AMP's fp32 gate / up weights cast into the fused layout in one pass.

Sits beside ``coda.fusions.layouts`` (pure torch, no kernels), on the map passes of
``coda.fusions._dispatch``. Under ``apply_coda(..., fuse_autocast=True)`` the fused MLP's
gate/up weight is made every step (and again in backward, as a recipe) from Hugging
Face's fp32 ``gate_proj`` / ``up_proj`` weights: cast to autocast's 16-bit dtype, then
interleaved (row 2i = gate row i, row 2i + 1 = up row i: ``layouts.interleave_gate_up``).
In PyTorch that is two casts and two strided row copies, and in backward the gradient's
two strided copies out of the interleaved rows and two casts up to fp32: 30 bytes moved
per weight element a step (the rebuild included).

The interleaved (2F, H) tensor is, byte for byte, an (F, 2H) one whose row i is
``[gate_i | up_i]``, so its gate and up halves are row-strided views that the TMA reads
and writes. ``cast_gate_up`` makes it with one map pass (TileLoad gate, up in fp32 ->
TileStore into the two halves in 16 bits, rounded as ``.to`` rounds), and its backward
reads the gradient's two halves and widens each to its fp32 gradient with one more (the
values of ``.to``, exactly): 18 bytes an element. Where a map pass cannot run it (off
Hopper, under ``torch.compile``, rows the TMA cannot take, small weights) it is the
PyTorch composition, ``layouts.assemble_gate_up(cast(gate), cast(up))``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from coda.epilogue import Epilogue
from coda.fusions import _dispatch, layouts
from coda.primitives import TileLoad, TileStore

__all__ = ["MIN_NUMEL", "cast_gate_up"]

#: the smallest gate (or up) weight, in elements, that ``cast_gate_up`` runs as map passes.
#: Measured on the H200 at 2^24 (Llama 3.2 1B: forward level with PyTorch's, backward
#: 2.07x) and 14336 x 4096 (Llama 3 8B: 1.48x / 1.57x; ``cast_widen_gate_up_h200.json``);
#: smaller ones take PyTorch's path, where a map pass's per-call host cost weighs more
MIN_NUMEL = 1 << 22


@functools.cache
def _halves_epilogue(src: torch.dtype, dst: torch.dtype) -> Epilogue:
    """gate, up (src) -> the two halves of one (F, 2H) tensor's rows (dst), or back."""
    return Epilogue(
        (
            TileLoad("gate", src),
            TileLoad("up", src),
            TileStore("gate", dst, name="gate_out"),
            TileStore("up", dst, name="up_out"),
        )
    )


def _runs_as_map_pass(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        dtype in _dispatch.SIXTEEN_BIT
        and gate.dtype == up.dtype == torch.float32
        and gate.shape == up.shape
        and gate.device == up.device
        and _dispatch.map_pass_takes(gate, MIN_NUMEL)
        and _dispatch.map_pass_takes(up, MIN_NUMEL)
    )


def _halves(t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of an interleaved (2 rows, H) tensor's (rows, 2H) view."""
    wide = t.view(rows, -1)
    cols = wide.shape[1] // 2
    return wide[:, :cols], wide[:, cols:]


def _cast_into_halves(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    F, H = gate.shape
    out = torch.empty((2 * F, H), dtype=dtype, device=gate.device)
    lo, hi = _halves(out, F)
    epi = _halves_epilogue(gate.dtype, dtype)
    _dispatch.run_map(epi, F, H, out, {"gate_out": lo, "up_out": hi}, gate=gate, up=up)
    return out


class _CastGateUp(torch.autograd.Function):
    """``cast_gate_up`` on a Hopper GPU: one map pass each way."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype):
        ctx.set_materialize_grads(False)  # an unused output leaves the gradients None
        return _cast_into_halves(gate, up, dtype)

    @staticmethod
    def backward(ctx: Any, d: torch.Tensor | None):
        if d is None:
            return None, None, None
        d = d.contiguous()
        F, H = d.shape[0] // 2, d.shape[1]
        dg, du = _halves(d, F)
        if d.data_ptr() % 16:  # not the TMA's: PyTorch's copies
            return dg.float(), du.float(), None
        epi = _halves_epilogue(d.dtype, torch.float32)
        got = _dispatch.run_map(epi, F, H, d, gate=dg, up=du)
        return got["gate_out"], got["up_out"], None


def cast_gate_up(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``layouts.assemble_gate_up(gate.to(dtype), up.to(dtype))`` (differentiable; the
    gradients of fp32 ``gate`` / ``up`` come back in fp32): the interleaved gate/up weight
    in autocast's ``dtype`` from fp32 weights, by one map pass on a Hopper GPU (and one in
    backward), by PyTorch's casts and copies elsewhere (see the module doc)."""
    if _runs_as_map_pass(gate, up, dtype):
        return _CastGateUp.apply(gate, up, dtype)
    return layouts.assemble_gate_up(_dispatch.cast(gate, dtype), _dispatch.cast(up, dtype))
