"""What returning the log-sum-exp and the z-loss costs the LM-head loss (Liger-Kernel's
``return_z_loss`` usage: the z-loss term logged beside the loss).

    python benchmarks/extras_cost.py [--shapes 2048x8192,4096x8192] [--V 128256]
        [--rounds 5] [--out benchmarks/results/extras_cost_h200.json] [--replot JSON]

A scalar loss with z-loss (1e-4), bf16, V = 128256, forward + backward of the loss (the
returned extras logged: not differentiated, unless said), interleaved rounds, medians
(benchmarks/common.py):

* ``coda``: ``linear_cross_entropy(..., z_loss=1e-4)``, the loss alone (the default
  gradient-in-forward path: 3 logits-sized GEMMs);
* ``coda_extras``: the same with ``return_lse=True, return_z_loss=True``: the path is
  kept, the extras come from its forward's statistics (``coda::lce_lse``);
* ``coda_extras_recompute``: the same on the recompute path (``grad_in_forward=False``),
  which returned extras took before (4 logits-sized GEMMs);
* ``coda_extras_used``: ``coda_extras`` with loss + 1e-4 * mean(lse) differentiated: the
  lse's gradient by the recompute path's backward, in the backward only (3 more GEMMs);
* ``compile``: ``torch.compile`` of the loss with z-loss, the lse and the z-loss term
  over materialized logits;
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss(lse_square_scale=1e-4,
  return_z_loss=True)`` (it returns no lse);
* ``cublas_floor``: the logits, dh and dW GEMMs on cuBLAS.

JSON ``{device, versions, command, "rows": [{"H", "M", "V", "pass": "fwd+bwd",
"cublas_floor_ms", "<contender>_ms", "<contender>_peak_gib"}]}`` (peaks: max allocated
above the inputs; a contender whose package is not installed is left out).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.fusions.cross_entropy import linear_cross_entropy  # noqa: E402

Z = 1e-4
CONTENDERS = (
    "coda",
    "coda_extras",
    "coda_extras_recompute",
    "coda_extras_used",
    "compile",
    "liger",
)


def eager_extras(h, W, t):
    """Loss with z-loss, the per-row lse and the z-loss term over materialized logits."""
    logits = (h @ W.T).float()
    lse = torch.logsumexp(logits, -1)
    valid = t != -100
    z = (Z * lse * lse * valid).sum() / valid.sum()
    return F.cross_entropy(logits, t, ignore_index=-100) + z, lse, z


def contenders(h, W, t) -> dict:
    compiled = torch.compile(eager_extras)

    def backward(loss):
        torch.autograd.grad(loss, (h, W))

    def extras(**kw):
        return linear_cross_entropy(h, W, t, z_loss=Z, return_lse=True, return_z_loss=True, **kw)

    dl = torch.empty(h.shape[0], W.shape[0], dtype=h.dtype, device=h.device)

    def floor():
        torch.mm(h.detach(), W.detach().T, out=dl)
        torch.mm(dl, W.detach())
        torch.mm(dl.T, h.detach())

    def used():
        loss, lse, _ = extras()
        backward(loss + Z * lse.mean())

    fns = {
        "cublas_floor": floor,
        "coda": lambda: backward(linear_cross_entropy(h, W, t, z_loss=Z)),
        "coda_extras": lambda: backward(extras()[0]),
        "coda_extras_recompute": lambda: backward(extras(grad_in_forward=False)[0]),
        "coda_extras_used": used,
        "compile": lambda: backward(compiled(h, W, t)[0]),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss(
            ignore_index=-100, lse_square_scale=Z, return_z_loss=True
        )
        fns["liger"] = lambda: backward(liger(W, h, t).loss)  # a CrossEntropyOutput
    except ImportError:
        pass
    return fns


def plot(out: dict, path: str) -> None:
    """Per shape, each contender's forward + backward over the cuBLAS GEMM floor."""
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    rows = out["rows"]
    names = [c for c in CONTENDERS if rows and f"{c}_ms" in rows[0]]
    fig, ax = plt.subplots(1, 1, figsize=(10, 5))
    width = 0.8 / len(names)
    for i, c in enumerate(names):
        ys = [r[f"{c}_ms"] / r["cublas_floor_ms"] for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=c)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(rows))],
        [f"H={r['H']}\nM={r['M']}" for r in rows],
    )
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_title("loss with z-loss, lse and z-loss returned: fwd+bwd / cuBLAS 3-GEMM floor")
    ax.legend(fontsize=8)
    common.save_figure(plt, fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_lm_head_args(p, "benchmarks/results/extras_cost_h200.json", rounds=5)
    args = p.parse_args()
    if common.replotted(args, plot):
        return
    rows = []
    for H, M, h, W, t, _g in common.lm_head_problems(args.shapes, args.V):
        row = {"H": H, "M": M, "V": args.V, "pass": "fwd+bwd"}
        rows.append(common.measured_row(row, contenders(h, W, t), args.rounds, args.reps))
    out = {**common.environment_with_peers(), "rows": rows}
    common.write_json(args.out, out)
    plot(out, common.png_beside(args.out))
    common.print_table(rows, ["H", "M", "cublas_floor_ms", *(f"{c}_ms" for c in CONTENDERS)])


if __name__ == "__main__":
    main()
