"""Fused epilogue vs coda's own plain GEMM on the same shape and config, side by side.

    python benchmarks/epilogue_overhead.py [--out benchmarks/results/epilogue_overhead_h200.json]

For each representative epilogue of ``coda.testing.catalog`` and each shape (M=16384,
N=K=4096 and N=K=8192), the fused kernel (``epi(A, B, **tensors)``, finalize included)
and the plain GEMM (``coda.gemm`` with the same 128x128 2x1 config, bf16 output) are
timed in interleaved rounds; fused_ms / plain_ms is the epilogue's cost.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.strategies import make_inputs  # noqa: E402

SHAPES = [(16384, 4096, 4096), (16384, 8192, 8192)]


def bench(name: str, m: int, n: int, k: int, rounds: int) -> dict:
    epi = EPILOGUES[name]
    A, B, tensors = make_inputs(epi, m, n, k, torch.bfloat16, seed=0)
    A, B = A.cuda(), B.cuda()
    tensors = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in tensors.items()}
    cfg = choose_epilogue_config(m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    times = common.interleaved(
        {
            "fused": lambda: epi(A, B, config=cfg, **tensors),
            "plain": lambda: gemm(A, B, out=out, config=cfg),
        },
        rounds=rounds,
        reps=max(3, min(30, int(2e13 / flops))),
    )
    fused, plain = common.median(times["fused"]), common.median(times["plain"])
    return {
        "epilogue": name,
        "M": m,
        "N": n,
        "K": k,
        "fused_ms": fused,
        "plain_ms": plain,
        "ratio": common.median_ratio(times["fused"], times["plain"]),
        "config": f"{cfg.tile_m}x{cfg.tile_n} cluster {cfg.cluster_m}x{cfg.cluster_n}",
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/epilogue_overhead_h200.json")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    rows = [bench(name, m, n, k, args.rounds) for m, n, k in SHAPES for name in EPILOGUES]
    common.write_json(args.out, {**common.environment(), "rows": rows})
    common.print_table(rows, ["epilogue", "M", "N", "K", "fused_ms", "plain_ms", "ratio"])


if __name__ == "__main__":
    main()
