"""One Llama decoder layer's host path: host time, GPU time and step time of a forward + backward.

    python benchmarks/block_host.py [--config llama3-1b] [--Ms 512,2048,8192]
        [--steps 6] [--rounds 3] [--only coda compile] [--out FILE] [--replot JSON]

The decoder-layer twin of ``loss_host.py``, on ``train_step.Block`` (one HF
``LlamaDecoderLayer`` and its fused twin ``coda.nn.FusedLlamaDecoderLayer``, the same
weights): per contender (``coda``: the fused layer, eager; ``compile``: the HF layer
under ``torch.compile``; ``coda_graph``, ``compile_graph``: their steps captured in a
CUDA graph and replayed, ``common.graphed``), for a forward + backward to the layer's
input and weights, ``host_ms`` (the steps issued behind a GPU sleep kernel), ``gpu_ms``
(CUDA events around steps queued behind one) and ``step_ms`` (a synchronized loop from
an idle GPU), as ``loss_host.py`` defines them. Contenders alternate within each round;
medians. Rows ``{"config", "H", "M", "<contender>_host_ms", "<contender>_gpu_ms",
"<contender>_step_ms"}``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import train_step as ts  # noqa: E402
from loss_host import timed_fields  # noqa: E402

CONTENDERS = ("coda", "compile", "coda_graph", "compile_graph")


def plot(result: dict, path: str) -> None:
    """Step time and host time per step over M, per contender."""
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    rows = result["rows"]
    Ms = [r["M"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in CONTENDERS:
        if rows and rows[0].get(f"{c}_step_ms") is None:
            continue
        line = ax.plot(Ms, [r[f"{c}_step_ms"] for r in rows], marker="o", label=f"{c} step")[0]
        ax.plot(Ms, [r[f"{c}_host_ms"] for r in rows], ls="--", color=line.get_color(),
                label=f"{c} host")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("ms per forward + backward")
    ax.legend(fontsize=8)
    name = rows[0]["config"] if rows else ""
    ax.set_title(f"one decoder layer ({name}): {result['device']}")
    common.save_figure(plt, fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama3-1b", choices=("llama3-1b", "h4096-trunc"))
    parser.add_argument("--Ms", default="512,2048,8192")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--out", default="benchmarks/results/block_host_h200.json")
    common.add_replot_option(parser)
    args = parser.parse_args(argv)
    if common.replotted(args, plot):
        return
    size = ts.configs(1)[args.config]
    rows = []
    for M in (int(m) for m in args.Ms.split(",")):
        block = ts.Block(size, M)
        steps = {}
        for c in args.only:
            run = getattr(block, "coda" if c.startswith("coda") else "hf")(True)
            steps[c] = common.graphed(run) if c.endswith("_graph") else run
        row = {"config": args.config, "H": size.hidden, "M": M}
        row.update(timed_fields(steps, CONTENDERS, args.rounds, args.steps))
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
        del block, steps
    payload = {**common.environment(), "rows": rows}
    common.write_json(args.out, payload)
    plot(payload, common.png_beside(args.out))
    cols = ["M"] + [f"{c}_{k}_ms" for c in CONTENDERS for k in ("host", "gpu", "step")]
    common.print_table(rows, cols)


if __name__ == "__main__":
    main()
