"""Causal GQA attention (PyTorch's ``scaled_dot_product_attention``) on the operand layouts a
Llama layer can hand it: does the layout of q, k and v change its time?

    python benchmarks/sdpa_layouts.py [--configs 1b,h4096] [--rounds 7] [--rotate] [--out FILE]

coda's attention (``coda.nn.attention``) attends q, k and v as views of the QKV GEMM's one
(T, (nh + 2 nkv) hd) output, so every token row of every head sits 2 (nh + 2 nkv) hd bytes
from the next. Hugging Face's eager Llama hands SDPA separate projections' outputs (row
strides nh hd and nkv hd), and the canonical layout is one (heads, T, hd) block per tensor.
In whole training steps (``results/kernel_profile_train_compile_hf_mask_h200.json``) the
same cuDNN kernels took 32.7 / 11.3 ms (backward / forward, 16 layers) under coda against
27.9 / 10.5 under eager. This times one layer's attention, forward and forward + backward,
interleaved rounds, medians, in each layout:

* ``qkv_view``: q, k, v views of one (T, nh hd + 2 nkv hd) buffer (coda today);
  the backward's dq, dk, dv concatenated into that buffer's gradient, as autograd does
  for ``split``.
* ``bthd``: three separate (T, heads hd) buffers (Hugging Face's eager layout).
* ``bhtd``: three separate (heads, T, hd) buffers.
* ``qkv_to_bhtd``: ``qkv_view``'s buffer copied into ``bhtd``'s layout first (one copy
  of the q|k|v buffer per forward), the gradient concatenated back: what a copy costs
  against what the layout saves.

Rows ``{"config", "T", "heads", "kv_heads", "head_dim", "layout", "pass": "fwd"|"fwd+bwd",
"ms", "ratio"}`` (ratio: ms / qkv_view's ms, median over rounds of per-round ratios) and
the strides SDPA's backward gave dq, dk, dv in each layout.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONFIGS = {
    # Llama 3.2 1B and the H = 4096 shapes of train_step.py: (heads, kv heads, head dim)
    "1b": (32, 8, 64),
    "h4096": (32, 8, 128),
}
LAYOUTS = ("qkv_view", "bthd", "bhtd", "qkv_to_bhtd")


def _split_views(qkv: torch.Tensor, nh: int, nkv: int, hd: int) -> tuple:
    T = qkv.shape[0]
    q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=1)
    return tuple(t.view(1, T, t.shape[1] // hd, hd).transpose(1, 2) for t in (q, k, v))


def _to_bhtd(qkv: torch.Tensor, nh: int, nkv: int, hd: int) -> tuple:
    """One copy of the q|k|v buffer into head-major planes: (nh + 2 nkv, T, hd)."""
    T = qkv.shape[0]
    planes = qkv.view(T, nh + 2 * nkv, hd).transpose(0, 1).contiguous()
    q, k, v = planes.split((nh, nkv, nkv), dim=0)
    return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


class Problem:
    """One layer's attention inputs in one layout, and its forward / forward + backward."""

    def __init__(self, layout: str, T: int, nh: int, nkv: int, hd: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        n = (nh + 2 * nkv) * hd
        qkv = torch.randn(T, n, device="cuda", dtype=torch.bfloat16, generator=g)
        self.layout, self.shape = layout, (nh, nkv, hd)
        self.do = torch.randn(1, nh, T, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        if layout in ("qkv_view", "qkv_to_bhtd"):
            self.leaves = (qkv.requires_grad_(),)
        elif layout == "bthd":
            self.leaves = tuple(
                t.contiguous().requires_grad_() for t in qkv.split((nh * hd, nkv * hd, nkv * hd), 1)
            )
        elif layout == "bhtd":
            self.leaves = tuple(t.squeeze(0).requires_grad_() for t in _to_bhtd(qkv, nh, nkv, hd))
        else:
            raise ValueError(f"unknown layout {layout!r}")

    def qkv(self) -> tuple:
        nh, nkv, hd = self.shape
        if self.layout == "qkv_view":
            return _split_views(self.leaves[0], nh, nkv, hd)
        if self.layout == "qkv_to_bhtd":
            return _to_bhtd(self.leaves[0], nh, nkv, hd)
        if self.layout == "bthd":
            T = self.leaves[0].shape[0]
            return tuple(t.view(1, T, t.shape[1] // hd, hd).transpose(1, 2) for t in self.leaves)
        return tuple(t.unsqueeze(0) for t in self.leaves)

    def forward(self) -> torch.Tensor:
        q, k, v = self.qkv()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def forward_backward(self) -> tuple:
        return torch.autograd.grad(self.forward(), self.leaves, self.do)

    def grad_strides(self) -> list:
        q, k, v = (t.detach().requires_grad_() for t in self.qkv())
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return [list(t.stride()) for t in torch.autograd.grad(o, (q, k, v), self.do)]


def chart(payload: dict, png: str) -> bool:
    """Bars of ms / qkv_view's ms per layout, one group per (config, pass); False without
    matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = payload["rows"]
    groups = list(dict.fromkeys((r["config"], r["pass"]) for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(LAYOUTS)
    for i, lay in enumerate(LAYOUTS):
        ratios = {(r["config"], r["pass"]): r["ratio"] for r in rows if r["layout"] == lay}
        xs = [g + (i - (len(LAYOUTS) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [ratios[g] for g in groups], width, label=lay)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(groups)), [f"{c}\n{p}" for c, p in groups])
    ax.set_ylim(0.9, max(1.15, max(r["ratio"] for r in rows) + 0.02))
    ax.set_ylabel("time / qkv_view's (median over rounds)")
    device = payload.get("device", "")
    ax.set_title(f"causal GQA SDPA by q/k/v layout, T = {rows[0]['T']}, {device}")
    ax.legend(fontsize=8, ncol=2)
    common.save_figure(plt, fig, png)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--T", type=int, default=8192, help="tokens (one sequence)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/sdpa_layouts_h200.json")
    common.add_rotate_option(p)
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    out = {**common.environment(), "rows": [], "grad_strides": {}}
    for name in args.configs.split(","):
        nh, nkv, hd = CONFIGS[name]
        probs = {lay: Problem(lay, args.T, nh, nkv, hd) for lay in LAYOUTS}
        out["grad_strides"][name] = {lay: pr.grad_strides() for lay, pr in probs.items()}
        for pass_, attr in (("fwd", "forward"), ("fwd+bwd", "forward_backward")):
            fns = {lay: getattr(pr, attr) for lay, pr in probs.items()}
            with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
                times = common.interleaved(fns, args.rounds, args.reps, rotate=args.rotate)
            for lay in LAYOUTS:
                out["rows"].append(
                    {
                        "config": name,
                        "T": args.T,
                        "heads": nh,
                        "kv_heads": nkv,
                        "head_dim": hd,
                        "layout": lay,
                        "pass": pass_,
                        "ms": common.median(times[lay]),
                        "ratio": common.median_ratio(times[lay], times["qkv_view"]),
                    }
                )
    common.print_table(out["rows"], ["config", "layout", "pass", "ms", "ratio"])
    print(out["grad_strides"])
    common.write_json(args.out, out)
    chart(out, common.png_beside(args.out))


if __name__ == "__main__":
    main()
