"""Run an ``Epilogue`` fused into the PingPong GEMM: a cached launch plan per epilogue.

Sits in ``coda.runtime`` and is installed as the runner of :meth:`coda.Epilogue.__call__`
(``coda.epilogue.set_runner``; the epilogue never imports the runtime). The work that
depends only on (epilogue, operand dtype, operand layout, device, cluster shape) is done
once, in :class:`EpiloguePlan`: the fusability check, ``n_multiple``, the config
(:func:`epilogue_config`: 128 x 128 tiles, narrower when the epilogue would spill
registers there), the fused visitor, the compiled kernel, and the order in which tensors
travel to it. A call then does only:

1. fast checks of every tensor (shape, dtype, device, TMA layout) -- on any mismatch the
   full, readable checks of :func:`coda.binding.bind` run to name the problem, and
   nothing is launched;
2. allocation of the outputs the caller did not supply (TileStore tensors, per-tile
   partials, finalized results);
3. one launch of the GEMM kernel (TVM-FFI: the torch tensors go straight to C) and, when
   the epilogue reduces across tiles, one launch of its finalize kernel
   (:mod:`coda.runtime.finalize`), which turns the partials into results on the GPU.

No host synchronization happens (tensor *values* are checked only with
``check_contents=True``) and nothing is allocated that the caller did not ask for, so a
call can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..binding import bind
from ..epilogue import Epilogue, set_runner
from ..errors import InputError
from ..mainloop.config import GemmConfig, choose_epilogue_config, epilogue_size_class
from . import checks, finalize, gemm_kernels
from .fused import FusedVisitor, n_multiple, unsupported
from .operands import cached_problem

#: Output-tile widths tried, after the heuristic's own and narrower than it, for a fused
#: epilogue: the first whose kernel keeps everything in registers (no local memory) is
#: used. A narrower tile holds fewer accumulator registers (tile_n per thread) and leaves
#: more to the epilogue's values.
TILE_N_FALLBACKS = (128, 96, 64)


def tile_candidates(base: GemmConfig) -> tuple[GemmConfig, ...]:
    """``base`` and its narrower fallbacks, widest first."""
    return (base, *(attrs.evolve(base, tile_n=t) for t in TILE_N_FALLBACKS if t < base.tile_n))


def epilogue_config(
    epi: Epilogue,
    ab_dtype: torch.dtype,
    m: int,
    n: int,
    k: int,
    num_sms: int,
    majors: tuple[str, str] = ("k", "k"),
) -> GemmConfig:
    """The config ``epi(A, B, ...)`` runs with when none is given: the heuristic's
    (128 x 128), or a narrower tile when that kernel would spill registers. Compiles (or
    loads from the caches) the candidates it inspects; the answer is cached with them."""
    visitor = FusedVisitor(epi)
    for cfg in tile_candidates(choose_epilogue_config(m, n, k, num_sms)):
        key = gemm_kernels.kernel_key(cfg, ab_dtype, visitor, num_sms, *majors)
        if gemm_kernels.local_memory_bytes(key) == 0:
            return cfg
    return cfg  # every candidate spills: the narrowest, which spills least


class EpiloguePlan:
    """Everything about running ``epi`` that does not depend on the call's tensors."""

    def __init__(
        self,
        epi: Epilogue,
        ab_dtype: torch.dtype,
        majors: tuple[str, str],
        device: torch.device,
        num_sms: int,
        config: GemmConfig,
    ):
        self.epi = epi
        self.device = device
        self.config = config
        self.tile = (config.tile_m, config.tile_n)
        self.visitor = FusedVisitor(epi)
        self.key = gemm_kernels.kernel_key(config, ab_dtype, self.visitor, num_sms, *majors)
        self.kernel = gemm_kernels.launcher(self.key)
        self.need_n = n_multiple(epi)
        # (name, role, dtype, width numerator, denominator) of each input, binding order
        self.inputs = tuple(
            (s.name, s.role, s.dtype, s.width.numerator, s.width.denominator) for s in epi.inputs
        )
        self.store_names = tuple(p.out for p in self.visitor.stores)
        self.load_names = tuple(p.name for p in self.visitor.loads)
        self.extras = tuple(
            (s.name, s.direction == "out", s.role == "scalar") for s in self.visitor.extras_specs
        )
        self.finalizer = finalize.plan(epi)
        # what a call allocates: the kernel's outputs (tiles, partials) and the results the
        # finalize kernel writes (the torch fallback allocates its own)
        finalized = self.finalizer.results if self.finalizer is not None else ()
        self.allocated = tuple(
            s for s in epi.outputs if s.role == "tile" or s.is_partials or s in finalized
        )
        self.output_names = tuple(s.name for s in epi.outputs)
        self._sizes: dict[tuple[int, int], tuple] = {}

    def sizes(self, m: int, n: int) -> tuple:
        """At (M, N), computed once per problem size: ((name, shape, dtype, is_tile) of each
        allocated output, the partials' workspace: (floats, ((name, shape, stride,
        offset), ...)), the finalize extent). The fp32 per-tile partials (internal to the
        finalize, returned for inspection) share one allocation, views 16-byte aligned;
        results and M x N outputs get their own, so no two results alias each other (as
        custom ops and autograd require)."""
        got = self._sizes.get((m, n))
        if got is None:
            if len(self._sizes) > 256:
                self._sizes.clear()
            outs, views, floats = [], [], 0
            for s in self.allocated:
                shape = s.shape(m, n, self.tile)
                if s.is_partials:
                    stride = (shape[1], 1) if len(shape) == 2 else (1,)
                    views.append((s.name, shape, stride, floats))
                    size = shape[0] * (shape[1] if len(shape) == 2 else 1)
                    floats += -(-size // 4) * 4
                else:
                    outs.append((s.name, shape, s.dtype, s.role == "tile"))
            extent = self.finalizer.extent(m, n) if self.finalizer is not None else 0
            got = self._sizes[(m, n)] = (tuple(outs), (floats, tuple(views)), extent)
        return got

    def fast_checks_pass(self, A, B, tensors: Mapping[str, Any], m: int, n: int) -> bool:
        """True when every input has exactly the expected shape, dtype and device and every
        M x N tensor meets TMA's layout contract; False sends the call to the full checks."""
        if len(tensors) != len(self.inputs) or n % self.need_n:
            return False
        device = self.device
        if A.device != device or B.device != device:
            return False
        for name, role, dtype, num, den in self.inputs:
            t = tensors.get(name)
            if role == "scalar":
                if not isinstance(t, (float, int)) or isinstance(t, bool):
                    return False
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device:
                return False
            shape = t.shape
            if role == "tile":
                if len(shape) != 2 or shape[0] != m or shape[1] * den != n * num:
                    return False
                stride = t.stride()
                if stride[1] != 1 or (stride[0] * t.element_size()) & 15 or t.data_ptr() & 15:
                    return False
            elif role == "row":
                if len(shape) != 1 or shape[0] != m or t.stride(0) != 1:
                    return False
            elif role == "col":
                if len(shape) != 1 or shape[0] * den != n * num or t.stride(0) != 1:
                    return False
        return True

    def __call__(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        tensors: Mapping[str, Any],
        outputs: Mapping[str, torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        m, n = A.shape[0], B.shape[0]
        outs, (floats, views), extent = self.sizes(m, n)
        device = self.device
        out: dict[str, torch.Tensor] = {}
        if not outputs:
            given = {}
            for name, shape, dtype, _ in outs:
                out[name] = torch.empty(shape, dtype=dtype, device=device)
            if floats:
                ws = torch.empty(floats, dtype=torch.float32, device=device)
                for name, shape, stride, offset in views:
                    out[name] = ws.as_strided(shape, stride, offset)
        else:
            given = outputs
            wanted = outs + tuple((v[0], v[1], torch.float32, False) for v in views)
            for name, shape, dtype, is_tile in wanted:
                t = given.get(name)
                if t is None:
                    t = torch.empty(shape, dtype=dtype, device=device)
                elif tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
                    raise InputError(f"outputs[{name!r}] must be {shape} {dtype} on {device}")
                elif is_tile:
                    checks.row_major_tma(f"outputs[{name!r}]", t)
                elif not t.is_contiguous():
                    raise InputError(f"outputs[{name!r}] must be contiguous")
                out[name] = t
        extras = tuple(
            (float(tensors[name]) if scalar else (out[name] if is_out else tensors[name]))
            for name, is_out, scalar in self.extras
        )
        self.kernel(
            A,
            B,
            tuple(out[name] for name in self.store_names),
            tuple(tensors[name] for name in self.load_names),
            extras,
        )
        if self.finalizer is not None:
            self.finalizer(out, m, n, extent, given)
        return {name: out[name] for name in self.output_names}


_plans: dict[tuple, EpiloguePlan] = {}


def _plan(epi, A, B, majors, config, m, n, k) -> EpiloguePlan:
    device = A.device
    num_sms = checks.hopper_device(device)
    pkey = (epi, A.dtype, majors, device, config, epilogue_size_class(m, n, k))
    plan = _plans.get(pkey)
    if plan is None:
        reason = unsupported(epi)
        if reason is not None:
            raise NotImplementedError(f"this epilogue cannot be fused yet: {reason}")
        cfg = config or epilogue_config(epi, A.dtype, m, n, k, num_sms, majors)
        plan = _plans[pkey] = EpiloguePlan(epi, A.dtype, majors, device, num_sms, cfg)
    return plan


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
    NaN-poisoned ones in tests, or buffers reused across steps); they must have the
    declared shapes and dtypes."""
    if not epi.outputs:
        raise InputError("this epilogue has no outputs: add a TileStore, TileReduce or ...")
    m, n, k, a_major, b_major = cached_problem(A, B)
    plan = _plan(epi, A, B, (a_major, b_major), config, m, n, k)
    if check_contents or not plan.fast_checks_pass(A, B, tensors, m, n):
        _full_checks(epi, A, B, tensors, n, plan.need_n, check_contents)
    return plan(A, B, tensors, outputs)


def _full_checks(epi, A, B, tensors, n, need, check_contents) -> None:
    """The readable checks (each failure names the tensor and what was expected)."""
    bind(epi, A, B, tensors, contents=check_contents)
    for spec in epi.inputs:
        if spec.role == "tile":
            checks.row_major_tma(spec.name, tensors[spec.name])
        elif spec.role in ("row", "col") and not tensors[spec.name].is_contiguous():
            raise InputError(f"{spec.name!r} must be a contiguous vector")
    if n % need:
        raise InputError(
            f"N={n}: this epilogue needs N to be a multiple of {need} (TMA moves every "
            f"M x N*width tensor in rows of a multiple of 16 bytes, and column pairs must "
            f"not straddle the edge)"
        )


set_runner(run)
