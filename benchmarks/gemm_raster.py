"""The tile raster of the plain GEMM: swizzle group heights and tiles against cuBLAS.

    python benchmarks/gemm_raster.py [--cases fwd:16384x4096x11008,wgrad:4096x11008x16384]
        [--group-m 1,2,4,8,16] [--tiles 128x192c2x1,256x128c2x1] [--rounds 3] [--out FILE]

For each case (``layout:MxNxK``, the GEMM's own M, N, K; ``layout`` fwd / dgrad / wgrad
says which operands are transposed views, as in ``gemm.py``), the heuristic's config and
the same config with each ``--group-m`` (the swizzle group height, in cluster rows: how
many rows of tiles the persistent grid walks column by column) are timed beside cuBLAS
(``torch.mm`` on the same views) in interleaved rounds. ``group_m`` decides how much of
A and B the tiles in flight share through L2: a group keeps ``group_m * cluster_m *
tile_m * K`` elements of A live while it sweeps the columns.
JSON rows ``{"layout", "M", "N", "K", "config", "group_m", "coda_ms", "cublas_ms"}``.
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.mainloop.config import choose_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.testing.layouts import operands  # noqa: E402


def label(cfg) -> str:
    return f"{cfg.tile_m}x{cfg.tile_n} c{cfg.cluster_m}x{cfg.cluster_n} g{cfg.group_m}"


def parse_tile(spec: str, base):
    """``"256x128c2x1"`` -> ``base`` with that tile and cluster."""
    tile, cluster = spec.split("c")
    tm, tn = (int(x) for x in tile.split("x"))
    cm, cn = (int(x) for x in cluster.split("x"))
    return attrs.evolve(base, tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn)


def sweep(
    layout: str, m: int, n: int, k: int, groups: list[int], rounds: int, tiles: list[str] = ()
) -> list[dict]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    A, B = operands(a, b, layout)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    base = choose_config(m, n, k)
    configs = {label(base): base}
    for tiled in [base, *(parse_tile(t, base) for t in tiles)]:
        for g in groups:
            cfg = attrs.evolve(tiled, group_m=g)
            configs.setdefault(label(cfg), cfg)
    contenders = {"cublas": lambda: torch.mm(A, B.t(), out=out)}
    for name, cfg in configs.items():
        contenders[name] = lambda cfg=cfg: gemm(A, B, out=out, config=cfg)
    reps = max(3, min(20, int(2e13 / (2 * m * n * k))))
    times = common.interleaved(contenders, rounds=rounds, reps=reps)
    cublas = common.median(times["cublas"])
    rows = []
    for name, cfg in configs.items():
        row = {
            "layout": layout, "M": m, "N": n, "K": k, "config": name,
            "group_m": cfg.group_m, "heuristic": cfg == base,
            "coda_ms": common.median(times[name]), "cublas_ms": cublas,
        }  # fmt: skip
        rows.append(row)
        print(
            f"{layout:5s} {m:6d} {n:6d} {k:6d} {name:22s} {row['coda_ms']:8.3f} ms "
            f"cuBLAS {cublas:8.3f} ms  {cublas / row['coda_ms']:.3f}",
            flush=True,
        )
    return rows


#: The Llama 3 8B (H = 4096) block's GEMMs with the longest K: the down projection's
#: forward and weight gradient, the gate/up projection's data and weight gradients.
CASES = "fwd:16384x4096x11008,wgrad:4096x11008x16384,dgrad:16384x4096x22016,wgrad:22016x4096x16384"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/gemm_raster_h200.json")
    p.add_argument("--cases", default=CASES)
    p.add_argument("--group-m", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiles", default="", help="also these tiles, e.g. 128x192c2x1,256x128c2x1")
    args = p.parse_args(argv)
    groups = [int(g) for g in args.group_m.split(",")]
    tiles = [t for t in args.tiles.split(",") if t]
    rows = []
    for case in args.cases.split(","):
        layout, shape = case.split(":")
        m, n, k = (int(x) for x in shape.split("x"))
        rows += sweep(layout, m, n, k, groups, args.rounds, tiles)
    common.write_json(args.out, {**common.environment(), "rows": rows})


if __name__ == "__main__":
    main()
