"""Does deeper epilogue buffering hide a fused epilogue? Fused vs plain at one shape.

    python benchmarks/epilogue_buffering.py [residual_store rmsnorm_fwd ...] [--nk 2048]
        [--variants base,load8,load8_epi2,epi8,epi2,load2_epi2,tile192,cluster1x2]
        [--out DIR]

At M=16384, N=K=``--nk`` (forward layout), each named ``coda.testing.catalog`` epilogue
runs with the fused-epilogue config (128x128, 2x1 cluster) and variants of its epilogue
buffering (``GemmConfig.load_stages``: buffers per loaded M x N operand, default 4;
``epi_stages``: output buffers, default 4) or of its tiling (``tile192``: 128x192 tiles;
``cluster1x2``: A multicast over a 1x2 cluster instead of B over 2x1), timed in
interleaved rounds against coda's plain GEMM with the same config (``plain``) and with
the GEMM heuristic's 128x192 (``plain192``); medians in microseconds and
``r_<variant>`` = variant / plain.
Writes ``epilogue_buffering_<nk>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402

M = 16384


def variants(base) -> dict:
    return {
        "base": base,
        "load8": attrs.evolve(base, load_stages=8),
        "load8_epi2": attrs.evolve(base, load_stages=8, epi_stages=2),
        "epi8": attrs.evolve(base, epi_stages=8),
        # fewer output buffers leave shared memory to more A/B stages of the mainloop
        "epi2": attrs.evolve(base, epi_stages=2),
        "load2_epi2": attrs.evolve(base, load_stages=2, epi_stages=2),
        # less L2 traffic for the mainloop's operands per output element: a wider tile, or
        # A multicast across a 1x2 cluster instead of B across 2x1
        "tile192": attrs.evolve(base, tile_n=192),
        "cluster1x2": attrs.evolve(base, cluster_m=1, cluster_n=2),
    }


def bench(name: str, nk: int, chosen: list[str], rounds: int) -> dict:
    epi = EPILOGUES[name]
    base = choose_epilogue_config(M, nk, nk)
    A, B, t = common.cuda_inputs(epi, M, nk, nk)
    out = torch.empty(M, nk, device="cuda", dtype=torch.bfloat16)
    fns = {
        "plain": lambda: gemm(A, B, out=out, config=base),
        "plain192": lambda: gemm(A, B, out=out),
    }
    for vname, cfg in variants(base).items():
        if vname in chosen:
            fns[vname] = lambda cfg=cfg: epi(A, B, config=cfg, **t)
    times = common.interleaved(fns, rounds=rounds, reps=20)
    med = {k: common.median(v) for k, v in times.items()}
    row = {"epilogue": name, **{k: round(v * 1e3, 1) for k, v in med.items()}}
    row.update({f"r_{k}": round(med[k] / med["plain"], 3) for k in chosen})
    row["r_plain192"] = round(med["plain192"] / med["plain"], 3)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("epilogues", nargs="*", default=list(EPILOGUES))
    p.add_argument("--nk", type=int, default=2048)
    p.add_argument("--variants", default="base,load8,load8_epi2,epi8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    chosen = args.variants.split(",")
    rows = []
    for name in args.epilogues:
        rows.append(bench(name, args.nk, chosen, args.rounds))
        print(rows[-1], flush=True)
    common.write_json(
        os.path.join(args.out, f"epilogue_buffering_{args.nk}.json"),
        {**common.environment(), "M": M, "N": args.nk, "K": args.nk, "rows": rows},
    )


if __name__ == "__main__":
    main()
