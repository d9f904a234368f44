"""Sweep PingPong GEMM configs against cuBLAS, in every operand layout (tuning aid).

    python benchmarks/gemm_configs.py [--out benchmarks/results/gemm_configs_h200.json]
        [--rounds 3] [--layouts fwd] [--H ''] [--tokens 16384] [--ffn H:FFN,...]
        [--shapes [layout:]MxNxK,...|none] [--extra 256x128_c2x1_g8,...]
        [--no-candidates] [--precompile 12] [--seconds 0.6]

For each shape, every config :func:`coda.runtime.autotune.candidates` would time (the
heuristic's config first, its tile with other swizzle-group heights, then
``CANDIDATES``) and cuBLAS (``torch.mm`` on the same views) run in interleaved rounds;
each row gives cublas_ms / config_ms per config (higher is better) and the best config.
Each round starts at another contender (``common.interleaved(rotate=True)``): in a fixed
order the config timed right after cuBLAS read several percent slow on the H200
(docs/gemm.md, "Cooperative 256 x 128 tiles for long K").
Shapes: ``benchmarks/gemm.py``'s seven reference shapes (forward only) unless
``--shapes`` names others (``MxNxK`` in each of ``--layouts``, ``layout:MxNxK`` in
one; ``none``: no such shapes), plus the Llama block projections
of ``--H`` in each of ``--layouts`` (the same shapes and flags as ``gemm.py``).

``--seconds S``: each contender of a round runs back to back for S seconds instead of
one timed batch, while board power and SM clock are sampled (``common.sampled``), so that
every kernel is timed at the clock its own power draw settles to (the card runs these
GEMMs at its power limit); rows then carry ``power``: per contender the medians over
rounds of ``sm_mhz``, ``watts`` and ``joules`` (energy per call).

``--precompile N`` first compiles every (config, operand layout) kernel in N processes at
once (a kernel does not depend on the problem's size), into the on-disk kernel cache the
timing process then loads from: on the lent GPU machine most of a sweep is otherwise one
core compiling.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from gemm import (  # noqa: E402
    SHAPES,
    TOKENS,
    ffn_sizes,
    layout_operands,
    layout_shape,
    llama_projections,
)

from coda.mainloop.config import GemmConfig  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.runtime.autotune import candidates  # noqa: E402
from coda.testing.layouts import operands  # noqa: E402


def label(cfg) -> str:
    kind = "" if cfg.tile_m == 128 else "coop"
    return (
        f"{kind}{cfg.tile_m}x{cfg.tile_n}_c{cfg.cluster_m}x{cfg.cluster_n}"
        f"_e{cfg.epi_n}_g{cfg.group_m}" + (f"_s{cfg.split_k}" if cfg.split_k > 1 else "")
    )


def layout_shapes(shapes: str, layouts: list[str]) -> list[tuple[str, int, int, int]]:
    """(layout, M, N, K) of ``[layout:]MxNxK,...``: a shape without a layout in each of
    ``layouts``, one with a layout in that one."""
    found = []
    for item in shapes.split(","):
        where, _, shape = item.rpartition(":")
        m, n, k = (int(v) for v in shape.split("x"))
        found += [(layout, m, n, k) for layout in ([where] if where else layouts)]
    return found


def problems(args) -> list[tuple[str, str, int, int, int]]:
    """(layout, projection, M, N, K) of every shape the sweep times."""
    layouts = [x for x in args.layouts.split(",") if x]
    found = []
    if args.shapes == "none":
        pass
    elif args.shapes:
        found += [(layout, "", *mnk) for layout, *mnk in layout_shapes(args.shapes, layouts)]
    elif "fwd" in layouts:
        found += [("fwd", "", *s) for s in SHAPES]
    ffn = ffn_sizes(args.ffn)
    for h in [int(x) for x in args.H.split(",") if x]:
        for proj, (out_f, in_f) in llama_projections(h, ffn.get(h)).items():
            for layout in layouts:
                found.append((layout, proj, *layout_shape(layout, out_f, in_f, args.tokens)))
    return found


def parse_config(text: str) -> GemmConfig:
    """A config from a label such as ``256x128_c2x1_g8`` (tile, cluster, swizzle group)."""
    tile, cluster, group = text.split("_")
    tm, tn = (int(v) for v in tile.split("x"))
    cm, cn = (int(v) for v in cluster.lstrip("c").split("x"))
    return GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, group_m=int(group[1:]))


def configs_of(m: int, n: int, k: int, extra: tuple, every_candidate: bool) -> tuple:
    """The configs timed for (m, n, k): ``candidates`` (the heuristic's first; only it
    unless ``every_candidate``), then ``extra``."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    found = candidates(m, n, k, sms)
    return tuple(dict.fromkeys((*(found if every_candidate else found[:1]), *extra)))


def sweep_shape(
    layout: str, m: int, n: int, k: int, rounds: int, configs: tuple, seconds: float = 0.0
) -> dict:
    a, b = layout_operands(layout, m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bt = b.t()
    contenders = {"cublas": lambda: torch.mm(a, bt, out=out)}
    for cfg in configs:
        contenders[label(cfg)] = lambda cfg=cfg: gemm(a, b, out=out, config=cfg)
    reps = max(3, min(30, int(2e13 / (2 * m * n * k))))
    times, power = common.timed_rounds(contenders, rounds, reps, True, seconds)
    row = {"layout": layout, "M": m, "N": n, "K": k, "heuristic": label(configs[0])}
    row["cublas_ms"] = common.median(times["cublas"])
    for cfg in configs:
        row[label(cfg)] = common.median_ratio(times["cublas"], times[label(cfg)])
    row["best"] = max((label(c) for c in configs), key=lambda name: row[name])
    if power:
        row["power"] = power
    return row


def compile_one(job: tuple) -> None:
    """Compile the kernel of one (layout, config), on small operands (a kernel does not
    depend on the problem's size)."""
    layout, cfg = job
    a, b = operands(
        torch.randn(512, 256, device="cuda", dtype=torch.bfloat16),
        torch.randn(512, 256, device="cuda", dtype=torch.bfloat16),
        layout,
    )
    gemm(a, b, config=cfg)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/gemm_configs_h200.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", default="fwd")
    p.add_argument("--H", default="", help="Llama hidden sizes, e.g. 2048,4096")
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--ffn", default="", help="FFN widths other than round_up(8H/3, 256): H:FFN,...")
    p.add_argument("--shapes", default="", help="[layout:]MxNxK,... or none")
    p.add_argument("--extra", default="", help="more configs: TMxTN_cCMxCN_gG,...")
    p.add_argument(
        "--no-candidates", action="store_true", help="the heuristic's config and --extra only"
    )
    common.add_seconds_option(p)
    common.add_precompile_options(p)
    args = p.parse_args(argv)
    extra = tuple(parse_config(c) for c in args.extra.split(",") if c)
    shapes = [
        (layout, proj, m, n, k, configs_of(m, n, k, extra, not args.no_candidates))
        for layout, proj, m, n, k in problems(args)
    ]
    jobs = sorted({(s[0], cfg) for s in shapes for cfg in s[5]}, key=repr)
    if common.precompiled(args, argv, os.path.abspath(__file__), jobs, compile_one):
        return
    rows = []
    for layout, proj, m, n, k, configs in shapes:
        row = sweep_shape(layout, m, n, k, args.rounds, configs, args.seconds)
        rows.append(dict(row, proj=proj))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    common.write_json(
        args.out,
        {
            **common.environment(),
            "metric": "cublas_ms/config_ms",
            "command": " ".join(["python3", "benchmarks/gemm_configs.py", *argv]),
            "rows": rows,
        },
    )
    common.print_table(rows, ["layout", "proj", "M", "N", "K", "heuristic", "best", "cublas_ms"])
    for r in rows:
        print(
            r["layout"],
            r["proj"],
            r["M"],
            r["N"],
            r["K"],
            f"heuristic {r[r['heuristic']]:.3f}",
            f"best {r['best']} {r[r['best']]:.3f}",
        )


if __name__ == "__main__":
    main()
