"""Split-K against the unsplit GEMM on few-tile fp32-output problems (weight gradients).

    python benchmarks/split_k.py [--shapes [layout:]MxNxK,...] [--layouts wgrad]
        [--modes out,accumulate] [--rounds 8] [--rotate] [--precompile 14]
        [--out benchmarks/results/split_k_h200.json]

``coda.gemm`` runs split-K with an explicit ``GemmConfig(split_k=...)`` (the LM-head
loss's short dh GEMMs take it that way), and the shape heuristic considers it only with
``coda.matmul.AUTO_SPLIT_K``, off until measured. This measures it where it could pay: an
fp32 output whose M x N has too few tiles to fill the GPU and a long K (a weight
gradient's K is the token count). Per shape, layout and mode, in interleaved rounds:

* ``unsplit``: the heuristic's config (``choose_config``, what ``coda.gemm`` runs today);
* ``auto``: what the heuristic picks with split-K allowed (``split_ok=True``: what
  ``AUTO_SPLIT_K = True`` would run), when it differs from ``unsplit``;
* ``split2``, ``split4``: 128 x 128 PingPong tiles in a 2 x 1 cluster split 2 and 4 ways
  (where every split keeps at least ``MIN_SPLIT_K_TILES`` k-tiles);
* ``cublas``: ``torch.mm(A, B.t(), out_dtype=torch.float32)`` on the same views (bf16
  output where this torch has no ``out_dtype``: ``cublas_out`` says which).

Modes: ``out`` writes a fresh product (a split config zeroes the output first, inside the
call), ``accumulate`` adds into it (``accumulate=True``: gradient accumulation over
micro-batches; no zeroing). Each contender's calls are timed as CUDA-graph replays of
``GRAPH_CALLS`` calls (GPU time: no host path in the measurement). JSON rows
``{"layout", "mode", "M", "N", "K", "tiles", "unsplit_config", "auto_config",
"cublas_out", "cublas_ms", "unsplit_ms", "auto_ms", "split2_ms", "split4_ms",
"auto_speedup", "split2_speedup", "split4_speedup",
"cublas_over_unsplit", "cublas_over_auto"}`` (ms: medians over rounds; speedups: medians
of the per-round unsplit / contender ratios; a contender that does not apply: null) and a
PNG beside it (``--replot JSON`` redraws it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from gemm import layout_operands  # noqa: E402
from gemm_configs import label, layout_shapes  # noqa: E402

from coda.mainloop.config import MIN_SPLIT_K_TILES, GemmConfig, choose_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.runtime.checks import short_swizzle_groups  # noqa: E402

#: Weight-gradient shapes (wgrad layout: A = dY^T M-major, B = X^T N-major; K = tokens)
#: of a few hundred to a few thousand outputs a side: Llama 3.2 1B's K/V (512 x 2048),
#: O (2048 x 2048) and QKV (3072 x 2048) projections, and smaller heads / adapters.
SHAPES = (
    "512x2048x16384",
    "2048x512x16384",
    "1024x1024x16384",
    "256x4096x16384",
    "512x4096x16384",
    "1024x2048x16384",
    "2048x2048x16384",
    "3072x2048x16384",
    "512x2048x8192",
    "1024x1024x8192",
)
SPLITS = (2, 4)
#: Calls of one contender captured in one CUDA graph (one replay = one timed call).
GRAPH_CALLS = 10


def contender_configs(
    m: int, n: int, k: int, sms: int, short_groups: bool = False
) -> dict[str, GemmConfig]:
    """The configs a row times, by contender name (``auto`` only where it differs), as
    ``coda.gemm``'s heuristic picks them on a card with ``short_groups``
    (``checks.short_swizzle_groups``: an H100's memory)."""
    unsplit = choose_config(m, n, k, sms, short_groups=short_groups)
    found = {"unsplit": unsplit}
    auto = choose_config(m, n, k, sms, split_ok=True, short_groups=short_groups)
    if auto != unsplit:
        found["auto"] = auto
    k_tiles = -(-k // GemmConfig().tile_k)
    for s in SPLITS:
        if k_tiles // s >= MIN_SPLIT_K_TILES:
            found[f"split{s}"] = GemmConfig(tile_n=128, cluster_m=2, split_k=s)
    return found


def problems(args) -> list[tuple[str, int, int, int]]:
    """(layout, M, N, K) of every shape the run times."""
    return layout_shapes(args.shapes, [x for x in args.layouts.split(",") if x])


def cublas_fn(a, bt, out32):
    """cuBLAS's fp32-output product on the same views, and which output it writes."""
    try:
        torch.mm(a[:8], bt[:, :8], out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        out16 = torch.empty(out32.shape, device=out32.device, dtype=a.dtype)
        return (lambda: torch.mm(a, bt, out=out16)), "bf16"
    return (lambda: torch.mm(a, bt, out_dtype=torch.float32)), "fp32"


def bench(layout: str, mode: str, m: int, n: int, k: int, args) -> dict:
    a, b = layout_operands(layout, m, n, k)
    out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    acc = mode == "accumulate"
    configs = contender_configs(m, n, k, *_device_class())
    fns = {}
    fns["cublas"], cublas_out = cublas_fn(a, b.t(), out)
    for name, cfg in configs.items():
        fns[name] = lambda cfg=cfg: gemm(a, b, out=out, accumulate=acc, config=cfg)
    # GPU time, not host time: each contender's GRAPH_CALLS calls captured in one CUDA
    # graph (explicit configs take coda.gemm's validating path on every call, tens of
    # microseconds of host time beside kernels of 30-100 us)
    fns = {
        name: common.graphed(lambda fn=fn: [fn() for _ in range(GRAPH_CALLS)])
        for name, fn in fns.items()
    }
    reps = max(2, min(20, int(4e12 / (2 * m * n * k * GRAPH_CALLS))))
    times = common.interleaved(fns, rounds=args.rounds, reps=reps, warmup=2, rotate=args.rotate)
    times = {name: [t / GRAPH_CALLS for t in ts] for name, ts in times.items()}
    unsplit = configs["unsplit"]
    row = {
        "layout": layout,
        "mode": mode,
        "M": m,
        "N": n,
        "K": k,
        "tiles": -(-m // unsplit.tile_m) * -(-n // unsplit.tile_n),
        "unsplit_config": label(unsplit),
        "auto_config": label(configs.get("auto", unsplit)),
        "cublas_out": cublas_out,
        "cublas_ms": common.median(times["cublas"]),
    }
    for name in ("unsplit", "auto", *(f"split{s}" for s in SPLITS)):
        row[f"{name}_ms"] = common.median(times[name]) if name in times else None
        if name != "unsplit":
            row[f"{name}_speedup"] = (
                common.median_ratio(times["unsplit"], times[name]) if name in times else None
            )
    row["cublas_over_unsplit"] = common.median_ratio(times["cublas"], times["unsplit"])
    best_auto = "auto" if "auto" in times else "unsplit"
    row["cublas_over_auto"] = common.median_ratio(times["cublas"], times[best_auto])
    return row


def _device_class() -> tuple[int, bool]:
    """(SMs, short swizzle groups) of the current GPU: what the heuristic's pick needs."""
    dev = torch.device("cuda", torch.cuda.current_device())
    return torch.cuda.get_device_properties(dev).multi_processor_count, short_swizzle_groups(dev)


def compile_one(job: tuple) -> None:
    """Compile one (layout, mode, config) kernel on small operands (a kernel does not
    depend on the problem's size)."""
    layout, mode, cfg = job
    a, b = layout_operands(layout, 256, 256, 1024 * max(1, cfg.split_k))
    out = torch.zeros(256, 256, device="cuda", dtype=torch.float32)
    gemm(a, b, out=out, accumulate=mode == "accumulate", config=cfg)


def chart(data: dict, png: str) -> bool:
    """Speed-up of each split contender over the unsplit GEMM, per shape and mode."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = data["rows"]
    names = [("auto", "heuristic with split-K"), ("split2", "split 2"), ("split4", "split 4")]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.5))
    width = 0.8 / len(names)
    for i, (key, text) in enumerate(names):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ys = [r.get(f"{key}_speedup") or 0.0 for r in rows]
        ax.bar(xs, ys, width, label=text)
    ax.scatter(
        range(len(rows)),
        [r["cublas_over_unsplit"] for r in rows],
        color="black",
        marker="_",
        s=300,
        label=f"cuBLAS ({rows[0]['cublas_out'] if rows else 'fp32'} out)",
        zorder=3,
    )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(
        [f"{r['M']}x{r['N']}x{r['K']}\n{r['layout']} {r['mode']}" for r in rows],
        fontsize=7,
        rotation=45,
        ha="right",
    )
    ax.set_ylabel("unsplit ms / contender ms (higher is faster)")
    ax.set_title(f"coda split-K vs unsplit, fp32 output ({data.get('device', '')})")
    ax.legend(fontsize=8)
    common.save_figure(plt, fig, png)
    return True


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/split_k_h200.json")
    p.add_argument("--shapes", default=",".join(SHAPES), help="[layout:]MxNxK,...")
    p.add_argument("--layouts", default="wgrad")
    p.add_argument("--modes", default="out,accumulate")
    p.add_argument("--rounds", type=int, default=8)
    common.add_rotate_option(p)
    common.add_precompile_options(p)
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    modes = [x for x in args.modes.split(",") if x]
    shapes = problems(args)
    device_class = _device_class()
    jobs = sorted(
        {
            (layout, mode, cfg)
            for layout, m, n, k in shapes
            for mode in modes
            for cfg in contender_configs(m, n, k, *device_class).values()
        },
        key=repr,
    )
    if common.precompiled(args, argv, os.path.abspath(__file__), jobs, compile_one):
        return
    rows = []
    for layout, m, n, k in shapes:
        for mode in modes:
            rows.append(bench(layout, mode, m, n, k, args))
            print(rows[-1], flush=True)
    data = {
        **common.environment(),
        "command": " ".join(["python3", "benchmarks/split_k.py", *argv]),
        "metric": "unsplit_ms / contender_ms (speedup), cublas_ms / coda_ms",
        "timing": f"CUDA-graph replays of {GRAPH_CALLS} calls, interleaved rounds, medians",
        "rows": rows,
    }
    common.write_json(args.out, data)
    chart(data, common.png_beside(args.out))
    common.print_table(
        rows,
        ["layout", "mode", "M", "N", "K", "tiles", "auto_config", "unsplit_ms", "auto_ms"]
        + ["split2_ms", "split4_ms", "cublas_ms"],
    )


if __name__ == "__main__":
    main()
