"""Fused epilogues on long-running problems: PingPong 128-row tiles against cooperative
256-row tiles, beside the plain GEMM.

    python benchmarks/epilogue_tiles.py [--shapes 16384x44032x8192,...]
        [--epilogues swiglu_fwd,lse_target,...] [--configs pp128x128,coop256x128]
        [--same-tile] [--rotate] [--precompile N] [--out FILE]

``choose_epilogue_config`` gives fused epilogues 128 x 128 PingPong tiles (128 x 192 on
short mainloops where the plain GEMM takes it: ``WIDE_EPILOGUE_MAX_K``); plain GEMMs
of ``LONG_RUN_FLOPS`` or more take cooperative 256-row tiles (fewer operand bytes per
FLOP, which at the power limit is clock), where both warpgroups run their epilogues at
once after the tile's mainloop (nothing to hide behind) and every epilogue runs (M x N
loads, reductions, vectors). This times, in interleaved rounds, each named catalogue
epilogue under each candidate config and the plain GEMM under the heuristic's config.
Rows ``{"epilogue", "M", "N", "K", "config", "ms", "plain_ms", "ratio"}`` (ratio: ms /
plain_ms); with ``--same-tile`` also ``plain_same_tile_ms`` (the plain GEMM in the row's
config) and ``same_tile_ratio``: how much of the ratio is the tile, how much the
epilogue. (Until 2026-11-26 this was ``store_epilogue_tiles.py``, for store-only
epilogues: ``results/store_epilogue_tiles_h200.json``.) ``--epilogues`` may also name the
training ops' epilogues of ``epilogue_overhead.TRAINING_EPILOGUES`` (e.g.
``fusion_swiglu_bwd``); ``--rotate`` starts each round at the next contender (on the
power-limited H200 a fixed order times later contenders slow); ``--precompile N``
compiles every timed kernel in N processes first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from epilogue_overhead import epilogue_named  # noqa: E402

from coda.mainloop.config import GemmConfig, choose_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402

CONFIGS = {
    "pp128x128": GemmConfig(tile_n=128),
    "pp128x192": GemmConfig(tile_n=192),
    # the same PingPong tiles in a 1 x 2 cluster (A multicast instead of B)
    "pp128x128c1x2": GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
    "pp128x192c1x2": GemmConfig(tile_n=192, cluster_m=1, cluster_n=2),
    "pp128x128c2x2": GemmConfig(tile_n=128, cluster_m=2, cluster_n=2),
    # no cluster: no multicast, and no CTA waits for a peer to release a shared stage
    "pp128x128c1x1": GemmConfig(tile_n=128, cluster_m=1, cluster_n=1),
    "coop256x128": GemmConfig(tile_m=256, tile_n=128),
    "coop256x192": GemmConfig(tile_m=256, tile_n=192),
}


def contenders(shape: tuple, name: str, configs: dict, same_tile: bool) -> tuple:
    """(the plain heuristic's config, {label: call}) of one row: the plain GEMM under
    ``choose_config``, the fused call in each config, and with ``same_tile`` the plain
    GEMM in each config too."""
    m, n, k = shape
    epi = epilogue_named(name)
    A, B, tensors = common.cuda_inputs(epi, m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    plain_cfg = choose_config(m, n, k)
    fns = {"plain": lambda: gemm(A, B, out=out, config=plain_cfg)}
    for label, cfg in configs.items():
        fns[label] = lambda cfg=cfg: epi(A, B, config=cfg, **tensors)
        if same_tile:  # the plain GEMM on the fused call's tile too
            fns[f"plain {label}"] = lambda cfg=cfg: gemm(A, B, out=out, config=cfg)
    return plain_cfg, fns


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16384x44032x8192,16384x22016x4096,16384x11264x2048")
    p.add_argument("--epilogues", default="swiglu_fwd,rmsnorm_fwd,lse_target,swiglu_bwd")
    p.add_argument("--configs", default=",".join(CONFIGS), help="labels of CONFIGS")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--same-tile",
        action="store_true",
        help="also time the plain GEMM in each fused config (splits tile from epilogue)",
    )
    p.add_argument("--out", default="benchmarks/results/epilogue_tiles_h200.json")
    common.add_rotate_option(p)
    common.add_precompile_options(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    configs = {label: CONFIGS[label] for label in args.configs.split(",")}
    jobs = [
        (tuple(map(int, shape.split("x"))), name)
        for shape in args.shapes.split(",")
        for name in args.epilogues.split(",")
    ]
    for name in {job[1] for job in jobs}:  # an unknown name fails before any GPU work
        epilogue_named(name)

    def compile_one(job: tuple) -> None:  # one call of each contender compiles its kernels
        for fn in contenders(*job, configs, args.same_tile)[1].values():
            fn()

    if common.precompiled(args, argv, os.path.abspath(__file__), jobs, compile_one):
        return
    rows = []
    for (m, n, k), name in jobs:
        plain_cfg, fns = contenders((m, n, k), name, configs, args.same_tile)
        times = common.interleaved(fns, rounds=args.rounds, reps=5, warmup=2, rotate=args.rotate)
        plain = common.median(times["plain"])
        for label in configs:
            ms = common.median(times[label])
            rows.append({"epilogue": name, "M": m, "N": n, "K": k, "config": label,
                         "ms": ms, "plain_ms": plain, "ratio": ms / plain,
                         "plain_config": str(plain_cfg)})  # fmt: skip
            if args.same_tile:
                same = common.median(times[f"plain {label}"])
                rows[-1].update(plain_same_tile_ms=same, same_tile_ratio=ms / same)
            print(rows[-1])
    payload = {**common.environment(), "command": " ".join(sys.argv), "rows": rows}
    common.write_json(args.out, payload)
    cols = ["epilogue", "M", "N", "K", "config", "ms", "plain_ms", "ratio"]
    if args.same_tile:
        cols += ["plain_same_tile_ms", "same_tile_ratio"]
    common.print_table(rows, cols)


if __name__ == "__main__":
    main()
