"""Run an ``Epilogue`` fused into the PingPong GEMM: validate, allocate, launch, finalize.

Sits in ``coda.runtime`` under :meth:`coda.Epilogue.__call__`. The order of work:

1. validate everything before any launch: the epilogue's own binding checks (names,
   shapes, dtypes, devices, target values), TMA's contract for every M x N tensor
   (contiguous rows, 16-byte row strides and pointers), a Hopper GPU, and whether the
   composition can be fused today (:func:`coda.runtime.fused.unsupported`);
2. pick the config (:func:`epilogue_config`: 128 x 128 tiles, narrower when the epilogue
   would spill registers there) and allocate outputs (TileStore tensors, per-tile
   partials for the kernel's tile shape);
3. launch the kernel compiled for (config, A's dtype, the fused visitor);
4. finalize: each primitive combines its partials into its outputs (tiny torch ops).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..binding import bind
from ..epilogue import Epilogue
from ..errors import InputError
from ..geometry import Problem
from ..mainloop.config import GemmConfig, choose_epilogue_config
from . import checks, gemm_kernels
from .fused import FusedVisitor, n_multiple, unsupported


def _cute_extra(spec, value: Any):
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    if spec.role == "scalar":
        return cutlass.Float32(float(value))
    if spec.is_partials:
        return gemm_kernels.as_cute_tensor(value)
    return from_dlpack(value, assumed_align=value.element_size()).mark_layout_dynamic()


#: Output-tile widths tried in order for a fused epilogue: the first whose kernel keeps
#: everything in registers (no local memory) is used. A narrower tile holds fewer
#: accumulator registers (tile_n per thread) and leaves more to the epilogue's values.
TILE_N_FALLBACKS = (96, 64)


def epilogue_config(
    epi: Epilogue, ab_dtype: torch.dtype, m: int, n: int, k: int, num_sms: int
) -> GemmConfig:
    """The config ``epi(A, B, ...)`` runs with when none is given: the heuristic's
    (128 x 128), or a narrower tile when that kernel would spill registers. Compiles (or
    loads from the caches) the candidates it inspects; the answer is cached with them."""
    base = choose_epilogue_config(m, n, k, num_sms)
    visitor = FusedVisitor(epi)
    for tile_n in (base.tile_n, *TILE_N_FALLBACKS):
        cfg = attrs.evolve(base, tile_n=tile_n)
        key = gemm_kernels.GemmKernelKey(cfg, ab_dtype, visitor, num_sms=num_sms)
        if gemm_kernels.local_memory_bytes(key) == 0:
            return cfg
    return cfg  # every candidate spills: the narrowest, which spills least


def run(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    tensors: Mapping[str, Any],
    config: GemmConfig | None = None,
    outputs: Mapping[str, torch.Tensor] | None = None,
    check_contents: bool = False,
) -> dict[str, torch.Tensor]:
    """Fused ``epi(A, B, **tensors)``. ``outputs`` may pre-supply output tensors (e.g.
    NaN-poisoned ones in tests); they must have the declared shapes and dtypes."""
    from ..matmul import check_gemm_operands

    reason = unsupported(epi)
    if reason is not None:
        raise NotImplementedError(f"this epilogue cannot be fused yet: {reason}")
    if not epi.outputs:
        raise InputError("this epilogue has no outputs: add a TileStore, TileReduce or ...")
    problem: Problem = bind(epi, A, B, tensors, contents=check_contents)
    m, n, k = check_gemm_operands(A, B)
    for spec in epi.inputs:
        if spec.role == "tile":
            checks.row_major_tma(spec.name, tensors[spec.name])
        elif spec.role in ("row", "col") and not tensors[spec.name].is_contiguous():
            raise InputError(f"{spec.name!r} must be a contiguous vector")
    need = n_multiple(epi)
    if n % need:
        raise InputError(
            f"N={n}: this epilogue needs N to be a multiple of {need} (TMA moves every "
            f"M x N*width tensor in rows of a multiple of 16 bytes, and column pairs must "
            f"not straddle the edge)"
        )
    checks.hopper_device(A.device)
    device = A.device
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg = config or epilogue_config(epi, A.dtype, m, n, k, num_sms)
    tile = (cfg.tile_m, cfg.tile_n)

    given = dict(outputs or {})
    out: dict[str, torch.Tensor] = {}
    for spec in epi.outputs:
        if spec.role != "tile" and not spec.is_partials:
            continue  # finalized from partials below
        shape = spec.shape(m, n, tile)
        t = given.get(spec.name)
        if t is None:
            t = torch.empty(shape, dtype=spec.dtype, device=device)
        elif tuple(t.shape) != shape or t.dtype != spec.dtype or t.device != device:
            raise InputError(f"outputs[{spec.name!r}] must be {shape} {spec.dtype} on {device}")
        out[spec.name] = t

    visitor = FusedVisitor(epi)
    extras = []
    for spec in visitor.extras_specs:
        value = out[spec.name] if spec.direction == "out" else tensors[spec.name]
        extras.append(_cute_extra(spec, value))
    key = gemm_kernels.GemmKernelKey(cfg, A.dtype, visitor, num_sms=num_sms)
    gemm_kernels.launch(
        key,
        A,
        B,
        tuple(out[p.out] for p in visitor.stores),
        tuple(tensors[p.name] for p in visitor.loads),
        tuple(extras),
    )
    partials = {name: t for name, t in out.items()}
    for p in epi.primitives:
        out.update(p.finalize(partials, problem, epi.values))
    return {spec.name: out[spec.name] for spec in epi.outputs}
