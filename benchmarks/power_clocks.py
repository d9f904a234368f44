"""Time, board power and SM clock of the LM-head loss's forward + backward, per contender.

    python benchmarks/power_clocks.py [--H 2048 8192] [--M 8192 16384] [--V 128256]
        [--seconds 3] [--rounds 2] [--out benchmarks/results/power_clocks_h200.json]

``--H`` and ``--M`` are paired: the defaults measure (H, M) = (2048, 8192) and
(8192, 16384).

Long GEMM-bound passes run at the card's power limit, where a kernel's speed is set by
its energy: what one pass draws decides the clock every kernel of it gets. This measures,
for each shape and contender (in interleaved rounds, each contender run back to back for
``--seconds`` while a thread samples ``torch.cuda.power_draw`` and
``torch.cuda.clock_rate`` every 10 ms):

* coda: ``linear_cross_entropy`` as called by default (gradient-in-forward, its row
  chunks from ``ce_chunks.grad_rows``);
* coda_one_chunk: the same with every row in one chunk (no fp32 dW accumulator, no cast,
  W read twice in all, the logits' whole buffer);
* compile: ``torch.compile`` of ``F.cross_entropy((h @ W.T).float(), t)``;
* cublas_floor: its three logits-sized GEMMs alone (``torch.mm``: logits, dh, dW);
* coda_floor: the same three GEMMs on coda's mainloop (``coda.gemm``).

JSON rows ``{"H", "M", "V", "contender", "round", "ms", "watts", "sm_mhz", "joules"}``
(median ms per pass, mean board watts, median SM MHz, watts x ms: energy per pass) and
a PNG beside it (time per pass and SM clock per contender, medians over rounds). The
first round's first contender may start below the power limit (the card ramping up from
idle): compare rounds at the same watts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.fusions.cross_entropy import linear_cross_entropy  # noqa: E402
from coda.matmul import gemm  # noqa: E402


def contenders(h, W, t) -> dict[str, Callable[[], object]]:
    M, V = h.shape[0], W.shape[0]

    def eager(h, W, t):
        return F.cross_entropy((h @ W.T).float(), t, ignore_index=-100)

    comp = torch.compile(eager)
    hd, Wd = h.detach(), W.detach()
    logits = torch.empty(M, V, dtype=h.dtype, device=h.device)
    dh, dW = torch.empty_like(hd), torch.empty_like(Wd)

    def cublas_floor():
        torch.mm(hd, Wd.t(), out=logits)
        torch.mm(logits, Wd, out=dh)
        torch.mm(logits.t(), hd, out=dW)

    def coda_floor():
        gemm(hd, Wd, out=logits)
        gemm(logits, Wd.t(), out=dh)
        gemm(logits.t(), hd.t(), out=dW)

    def loss_grads(**kw):
        return lambda: torch.autograd.grad(linear_cross_entropy(h, W, t, **kw), (h, W))

    return {
        "coda": loss_grads(),
        "coda_one_chunk": loss_grads(chunk_rows=M),
        "compile": lambda: torch.autograd.grad(comp(h, W, t), (h, W)),
        "cublas_floor": cublas_floor,
        "coda_floor": coda_floor,
    }


def chart(payload: dict, png: str) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    rows = payload["rows"]
    shapes = sorted({(r["H"], r["M"]) for r in rows})
    names = list(dict.fromkeys(r["contender"] for r in rows))
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.5 * len(shapes), 6), squeeze=False)
    for j, (H, M) in enumerate(shapes):
        for i, key in enumerate(("ms", "sm_mhz")):
            vals = [
                statistics.median(
                    r[key] for r in rows if (r["H"], r["M"], r["contender"]) == (H, M, n)
                )
                for n in names
            ]
            ax = axes[i][j]
            colors = ["C0" if n.startswith("coda") else "C1" for n in names]
            ax.bar(range(len(names)), vals, color=colors)
            ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
            ax.set_title(f"H={H}, M={M}", fontsize=9)
            ax.set_ylabel("ms per fwd+bwd pass" if key == "ms" else "median SM MHz")
            lo = min(vals)
            ax.set_ylim(lo * 0.9, max(vals) * 1.02)
    fig.suptitle(f"power_clocks, {payload.get('device', '')}", fontsize=10)
    common.save_figure(plt, fig, png)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--H", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--M", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/power_clocks_h200.json")
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    rows = []
    for H, M in zip(args.H, args.M, strict=True):
        g = torch.Generator(device="cuda").manual_seed(0)
        bf = torch.bfloat16
        h = (torch.randn(M, H, device="cuda", generator=g) * 0.5).to(bf).requires_grad_()
        W = (torch.randn(args.V, H, device="cuda", generator=g) * H**-0.5).to(bf)
        W.requires_grad_()
        t = torch.randint(0, args.V, (M,), device="cuda", generator=g)
        fns = contenders(h, W, t)
        for rnd in range(args.rounds):
            for name, fn in fns.items():
                got = common.sampled(fn, args.seconds)
                row = {"H": H, "M": M, "V": args.V, "contender": name, "round": rnd, **got}
                rows.append(row)
                print(
                    f"H={H} M={M} {name:17s} r{rnd} {got['ms']:8.2f} ms {got['watts']:6.1f} W "
                    f"{got['sm_mhz']:6.0f} MHz {got['joules']:6.2f} J",
                    flush=True,
                )
        del h, W, t, fns
        torch.cuda.empty_cache()
    payload = {**common.environment(), "rows": rows}
    common.write_json(args.out, payload)
    chart(payload, common.png_beside(args.out))


if __name__ == "__main__":
    main()
