"""coda's PingPong GEMM vs cuBLAS (torch.mm, same layouts), side by side in one run.

    python benchmarks/gemm.py [--out benchmarks/results/gemm_h200.json] [--rounds 7]
                              [--layouts fwd,dgrad,wgrad] [--H 2048,4096,8192]
                              [--tokens 16384] [--ffn 4096:14336,...] [--rotate]

out = A @ B^T in bf16 with bf16 output. Rows carry a ``layout``:

* ``fwd``: A (M, K) and B (N, K) row-major (``X @ W.T``): the seven reference shapes, plus
  the forward GEMMs of a Llama block;
* ``dgrad``: ``dY @ W`` = A @ B^T with B = W.t() (N-major), M = 16384 tokens;
* ``wgrad``: ``dY.T @ X`` = A @ B^T with A = dY.t() (M-major) and B = X.t() (N-major),
  K = 16384 tokens.

The Llama block's projections at hidden size H: QKV (H -> H + 2 * 8 KV heads * 128),
O (H -> H), gate+up (H -> 2 * FFN) and down (FFN -> H), FFN = round_up(8H/3, 256)
unless ``--ffn H:FFN`` names another (Llama 3's: 2048:8192,4096:14336,8192:28672, the
sizes of ``benchmarks/train_step.py``'s block); ``--tokens`` replaces the 16384 tokens
(``train_step.py``'s block runs 8192). ``--rotate``: cuBLAS and coda take turns starting
a round (``common.interleaved(rotate=True)``), so that neither always runs right after
the other's previous round.
cuBLAS runs ``torch.mm`` on exactly the same (transposed) views. Writes JSON (device,
versions, command, rows, geomean per layout) and a PNG chart, then prints a table.
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
from coda.testing.layouts import operands  # noqa: E402

SHAPES = [
    (8192, 8192, 8192),
    (16384, 2048, 2048),
    (16384, 4096, 4096),
    (16384, 8192, 8192),
    (16384, 22016, 4096),
    (16384, 4096, 11008),
    (16384, 44032, 8192),
]


TOKENS = 16384


def llama_projections(h: int, ffn: int | None = None) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of the Llama block's weights at hidden size ``h``
    (FFN width ``ffn``, by default round_up(8h/3, 256))."""
    ffn = ffn or -(-8 * h // 3 // 256) * 256
    return {"qkv": (h + 2 * 8 * 128, h), "o": (h, h), "gate_up": (2 * ffn, h), "down": (h, ffn)}


def layout_shape(layout: str, out_f: int, in_f: int, tokens: int = TOKENS) -> tuple[int, int, int]:
    """(M, N, K) of the ``layout`` GEMM of a Linear(in_f -> out_f) over ``tokens`` tokens."""
    if layout == "fwd":
        return tokens, out_f, in_f
    if layout == "dgrad":
        return tokens, in_f, out_f
    return out_f, in_f, tokens


def ffn_sizes(spec: str) -> dict[int, int]:
    """``--ffn`` "H:FFN,..." as {H: FFN}."""
    pairs = (item.split(":") for item in spec.split(",") if item)
    return {int(h): int(f) for h, f in pairs}


def layout_operands(layout: str, m: int, n: int, k: int) -> tuple:
    """(A, B) of an (m, n, k) problem in ``layout``'s operand views
    (``coda.testing.layouts.operands``), random bf16 on the GPU, seed 0: what the GEMM
    scripts time coda and cuBLAS (``torch.mm(A, B.t())``) on."""
    torch.manual_seed(0)
    a0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return operands(a0, b0, layout)


def bench_shape(
    m: int, n: int, k: int, rounds: int, config=None, layout: str = "fwd", rotate: bool = False
) -> dict:
    a, b = layout_operands(layout, m, n, k)
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
        rotate=rotate,
    )
    err = (d_coda.float() - d_cublas.float()).abs().max().item()
    coda_ms, cublas_ms = common.median(times["coda"]), common.median(times["cublas"])
    return {
        "layout": layout,
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
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no chart")
        return
    labels = [f"{r['layout']} {r.get('proj', '')} {r['M']}x{r['N']}x{r['K']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(10, 0.35 * len(rows)), 4.5))
    ax.bar([i - 0.2 for i in x], [r["cublas_tflops"] for r in rows], 0.4, label="cuBLAS")
    ax.bar([i + 0.2 for i in x], [r["coda_tflops"] for r in rows], 0.4, label="coda PingPong")
    ax.set_xticks(list(x), labels, rotation=70, fontsize=6)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title("GEMM out = A @ B^T, " + torch.cuda.get_device_name(0))
    ax.legend()
    common.save_figure(plt, fig, path)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/gemm_h200.json")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", default="", help="fwd subset (MxNxK,...) or none")
    p.add_argument("--layouts", default="fwd,dgrad,wgrad")
    p.add_argument("--H", default="2048,4096,8192", help="Llama hidden sizes ('' for none)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens of the Llama GEMMs")
    p.add_argument("--ffn", default="", help="FFN widths other than round_up(8H/3, 256): H:FFN,...")
    common.add_rotate_option(p)
    args = p.parse_args(argv)
    ffn = ffn_sizes(args.ffn)
    layouts = [x for x in args.layouts.split(",") if x]
    shapes = SHAPES
    if args.shapes == "none":
        shapes = []
    elif args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    if "fwd" in layouts:
        rows += [
            dict(bench_shape(m, n, k, args.rounds, rotate=args.rotate), proj="")
            for m, n, k in shapes
        ]
    for h in [int(x) for x in args.H.split(",") if x]:
        for proj, (out_f, in_f) in llama_projections(h, ffn.get(h)).items():
            for layout in layouts:
                m, n, k = layout_shape(layout, out_f, in_f, args.tokens)
                row = bench_shape(m, n, k, args.rounds, layout=layout, rotate=args.rotate)
                rows.append(dict(row, proj=proj, H=h))
                torch.cuda.empty_cache()
    by_layout = {
        layout: [r["speedup_vs_cublas"] for r in rows if r["layout"] == layout]
        for layout in layouts
    }
    summary = {
        layout: {"geomean_cublas_over_coda": geomean(v), "min_cublas_over_coda": min(v)}
        for layout, v in by_layout.items()
        if v
    }
    reference = [r["speedup_vs_cublas"] for r in rows if r["layout"] == "fwd" and not r["proj"]]
    payload = {
        **common.environment(),
        "by_layout": summary,
        "geomean_cublas_over_coda": geomean(reference) if reference else None,
        "min_cublas_over_coda": min(reference) if reference else None,
        "rows": rows,
    }
    common.write_json(args.out, payload)
    chart(rows, os.path.splitext(args.out)[0] + ".png")
    common.print_table(
        rows,
        [
            "layout",
            "proj",
            "M",
            "N",
            "K",
            "coda_ms",
            "cublas_ms",
            "coda_tflops",
            "speedup_vs_cublas",
        ],
    )
    for layout, s in summary.items():
        print(
            f"{layout}: geomean cublas_ms/coda_ms = {s['geomean_cublas_over_coda']:.3f}, "
            f"min {s['min_cublas_over_coda']:.3f}"
        )


if __name__ == "__main__":
    main()
