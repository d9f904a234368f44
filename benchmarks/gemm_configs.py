"""Sweep PingPong GEMM configs against cuBLAS on the benchmark shapes (tuning aid).

    python benchmarks/gemm_configs.py [--out benchmarks/results/gemm_configs_h200.json]

For each shape, every candidate config of coda.runtime.autotune and cuBLAS are timed in
interleaved rounds; the table shows cublas_ms / config_ms per config (higher is better).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from gemm import SHAPES  # noqa: E402

from coda.mainloop.config import choose_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.runtime.autotune import CANDIDATES  # noqa: E402


def label(cfg) -> str:
    return f"{cfg.tile_m}x{cfg.tile_n}_c{cfg.cluster_m}x{cfg.cluster_n}_e{cfg.epi_n}_g{cfg.group_m}"


def sweep_shape(m: int, n: int, k: int, rounds: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bt = b.t()
    contenders = {"cublas": lambda: torch.mm(a, bt, out=out)}
    for cfg in CANDIDATES:
        contenders[label(cfg)] = lambda cfg=cfg: gemm(a, b, out=out, config=cfg)
    reps = max(3, min(30, int(2e13 / (2 * m * n * k))))
    times = common.interleaved(contenders, rounds=rounds, reps=reps)
    row = {"M": m, "N": n, "K": k, "heuristic": label(choose_config(m, n, k))}
    for name in contenders:
        if name != "cublas":
            row[name] = common.median_ratio(times["cublas"], times[name])
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/gemm_configs_h200.json")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    for m, n, k in SHAPES:
        rows.append(sweep_shape(m, n, k, args.rounds))
        print(rows[-1], flush=True)
    common.write_json(
        args.out, {**common.environment(), "metric": "cublas_ms/config_ms", "rows": rows}
    )
    common.print_table(rows, ["M", "N", "K", "heuristic"] + [label(c) for c in CANDIDATES])


if __name__ == "__main__":
    main()
