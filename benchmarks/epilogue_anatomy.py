"""Where a fused epilogue's cost comes from: the heavy catalogue epilogues taken apart.

    python benchmarks/epilogue_anatomy.py [--m 16384] [--size 2048] [--rounds 3]
        [--out benchmarks/results/epilogue_anatomy_h200.json]

At M x N x K (default 16384 x 2048 x 2048, where ``epilogue_overhead.py`` measures the
largest ratios) each variant below runs as ``epi(A, B, **tensors)`` in the config the
fused heuristics pick, in interleaved rounds beside coda's plain GEMM in that config
(medians; ``ratio`` = median over rounds of variant / plain). Each variant adds one
ingredient to the one before it, so the differences say what each costs:

* ``store_acc``: the accumulator stored through the fused visitor (the plain GEMM's work);
* ``residual_store``, ``two_stores`` (+ a second M x N store of x * gamma),
  ``rmsnorm_fwd`` (+ the per-row sum of squares and its finalize);
* ``sumsq_only``: the row reduction alone (no M x N load or store);
* ``gu_copy`` (the width-2 gate/up tile loaded and stored back: SwiGLU backward's
  memory traffic), ``swiglu_bwd_map`` (+ its math), ``swiglu_bwd`` (+ the row partial);
* ``colsum_only``, ``dgamma_colsum`` (+ a column max);
* ``lse_target`` (the loss's statistics: no M x N traffic, the most math per element).

Then torch.profiler splits each variant's time into its GEMM kernel and its finalize
kernel (``gemm_kernel_us``, ``finalize_kernel_us`` per call: a programmatic dependent
launch, whose duration includes its wait for the GEMM) and gives the call's GPU span
(``call_span_us``: the GEMM's start to the end of the call's last kernel, median). JSON
rows ``{"variant", "M", "N", "K", "ms", "plain_ms", "ratio", "gemm_kernel_us",
"finalize_kernel_us", "call_span_us"}``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.epilogue import Epilogue  # noqa: E402
from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.primitives import Elementwise, TileLoad, TileReduce, TileStore, VecLoad, ops  # noqa: E402
from coda.testing.catalog import EPILOGUES, rstd_post  # noqa: E402

bf16 = torch.bfloat16


def _residual_x() -> Epilogue:
    return (
        Epilogue()
        .add(TileLoad("residual", bf16))
        .add(Elementwise("x", ops.add, ins=("acc", "residual")))
        .add(TileStore("x", bf16))
    )


def variants() -> dict[str, Epilogue]:
    two_stores = (
        _residual_x()
        .add(VecLoad("gamma", per="col", dtype=bf16))
        .add(Elementwise("h", ops.mul, ins=("x", "gamma")))
        .add(TileStore("h", bf16))
    )
    gu = TileLoad("gu", bf16, width=2)
    swiglu_map = (
        Epilogue()
        .add(gu)
        .add(Elementwise("dgu", ops.swiglu_backward, ins=("gu", "acc"), pairwise="map"))
        .add(TileStore("dgu", bf16))
    )
    return {
        "store_acc": Epilogue().add(TileStore("acc", bf16)),
        "residual_store": EPILOGUES["residual_store"],
        "two_stores": two_stores,
        "rmsnorm_fwd": EPILOGUES["rmsnorm_fwd"],
        "sumsq_only": Epilogue().add(TileReduce("rstd", of="acc", op="sumsq", post=rstd_post)),
        "gu_copy": Epilogue().add(gu).add(TileStore("gu", bf16, name="gu_out")),
        "swiglu_bwd_map": swiglu_map,
        "swiglu_bwd": EPILOGUES["swiglu_bwd"],
        "colsum_only": Epilogue()
        .add(TileLoad("x_hat", bf16))
        .add(Elementwise("gx", ops.mul, ins=("acc", "x_hat")))
        .add(TileReduce("dgamma", of="gx", op="sum", per="col")),
        "dgamma_colsum": EPILOGUES["dgamma_colsum"],
        "lse_target": EPILOGUES["lse_target"],
    }


def _kernel_split(fn, reps: int = 10) -> tuple[float, float, float]:
    """(GEMM kernel us, finalize kernel us, call span us) per call, from torch.profiler.
    The span runs from the GEMM kernel's start to the end of the call's last kernel. The
    finalize kernel is a programmatic dependent launch: its own duration includes the
    time its CTAs wait for the GEMM grid to finish."""
    kernels = common.profiled_kernels(fn, reps)
    gemm_us, fin_us, spans = 0.0, 0.0, []
    for start, dur, name in kernels:
        if "codamainloop" in name:
            gemm_us += dur / 1e3
            spans.append([start, start + dur])
        elif "finalize" in name:
            fin_us += dur / 1e3
            if spans:
                spans[-1][1] = max(spans[-1][1], start + dur)
    span = common.median([(b - a) / 1e3 for a, b in spans]) if spans else 0.0
    return gemm_us / reps, fin_us / reps, span


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/epilogue_anatomy_h200.json")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--size", type=int, default=2048, help="N = K")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=None, help="comma-separated subset")
    args = p.parse_args(argv)
    m, n = args.m, args.size
    k = n
    cfg = choose_epilogue_config(m, n, k)
    epis = variants()
    if args.variants:
        epis = {name: epis[name] for name in args.variants.split(",")}
    A = torch.randn(m, k, device="cuda").to(bf16)
    B = torch.randn(n, k, device="cuda").to(bf16) / k**0.5
    out = torch.empty(m, n, device="cuda", dtype=bf16)
    methods = {"plain": lambda: gemm(A, B, out=out, config=cfg)}
    for name, epi in epis.items():
        _, _, full = common.cuda_inputs(epi, m, n, k)
        methods[name] = lambda epi=epi, t=full: epi(A, B, config=cfg, **t)
    reps = max(3, min(30, int(2e13 / (2 * m * n * k))))
    times = common.interleaved(methods, rounds=args.rounds, reps=reps)
    plain = common.median(times["plain"])
    rows = []
    for name in epis:
        gemm_us, fin_us, span_us = _kernel_split(methods[name])
        rows.append(
            {
                "variant": name,
                "M": m,
                "N": n,
                "K": k,
                "ms": common.median(times[name]),
                "plain_ms": plain,
                "ratio": common.median_ratio(times[name], times["plain"]),
                "gemm_kernel_us": gemm_us,
                "finalize_kernel_us": fin_us,
                "call_span_us": span_us,
            }
        )
    common.write_json(args.out, {**common.environment(), "config": str(cfg), "rows": rows})
    common.print_table(
        rows,
        [
            "variant",
            "ms",
            "plain_ms",
            "ratio",
            "gemm_kernel_us",
            "finalize_kernel_us",
            "call_span_us",
        ],
    )


if __name__ == "__main__":
    main()
