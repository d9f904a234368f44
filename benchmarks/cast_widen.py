"""Widening a 16-bit weight gradient to fp32: PyTorch's cast against coda's map pass.

    python benchmarks/cast_widen.py [--out benchmarks/results/cast_widen_h200.json]

Under AMP (fp32 parameters, GEMMs in bf16) every weight gradient arrives in bf16 and is
cast up to its parameter's fp32. PyTorch's copy with a dtype change from bf16 to fp32
runs its unvectorized kernel; ``coda.fusions._dispatch.widen`` (what coda's
``cast`` uses in backward) runs a map pass instead (TileLoad bf16 -> TileStore fp32).
Times both on the weight shapes of a Llama 3.2 1B layer and its tied head / embedding
(``common.interleaved``, rotated: each round times both, medians over rounds), checks they give the
same bits, and writes JSON rows ``{"name", "rows", "cols", "torch_us", "widen_us",
"torch_gbps", "widen_gbps", "speedup", "bitwise_equal"}`` (bytes: 2 read + 4 written per
element) and a PNG beside it (``--replot FILE`` redraws it from a written JSON).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.fusions._dispatch import widen  # noqa: E402

#: (name, rows, cols): the 1B model's weight gradients (H = 2048, FFN 8192, 32 / 8 heads
#: of 64), the q|k|v and gate/up ones as coda's fused layouts produce them
SHAPES = (
    ("qkv", 3072, 2048),
    ("o", 2048, 2048),
    ("gate_up", 16384, 2048),
    ("down", 2048, 8192),
    ("head", 128256, 2048),
)


def chart(payload: dict, png: str) -> bool:
    """Bars of GB/s per shape, PyTorch's cast beside the map pass; False without
    matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = payload["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([x - 0.2 for x in xs], [r["torch_gbps"] for r in rows], 0.4, label="torch .to(fp32)")
    ax.bar([x + 0.2 for x in xs], [r["widen_gbps"] for r in rows], 0.4, label="coda widen")
    ax.set_xticks(list(xs), [f"{r['name']}\n{r['rows']}x{r['cols']}" for r in rows])
    ax.set_ylabel("GB/s (2 B read + 4 B written)")
    ax.set_title(f"bf16 -> fp32 weight gradients, {payload.get('device', '')}")
    ax.legend()
    common.save_figure(plt, fig, png)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/cast_widen_h200.json")
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, m, n in SHAPES:
        g = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        fns = {
            "torch": lambda g=g: g.to(torch.float32),
            "widen": lambda g=g: widen(g, torch.float32),
        }
        same = torch.equal(fns["torch"]().view(torch.int32), fns["widen"]().view(torch.int32))
        times = common.interleaved(fns, rounds=args.rounds, reps=args.reps, rotate=True)
        t_us, w_us = (1e3 * common.median(times[k]) for k in ("torch", "widen"))
        nbytes = 6 * m * n
        rows.append(
            {
                "name": name,
                "rows": m,
                "cols": n,
                "torch_us": round(t_us, 2),
                "widen_us": round(w_us, 2),
                "torch_gbps": round(nbytes / t_us / 1e3, 1),
                "widen_gbps": round(nbytes / w_us / 1e3, 1),
                "speedup": round(t_us / w_us, 3),
                "bitwise_equal": bool(same),
            }
        )
        print(rows[-1])
    payload = {**common.environment(), "command": " ".join(sys.argv), "rows": rows}
    common.write_json(args.out, payload)
    chart(payload, common.png_beside(args.out))


if __name__ == "__main__":
    main()
