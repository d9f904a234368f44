"""Static persistent tile scheduler with grouped (swizzled) rasterization, in CuTeDSL.

Sits under ``coda.mainloop``; used by the producer warp and both consumer warpgroups of
the PingPong kernel. Work is enumerated in *cluster* units: linear index ``t`` runs over
all clusters of output tiles, each persistent cluster starts at its own id and strides
by the number of persistent clusters (the PingPong consumers stride by twice that,
each owning every other tile). A linear index maps to a cluster coordinate by
grouped rasterization: ``group_m`` cluster-rows form a group visited column by column,
so consecutive work shares B columns and A rows in L2.

Split-K (``splits`` > 1): the K loop of every output tile is cut into ``splits`` equal
ranges of k-tiles, each its own unit of work (the split index is the outermost digit of
the linear index); the kernel then stores every unit through TMA reduce-add, so the
units of one tile sum in global memory. It fills the machine when M x N has too few
tiles for a full wave (a long-K GEMM with a small output, e.g. dh of an LM head).
"""

from __future__ import annotations

from .cute_env import ensure_arch

ensure_arch()

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


class TileScheduler:
    """Trace-time helper; all arithmetic is emitted as device code (Int32).

    ``clusters_m`` / ``clusters_n`` are the number of clusters along M / N (dynamic),
    ``group_m`` the swizzle group height in clusters (static).
    """

    def __init__(
        self,
        clusters_m: Int32,
        clusters_n: Int32,
        cluster_shape_mn: tuple[int, int],
        group_m: int,
        splits: int = 1,
    ):
        self.clusters_m = clusters_m
        self.clusters_n = clusters_n
        self.cluster_shape_mn = cluster_shape_mn
        self.group_m = group_m
        self.splits = splits

    # A scheduler is carried through dynamic control flow: expose its runtime values.
    def __extract_mlir_values__(self):
        return extract_mlir_values(self.clusters_m) + extract_mlir_values(self.clusters_n)

    def __new_from_mlir_values__(self, values):
        return TileScheduler(
            new_from_mlir_values(self.clusters_m, [values[0]]),
            new_from_mlir_values(self.clusters_n, [values[1]]),
            self.cluster_shape_mn,
            self.group_m,
            self.splits,
        )

    @property
    def num_work(self) -> Int32:
        if self.splits > 1:
            return self.clusters_m * self.clusters_n * Int32(self.splits)
        return self.clusters_m * self.clusters_n

    def k_split(self, t: Int32) -> Int32:
        """The split-K index (0 .. splits - 1) of linear work index ``t``."""
        if self.splits > 1:
            return cute.arch.make_warp_uniform(t // (self.clusters_m * self.clusters_n))
        return Int32(0)

    def tile_coord(self, t: Int32, cta_in_cluster_mn: tuple[Int32, Int32]) -> tuple[Int32, Int32]:
        """(tile_m_idx, tile_n_idx) of this CTA for linear cluster-work index ``t``."""
        if self.splits > 1:
            t = t % (self.clusters_m * self.clusters_n)
        per_group = Int32(self.group_m) * self.clusters_n
        group = t // per_group
        first_m = group * Int32(self.group_m)
        rows = cutlass.min(self.clusters_m - first_m, Int32(self.group_m))
        r = t - group * per_group
        cm = first_m + r % rows
        cn = r // rows
        tm = cm * Int32(self.cluster_shape_mn[0]) + cta_in_cluster_mn[0]
        tn = cn * Int32(self.cluster_shape_mn[1]) + cta_in_cluster_mn[1]
        return cute.arch.make_warp_uniform(tm), cute.arch.make_warp_uniform(tn)


def host_tile_order(
    clusters_m: int, clusters_n: int, group_m: int, splits: int = 1
) -> list[tuple[int, ...]]:
    """The same mapping in plain Python (cluster coordinates in visiting order; with
    ``splits`` > 1, (cluster m, cluster n, split) triples).

    Used by CPU tests to check that the schedule is a permutation of all work.
    """
    order = []
    per_group = group_m * clusters_n
    per_split = clusters_m * clusters_n
    for u in range(per_split * splits):
        t = u % per_split
        group = t // per_group
        first_m = group * group_m
        rows = min(clusters_m - first_m, group_m)
        r = t - group * per_group
        coord = (first_m + r % rows, r // rows)
        order.append(coord + (u // per_split,) if splits > 1 else coord)
    return order
