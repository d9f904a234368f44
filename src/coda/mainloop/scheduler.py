"""Static persistent tile scheduler with grouped (swizzled) rasterization, in CuTeDSL.

Sits under ``coda.mainloop``; used by the producer warp and both consumer warpgroups of
the PingPong kernel. Work is enumerated in *cluster* units: linear index ``t`` runs over
all clusters of output tiles, each persistent cluster starts at its own id and strides
by the number of persistent clusters (the PingPong consumers stride by twice that,
each owning every other tile). A linear index maps to a cluster coordinate by
grouped rasterization: ``group_m`` cluster-rows form a group visited column by column,
so consecutive work shares B columns and A rows in L2.
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
    ):
        self.clusters_m = clusters_m
        self.clusters_n = clusters_n
        self.cluster_shape_mn = cluster_shape_mn
        self.group_m = group_m

    # A scheduler is carried through dynamic control flow: expose its runtime values.
    def __extract_mlir_values__(self):
        return extract_mlir_values(self.clusters_m) + extract_mlir_values(self.clusters_n)

    def __new_from_mlir_values__(self, values):
        return TileScheduler(
            new_from_mlir_values(self.clusters_m, [values[0]]),
            new_from_mlir_values(self.clusters_n, [values[1]]),
            self.cluster_shape_mn,
            self.group_m,
        )

    @property
    def num_work(self) -> Int32:
        return self.clusters_m * self.clusters_n

    def tile_coord(self, t: Int32, cta_in_cluster_mn: tuple[Int32, Int32]) -> tuple[Int32, Int32]:
        """(tile_m_idx, tile_n_idx) of this CTA for linear cluster-work index ``t``."""
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


def host_tile_order(clusters_m: int, clusters_n: int, group_m: int) -> list[tuple[int, int]]:
    """The same mapping in plain Python (cluster coordinates in visiting order).

    Used by CPU tests to check that the schedule is a permutation of all clusters.
    """
    order = []
    per_group = group_m * clusters_n
    for t in range(clusters_m * clusters_n):
        group = t // per_group
        first_m = group * group_m
        rows = min(clusters_m - first_m, group_m)
        r = t - group * per_group
        order.append((first_m + r % rows, r // rows))
    return order
