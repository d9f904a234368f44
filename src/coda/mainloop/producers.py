"""The PingPong kernel's producer warps: TMA loads of A/B k-tiles and of the epilogue's
M x N operands (a mixin of :class:`coda.mainloop.kernel.PingPongGemm`).

Sits in ``coda.mainloop``. Warpgroup 2 of the kernel is the producer: its first warp
walks the tile schedule and fills the ``ab_stages``-deep A/B ring (multicasting the tile
the cluster's CTAs share), its second warp loads the visitor's M x N operands subtile by
subtile, in the epilogue's order, into the ``load_stages`` ring ahead of the consumers
(with the L2 evict-first hint, ``coda.mainloop.config.EPILOGUE_L2_HINT``, as the
consumers' TMA stores).
"""

from __future__ import annotations

from .cute_env import ensure_arch

ensure_arch()

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .config import EPILOGUE_L2_HINT


def l2_hint(policy: int | None) -> dict:
    """``cute.copy`` keyword arguments of a TMA copy with L2 eviction hint ``policy``
    (:data:`coda.mainloop.config.L2_EVICT_FIRST`, ...; None: no hint)."""
    return {} if policy is None else {"cache_policy": Int64(policy)}


class Producers:
    """Producer-warp methods of the PingPong kernel (uses its config and tile helpers)."""

    @cute.jit
    def _produce_ab(
        self,
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
    ):
        """Producer warp: TMA loads of A/B k-tiles for every tile of this cluster."""
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cta_coord, mode=1)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cta_coord, mode=0)
        tAsA, tAgA = cpasync.tma_partition(
            tma_a,
            cta_coord[1],
            cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b,
            cta_coord[0],
            cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        t = Int32(bidz)
        while t < sched.num_work:
            tm, tn = sched.tile_coord(t, cta_mn)
            k0 = sched.k_split(t) * k_tiles
            for kk in cutlass.range(k_tiles, unroll=1):
                k = k0 + kk
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                if const_expr(self.num_mcast_a > 1):
                    cute.copy(
                        tma_a,
                        tAgA[(None, tm, k)],
                        tAsA[(None, state.index)],
                        tma_bar_ptr=bar,
                        mcast_mask=a_mask,
                    )
                else:
                    cute.copy(
                        tma_a, tAgA[(None, tm, k)], tAsA[(None, state.index)], tma_bar_ptr=bar
                    )
                if const_expr(self.num_mcast_b > 1):
                    cute.copy(
                        tma_b,
                        tBgB[(None, tn, k)],
                        tBsB[(None, state.index)],
                        tma_bar_ptr=bar,
                        mcast_mask=b_mask,
                    )
                else:
                    cute.copy(
                        tma_b, tBgB[(None, tn, k)], tBsB[(None, state.index)], tma_bar_ptr=bar
                    )
                ab_pipe.producer_commit(state)
                state.advance()
            t += num_clusters
        ab_pipe.producer_tail(state)

    @cute.jit
    def _produce_epilogue_loads(self, tma_c, mC, sC, load_pipe, sched, cta_mn, bidz, num_clusters):
        """Second producer warp: TMA loads of the visitor's M x N operands, subtile by
        subtile in the epilogue's order, for every tile of this CTA (both warpgroups'; of
        a cooperative tile, its two 128-row halves' subtiles alternately)."""
        n_loads = len(self.load_dtypes)
        sub_m, sub_n = self.config.subtiles_per_tile
        halves = 2 if const_expr(self.cooperative) else 1
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.load_stages)
        t = Int32(bidz)
        while t < sched.num_work:
            cta_tm, tn = sched.tile_coord(t, cta_mn)
            # (TMA view of the ring, of the warpgroup tile's subtiles) per half and load
            parts = []
            for h in cutlass.range_constexpr(halves):
                tm = halves * cta_tm + h  # the warpgroup tile's row of tiles
                for i in cutlass.range_constexpr(n_loads):
                    w = self.load_widths[i]
                    gC = cute.local_tile(mC[i], self._tile(w), (tm, tn))
                    parts.append(
                        cpasync.tma_partition(
                            tma_c[i],
                            0,
                            cute.make_layout(1),
                            cute.group_modes(sC[i], 0, 2),
                            cute.zipped_divide(gC, self._box(w)),
                        )
                    )
            for s in cutlass.range_constexpr(sub_m * sub_n):
                sm, sn = s // sub_n, s % sub_n
                # a cooperative tile's halves alternate, subtile by subtile
                for h in cutlass.range_constexpr(halves):
                    load_pipe.producer_acquire(state)
                    bar = load_pipe.producer_get_barrier(state)
                    for i in cutlass.range_constexpr(n_loads):
                        part = parts[h * n_loads + i]
                        cute.copy(
                            tma_c[i],
                            part[1][(None, (sm, sn))],
                            part[0][(None, state.index)],
                            tma_bar_ptr=bar,
                            **l2_hint(EPILOGUE_L2_HINT),
                        )
                    load_pipe.producer_commit(state)
                    state.advance()
            t += num_clusters
        load_pipe.producer_tail(state)
