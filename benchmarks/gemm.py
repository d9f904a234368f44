"""coda's PingPong GEMM vs cuBLAS (torch.mm, same layouts), side by side in one run.

    python benchmarks/gemm.py [--out benchmarks/results/gemm_h200.json] [--rounds 7]

out = A @ B^T with A (M, K) and B (N, K) in bf16, bf16 output, for the issue's shapes.
Writes JSON (device, versions, command, rows) and a PNG chart, then prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.matmul import gemm as coda_gemm  # noqa: E402

SHAPES = [
    (8192, 8192, 8192),
    (16384, 2048, 2048),
    (16384, 4096, 4096),
    (16384, 8192, 8192),
    (16384, 22016, 4096),
    (16384, 4096, 11008),
    (16384, 44032, 8192),
]


def bench_shape(m: int, n: int, k: int, rounds: int, config=None) -> dict:
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d_coda = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    d_cublas = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bt = b.t()
    flops = 2 * m * n * k
    reps = max(3, min(50, int(2e13 / flops)))
    times = common.interleaved(
        {
            "coda": lambda: coda_gemm(a, b, out=d_coda, config=config),
            "cublas": lambda: torch.mm(a, bt, out=d_cublas),
        },
        rounds=rounds,
        reps=reps,
    )
    err = (d_coda.float() - d_cublas.float()).abs().max().item()
    coda_ms, cublas_ms = common.median(times["coda"]), common.median(times["cublas"])
    return {
        "M": m,
        "N": n,
        "K": k,
        "coda_ms": coda_ms,
        "cublas_ms": cublas_ms,
        "coda_tflops": flops / coda_ms / 1e9,
        "cublas_tflops": flops / cublas_ms / 1e9,
        "speedup_vs_cublas": common.median_ratio(times["cublas"], times["coda"]),
        "max_abs_diff_vs_cublas": err,
    }


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['M']}x{r['N']}x{r['K']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([i - 0.2 for i in x], [r["cublas_tflops"] for r in rows], 0.4, label="cuBLAS")
    ax.bar([i + 0.2 for i in x], [r["coda_tflops"] for r in rows], 0.4, label="coda PingPong")
    ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title("GEMM out = A @ B^T, " + torch.cuda.get_device_name(0))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/gemm_h200.json")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", default="", help="subset, e.g. 8192x8192x8192,16384x2048x2048")
    args = p.parse_args(argv)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [bench_shape(m, n, k, args.rounds) for m, n, k in shapes]
    geo = math.exp(sum(math.log(r["speedup_vs_cublas"]) for r in rows) / len(rows))
    payload = {
        **common.environment(),
        "geomean_cublas_over_coda": geo,
        "min_cublas_over_coda": min(r["speedup_vs_cublas"] for r in rows),
        "rows": rows,
    }
    common.write_json(args.out, payload)
    chart(rows, os.path.splitext(args.out)[0] + ".png")
    common.print_table(
        rows,
        [
            "M",
            "N",
            "K",
            "coda_ms",
            "cublas_ms",
            "coda_tflops",
            "cublas_tflops",
            "speedup_vs_cublas",
        ],
    )
    print(f"geomean cublas_ms/coda_ms = {geo:.3f}")


if __name__ == "__main__":
    main()
