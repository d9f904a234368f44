"""The epilogue's finalize kernel (CuTeDSL): every per-tile partial -> result, one launch.

Sits in ``coda.runtime`` under :mod:`coda.runtime.finalize` (imported only when a
finalize kernel is compiled: it imports CuTeDSL). ``row_lanes`` neighbouring threads
finalize each row of every row result (they stride over the row's tiles: coalesced
however many tiles there are) and ``col_lanes`` threads each column of every column
result (warp ``w`` holds columns ``w * 32 / col_lanes`` onward), each primitive emitting
its own ``trace_finalize`` (combine the tiles' partials, apply ``post``); the thread
counts come from :func:`coda.runtime.finalize.lanes` (part of the compile key). The grid's
``extent`` threads cover row_lanes x M (rows) and col_lanes x the longest column
result.

It is launched as a programmatic dependent of the GEMM kernel (``use_pdl``: the GEMM
kernel lets it start as soon as every one of its CTAs runs, see
``coda.mainloop.kernel``): its CTAs take SMs as the GEMM's last tiles free them and
wait (``griddepcontrol.wait``) for the whole GEMM grid to finish and its writes to be
visible before reading a partial, so the launch gap between the two kernels is gone.
Shapes are symbolic and every tensor is checked by the TVM-FFI entry, like the GEMM
kernels.

``early`` (row results only, the GEMM's tiles 128 rows high): a CTA's rows lie in one
row of tiles, and instead of waiting for the whole GEMM grid the CTA waits until that
row of tiles' arrival counter (``counters[band]``, which every tile of it increments
once its partials are written: ``coda.runtime.fused``'s ``early_rows``) reaches
``arrivals`` (the row's tiles, as the scheduler enumerates them): one thread polls it
with GPU-scope acquire loads, then the CTA's barrier (CUTLASS's generic-barrier
pattern). So the rows whose tiles are done finalize during the GEMM's last wave, on the
SMs it leaves idle, and only the last rows' finalize trails the GEMM. Each CTA then
counts itself at ``counters[bands + band]``; the last of its row of tiles resets both
counters to zero (the stream scratch's rule: every launch leaves them at zero). The
grid's last CTA ends with ``griddepcontrol.wait``, so the kernel never completes before
the GEMM grid whose outputs later kernels read. Without ``early``, ``counters`` and
``arrivals`` are unused.
"""

from __future__ import annotations

from ..mainloop.cute_env import ensure_arch

ensure_arch()

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..primitives.tracing import TraceFinalize

THREADS = 128
#: rows of one row of tiles of the GEMM an ``early`` finalize follows (PingPong tiles)
BAND_ROWS = 128


class FinalizeKernel:
    """Compile-time object: ``prims`` (primitives with ``traces_finalize``), ``names``
    (the tensors they read and write, in argument order), the epilogue's value specs."""

    def __init__(
        self,
        prims,
        names,
        specs,
        row_lanes: int,
        col_lanes: int,
        spread_smem: int = 0,
        early: bool = False,
    ):
        self.prims = prims
        self.names = names
        self.specs = specs
        self.row_lanes = row_lanes
        self.col_lanes = col_lanes
        #: shared memory each CTA reserves (and never uses), so that few CTAs share an SM
        self.spread_smem = spread_smem
        #: each CTA waits for its own row of tiles, not the whole GEMM grid (module doc)
        self.early = early

    @cute.jit
    def __call__(
        self, tensors, counters, m: Int32, n: Int32, extent: Int32, arrivals: Int32, stream
    ):
        blocks = (extent + THREADS - 1) // THREADS
        if cutlass.const_expr(self.spread_smem > 0):
            self.kernel(tensors, counters, m, n, arrivals).launch(
                grid=(blocks, 1, 1),
                block=(THREADS, 1, 1),
                stream=stream,
                use_pdl=True,
                smem=self.spread_smem,
            )
        else:
            self.kernel(tensors, counters, m, n, arrivals).launch(
                grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True
            )

    @cute.jit
    def _await_band(self, counters, band: Int32, arrivals: Int32, tidx: Int32):
        """Until row of tiles ``band`` has all its ``arrivals`` (one polling thread, then
        the CTA's barrier)."""
        if tidx == 0:
            ptr = (counters.iterator + band).llvm_ptr
            seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            while seen < arrivals:
                seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()

    @cute.jit
    def _release_band(self, counters, band: Int32, m: Int32, tidx: Int32):
        """Count this CTA done with ``band``'s arrivals; the band's last CTA resets its
        arrival and CTA counters."""
        if tidx == 0:
            bands = (m + BAND_ROWS - 1) // BAND_ROWS
            rows = cutlass.min(m - band * BAND_ROWS, BAND_ROWS)
            ctas = (rows * self.row_lanes + THREADS - 1) // THREADS
            old = cute.arch.atomic_add(
                ptr=(counters.iterator + bands + band).llvm_ptr,
                val=Int32(1),
                sem="relaxed",
                scope="gpu",
            )
            if old == ctas - 1:
                counters[band] = Int32(0)
                counters[bands + band] = Int32(0)

    @cute.kernel
    def kernel(self, tensors, counters, m: Int32, n: Int32, arrivals: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        index = bidx * THREADS + tidx
        lane = tidx % 32
        per_warp = 32 // self.col_lanes  # consecutive columns in a warp
        by_name = {name: tensors[i] for i, name in enumerate(self.names)}
        fin = TraceFinalize(
            row=index // self.row_lanes,
            lane=index % self.row_lanes,
            col=(index // 32) * per_warp + lane % per_warp,
            tensors=by_name,
            m=m,
            n=n,
            specs=self.specs,
            lanes=self.row_lanes,
            col_lane=lane // per_warp,
            col_lanes=self.col_lanes,
        )
        if cutlass.const_expr(self.early):
            # this CTA's rows lie in one row of tiles: wait for its tiles only
            band = (bidx * (THREADS // self.row_lanes)) // BAND_ROWS
            self._await_band(counters, band, arrivals, tidx)
            self._release_band(counters, band, m, tidx)
            for p in self.prims:
                p.trace_finalize(fin)
            gdim, _, _ = cute.arch.grid_dim()
            if bidx == gdim - 1:  # the kernel completes after the GEMM grid
                cute.arch.griddepcontrol_wait()
        else:
            # the GEMM grid (this launch's programmatic prerequisite) has finished and its
            # partials are visible from here on
            cute.arch.griddepcontrol_wait()
            for p in self.prims:
                p.trace_finalize(fin)


def fake_args(kernel: FinalizeKernel, shapes):
    """Compile-time stand-ins: one fp32 tensor per name (``shapes[name]`` says which
    symbols its dims use: "rows", "tiles", "cols" or a tuple of them), M, N, the extent
    and the environment stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    symbols: dict[str, object] = {}

    def sym(key):
        if key not in symbols:
            symbols[key] = cute.sym_int32()
        return symbols[key]

    tensors = tuple(
        make_fake_compact_tensor(
            cutlass.Float32,
            tuple(sym(d) for d in shapes[name]),
            stride_order=tuple(range(len(shapes[name])))[::-1],
        )
        for name in kernel.names
    )
    counters = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (tensors, counters, Int32(1), Int32(1), Int32(1), Int32(1), stream)
