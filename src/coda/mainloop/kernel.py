"""The fixed sm90a PingPong GEMM kernel (CuTeDSL): D = visitor(A @ B^T).

Sits at the bottom of ``coda.mainloop``; everything else in coda plugs into it through
the epilogue visitor hooks (:mod:`coda.mainloop.visitor`) and never edits it. This module
holds the host launch, the shared-memory plan and the consumer warpgroups' persistent
loop and WGMMA mainloop; their epilogue (per tile and per subtile) lives in
:mod:`coda.mainloop.epilogue_driver`, the producer warps in
:mod:`coda.mainloop.producers`, the epilogue's buffers and register/shared copies in
:mod:`coda.mainloop.epilogue_io`, and the CTA's warp roles, register split and
named-barrier ids in :mod:`coda.mainloop.roles`.

Schedule (one CTA = 3 warpgroups, 384 threads, persistent over output tiles):

* warpgroup 2 is the producer: its first warp walks the tile schedule and issues TMA
  loads of A (M, K) and B (N, K) k-tiles into a ``ab_stages``-deep shared-memory ring
  guarded by an mbarrier pipeline; in a 2x1 (1x2) cluster B (A) is multicast to both
  CTAs. It gives its registers away with ``setmaxnreg`` (24 per thread).
* warpgroups 0 and 1 are consumers that own alternate tiles of the schedule (PingPong).
  Two pairs of named barriers order them: the *mma* pair makes their WGMMA mainloops
  take turns, the *epi* pair makes their epilogues take turns. So while warpgroup 0
  runs the epilogue of tile t, warpgroup 1 runs the tensor cores on tile t+1, and the
  epilogue hides behind the matmul. Consumers take 240 registers each.
  With ``concurrent_epilogues`` (problems of one k-tile, whose epilogue is the whole
  kernel) the epi pair is not used: each warpgroup stores through its own half of the
  store buffers, and both epilogues run at once. Each warpgroup has its own scratch
  (e.g. a column reduction's per-warp slots) in every schedule.
* the epilogue visits the 128 x tile_n accumulator in ``epi_m x epi_n`` subtiles:
  registers -> visitor -> dtype convert -> shared memory (stmatrix) -> global (TMA
  store), with ``epi_stages`` buffers in flight, for every output the visitor stores.
  The subtiles of each 64-row band are unrolled at trace time (one copy of the code per
  subtile) or, with ``GemmConfig.rolled_epilogue``, run in a runtime loop over one copy
  (the subtile's accumulator registers picked by a switch: registers cannot be indexed
  at run time).
  Outputs and operands of width w != 1 (M x N*w: a SwiGLU output, an interleaved
  gate/up operand) use a (epi_m, epi_n*w) box and move between registers and shared
  memory element by element in the fragment order of :mod:`coda.mainloop.fragment`.
  M x N operands the visitor reads are loaded by the producer warpgroup's second warp,
  subtile by subtile through TMA, into a ring of ``load_stages`` shared-memory buffers
  ahead of the epilogue that reads them. TMA clips out-of-bounds rows and columns and
  zero-fills out-of-bounds loads, so ragged M, N, K need no masking in the kernel.
* a visitor that never reads the accumulator (``reads_acc`` False: a map pass, an
  epilogue over M x N operands alone) gets no mainloop: no A/B loads, no WGMMA, no turns
  on the tensor cores; each tile is its epilogue. (A map pass on the zero GEMM of K = 8
  it ran on before moved 2.98 TB/s, now 3.46: ``results/map_pass_no_mainloop_h200.json``.)
"""

from __future__ import annotations

from fractions import Fraction

from .cute_env import ensure_arch

ensure_arch()

import attrs
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .config import DEFAULT_NUM_SMS, GemmConfig, SmemPlan, plan_smem
from .dtypes import to_cutlass
from .epilogue_driver import EpilogueDriver
from .epilogue_io import EpilogueIO
from .producers import Producers
from .roles import (
    EPI_LOAD_WARP,
    NUM_CONSUMER_WGS,
    PRODUCER_WARP,
    REGS_CONSUMER,
    REGS_PRODUCER,
    THREADS_PER_WG,
    Barrier,
)
from .scheduler import TileScheduler
from .visitor import AccStore

#: A/B stages a kernel with a mainloop keeps before deeper epilogue buffers
#: (``PingPongGemm._fit_smem``; PingPong tiles taking turns)
FEWEST_MAINLOOP_AB_STAGES = 5


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _widths(visitor, attr: str, count: int) -> tuple[Fraction, ...]:
    """The visitor's widths (relative to N) of its stores or loads; 1 when undeclared."""
    widths = tuple(Fraction(w) for w in getattr(visitor, attr, (1,) * count))
    if len(widths) != count or any(w not in (Fraction(1, 2), 1, 2) for w in widths):
        raise ValueError(f"visitor {attr} must give 1/2, 1 or 2 for each of {count}: {widths}")
    return widths


class PingPongGemm(Producers, EpilogueIO, EpilogueDriver):
    """Compile-time kernel object for one (config, operand dtype, visitor).

    ``__call__`` is the ``@cute.jit`` host function: it builds TMA descriptors for the
    runtime tensors, sizes the persistent grid and launches. Shapes are dynamic, so one
    compiled kernel serves every (M, N, K) that meets the alignment contract.
    ``stores`` / ``loads`` are tuples of M x N tensors matching the visitor's
    ``store_dtypes`` / ``load_dtypes``; ``extras`` is passed through to the visitor.
    """

    def __init__(
        self,
        config: GemmConfig,
        ab_dtype,
        visitor=None,
        num_sms: int = DEFAULT_NUM_SMS,
    ):
        # ``cta_config``: the CTA's tile (A loads, the schedule); ``config``: the tile one
        # consumer warpgroup computes and stores (the same but for a cooperative tile)
        self.cta_config = config
        self.cooperative = config.cooperative
        self.config = config.warpgroup_config
        self.ab_dtype = ab_dtype
        self.acc_dtype = Float32
        self.visitor = visitor if visitor is not None else AccStore()
        # an epilogue that never reads acc (a map pass) needs no mainloop: no A/B loads,
        # no WGMMA, no turns on the tensor cores; its tiles are epilogues back to back
        self.mainloop = bool(getattr(self.visitor, "reads_acc", True))
        # one copy of the subtile code in a runtime loop over each band's subtiles
        self.rolled = bool(self.config.rolled_epilogue)
        if self.rolled and not getattr(self.visitor, "rollable", False):
            raise ValueError(
                "GemmConfig.rolled_epilogue needs a visitor whose subtile code runs for a "
                "runtime subtile index (rollable); this one does not"
            )
        self.num_sms = num_sms
        self.cluster_size = config.cluster_m * config.cluster_n
        self.num_mcast_a = config.cluster_n  # A tile shared by CTAs along N
        self.num_mcast_b = config.cluster_m  # B tile shared by CTAs along M
        self.store_dtypes = tuple(to_cutlass(d) for d in self.visitor.store_dtypes)
        self.load_dtypes = tuple(to_cutlass(d) for d in self.visitor.load_dtypes)
        self.store_widths = _widths(self.visitor, "store_widths", len(self.store_dtypes))
        self.load_widths = _widths(self.visitor, "load_widths", len(self.load_dtypes))
        # per stored tensor: True = TMA reduce-add into global (out += value), else store
        self.store_accumulate = tuple(
            bool(x)
            for x in getattr(self.visitor, "store_accumulate", (False,) * len(self.store_dtypes))
        )
        if len(self.store_accumulate) != len(self.store_dtypes):
            raise ValueError("visitor store_accumulate must give one flag per stored tensor")
        if config.split_k > 1 and not (
            self.store_accumulate
            and all(self.store_accumulate)
            and not self.load_dtypes
            and self.visitor.smem_bytes(config) == 0
        ):
            raise ValueError(
                f"split_k={config.split_k} sums partial products in global memory: it needs a "
                f"visitor that only stores acc through reduce-add (AccStore(accumulate=True)), "
                f"no M x N loads and no tile reductions"
            )
        # a warpgroup's scratch: its 128-row tile's (a cooperative tile's half)
        self.scratch_floats = self.visitor.smem_bytes(self.config) // 4
        # each consumer warpgroup has its own scratch: epilogues at once (concurrent,
        # cooperative) need it, and when they take turns it keeps one warpgroup's last
        # reads of a tile's scratch (a column reduction's flush) apart from the other's
        # first writes of the next tile by more than the epilogue turn's bar.arrive ->
        # bar.sync: compute-sanitizer's racecheck does not count that arrival as ordering
        # the two and reported those hazards (128 x 192 tiles, several per CTA,
        # results/sanitize_split_wide_racecheck_before_h200.json); a few KiB at most
        self.scratch_copies = 2
        fit = None
        if self.config.concurrent_epilogues:
            fit = self._fit_smem(config, concurrent=True)
        self.concurrent = fit is not None
        if fit is None:
            fit = None if self.cooperative else self._fit_smem(config, concurrent=False)
            if fit is None:
                raise ValueError(
                    f"the epilogue's {len(self.visitor.store_dtypes)} stored and "
                    f"{len(self.visitor.load_dtypes)} loaded M x N tensors do not fit in "
                    f"shared memory next to the GEMM's A/B ring (tile {config.tile_m}x"
                    f"{config.tile_n}); split the epilogue or use a smaller tile_n"
                )
        self.smem, self.epi_stages, self.load_stages = fit
        self.ab_stages = self.smem.ab_stages

    def _fit_smem(self, config: GemmConfig, concurrent: bool) -> tuple[SmemPlan, int, int] | None:
        """Deepest epilogue store/load buffering that still leaves >= 4 A/B stages (or,
        failing that, >= 2); None when the visitor's tensors do not fit. A kernel that
        takes turns (neither concurrent nor cooperative) and has a mainloop first looks
        for ``FEWEST_MAINLOOP_AB_STAGES`` (5), with 2 store and 2 load buffers if need be.

        Concurrent epilogues split the store buffers between the warpgroups (an even
        number, at least one each; >= 2 A/B stages: one k-tile per tile needs no more)
        and need a load ring of exactly two tiles' subtiles, so that every stage belongs
        to one warpgroup (ring position = tile parity * subtiles + subtile). A stage the
        two shared would break the mbarrier phase-parity wait: a warpgroup a whole tile
        ahead would wait for the parity of a fill two fills ahead and pass on the one
        between, meant for the other warpgroup. Cooperative tiles (both warpgroups on one
        tile at once) alternate the warpgroups stage by stage instead, so any even ring
        keeps one consumer per stage. None when that ring does not fit."""
        sub = config.epi_m * config.epi_n
        # subtiles of one warpgroup's tile (a cooperative tile's 128-row half)
        sub_m, sub_n = config.warpgroup_config.subtiles_per_tile
        n_sub = sub_m * sub_n
        store_bytes = sum(
            int(sub * w) * _nbytes(d)
            for d, w in zip(self.visitor.store_dtypes, self.store_widths, strict=True)
        )
        load_bytes = sum(
            int(sub * w) * _nbytes(d)
            for d, w in zip(self.visitor.load_dtypes, self.load_widths, strict=True)
        )
        if config.cooperative:
            # a long mainloop per tile: A/B stages first, then 2 store buffers per
            # warpgroup; the load ring alternates the halves subtile by subtile (even
            # stages warpgroup 0's, odd ones warpgroup 1's: each stage has one consumer)
            deep = 2 * min(config.load_stages, n_sub)
            candidates = [(4, deep), (4, 4), (2, 4), (2, 2)] if load_bytes else [(4, 0), (2, 0)]
            min_abs = (4, 3, 2)
        elif concurrent:
            ring = 2 * n_sub
            candidates = [
                (e, ring) for e in (config.epi_stages - config.epi_stages % 2, 4, 2) if e >= 2
            ]
            min_abs = (2,)
        else:
            candidates = [
                (min(e, config.epi_stages), min(ld, n_sub))
                for e, ld in ((config.epi_stages, config.load_stages), (2, 2), (1, 2), (1, 1))
            ]
            # a mainloop beside 4 A/B stages runs measurably slower than beside 5 (the
            # training ops' SwiGLU backward, 128 x 128 tiles: 2 store and 2 load buffers
            # for a 5th stage took fused / plain 1.244 -> 1.145 at N = K = 4096 and
            # 1.116 -> 1.045 at 8192 in bursts, 1.181 -> 1.149 and 1.102 -> 1.089 at the
            # power limit; benchmarks/results/epilogue_buffers_h200.json); kernels that
            # have 5 keep their deeper buffers (from 5 to 6 stages the same trade lost at
            # the power limit). A map pass has no mainloop: its buffers come first
            min_abs = (FEWEST_MAINLOOP_AB_STAGES, 4, 2) if self.mainloop else (4, 2)
        scratch_bytes = 4 * self.scratch_floats * self.scratch_copies
        for min_ab in min_abs:
            for epi_st, load_st in candidates:
                try:
                    # (a concurrent config's fallback to taking turns may take 1 store
                    # buffer, which a config that says concurrent refuses to describe)
                    plan = plan_smem(
                        attrs.evolve(
                            config,
                            epi_stages=epi_st,
                            concurrent_epilogues=concurrent and config.concurrent_epilogues,
                        ),
                        _nbytes(torch.bfloat16),
                        store_bytes,
                        load_bytes * load_st + scratch_bytes,
                    )
                except ValueError:
                    continue
                if plan.ab_stages >= min_ab:
                    return plan, epi_st, load_st
        return None

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, stores, loads, extras, stream):
        cfg = self.config
        cta = self.cta_config
        tile_mnk = cta.tile_shape_mnk
        a_layout = LayoutEnum.from_tensor(mA)
        b_layout = LayoutEnum.from_tensor(mB)

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (1, 1, 1),
            tiler_mn=(64, cfg.tile_n),
        )
        a_smem_staged = sm90_utils.make_smem_layout_a(
            a_layout, tile_mnk, self.ab_dtype, self.ab_stages
        )
        b_smem_staged = sm90_utils.make_smem_layout_b(
            b_layout, tile_mnk, self.ab_dtype, self.ab_stages
        )
        row_major = LayoutEnum.ROW_MAJOR
        d_smem = tuple(
            sm90_utils.make_smem_layout_epi(dt, row_major, self._box(w), self.epi_stages)
            for dt, w in zip(self.store_dtypes, self.store_widths, strict=True)
        )
        c_smem = tuple(
            sm90_utils.make_smem_layout_epi(dt, row_major, self._box(w), self.load_stages)
            for dt, w in zip(self.load_dtypes, self.load_widths, strict=True)
        )

        a_op = (
            cpasync.CopyBulkTensorTileG2SOp()
            if self.num_mcast_a == 1
            else cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        b_op = (
            cpasync.CopyBulkTensorTileG2SOp()
            if self.num_mcast_b == 1
            else cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        tma_a, tA = cpasync.make_tiled_tma_atom(
            a_op,
            mA,
            cute.slice_(a_smem_staged, (None, None, 0)),
            (cta.tile_m, cfg.tile_k),
            num_multicast=self.num_mcast_a,
        )
        tma_b, tB = cpasync.make_tiled_tma_atom(
            b_op,
            mB,
            cute.slice_(b_smem_staged, (None, None, 0)),
            (cfg.tile_n, cfg.tile_k),
            num_multicast=self.num_mcast_b,
        )
        tma_d = []
        tD = []
        for i in cutlass.range_constexpr(len(stores)):
            atom, t = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(cpasync.ReductionKind.ADD)
                if self.store_accumulate[i]
                else cpasync.CopyBulkTensorTileS2GOp(),
                stores[i],
                cute.slice_(d_smem[i], (None, None, 0)),
                self._box(self.store_widths[i]),
            )
            tma_d.append(atom)
            tD.append(t)
        tma_c = []
        tC = []
        for i in cutlass.range_constexpr(len(loads)):
            atom, t = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(),
                loads[i],
                cute.slice_(c_smem[i], (None, None, 0)),
                self._box(self.load_widths[i]),
            )
            tma_c.append(atom)
            tC.append(t)

        M = cute.size(mA, mode=[0])
        N = cute.size(mB, mode=[0])
        tiles_m = cute.ceil_div(M, cta.tile_m)
        tiles_n = cute.ceil_div(N, cfg.tile_n)
        clusters_m = cute.ceil_div(tiles_m, cfg.cluster_m)
        clusters_n = cute.ceil_div(tiles_n, cfg.cluster_n)
        # num_sms: the SMs the grid may occupy (coda.runtime.occupancy.grid_sms: a multiple
        # of the cluster size that fits the device at once)
        max_clusters = self.num_sms // self.cluster_size
        num_clusters = cutlass.min(
            clusters_m * clusters_n * Int32(cfg.split_k), Int32(max_clusters)
        )

        ab_stages = self.ab_stages

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, ab_stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)], 1024
            ]

        self.shared_storage = SharedStorage

        self.kernel(
            tiled_mma,
            tma_a,
            tA,
            tma_b,
            tB,
            tuple(tma_d),
            tuple(tD),
            tuple(tma_c),
            tuple(tC),
            a_smem_staged,
            b_smem_staged,
            d_smem,
            c_smem,
            M,
            N,
            clusters_m,
            clusters_n,
            extras,
        ).launch(
            grid=(cfg.cluster_m, cfg.cluster_n, num_clusters),
            block=(THREADS_PER_WG * (NUM_CONSUMER_WGS + 1), 1, 1),
            cluster=cfg.cluster_shape_mnk,
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d,
        mD,
        tma_c,
        mC,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem,
        c_smem,
        M: Int32,
        N: Int32,
        clusters_m: Int32,
        clusters_n: Int32,
        extras,
    ):
        cfg = self.config
        tile_mnk = self.cta_config.tile_shape_mnk
        n_stores = len(self.store_dtypes)
        n_loads = len(self.load_dtypes)
        sub_m, sub_n = cfg.subtiles_per_tile
        n_sub = sub_m * sub_n
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        # A kernel launched after this one as its programmatic dependent (the epilogue's
        # finalize kernel) may start once every CTA of this grid runs: its CTAs take the
        # SMs our last tiles free and wait for this grid to finish (griddepcontrol.wait).
        # Every CTA of this grid is resident by then, so they never take one's place.
        # (Launching the GEMM itself that way, its setup overlapping the previous
        # kernel's tail, was measured on an H100 and not kept: back-to-back 4096^3 GEMMs
        # 201 -> 215-221 us, SwiGLU forward at 16384 x 2048 x 2048 210 -> 220-225 us; only
        # calls of a few microseconds gained, about 1 us.)
        cute.arch.griddepcontrol_launch_dependents()

        if warp_idx == PRODUCER_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            for i in cutlass.range_constexpr(n_stores):
                cpasync.prefetch_descriptor(tma_d[i])
            for i in cutlass.range_constexpr(n_loads):
                cpasync.prefetch_descriptor(tma_c[i])

        # Cluster geometry: grid is (cluster_m, cluster_n, clusters); block z is the cluster id.
        cta_layout_mnk = cute.make_layout(cfg.cluster_shape_mnk)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        _, _, bidz = cute.arch.block_idx()
        _, _, num_clusters = cute.arch.grid_dim()
        sched = TileScheduler(
            clusters_m, clusters_n, (cfg.cluster_m, cfg.cluster_n), cfg.group_m, cfg.split_k
        )
        cta_mn = (Int32(cta_coord[0]), Int32(cta_coord[1]))

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # (TMA view, register-copy view) of every output's and operand's buffers
        sD, sD_rs = self._allocate_epi(smem, self.store_dtypes, self.store_widths, d_smem)
        sC, sC_sr = self._allocate_epi(smem, self.load_dtypes, self.load_widths, c_smem)
        scratch_all = None
        if const_expr(self.scratch_floats > 0):
            scratch_all = smem.allocate_tensor(
                Float32, cute.make_layout(self.scratch_floats * self.scratch_copies), 16
            )

        a_stage_layout = cute.slice_(a_smem_staged, (None, None, 0))
        b_stage_layout = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_stage_layout) + cute.size_in_bytes(
            self.ab_dtype, b_stage_layout
        )
        # One consumer warpgroup (4 warps; both with a cooperative tile) reads each stage;
        # each of its warps releases the stage to every CTA that multicast into it.
        mcast_peers = self.num_mcast_a + self.num_mcast_b - 1
        consumer_warps = 4 * (2 if self.cooperative else 1)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, consumer_warps * mcast_peers
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        load_pipe = None
        if const_expr(n_loads > 0):
            load_tx = 0
            for i in cutlass.range_constexpr(n_loads):
                load_tx += cute.size_in_bytes(
                    self.load_dtypes[i], cute.slice_(c_smem[i], (None, None, 0))
                )
            # CTA-local: the 4 warps of the consuming warpgroup release each stage.
            load_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=smem.allocate_array(
                    cutlass.Int64, 2 * self.load_stages, byte_alignment=8
                ),
                num_stages=self.load_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                tx_count=load_tx,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cfg.cluster_shape_mnk[:2], is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)

        # (tile_m, tile_k, tiles_m, k_tiles) and (tile_n, tile_k, tiles_n, k_tiles)
        gA = cute.local_tile(mA, cute.slice_(tile_mnk, (None, 0, None)), (None, None))
        gB = cute.local_tile(mB, cute.slice_(tile_mnk, (0, None, None)), (None, None))
        k_tiles = cute.size(gA, mode=[3])
        if const_expr(cfg.split_k > 1):
            # every unit of work runs k_tiles k-tiles from split * k_tiles (the last split's
            # k-tiles past K are out of bounds: TMA fills them with zeros)
            k_tiles = cute.ceil_div(k_tiles, cfg.split_k)

        pipeline.pipeline_init_wait(cluster_shape_mn=cfg.cluster_shape_mnk[:2])

        if warp_idx >= PRODUCER_WARP:
            # ------------------------------------------------------------ producers
            cute.arch.setmaxregister_decrease(REGS_PRODUCER)
            if warp_idx == PRODUCER_WARP and const_expr(self.mainloop):
                self._produce_ab(
                    tma_a,
                    tma_b,
                    sA,
                    sB,
                    gA,
                    gB,
                    k_tiles,
                    ab_pipe,
                    sched,
                    cta_layout_mnk,
                    cta_coord,
                    cta_mn,
                    bidz,
                    num_clusters,
                )
            if const_expr(n_loads > 0):
                if warp_idx == EPI_LOAD_WARP:
                    self._produce_epilogue_loads(
                        tma_c, mC, sC, load_pipe, sched, cta_mn, bidz, num_clusters
                    )

        if warp_idx < PRODUCER_WARP:
            # ------------------------------------------------------------ consumers
            cute.arch.setmaxregister_increase(REGS_CONSUMER)
            wg = cute.arch.make_warp_uniform(warp_idx // 4)
            wg_tidx = tidx % THREADS_PER_WG
            is_store_warp = warp_idx % 4 == 0

            thr_mma = tiled_mma.get_slice(wg_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            if const_expr(self.cooperative):
                # (MMA, 4 row blocks of 64, k, stage): this warpgroup's rows are blocks
                # 2 wg and 2 wg + 1 of the 256-row stage
                tCrA = cute.logical_divide(tCrA, (None, 2))[(None, (None, wg), None, None)]
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((cfg.tile_m, cfg.tile_n)), self.acc_dtype
            )
            k_blocks = cute.size(tCrA, mode=[2])

            # The CTAs whose multicasts fill this CTA's A/B stages, released after use: in
            # a 2x2 cluster (rank = m + 2 n) this one, its B peer (other m) and its A peer
            # (other n); in smaller clusters every CTA (``_release``)
            ab_peers = None
            if const_expr(cfg.cluster_m == 2 and cfg.cluster_n == 2):
                ab_peers = (cta_rank, cta_rank ^ 1, cta_rank ^ 2)

            # Epilogue partitions and pipelines (fixed per warpgroup, reused for every tile).
            parts = self._epilogue_parts(
                tiled_mma,
                acc,
                wg,
                wg_tidx,
                is_store_warp,
                (sD, sD_rs, mD, tma_d),
                (sC, sC_sr, load_pipe),
                scratch_all,
                (M, N),
                extras,
            )
            epi_bar, store_pipe = parts.epi_bar, parts.store_pipe
            concurrent = self.concurrent

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            lread = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.load_stages
            )
            cooperative = self.cooperative
            mainloop = self.mainloop
            wants_clocks = getattr(self.visitor, "wants_clocks", False)
            wants_waits = wants_clocks and getattr(self.visitor, "wants_waits", False)
            if const_expr(not mainloop):
                acc.fill(0.0)  # never read by the epilogue; defined all the same
            if const_expr(not cooperative):
                if wg == 0:
                    # warpgroup 0 goes first: it signals its own turn barriers once.
                    if const_expr(mainloop):
                        self._turn_arrive(Barrier.MMA_TURN, 0)
                    if const_expr(not concurrent):
                        self._turn_arrive(Barrier.EPI_TURN, 0)
                # warpgroup 1 starts on the second tile: skip warpgroup 0's stages.
                if wg == 1:
                    read.advance(k_tiles)
                    if const_expr(n_loads > 0):
                        lread.advance(n_sub)
            elif const_expr(n_loads > 0):
                # cooperative: the halves' subtiles alternate in the load ring
                if wg == 1:
                    lread.advance(1)

            splits = getattr(self.visitor, "splits_interior", False)
            # PingPong: the warpgroups take alternate tiles; cooperative: both take each
            t = Int32(bidz) if const_expr(cooperative) else Int32(bidz) + wg * num_clusters
            while t < sched.num_work:
                tm, tn = sched.tile_coord(t, cta_mn)
                if const_expr(cooperative):
                    tm = 2 * tm + wg  # this warpgroup's 128-row half of the CTA tile

                # ---- mainloop (takes its turn on the tensor cores, unless cooperative)
                clocks = None
                if const_expr(mainloop):
                    read, clocks = self._tile_mainloop(
                        tiled_mma, acc, tCrA, tCrB, k_blocks, k_tiles, ab_pipe, read, wg, ab_peers
                    )
                elif const_expr(wants_clocks):
                    clocks = [cute.arch.clock64()] * 2
                    if const_expr(wants_waits):
                        clocks += [Int64(0)] * 3

                # ---- epilogue (takes its turn on the store path, unless concurrent)
                if const_expr(not concurrent):
                    self._turn_wait(Barrier.EPI_TURN, wg)
                # The tile's epilogue; a visitor that masks elements outside M x N is
                # traced twice: without the masks for tiles inside M x N, with them for
                # the edge tiles (a runtime branch per tile, uniform over the warpgroup).
                clk = tuple(clocks) if const_expr(wants_clocks) else None
                if const_expr(splits):
                    inside = ((tm + 1) * cfg.tile_m <= M) & ((tn + 1) * cfg.tile_n <= N)
                    if inside:
                        self._tile_epilogue(parts, tm, tn, t, clk, lread.clone(), True)
                    else:
                        self._tile_epilogue(parts, tm, tn, t, clk, lread.clone(), False)
                else:
                    self._tile_epilogue(parts, tm, tn, t, clk, lread.clone(), False)
                if const_expr(n_loads > 0):
                    # the subtiles' loads the tile's epilogue consumed
                    lread.advance(n_sub * (2 if const_expr(cooperative) else 1))
                if const_expr(hasattr(self.visitor, "after_tile")):
                    # work off the store path (e.g. finalizing results), while the other
                    # warpgroup runs its epilogue; once per tile, outside the branch
                    self.visitor.after_tile(self._tile_ctx(parts, tm, tn, clk, False))

                if const_expr(cooperative):
                    if const_expr(self.scratch_floats > 0):
                        # No turn barrier orders this warpgroup's tiles: its warps must all
                        # have read the scratch (e.g. a column reduction's flush) before
                        # any writes the next tile's (compute-sanitizer racecheck).
                        epi_bar.arrive_and_wait()
                    t += num_clusters
                else:
                    read.advance(k_tiles)  # skip the other warpgroup's tile
                    if const_expr(n_loads > 0):
                        lread.advance(n_sub)
                    t += 2 * num_clusters
            if const_expr(concurrent and n_stores > 0):
                # the shared-memory buffers must outlive the stores that read them
                if is_store_warp:
                    store_pipe.producer_tail()

    # ------------------------------------------------------------------- helpers
    @cute.jit
    def _tile_mainloop(
        self,
        tiled_mma,
        acc,
        tCrA,
        tCrB,
        k_blocks: cutlass.Constexpr,
        k_tiles,
        ab_pipe,
        read,
        wg,
        ab_peers,
    ):
        """One tile's mainloop: the warpgroup's turn on the tensor cores (PingPong), the
        WGMMAs of every k-tile from the A/B ring (``read``), each stage released once the
        next k-tile's WGMMAs are issued. Returns ``read`` advanced past the tile and, for a
        profiling visitor (``wants_clocks``), the tile's clocks: the mainloop's start and
        end (and with ``wants_waits`` the k-loop's stage-wait, WGMMA-issue and WGMMA-wait
        cycles after its first k-tile, whose stage wait also holds the turn's)."""
        cfg = self.config
        cooperative = self.cooperative
        wants_clocks = getattr(self.visitor, "wants_clocks", False)
        wants_waits = wants_clocks and getattr(self.visitor, "wants_waits", False)
        clocks = None
        if const_expr(not cooperative):
            self._turn_wait(Barrier.MMA_TURN, wg)
        if const_expr(wants_clocks):
            clocks = [cute.arch.clock64()]
        release = read.clone()
        ab_pipe.consumer_wait(read)
        self._mma_ktile(tiled_mma, acc, tCrA, tCrB, k_blocks, read.index, zero_init=True)
        read.advance()
        if const_expr(wants_waits):
            w_full = Int64(0)
            w_issue = Int64(0)
            w_mma = Int64(0)
        for _k in cutlass.range(1, k_tiles, unroll=1):
            if const_expr(wants_waits):
                c0 = cute.arch.clock64()
            ab_pipe.consumer_wait(read)
            if const_expr(wants_waits):
                c1 = cute.arch.clock64()
                w_full += c1 - c0
            self._mma_ktile(tiled_mma, acc, tCrA, tCrB, k_blocks, read.index, zero_init=False)
            if const_expr(wants_waits):
                c0 = cute.arch.clock64()
                w_issue += c0 - c1
            warpgroup.wait_group(1)
            if const_expr(wants_waits):
                w_mma += cute.arch.clock64() - c0
            self._release(ab_pipe, release, cfg.cluster_m * cfg.cluster_n, ab_peers)
            release.advance()
            read.advance()
        if const_expr(not cooperative):
            self._turn_arrive(Barrier.MMA_TURN, 1 - wg)
        if const_expr(wants_waits):
            c0 = cute.arch.clock64()
        warpgroup.wait_group(0)
        if const_expr(wants_clocks):
            clocks.append(cute.arch.clock64())
        if const_expr(wants_waits):
            w_mma += clocks[1] - c0
            clocks += [w_full, w_issue, w_mma]
        self._release(ab_pipe, release, cfg.cluster_m * cfg.cluster_n, ab_peers)
        return read, clocks

    def _turn_wait(self, base: int, wg):
        cute.arch.barrier(barrier_id=base + wg, number_of_threads=2 * THREADS_PER_WG)

    def _turn_arrive(self, base: int, wg):
        cute.arch.barrier_arrive(barrier_id=base + wg, number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def _release(self, pipe, state, cluster_size: cutlass.Constexpr, peers=None):
        """Release ``state``'s stage of a TMA pipeline: one elected lane per consumer warp
        arrives on the stage's empty barrier of every CTA whose multicast fills this CTA's
        stage: every CTA of a 1x1, 2x1 or 1x2 cluster (``cluster_size``), or the ``peers``
        ranks of a 2x2 one (this CTA, the one sharing its A tile, the one sharing its B
        tile; not the diagonal one), which is the arrive count the pipeline expects.
        CuTeDSL's ``consumer_release`` picks the signalling lanes from the thread index
        instead; ptxas re-reads that (S2R, through the MIO queue) on every k-tile, and under
        a heavy epilogue on the other warpgroup that read stalled the tensor-core issue
        (Nsight Compute, swiglu_bwd: the k-loop's hottest instruction). ``elect.sync``
        needs no thread index."""
        barrier = pipe.sync_object_empty.get_barrier(state.index)
        with cute.arch.elect_one():
            if const_expr(peers is not None):
                for i in cutlass.range_constexpr(len(peers)):
                    cute.arch.mbarrier_arrive(barrier, peers[i])
            elif const_expr(cluster_size == 1):
                cute.arch.mbarrier_arrive(barrier)
            else:
                for rank in cutlass.range_constexpr(cluster_size):
                    cute.arch.mbarrier_arrive(barrier, Int32(rank))

    @cute.jit
    def _mma_ktile(
        self,
        tiled_mma,
        acc,
        tCrA,
        tCrB,
        k_blocks: cutlass.Constexpr,
        stage,
        zero_init: cutlass.Constexpr,
    ):
        """Issue the WGMMAs of one k-tile (k_blocks x k16) as one commit group."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(atom, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
