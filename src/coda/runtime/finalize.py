"""Finalize: turn the per-tile partials a fused kernel wrote into the epilogue's results.

Sits in ``coda.runtime`` under :mod:`coda.runtime.epilogue_kernels`. Reductions and
running states (``TileReduce``, ``LogSumExp``, ``TargetSelect``) leave per-tile partials
(M x tiles or tiles x N*w); each primitive combines them (and applies its ``post``).

Every primitive with ``traces_finalize`` is finalized on the GPU, in one of two places:

* in the GEMM kernel itself (:func:`in_gemm`: small problems, where each consumer
  warpgroup arrives at the counters about once, with rows or columns of tiles short
  enough for the last tile of each to finalize them; :class:`coda.runtime.fused.FusedVisitor`
  with ``finalize_in_kernel``): nothing is launched after the GEMM;
* else by ONE small kernel per epilogue (:mod:`coda.runtime.finalize_kernel`, compiled
  once per epilogue value and kept in the same memory and disk caches as the GEMM
  kernels), launched right after the GEMM on the same stream (an LM head's rows have
  ~1000 tiles: a grid of warps reads them faster than one tile's threads would). With
  row results only (:func:`early_rows`), the GEMM's tiles count themselves per row of
  tiles and the kernel finalizes each row band as soon as its tiles are in, during the
  GEMM's last wave, instead of after the whole grid.

Either way: no allocation the caller did not ask for, CUDA graph friendly. A user
primitive without ``trace_finalize`` is finalized by its torch ``finalize`` (correct,
just slower). :func:`plan` prepares this once per launch plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from ..epilogue import Epilogue
from ..geometry import Problem
from ..primitives.base import COL_LANES, Primitive
from . import gemm_kernels
from .fused import in_kernel_axes, padded_tiles, traced_finalizers

#: The GEMM kernel finalizes its results itself only while the problem has at most this
#: many 128 x 128 output tiles per SM, i.e. each consumer warpgroup arrives about once.
#: Every tile's arrival at the counters (a barrier, a fence, an atomic round trip) and
#: the last tile's finalize lengthen the epilogue that hides in the other warpgroup's
#: mainloop: on an H100 at M=16384, N=K=2048 (2048 tiles) they cost the log-sum-exp
#: epilogue 10% of its kernel time (1.16 vs 1.06 of the plain GEMM), far more than the
#: finalize kernel's few microseconds; a map pass (K <= 64, no mainloop at all) would pay
#: them per tile too. Few tiles are the small, host-bound calls, where the saved launch
#: is what counts (512^3: 16 tiles, 2048^3: 256).
IN_GEMM_MAX_TILES_PER_SM = 2
#: ... and while a row has at most this many columns (64 tiles of 128: a thread per row
#: reads its row's partials, 8 loads in flight) ...
ROWS_IN_GEMM_MAX_N = 8192
#: ... and a column at most this many rows (a column of tiles completes at the end of
#: the schedule, so its finalize adds to the kernel's tail).
COLS_IN_GEMM_MAX_M = 4096


def in_gemm(epi: Epilogue, config: Any, m: int, n: int, num_sms: int) -> bool:
    """True when the GEMM kernel finalizes ``epi``'s GPU-finalized results itself at
    (M, N) on ``num_sms`` SMs with ``config`` (PingPong 128-row tiles, no split-K)."""
    axes = in_kernel_axes(epi)
    if axes is None or config.tile_m != 128 or config.split_k != 1:
        return False
    rows, cols = axes
    few, short_rows, short_cols = size_class(m, n, num_sms)
    return few and (short_rows or not rows) and (short_cols or not cols)


#: Finalize row results early (:func:`early_rows`) where that applies: the default since
#: the forty-seventh session, after every GPU test of a reducing path, the fuzzer and
#: compute-sanitizer ran with it on the H200 (``CODA_EARLY_FINALIZE=0`` in the
#: environment, read at import, turns it off; docs/fused-epilogues.md, "Early finalize").
EARLY_ROWS = os.environ.get("CODA_EARLY_FINALIZE", "1") != "0"


def early_rows(epi: Epilogue, config: Any, in_kernel: bool) -> bool:
    """True when ``epi``'s finalize kernel finalizes each row band as soon as the GEMM's
    tiles of that band are in (the tiles arrive at per-band counters): every
    GPU-finalized result is a row result, the GEMM finalizes nothing itself, its tiles
    are 128 rows high (PingPong) and not split along K."""
    if not EARLY_ROWS or in_kernel or config.tile_m != 128 or config.split_k != 1:
        return False
    return in_kernel_axes(epi) == (True, False)


def early_counter_slots(config: Any, m: int) -> int:
    """Length of an early finalize's counter tensor: an arrival counter per row of tiles
    (as the scheduler enumerates them), then one counting the finalize's CTAs done."""
    return 2 * padded_tiles(m, config.tile_m, config.cluster_m)


def size_class(m: int, n: int, num_sms: int) -> tuple[bool, bool, bool]:
    """What of (M, N) :func:`in_gemm` depends on (part of a launch plan's key): few tiles
    (counted at 128 x 128, whatever the tile), short rows, short columns."""
    tiles = -(-m // 128) * -(-n // 128)
    return (
        tiles <= IN_GEMM_MAX_TILES_PER_SM * num_sms,
        n <= ROWS_IN_GEMM_MAX_N,
        m <= COLS_IN_GEMM_MAX_M,
    )


#: Threads of the finalize kernel per row result, for rows of at most
#: ``ROWS_IN_GEMM_MAX_N`` columns (``size_class``'s short rows: <= 64 tiles of 128) and
#: for longer ones (an LM head's ~1000 tiles: a warp's 32 lanes, coalesced); and per
#: column result for columns of at most ``COLS_IN_GEMM_MAX_M`` rows (<= 32 tiles) and
#: longer ones. Measured at M = 16384, N = K = 2048 (16 tiles a row, 128 a column): the
#: finalize's tail after the GEMM went 7.1 -> 4.3 us for log-sum-exp + target (32 -> 16
#: threads a row: the grid fits one wave), 3.8 -> 2.5 us for RMSNorm's sum of squares
#: (H100, ``results/finalize_lanes_ab_h100.json``) and 11.7 -> 6.1 us for the dgamma
#: column sum + column max (16 -> 32 threads a column with ``COLUMNS_SPREAD_SMEM``; 8
#: threads, the engine before: 15.1; H200, ``results/finalize_spread_h200.json``).
SHORT_ROW_LANES = 16
LONG_ROW_LANES = 32
SHORT_COL_LANES = COL_LANES
LONG_COL_LANES = 32


#: (threads per row result, per column result) of a finalize kernel built without a size
#: in mind (``FinalizeKey``'s defaults, tests and inspection)
DEFAULT_LANES = (32, COL_LANES)

#: Shared memory each CTA of a finalize kernel with column results only reserves (and
#: never uses), so that at most 4 of its CTAs share an SM. It runs as the GEMM's
#: programmatic dependent, so its CTAs land on the SMs the GEMM frees first: 16 to an
#: SM, a grid of a few hundred CTAs sat on ~16 SMs and read the (tiles, cols) partials
#: there (the column sums' finalize of RMSNorm's dgamma at M = 16384, N = 2048 ended
#: 11.7 us after the GEMM on an H200, 8.9 us spread, with 16 threads a column; row
#: results fill every SM with thousands of CTAs).
COLUMNS_SPREAD_SMEM = 48 * 1024


def lanes(m: int, n: int) -> tuple[int, int]:
    """(threads per row result, threads per column result) of the finalize kernel at
    (M, N): a function of ``size_class``'s short rows and short columns only."""
    return (
        SHORT_ROW_LANES if n <= ROWS_IN_GEMM_MAX_N else LONG_ROW_LANES,
        SHORT_COL_LANES if m <= COLS_IN_GEMM_MAX_M else LONG_COL_LANES,
    )


def _finalizing(epi: Epilogue) -> tuple[Primitive, ...]:
    return tuple(p for p in epi.primitives if type(p).finalize is not Primitive.finalize)


@attrs.frozen(cache_hash=True)
class FinalizeKey:
    """Everything the finalize kernel of an epilogue depends on (a compile-cache key)."""

    epilogue: Epilogue
    dsl: str = attrs.field(factory=gemm_kernels.dsl_version)
    #: threads per row result and per column result (``lanes``)
    row_lanes: int = DEFAULT_LANES[0]
    col_lanes: int = DEFAULT_LANES[1]
    #: shared memory each CTA reserves to spread the grid over the SMs (0: none)
    spread_smem: int = 0
    #: each CTA waits for its row of tiles' arrivals, not the GEMM grid (``early_rows``)
    early: bool = False

    def traced(self) -> tuple[Primitive, ...]:
        return traced_finalizers(self.epilogue)

    def tensor_names(self) -> tuple[str, ...]:
        """The partials and results the kernel reads and writes, in argument order."""
        values = self.epilogue.values
        names: list[str] = []
        for p in self.traced():
            names += [s.name for s in p.tensors(values) if s.direction == "out"]
        return tuple(names)

    def compile(self, options: str | None = None):
        """Compile the kernel for sm_90a (uncached; works without a GPU)."""
        gemm_kernels.ensure_arch()
        import cutlass.cute as cute

        from .finalize_kernel import FinalizeKernel, fake_args

        names = self.tensor_names()
        shapes = {
            name: tuple(f"{name}:{d}" for d in range(_rank(self.epilogue, name))) for name in names
        }
        kernel = FinalizeKernel(
            self.traced(),
            names,
            self.epilogue.values,
            self.row_lanes,
            self.col_lanes,
            self.spread_smem,
            self.early,
        )
        opts = f"{gemm_kernels.TVM_FFI} {options or ''}".strip()
        return cute.compile(kernel, *fake_args(kernel, shapes), options=opts)


def key_for(
    epi: Epilogue, lanes: tuple[int, int] = DEFAULT_LANES, early: bool = False
) -> FinalizeKey:
    """The finalize kernel of ``epi`` with ``lanes`` threads per row and per column
    result; with column results only, its CTAs spread over the SMs
    (``COLUMNS_SPREAD_SMEM``); ``early``: it follows a GEMM whose tiles arrive per row
    of tiles (:func:`early_rows`)."""
    rows, _ = _extent_widths(epi, traced_finalizers(epi))
    spread = 0 if rows else COLUMNS_SPREAD_SMEM
    return FinalizeKey(epi, row_lanes=lanes[0], col_lanes=lanes[1], spread_smem=spread, early=early)


def _rank(epi: Epilogue, name: str) -> int:
    spec = next(s for s in epi.outputs if s.name == name)
    return 2 if spec.is_partials else 1


def _extent_widths(epi: Epilogue, traced) -> tuple[bool, tuple]:
    """(has row results, widths of its column results): the grid covers M and N * w."""
    rows, widths = False, []
    for p in traced:
        for s in p.tensors(epi.values):
            if s.direction == "out" and not s.is_partials:
                if s.role == "row":
                    rows = True
                else:
                    widths.append(s.width)
    return rows, tuple(widths)


class FinalizePlan:
    """How an epilogue's results are finalized (prepared once per launch plan).

    ``results``: the result tensors the finalize kernel writes (the caller allocates them
    with the kernel's other outputs); ``extent(m, n)``: the kernel's thread count;
    ``__call__(out, m, n, extent, given, counters, arrivals)``: launch the kernel on
    ``out`` (partials and results by name; ``early``: the GEMM's arrival counters and the
    arrivals a row of tiles completes at, else any int32 tensor and 0), then run the
    torch ``finalize`` of primitives without a traced one.
    """

    def __init__(
        self,
        epi: Epilogue,
        in_kernel: bool = False,
        lanes: tuple[int, int] = DEFAULT_LANES,
        early: bool = False,
    ):
        key = key_for(epi, lanes, early)
        self.early = early
        self.row_lanes, self.col_lanes = lanes
        traced = key.traced()
        #: the GEMM kernel finalizes ``traced`` itself: nothing to launch here
        self.in_kernel = in_kernel and bool(traced)
        self.eager = tuple(p for p in _finalizing(epi) if not p.traces_finalize)
        self.values = epi.values
        self.names = key.tensor_names()
        self.results = tuple(
            s
            for p in traced
            for s in p.tensors(epi.values)
            if s.direction == "out" and not s.is_partials
        )
        self.launch = None
        if traced and not self.in_kernel:
            fn = gemm_kernels.get_compiled("finalize", key, FinalizeKey.compile)
            self.launch = getattr(fn, "_tvm_ffi_function", None) or fn
        self._rows, self._widths = _extent_widths(epi, traced)

    def extent(self, m: int, n: int) -> int:
        """Threads of the finalize kernel: ``row_lanes`` per row, ``col_lanes`` per column
        (whole warps of 32 / col_lanes columns)."""
        per_warp = 32 // self.col_lanes
        cols = [32 * -(-int(n * w) // per_warp) for w in self._widths]
        rows = -(-self.row_lanes * m // 32) * 32  # whole warps
        return max(([rows] if self._rows else [1]) + cols)

    def __call__(
        self,
        out: dict,
        m: int,
        n: int,
        extent: int,
        given: Mapping,
        counters: Any = None,
        arrivals: int = 0,
    ) -> None:
        if self.launch is not None:
            self.launch(tuple([out[name] for name in self.names]), counters, m, n, extent, arrivals)
        if self.eager:
            problem = Problem(M=m, N=n, K=1)
            partials = dict(out)
            for p in self.eager:
                for name, t in p.finalize(partials, problem, self.values).items():
                    dst = given.get(name)
                    if dst is not None:
                        dst.copy_(t)
                        t = dst
                    out[name] = t


def plan(
    epi: Epilogue,
    in_kernel: bool = False,
    lanes: tuple[int, int] = DEFAULT_LANES,
    early: bool = False,
) -> FinalizePlan | None:
    """The :class:`FinalizePlan` of ``epi`` (``in_kernel``: the GEMM kernel finalizes what
    it can; ``lanes``: threads per row and per column result in the finalize kernel;
    ``early``: :func:`early_rows`), or None when nothing needs finalizing."""
    return FinalizePlan(epi, in_kernel, lanes, early) if _finalizing(epi) else None


def compile_artifacts(
    epi: Epilogue, dump_dir: str, lanes: tuple[int, int] = DEFAULT_LANES, early: bool = False
) -> tuple[str, bytes]:
    """(PTX, cubin) of ``epi``'s finalize kernel with ``lanes`` threads per row and per
    column result (``early``: :func:`early_rows`); for inspection and CPU tests."""
    fn = key_for(epi, lanes, early).compile(
        options=f"--keep-ptx --keep-cubin --gpu-arch sm_90a --dump-dir {dump_dir}"
    )
    return fn.__ptx__, fn.__cubin__


def uses_kernel(epi: Epilogue) -> bool:
    """True when ``epi`` has results finalized by the finalize kernel."""
    return bool(FinalizeKey(epi).traced())


__all__: list[Any] = [
    "FinalizeKey",
    "FinalizePlan",
    "compile_artifacts",
    "early_counter_slots",
    "early_rows",
    "in_gemm",
    "plan",
    "size_class",
    "uses_kernel",
]
