"""Run an ``Epilogue`` fused into the PingPong GEMM: a cached launch plan per epilogue.

Sits in ``coda.runtime`` and is installed as the runner of :meth:`coda.Epilogue.__call__`
(``coda.epilogue.set_runner``; the epilogue never imports the runtime). The work that
depends only on (epilogue, operand dtype, operand layout, device, cluster shape) is done
once, in :class:`EpiloguePlan`: the fusability check, ``n_multiple``, the config
(:func:`epilogue_choice`: 128 x 128 tiles, narrower when the epilogue would spill
registers there), the fused visitor, the compiled kernel, and the order in which tensors
travel to it. A call then does only:

1. fast checks of every tensor (shape, dtype, device, TMA layout) -- on any mismatch the
   full, readable checks of :func:`coda.binding.bind` run to name the problem, and
   nothing is launched;
2. allocation of the outputs the caller did not supply (TileStore tensors, finalized
   results); the per-tile partials of reductions are scratch of the kernel's tiling and
   live in the stream's :class:`StreamScratch` (returned only when the caller passes
   ``outputs``, which then get their own);
3. one launch of the GEMM kernel (TVM-FFI: the torch tensors go straight to C). When
   the epilogue reduces across tiles, its results are finalized on the GPU
   (:mod:`coda.runtime.finalize`): by the GEMM kernel itself where the rows (columns)
   of tiles are short (the last tile of each finalizes them, counting arrivals in the
   stream scratch's counters, which every launch leaves at zero), else by one launch
   of the finalize kernel.

A repeated call -- the same epilogue, config and tensor dtypes, devices, shapes and
strides as an earlier call that passed the checks -- is recognized by one dictionary
look-up of that signature (:func:`_signature`) and runs the plan's bound call at that
size (:mod:`.bound_call`: straight-line code written once, which checks only the base
pointers, allocates, borrows the scratch and launches).

No host synchronization happens (tensor *values* are checked only with
``check_contents=True``) and nothing is allocated that the caller did not ask for, so a
call can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ..binding import bind
from ..caches import BoundedCache
from ..epilogue import Epilogue, set_runner
from ..errors import InputError
from ..mainloop.config import (
    GemmConfig,
    choose_config,
    choose_epilogue_config,
    epilogue_size_class,
)
from . import bound_call, checks, finalize, gemm_kernels
from .fused import (
    FusedVisitor,
    counter_slots,
    n_multiple,
    not_rollable,
    padded_tiles,
    unsupported,
)
from .kept import kept
from .operands import cached_problem

#: Output-tile widths tried, after the heuristic's own and narrower than it, for a fused
#: epilogue: the first whose kernel keeps everything in registers (no local memory) is
#: used. A narrower tile holds fewer accumulator registers (tile_n per thread) and leaves
#: more to the epilogue's values.
TILE_N_FALLBACKS = (128, 96, 64)


def tile_candidates(base: GemmConfig) -> tuple[GemmConfig, ...]:
    """``base`` and its fallbacks, widest first: with subtiles wider than 32 columns
    (the map passes'), the same tile with 32-column subtiles (half the values per
    thread), then the narrower tiles, each with 32-column subtiles."""
    narrow = (attrs.evolve(base, epi_n=32),) if base.epi_n > 32 else ()
    fallbacks = (
        attrs.evolve(base, tile_n=t, epi_n=32) for t in TILE_N_FALLBACKS if t < base.tile_n
    )
    return (base, *narrow, *fallbacks)


def epilogue_choice(
    epi: Epilogue,
    ab_dtype: torch.dtype,
    m: int,
    n: int,
    k: int,
    num_sms: int,
    majors: tuple[str, str] = ("k", "k"),
    base: GemmConfig | None = None,
    device: torch.device | None = None,
) -> tuple[GemmConfig, bool]:
    """(config, finalize in the GEMM kernel) that ``epi(A, B, ...)`` runs with when no
    config is given: the heuristic's tile (128 x 128; ``base`` instead when given, e.g.
    the plain GEMM's for ``config="gemm"``), or a narrower one when that kernel would
    spill registers; at each width the kernel's own finalize first
    (:func:`coda.runtime.finalize.in_gemm`), then the finalize kernel. The first
    kernel with no local memory wins. Compiles (or loads from the caches) the candidates
    it inspects; the answer is cached with them. With ``device`` the candidates are the
    kernels a launch there runs (``gemm_kernels.device_key``: the grid sized by the
    clusters that fit), so the winner's compile is the launch's; without, kernels for
    ``num_sms`` SMs (inspection off the GPU)."""
    return epilogue_placement(epi, ab_dtype, m, n, k, num_sms, majors, base, device)[:2]


def epilogue_placement(
    epi: Epilogue,
    ab_dtype: torch.dtype,
    m: int,
    n: int,
    k: int,
    num_sms: int,
    majors: tuple[str, str] = ("k", "k"),
    base: GemmConfig | None = None,
    device: torch.device | None = None,
) -> tuple[GemmConfig, bool, bool]:
    """:func:`epilogue_choice` and whether the finalize kernel finalizes row results
    early (``finalize.early_rows``): at each width and finalize placement, the kernel
    whose tiles arrive for an early finalize first, the one without those arrivals when
    it spills (their barrier and atomic can tip an epilogue at the register limit)."""
    if base is None:
        base = choose_epilogue_config(m, n, k, num_sms)
    for cfg in tile_candidates(base):
        for in_kernel in (True, False) if finalize.in_gemm(epi, cfg, m, n, num_sms) else (False,):
            for early in (True, False) if finalize.early_rows(epi, cfg, in_kernel) else (False,):
                if spills_free(epi, ab_dtype, cfg, in_kernel, early, num_sms, majors, device):
                    return cfg, in_kernel, early
    return cfg, False, False  # every candidate spills: the narrowest, which spills least


def spills_free(
    epi: Epilogue,
    ab_dtype: torch.dtype,
    cfg: GemmConfig,
    in_kernel: bool,
    early: bool,
    num_sms: int,
    majors: tuple[str, str],
    device: torch.device | None,
) -> bool:
    """True when the fused kernel of ``epi`` in ``cfg`` (finalizing in the kernel, or
    arriving for an early finalize) uses no local memory. Compiles it (or loads it from
    the caches); with ``device``, the kernel a launch there runs."""
    visitor = FusedVisitor(epi, in_kernel, early)
    if device is None:
        key = gemm_kernels.kernel_key(cfg, ab_dtype, visitor, num_sms, *majors)
    else:
        key = gemm_kernels.device_key(cfg, ab_dtype, visitor, device, *majors)
    return gemm_kernels.local_memory_bytes(key) == 0


class EpiloguePlan:
    """Everything about running ``epi`` that does not depend on the call's tensors."""

    def __init__(
        self,
        epi: Epilogue,
        ab_dtype: torch.dtype,
        majors: tuple[str, str],
        device: torch.device,
        config: GemmConfig,
        finalize_in_kernel: bool = False,
        finalize_lanes: tuple[int, int] = finalize.DEFAULT_LANES,
        early_finalize: bool = False,
    ):
        self.epi = epi
        self.device = device
        self.config = config
        self.tile = config.partials_tile
        #: the GEMM's tiles arrive per row of tiles and the finalize kernel finalizes each
        #: row band as soon as its tiles are in (the caller, :func:`_plan`, decided it
        #: with ``finalize.early_rows`` and :func:`spills_free`)
        self.early = early_finalize
        self.visitor = FusedVisitor(epi, finalize_in_kernel, self.early)
        self.key = gemm_kernels.device_key(config, ab_dtype, self.visitor, device, *majors)
        self.kernel = gemm_kernels.launcher(self.key)
        self.need_n = n_multiple(epi)
        # (name, role, dtype, width numerator, denominator) of each input, binding order
        self.inputs = tuple(
            (s.name, s.role, s.dtype, s.width.numerator, s.width.denominator) for s in epi.inputs
        )
        self.store_names = tuple(p.out for p in self.visitor.stores)
        self.tile_inputs = tuple(s.name for s in epi.inputs if s.role == "tile")
        self.load_names = tuple(p.name for p in self.visitor.loads)
        self.extras = tuple(
            (s.name, s.direction == "out", s.role == "scalar") for s in self.visitor.extras_specs
        )
        self.finalizer = finalize.plan(epi, finalize_in_kernel, finalize_lanes, self.early)
        #: the kernel takes arrival counters (after its extras): it finalizes itself, or
        #: its tiles arrive for the early finalize
        self.counters = self.visitor.takes_counters
        #: what a finalize kernel that reads no counters is handed in their place
        self._no_counters = _stand_in_counters(device)
        # what runs after the GEMM: the finalize kernel and / or torch finalizes
        self.after = self.finalizer is not None and (
            self.finalizer.launch is not None or bool(self.finalizer.eager)
        )
        # what a call allocates: the kernel's outputs (tiles, partials) and the results the
        # finalize kernel writes (the torch fallback allocates its own)
        finalized = self.finalizer.results if self.finalizer is not None else ()
        self.allocated = tuple(
            s for s in epi.outputs if s.role == "tile" or s.is_partials or s in finalized
        )
        self.output_names = tuple(s.name for s in epi.outputs)
        #: what a call returns when the caller passes no ``outputs``: everything but the
        #: per-tile partials (scratch of the kernel's tiling, see :class:`StreamScratch`)
        self.result_names = tuple(s.name for s in epi.outputs if not s.is_partials)
        self._sizes: BoundedCache[tuple[int, int], tuple] = BoundedCache(256)
        self._bound: BoundedCache[tuple[int, int], bound_call.BoundCall] = BoundedCache(256)

    def sizes(self, m: int, n: int) -> tuple:
        """At (M, N), computed once per problem size: ((name, shape, dtype, is_tile) of each
        allocated output, the partials' workspace: (floats, ((name, shape, stride,
        offset), ...)), the finalize kernel's extent, the arrival-counter slots). The fp32
        per-tile partials (internal to the finalize) share one workspace, views 16-byte
        aligned; results and M x N outputs get their own allocation, so no two results
        alias each other (as custom ops and autograd require)."""
        got = self._sizes.get((m, n))
        if got is None:
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
            slots = 0
            if self.early:
                slots = finalize.early_counter_slots(self.config, m)
            elif self.counters:
                slots = counter_slots(self.config, m, n)
            got = self._sizes.put((m, n), (tuple(outs), (floats, tuple(views)), extent, slots))
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
        if not outputs:
            return self.launch(A, B, tensors, m, n)
        outs, (floats, views), extent, slots = self.sizes(m, n)
        device = self.device
        out: dict[str, torch.Tensor] = {}
        given = outputs
        wanted = outs + tuple((v[0], v[1], torch.float32, False) for v in views)
        for name, shape, dtype, is_tile in wanted:
            t = given.get(name)
            if t is None:
                t = torch.empty(shape, dtype=dtype, device=device)
            elif tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
                raise InputError(f"outputs[{name!r}] must be {shape} {dtype} on {device}")
            elif is_tile:
                checks.row_major_tma(f"outputs[{name!r}]", t, written=True)
            elif not t.is_contiguous():
                raise InputError(f"outputs[{name!r}] must be contiguous")
            out[name] = t
        counters = _scratch(device).counters(slots) if slots else None
        self._launch(A, B, tensors, out, counters, m, n, extent, given)
        return {name: out[name] for name in self.output_names}

    def launch(self, A, B, tensors: Mapping[str, Any], m: int, n: int) -> dict:
        """The call with every output allocated here (the hot path: no checks). Returns
        the results and M x N outputs; the partials live in the stream's scratch."""
        got = self.bound(m, n)(A, B, tensors)
        if got is None:
            raise InputError("A, B and every M x N tensor must start 16-byte aligned (TMA)")
        return got

    def bound(self, m: int, n: int) -> bound_call.BoundCall:
        """The straight-line host code of a call at (M, N) (:mod:`.bound_call`): the
        allocations, the scratch it borrows, one kernel launch and the finalize, written
        out once for this plan and size."""
        fn = self._bound.get((m, n))
        if fn is None:
            outs, work, extent, slots = self.sizes(m, n)
            device = self.device

            def lend():
                return _scratch(device).get(self, m, n, work, slots)

            arrivals = self.arrivals(n)
            no_counters = self._no_counters

            def after(out, counters):
                if counters is None:
                    counters = no_counters
                self.finalizer(out, m, n, extent, {}, counters, arrivals)

            fn = bound_call.bind(
                kernel=self.kernel,
                device=device,
                allocated=tuple((name, shape, dtype) for name, shape, dtype, _ in outs),
                partials=tuple(v[0] for v in work[1]),
                counters=bool(slots),
                lend=lend if work[0] or slots else None,
                store_names=self.store_names,
                load_names=self.load_names,
                tile_inputs=self.tile_inputs,
                extras=self.extras,
                finalize=after if self.after else None,
                returned=self.result_names,
            )
            self._bound.put((m, n), fn)
        return fn

    def arrivals(self, n: int) -> int:
        """The tiles of a row of tiles an early finalize waits for (the scheduler's, with
        the cluster's padding columns; 0 without ``early``)."""
        return padded_tiles(n, self.config.tile_n, self.config.cluster_n) if self.early else 0

    def _launch(self, A, B, tensors, out, counters, m, n, extent, given) -> None:
        extras = [
            (float(tensors[name]) if scalar else (out[name] if is_out else tensors[name]))
            for name, is_out, scalar in self.extras
        ]
        if counters is not None:
            extras.append(counters)
        self.kernel(
            A,
            B,
            tuple([out[name] for name in self.store_names]),
            tuple([tensors[name] for name in self.load_names]),
            tuple(extras),
        )
        if self.after:
            fin_counters = counters if counters is not None else self._no_counters
            self.finalizer(out, m, n, extent, given, fin_counters, self.arrivals(n))


#: device -> the int32 tensor a finalize kernel that reads no counters is handed
_STAND_INS: dict[torch.device, torch.Tensor] = {}


def _stand_in_counters(device: torch.device) -> torch.Tensor:
    """One int32 element per device, kept between calls (``kept``: never in a private
    memory pool that a CUDA graph tree warms up)."""
    got = _STAND_INS.get(device)
    if got is None:
        got = _STAND_INS[device] = kept(
            lambda: torch.zeros(1, dtype=torch.int32, device=device), device
        )
    return got


#: The largest partials workspace (fp32 elements, 8 MiB) a stream keeps between calls.
SCRATCH_MAX_FLOATS = 1 << 21


class StreamScratch:
    """Scratch of the fused calls on one CUDA stream: a workspace for per-tile partials
    (fp32) and the int32 arrival counters of in-kernel finalizes.

    Calls on one stream run one after another, so they can share it: each call's
    partials are written and consumed (by the kernel's own finalize, the finalize
    kernel or a torch finalize, all on the stream) before the next call starts, and
    every launch leaves the counters it used at zero. The views a plan needs at a size
    are made once and kept. Under CUDA-graph capture :func:`_scratch` hands out a
    fresh one instead (owned by the graph's memory pool: a graph may replay on any
    stream)."""

    def __init__(self, device: torch.device, keep: bool = True):
        self.device = device
        self.keep = keep
        self._floats = torch.empty(0, dtype=torch.float32, device=device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._views: dict[tuple, tuple] = {}

    def _new(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A buffer: kept ones outside any private memory pool (:func:`kept`)."""
        return kept(make, self.device) if self.keep else make()

    def counters(self, slots: int) -> torch.Tensor:
        if self._counters.numel() < slots:
            # a replaced buffer goes back to the allocator in stream order: no hazard
            size = max(slots, 1024) if self.keep else slots
            self._counters = self._new(
                lambda: torch.zeros(size, dtype=torch.int32, device=self.device)
            )
            self._views.clear()
        return self._counters

    def get(self, plan: Any, m: int, n: int, work: tuple, slots: int) -> tuple:
        """({partials name: view}, counters or None) for ``plan`` at (M, N). Partials
        larger than ``SCRATCH_MAX_FLOATS`` get a workspace of their own per call (an LM
        head's: a long-running call, and memory not to keep)."""
        key = (plan, m, n)
        hit = self._views.get(key)
        if hit is None:
            floats, views = work
            counters = self.counters(slots) if slots else None
            if floats > SCRATCH_MAX_FLOATS:
                ws = torch.empty(floats, dtype=torch.float32, device=self.device)
                return {name: ws.as_strided(sh, st, off) for name, sh, st, off in views}, counters
            if self._floats.numel() < floats:
                size = max(floats, 2 * self._floats.numel()) if self.keep else floats
                self._floats = self._new(
                    lambda: torch.empty(size, dtype=torch.float32, device=self.device)
                )
                self._views.clear()
            ws = self._floats
            partials = {name: ws.as_strided(sh, st, off) for name, sh, st, off in views}
            hit = (partials, counters)
            if self.keep:
                if len(self._views) > 256:
                    self._views.clear()
                self._views[key] = hit
        return hit


#: (device index, raw stream) -> that stream's :class:`StreamScratch`
_scratches: dict[tuple[int, int], StreamScratch] = {}


def _scratch(device: torch.device) -> StreamScratch:
    """The scratch of the current stream (a fresh, unshared one under graph capture)."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return StreamScratch(device, keep=False)
    index = device.index
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    got = _scratches.get(key)
    if got is None:
        got = _scratches[key] = StreamScratch(device)
    return got


#: bounded: config="gemm" keys whole shapes
_plans: BoundedCache[tuple, EpiloguePlan] = BoundedCache(4096)


#: ``config`` value of a fused call that takes the plain GEMM's heuristic tile
GEMM_TILES = "gemm"


def gemm_tiles(m: int, n: int, k: int, num_sms: int, short_groups: bool = False) -> GemmConfig:
    """The tile of ``config="gemm"``: the one ``coda.gemm`` picks for (m, n, k) (e.g. a
    256-row cooperative tile on long-running problems, whose warpgroups run the
    epilogue at once after the mainloop: for light epilogues on long mainloops).
    ``epilogue_choice`` then narrows it if that spills."""
    return choose_config(m, n, k, num_sms, short_groups=short_groups)


def _plan(epi, A, B, majors, config, m, n, k) -> EpiloguePlan:
    device = A.device
    num_sms = checks.hopper_device(device)
    if config == GEMM_TILES:  # the plain heuristic reads the whole shape
        size: tuple = (m, n, k)
    elif config is None or isinstance(config, GemmConfig):
        size = (epilogue_size_class(m, n, k, num_sms), finalize.size_class(m, n, num_sms))
    else:
        raise TypeError(f"config must be a GemmConfig, None or 'gemm'; got {config!r}")
    pkey = (epi, A.dtype, majors, device, config, *size)
    plan = _plans.get(pkey)
    if plan is None:
        reason = unsupported(epi)
        if reason is not None:
            raise NotImplementedError(f"this epilogue cannot be fused yet: {reason}")
        if isinstance(config, GemmConfig) and config.rolled_epilogue:
            stuck = not_rollable(epi)
            if stuck:
                raise ValueError(
                    f"GemmConfig.rolled_epilogue: {', '.join(stuck)} cannot run for a runtime "
                    f"subtile index (Primitive.rollable is False); drop rolled_epilogue"
                )
        if config is None:
            cfg, in_kernel, early = epilogue_placement(
                epi, A.dtype, m, n, k, num_sms, majors, device=device
            )
        elif config == GEMM_TILES:
            base = gemm_tiles(m, n, k, num_sms, checks.short_swizzle_groups(device))
            cfg, in_kernel, early = epilogue_placement(
                epi, A.dtype, m, n, k, num_sms, majors, base=base, device=device
            )
        else:  # the caller's config, as given
            cfg, in_kernel = config, finalize.in_gemm(epi, config, m, n, num_sms)
            early = finalize.early_rows(epi, cfg, in_kernel) and spills_free(
                epi, A.dtype, cfg, in_kernel, True, num_sms, majors, device
            )
        lanes = finalize.lanes(m, n)
        plan = EpiloguePlan(epi, A.dtype, majors, device, cfg, in_kernel, lanes, early)
        plan = _plans.put(pkey, plan)
    return plan


def run(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    tensors: Mapping[str, Any],
    config: GemmConfig | str | None = None,
    outputs: Mapping[str, torch.Tensor] | None = None,
    check_contents: bool = False,
) -> dict[str, torch.Tensor]:
    """Fused ``epi(A, B, **tensors)``. ``outputs`` may pre-supply output tensors (e.g.
    NaN-poisoned ones in tests, or buffers reused across steps); they must have the
    declared shapes and dtypes."""
    sig = None if outputs or check_contents else _signature(epi, config, A, B, tensors)
    if sig is not None:
        call = _calls.get(sig)
        if call is not None:
            got = call(A, B, tensors)
            if got is not None:  # else a base pointer breaks TMA's rule: the full path
                return got
    if not epi.outputs:
        raise InputError("this epilogue has no outputs: add a TileStore, TileReduce or ...")
    m, n, k, a_major, b_major = cached_problem(A, B)
    plan = _plan(epi, A, B, (a_major, b_major), config, m, n, k)
    if check_contents or not plan.fast_checks_pass(A, B, tensors, m, n):
        _full_checks(epi, A, B, tensors, n, plan.need_n, check_contents)
    if sig is not None:
        _calls.put(sig, plan.bound(m, n))
    return plan(A, B, tensors, outputs)


#: call signature (:func:`_signature`) -> the plan's bound call at that size
#: (:meth:`EpiloguePlan.bound`): a call whose every tensor has the dtype, device, shape and
#: strides of an earlier call that passed the checks needs only its base pointers checked,
#: which the bound call does (fail-closed: any difference, a new name or a non-tensor in a
#: tensor's place, misses and takes the full path).
_calls: BoundedCache[tuple, bound_call.BoundCall] = BoundedCache(4096)


#: epilogue -> its call-signature function (:func:`bound_call.signature_of`)
_signature_fns: BoundedCache[Epilogue, Any] = BoundedCache(4096)


def _signature(epi, config, A, B, tensors: Mapping[str, Any]) -> tuple | None:
    """The call's signature, or None when it cannot be identified cheaply (A or B no
    tensor, a name missing or extra, a non-tensor in a tensor's place: the full checks
    say which)."""
    fn = _signature_fns.get(epi)
    if fn is None:
        fn = _signature_fns.put(
            epi, bound_call.signature_of(tuple((s.name, s.role == "scalar") for s in epi.inputs))
        )
    return fn(epi, config, A, B, tensors)


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
