"""What the per-token softmax entropy costs the LM-head loss (RL losses), beside eager and
torch.compile computing it from materialized logits.

    python benchmarks/entropy_cost.py [--shapes 2048x8192,4096x8192] [--V 128256]
        [--rounds 3] [--out benchmarks/results/entropy_cost_h200.json] [--replot JSON]

Per-token losses (``reduction="none"``, what policy-gradient losses weight per token),
bf16, V = 128256 (Llama 3), forward and forward + backward with an upstream gradient on
every output, interleaved rounds, medians (benchmarks/common.py):

* ``coda``: ``linear_cross_entropy(..., reduction="none", return_lse=True)`` (the recompute
  path: the logits GEMM with the statistics in its epilogue, then a 3-GEMM backward);
* ``coda_entropy``: the same with ``return_entropy=True`` (``SoftmaxEntropy`` beside the
  log-sum-exp in the forward epilogue, the entropy's term in the gradient epilogue);
* ``coda_fused``: ``linear_cross_entropy(..., reduction="none", grad_in_forward=True)``,
  the per-token loss alone on the gradient-in-forward path in one row chunk (the logits
  GEMM storing the softmax's M x V rows, the backward's dh and dW GEMMs with the per-token
  upstream gradient as their row factor: 3 logits-sized GEMMs);
* ``coda_weighted``: ``linear_cross_entropy(..., reduction="sum", row_weight=g)``, the
  same per-token gradient as a weighted scalar loss (REINFORCE / GRPO losses weight each
  token's loss by its advantage, known before the forward): the default
  gradient-in-forward path with the weights in its per-row coefficients, in row chunks
  (no opt-in, its usual workspace);
* ``coda_fused_entropy``: ``coda_fused`` with ``return_entropy="detached"``, the entropy
  logged beside the loss without a gradient (``SoftmaxEntropy`` in the logits GEMM's
  epilogue in place of the log-sum-exp, on the same path);
* ``eager`` / ``compile``: logits = h @ W.T materialized, ``F.cross_entropy`` per token and
  the entropy -sum p log p of log_softmax (fp32), eager and under ``torch.compile``;
* ``compile_nll``: the per-token loss alone (no entropy) under ``torch.compile``, the
  counterpart of ``coda_fused``;
* ``compile_logged``: the per-token loss and the entropy of the detached log-softmax
  (logged, no gradient) under ``torch.compile``, the counterpart of ``coda_fused_entropy``;
* ``liger`` / ``cce``: the per-token loss alone (``reduction="none"``; neither returns the
  entropy) of Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` and Cut Cross-Entropy's
  ``linear_cross_entropy``, under the same per-token upstream gradient;
* ``cublas_floor``: the GEMMs alone on cuBLAS, the logits GEMM (forward) and the logits,
  dh and dW GEMMs (forward + backward: what a loss over materialized logits cannot beat).

JSON ``{device, versions, command, "rows": [{"H", "M", "V", "pass", "cublas_floor_ms",
"<contender>_ms", "<contender>_peak_gib" for each contender above}]}`` (peaks: max
allocated above the inputs; a contender whose package is not installed is left out).
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


def eager_entropy_loss(h, W, t):
    """Per-token loss and entropy from materialized logits (fp32 softmax)."""
    logits = (h @ W.T).float()
    logp = torch.log_softmax(logits, -1)
    loss = F.nll_loss(logp, t, reduction="none", ignore_index=-100)
    return loss, -(logp.exp() * logp).sum(-1)


def eager_nll_loss(h, W, t):
    """Per-token loss alone from materialized logits (fp32 softmax)."""
    logits = (h @ W.T).float()
    return F.cross_entropy(logits, t, reduction="none", ignore_index=-100), None


def eager_logged_entropy_loss(h, W, t):
    """Per-token loss from materialized logits and the entropy of the detached
    log-softmax (logged: no gradient through it)."""
    logp = torch.log_softmax((h @ W.T).float(), -1)
    loss = F.nll_loss(logp, t, reduction="none", ignore_index=-100)
    logp = logp.detach()
    return loss, -(logp.exp() * logp).sum(-1)


def contenders(h, W, t, up, backward: bool) -> dict:
    compiled = torch.compile(eager_entropy_loss)
    compiled_nll = torch.compile(eager_nll_loss)
    compiled_logged = torch.compile(eager_logged_entropy_loss)
    peers = common.peer_losses("none")

    def run(fn, entropy: bool, weighted: bool = False):
        def step():
            if entropy:
                loss, ent = fn()
                total = (loss * up).sum() + (ent * up).sum()
            elif weighted:  # the weights are in the loss already
                total, _ = fn()
            else:
                loss, _ = fn()
                total = (loss * up).sum()
            if backward:
                torch.autograd.grad(total, (h, W))

        return step

    dl = torch.empty(h.shape[0], W.shape[0], dtype=h.dtype, device=h.device)

    def floor():  # the logits GEMM (+ the dh and dW GEMMs of a materialized backward)
        torch.mm(h.detach(), W.detach().T, out=dl)
        if backward:
            torch.mm(dl, W.detach())
            torch.mm(dl.T, h.detach())

    return {
        "cublas_floor": floor,
        "coda": run(
            lambda: linear_cross_entropy(h, W, t, reduction="none", return_lse=True), False
        ),
        "coda_entropy": run(
            lambda: linear_cross_entropy(h, W, t, reduction="none", return_entropy=True), True
        ),
        "coda_fused": run(
            lambda: (linear_cross_entropy(h, W, t, reduction="none", grad_in_forward=True), None),
            False,
        ),
        "coda_weighted": run(
            lambda: (linear_cross_entropy(h, W, t, reduction="sum", row_weight=up), None),
            False,
            weighted=True,
        ),
        "coda_fused_entropy": run(
            lambda: linear_cross_entropy(
                h, W, t, reduction="none", grad_in_forward=True, return_entropy="detached"
            ),
            False,
        ),
        "eager": run(lambda: eager_entropy_loss(h, W, t), True),
        "compile": run(lambda: compiled(h, W, t), True),
        "compile_nll": run(lambda: compiled_nll(h, W, t), False),
        "compile_logged": run(lambda: compiled_logged(h, W, t), False),
        **{
            name: run(lambda fn=fn: (fn(h, W, t), None), False)
            for name, fn in peers.items()
            if fn is not None
        },
    }


CONTENDERS = (
    "coda",
    "coda_entropy",
    "coda_fused",
    "coda_weighted",
    "coda_fused_entropy",
    "eager",
    "compile",
    "compile_nll",
    "compile_logged",
    "liger",
    "cce",
)


def plot(out: dict, path: str) -> None:
    """Per shape and pass, each contender's time over the cuBLAS GEMM floor, and the
    fwd+bwd peaks."""
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    rows = out["rows"]
    names = [c for c in CONTENDERS if rows and f"{c}_ms" in rows[0]]  # peers: if installed
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    width = 0.8 / len(names)
    colors = {c: plt.get_cmap("tab20")(i) for i, c in enumerate(names)}  # > 10 contenders
    for ax, kind in zip(axes[:2], ("fwd", "fwd+bwd"), strict=True):
        sel = [r for r in rows if r["pass"] == kind]
        for i, c in enumerate(names):
            ys = [r[f"{c}_ms"] / r["cublas_floor_ms"] for r in sel]
            ax.bar([x + i * width for x in range(len(sel))], ys, width, label=c, color=colors[c])
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(sel))],
            [f"H={r['H']}\nM={r['M']}" for r in sel],
        )
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"per-token loss, {kind}: time / cuBLAS GEMM floor (lower is better)")
    sel = [r for r in rows if r["pass"] == "fwd+bwd"]
    for i, c in enumerate(names):
        ys = [r[f"{c}_peak_gib"] for r in sel]
        axes[2].bar([x + i * width for x in range(len(sel))], ys, width, label=c, color=colors[c])
    axes[2].set_xticks(
        [x + 0.4 - width / 2 for x in range(len(sel))], [f"H={r['H']}\nM={r['M']}" for r in sel]
    )
    axes[2].set_title("fwd+bwd peak memory above inputs (GiB)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"LM head + per-token cross-entropy (RL), V={sel[0]['V'] if sel else ''}")
    common.save_figure(plt, fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_lm_head_args(p, "benchmarks/results/entropy_cost_h200.json", rounds=3)
    args = p.parse_args()
    if common.replotted(args, plot):
        return
    rows = []
    for H, M, h, W, t, g in common.lm_head_problems(args.shapes, args.V):
        up = torch.randn(M, device="cuda", generator=g)
        for backward in (False, True):
            fns = contenders(h, W, t, up, backward)
            row = {"H": H, "M": M, "V": args.V, "pass": "fwd+bwd" if backward else "fwd"}
            rows.append(common.measured_row(row, fns, args.rounds, args.reps))
    out = {**common.environment_with_peers(), "rows": rows}
    common.write_json(args.out, out)
    plot(out, common.png_beside(args.out))
    columns = ["H", "M", "pass", "cublas_floor_ms", "coda_ms", "coda_entropy_ms", "compile_ms"]
    columns += ["coda_fused_ms", "coda_weighted_ms", "compile_nll_ms", "coda_fused_entropy_ms"]
    columns += ["compile_logged_ms", "liger_ms", "cce_ms"]
    peaks = ["coda_entropy_peak_gib", "compile_peak_gib", "coda_fused_peak_gib"]
    peaks += ["coda_weighted_peak_gib", "compile_nll_peak_gib", "liger_peak_gib", "cce_peak_gib"]
    common.print_table(rows, [c for c in columns + peaks if c in rows[0]])


if __name__ == "__main__":
    main()
