"""The consumer warpgroups' epilogue in the PingPong kernel: what a warpgroup's epilogues
share (built once before the persistent tile loop), one tile's epilogue (the visitor's
tile and band hooks, its subtiles, the store drain and the epilogue turn's hand-over) and
one subtile's path (accumulator and loaded operands -> visitor -> shared memory -> TMA
stores).

A mixin of :class:`coda.mainloop.kernel.PingPongGemm`, beside
:class:`~coda.mainloop.producers.Producers` and
:class:`~coda.mainloop.epilogue_io.EpilogueIO` (the register <-> shared copies it
drives); it calls the kernel's ``_turn_arrive`` and ``_release``.
"""

from __future__ import annotations

from .cute_env import ensure_arch

ensure_arch()

import attrs
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from .config import EPILOGUE_L2_HINT
from .epilogue_io import stagger_parity
from .fragment import Fragment
from .producers import l2_hint
from .roles import THREADS_PER_WG, Barrier
from .visitor import SubtileContext, TileContext


@attrs.define
class EpilogueParts:
    """What every tile's epilogue of one consumer warpgroup shares (built once, before
    the persistent tile loop): output tensors and their shared buffers, the subtile
    copies, the store / load pipelines and the warpgroup's barrier."""

    wg: object
    mD: object
    sD: object
    tma_d: object
    ids: object  # (row, col) of every output element, by tiles
    shape_mn: tuple
    extras: object
    frag: object
    scratch: object
    epi_bar: object
    thr_coord: object
    acc: object  # the accumulator, viewed by subtiles
    acc_sub: object  # one subtile's accumulator registers
    loads: list
    stores: list
    load_pipe: object
    store_pipe: object
    is_store_warp: object
    first_buf: object
    own_bufs: int


@attrs.define
class SubtileLoop:
    """What every subtile of one tile's epilogue shares (built once per tile, read-only
    in the subtile loop: nothing in it is carried from one subtile to the next): the
    warpgroup's ``parts`` and this tile's context, visitor state, element coordinates,
    TMA store partitions and schedule index."""

    parts: EpilogueParts
    tctx: TileContext
    vstate: object
    tile_ids: object
    bSG: list
    t: object


class EpilogueDriver:
    """The consumer warpgroups' epilogue methods of :class:`PingPongGemm`."""

    def _epilogue_parts(
        self,
        tiled_mma,
        acc,
        wg,
        wg_tidx,
        is_store_warp,
        out,
        operands,
        scratch_all,
        shape_mn,
        extras,
    ) -> EpilogueParts:
        """What every tile's epilogue of consumer warpgroup ``wg`` shares: the register <->
        shared copies of its subtiles (``out``: the stored outputs' TMA and register views,
        tensors and TMA atoms; ``operands``: the loaded operands' views and their pipeline),
        its store buffers and store pipeline, its scratch and its barrier."""
        cfg = self.config
        sD, sD_rs, mD, tma_d = out
        sC, sC_sr, load_pipe = operands
        M, N = shape_mn
        coord_copy = self._make_r2s_copy(tiled_mma, cutlass.BFloat16)
        thr_coord = coord_copy.get_slice(wg_tidx)
        frag_geom = Fragment(coord_copy, cfg.epi_tile)
        frag_shape = thr_coord.partition_S(cute.make_identity_tensor(cfg.epi_tile)).shape
        tRS_rAcc = self._acc_subtile_view(acc, coord_copy)
        tRS_rD = cute.make_rmem_tensor(frag_shape, self.acc_dtype)
        # 32-bit shared copies staggered by lane parity (GemmConfig.staggered_copies)
        parity = stagger_parity(wg_tidx)
        # subtile-local (row, col) of each element, for values of width != 1
        local = thr_coord.partition_S(cute.make_identity_tensor(cfg.epi_tile))
        local_points = [local[j] for j in range(cute.size(local))]
        stores = self._subtile_stores(
            tiled_mma, wg_tidx, sD, sD_rs, frag_geom, frag_shape, local_points, parity
        )
        loads = self._subtile_loads(
            tiled_mma, wg_tidx, sC, sC_sr, frag_geom, frag_shape, local_points, parity
        )
        concurrent = self.concurrent
        # store buffers this warpgroup cycles through, from its first one
        own_bufs = self.epi_stages // 2 if const_expr(concurrent) else self.epi_stages
        first_buf = wg * own_bufs if const_expr(concurrent) else 0
        scratch = scratch_all
        if const_expr(self.scratch_floats > 0):
            scratch = cute.make_tensor(
                scratch_all.iterator + wg * self.scratch_floats,
                cute.make_layout(self.scratch_floats),
            )
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=own_bufs,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS_PER_WG),
        )
        epi_bar = pipeline.NamedBarrier(barrier_id=Barrier.EPI + wg, num_threads=THREADS_PER_WG)
        idD_all = cute.local_tile(
            cute.make_identity_tensor((M, N)), (cfg.tile_m, cfg.tile_n), (None, None)
        )
        return EpilogueParts(
            wg=wg,
            mD=mD,
            sD=sD,
            tma_d=tma_d,
            ids=idD_all,
            shape_mn=(M, N),
            extras=extras,
            frag=frag_geom,
            scratch=scratch,
            epi_bar=epi_bar,
            thr_coord=thr_coord,
            acc=tRS_rAcc,
            acc_sub=tRS_rD,
            loads=loads,
            stores=stores,
            load_pipe=load_pipe,
            store_pipe=store_pipe,
            is_store_warp=is_store_warp,
            first_buf=first_buf,
            own_bufs=own_bufs,
        )

    @cute.jit
    def _tile_epilogue(
        self, parts, tm, tn, t, clocks, lread, interior: cutlass.Constexpr[bool]
    ) -> None:
        """Tile (tm, tn)'s epilogue, from the visitor's ``begin_tile`` to its
        ``end_tile``: its subtiles (consuming the load ring from ``lread``, a copy the
        caller advances), the store drain and the epilogue turn's hand-over.
        ``interior``: traced for tiles inside M x N only (``TileContext.interior``)."""
        cfg = self.config
        n_stores = len(self.store_dtypes)
        sub_m, sub_n = cfg.subtiles_per_tile
        concurrent = self.concurrent
        rolled = self.rolled
        bands = hasattr(self.visitor, "begin_band")
        is_store_warp, store_pipe = parts.is_store_warp, parts.store_pipe
        bSG = []
        for i in cutlass.range_constexpr(n_stores):
            gD = cute.local_tile(parts.mD[i], self._tile(self.store_widths[i]), (tm, tn))
            bSG.append(
                cpasync.tma_partition(
                    parts.tma_d[i],
                    0,
                    cute.make_layout(1),
                    cute.group_modes(parts.sD[i], 0, 2),
                    cute.zipped_divide(gD, self._box(self.store_widths[i])),
                )
            )
        tctx = self._tile_ctx(parts, tm, tn, clocks, interior)
        vstate = self.visitor.begin_tile(tctx)
        sub = SubtileLoop(
            parts=parts,
            tctx=tctx,
            vstate=vstate,
            tile_ids=parts.ids[(None, None, tm, tn)],
            bSG=bSG,
            t=t,
        )
        # subtiles row-major within the tile (n fastest), by 64-row bands
        for sm in cutlass.range_constexpr(sub_m):
            if const_expr(bands):
                self.visitor.begin_band(self._band_ctx(sub, sm), vstate, rolled)
            if const_expr(rolled):
                # one copy of the subtile's code, run sub_n times
                for sn in cutlass.range(sub_n, unroll=1):
                    lread = self._epilogue_subtile(sub, lread, sm, sn)
            else:
                for sn in cutlass.range_constexpr(sub_n):
                    lread = self._epilogue_subtile(sub, lread, sm, sn)
            if const_expr(bands):
                # the band's coordinates again after a rolled loop (kept out of the
                # loop's live registers)
                self.visitor.end_band(self._band_ctx(sub, sm), vstate, rolled)
        self.visitor.end_tile(tctx, vstate)
        if const_expr(not concurrent):
            # The other warpgroup reuses the epilogue buffers: drain our stores first.
            if const_expr(n_stores > 0):
                if is_store_warp:
                    store_pipe.producer_tail()
            self._turn_arrive(Barrier.EPI_TURN, 1 - parts.wg)

    def _tile_ctx(self, parts, tm, tn, clocks, interior: bool) -> TileContext:
        return TileContext(
            tile_coord=(tm, tn),
            shape_mn=parts.shape_mn,
            extras=parts.extras,
            frag=parts.frag,
            scratch=parts.scratch,
            barrier=parts.epi_bar,
            config=self.config,
            clocks=clocks,
            interior=interior,
        )

    def _band_ctx(self, sub, sm: int) -> SubtileContext:
        """The context of band ``sm``'s first subtile (for the visitor's band hooks)."""
        cfg = self.config
        coords = sub.parts.thr_coord.partition_S(
            cute.local_tile(sub.tile_ids, cfg.epi_tile, (sm, 0))
        )
        return SubtileContext(tile=sub.tctx, subtile=(sm, 0), coords=coords)

    @cute.jit
    def _epilogue_subtile(self, sub, lread, sm: cutlass.Constexpr[int], sn):
        """One subtile of the epilogue: accumulator (and loaded operands) -> visitor ->
        shared memory -> TMA stores. ``sn`` is a Python int in an unrolled subtile loop,
        a runtime index in a rolled one (``GemmConfig.rolled_epilogue``). Returns the
        load ring's advanced consumer state."""
        cfg = self.config
        n_stores = len(self.store_dtypes)
        n_loads = len(self.load_dtypes)
        sub_n = cfg.subtiles_per_tile[1]
        s = sm * sub_n + sn
        # A runtime buffer index (it varies with the tile): a static one lets the
        # compiler hoist every (output, buffer) smem address out of the persistent loop,
        # and those registers spill in heavy epilogues.
        p = sub.parts
        buf = p.first_buf + (sub.t + s) % p.own_bufs
        # locals, not ``p.x``: a method called on a name inside a runtime ``if`` makes
        # the DSL carry that name through the branch
        acc, acc_sub, store_pipe, tma_d, bSG = p.acc, p.acc_sub, p.store_pipe, p.tma_d, sub.bSG
        if const_expr(isinstance(sn, int)):
            cute.autovec_copy(acc[None, None, None, (sm, sn)], acc_sub)
        else:
            # registers cannot be indexed at run time: pick the subtile's by a switch
            for j in cutlass.range_constexpr(sub_n):
                if sn == j:
                    cute.autovec_copy(acc[None, None, None, (sm, j)], acc_sub)
        loaded = []
        if const_expr(n_loads > 0):
            p.load_pipe.consumer_wait(lread)
            for i in cutlass.range_constexpr(n_loads):
                loaded.append(p.loads[i](lread.index))
            cute.arch.fence_view_async_shared()
            self._release(p.load_pipe, lread, 1)
            lread.advance(2 if const_expr(self.cooperative) else 1)
        coords = p.thr_coord.partition_S(cute.local_tile(sub.tile_ids, cfg.epi_tile, (sm, sn)))
        ctx = SubtileContext(tile=sub.tctx, subtile=(sm, sn), coords=coords)
        outs = self.visitor.visit(ctx, acc_sub.load(), tuple(loaded), sub.vstate)
        if const_expr(n_stores > 0):
            for i in cutlass.range_constexpr(n_stores):
                p.stores[i].values.store(outs[i].to(self.store_dtypes[i]))
            if p.is_store_warp:
                store_pipe.producer_acquire()
            p.epi_bar.arrive_and_wait()
            for i in cutlass.range_constexpr(n_stores):
                p.stores[i](buf)
            cute.arch.fence_proxy("async.shared", space="cta")
            p.epi_bar.arrive_and_wait()
            if p.is_store_warp:
                for i in cutlass.range_constexpr(n_stores):
                    cute.copy(
                        tma_d[i],
                        bSG[i][0][(None, buf)],
                        bSG[i][1][(None, (sm, sn))],
                        **l2_hint(EPILOGUE_L2_HINT),
                    )
                store_pipe.producer_commit()
        return lread
