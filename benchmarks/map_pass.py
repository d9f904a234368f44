"""Throughput of GEMM-free epilogue passes (``run_map``) under kernel configs.

    python benchmarks/map_pass.py [--m 8192] [--n 8192] [--out FILE]

A map pass (``coda.fusions._dispatch.run_map``: an epilogue that never reads acc, launched
as a zero GEMM of K = 8 whose kernel runs no mainloop) is memory-bound work: the cross-
entropy gradient map, the RoPE / RMSNorm backward maps. This measures its bytes per second
for a pure copy (TileLoad -> TileStore), for the RMSNorm backward map (``scaled_grad``:
two loads, one store, a row reduction) and for the loss's gradient map (``ce_grad``),
under the default epilogue config and variants (taking turns, load / store buffering
depth, cluster, tile width), each against a torch copy of the same bytes. Writes JSON rows
``{"epilogue", "variant", "config", "us", "gbps", "torch_copy_gbps"}`` and a PNG beside it
(``--replot FILE`` redraws the PNG of a written JSON, on any machine).
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda import Epilogue  # noqa: E402
from coda.fusions import epilogues  # noqa: E402
from coda.fusions._dispatch import MAP_K  # noqa: E402
from coda.fusions.ce_epilogues import STORED_ACC, TARGET_DTYPE, grad_map_epilogue  # noqa: E402
from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.primitives import TileLoad, TileStore  # noqa: E402

BF16 = torch.bfloat16
VARIANTS = {
    "base": {},
    # the epilogues of the two consumer warpgroups taking turns (the default before
    # concurrent_epilogues), at the old and at the deeper buffering
    "turns": {"concurrent_epilogues": False, "epi_stages": 4, "load_stages": 4},
    "turns_load8_epi8": {"concurrent_epilogues": False, "epi_stages": 8, "load_stages": 8},
    "epi4": {"epi_stages": 4},
    "cluster1x1": {"cluster_m": 1},
    "tile64": {"tile_n": 64},
    # 64 x 64 subtiles: half the subtiles (and warpgroup barriers) per tile
    "epin64": {"epi_n": 64},
    "epin64_epi4": {"epi_n": 64, "epi_stages": 4},
}


def timed_us(fn, reps: int = 20) -> float:
    """Median over 5 rounds of the mean microseconds per call (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return common.median([common.time_once(fn, reps) * 1e3 for _ in range(5)])


def chart(payload: dict, png: str) -> bool:
    """Bars of GB/s per (epilogue, variant), torch's copy as a line; False without
    matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False

    rows = [r for r in payload["rows"] if "gbps" in r]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(rows)), 4.2))
    ax.bar(range(len(rows)), [r["gbps"] for r in rows], color="tab:blue", label="coda map pass")
    ax.axhline(rows[0]["torch_copy_gbps"], color="black", lw=0.8, label="torch copy")
    labels = [f"{r['epilogue']}\n{r['variant']}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title(f"GEMM-free epilogue passes, {payload['m']} x {payload['n']}, {payload['device']}")
    ax.legend(fontsize=8)
    common.save_figure(plt, fig, png)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="benchmarks/results/map_pass_h200.json")
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    m, n = args.m, args.n
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", generator=g).to(BF16)
    z = torch.randn(m, n, device="cuda", generator=g).to(BF16)
    rstd = torch.rand(m, device="cuda", generator=g) + 0.5
    A = torch.zeros(m, MAP_K, dtype=BF16, device="cuda")
    B = torch.zeros(n, MAP_K, dtype=BF16, device="cuda")
    copy = Epilogue((TileLoad("x", BF16), TileStore("x", BF16, name="y")))
    cases = {
        "copy": (copy, {"x": x}, 2 * m * n * 2),
        "scaled_grad": (
            epilogues.scaled_grad(BF16),
            {"dz": x, "z": z, "rstd": rstd},
            3 * m * n * 2,
        ),
        # the loss's gradient map: dlogits = ga * exp(z - lse) - gt * onehot (bf16 in, out)
        "ce_grad": (
            grad_map_epilogue(BF16, BF16, None, False, None, False, False, False),
            {
                STORED_ACC: x,
                "lse": torch.full((m,), 12.0, device="cuda"),
                "ga": rstd,
                "gt": rstd,
                "tloc": torch.randint(0, n, (m,), device="cuda", generator=g).to(TARGET_DTYPE),
            },
            2 * m * n * 2,
        ),
    }
    dst = torch.empty_like(x)
    torch_copy_us = timed_us(lambda: dst.copy_(x))
    torch_gbps = 2 * m * n * 2 / torch_copy_us / 1e3
    rows = []
    base = choose_epilogue_config(m, n, MAP_K)
    for name, (epi, tensors, nbytes) in cases.items():
        for var in args.variants.split(","):
            cfg = attrs.evolve(base, **VARIANTS[var])
            try:
                us = timed_us(lambda: epi(A, B, config=cfg, **tensors))  # noqa: B023
            except Exception as exc:  # a variant that does not fit: recorded, run goes on
                rows.append({"epilogue": name, "variant": var, "error": str(exc)[:200]})
                continue
            rows.append(
                {
                    "epilogue": name,
                    "variant": var,
                    "config": str(cfg),
                    "us": round(us, 2),
                    "gbps": round(nbytes / us / 1e3, 1),
                    "torch_copy_gbps": round(torch_gbps, 1),
                }
            )
            print(rows[-1])
    env = common.environment()
    payload = {**env, "command": " ".join(sys.argv), "m": m, "n": n, "rows": rows}
    common.write_json(args.out, payload)
    chart(payload, common.png_beside(args.out))


if __name__ == "__main__":
    main()
