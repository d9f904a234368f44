"""LM head + cross-entropy: coda vs eager, torch.compile, Liger-Kernel and Cut Cross-Entropy.

    python benchmarks/cross_entropy.py [--H 2048 4096 8192] [--M 8192 16384] [--V 128256]
        [--rounds 5] [--sweep CHUNK_SIZE ...] [--rows-sweep CHUNK_ROWS ...]
        [--dtype bf16|fp16] [--rotate] [--out benchmarks/results/cross_entropy_h200.json]
    python benchmarks/cross_entropy.py --H 2048 --M 8192 --rounds 3          # a short run

For each shape (H, M, V) and pass ("fwd": the loss of inputs that require grad, as in
training; "fwd+bwd": the loss and its gradients dh, dW by ``torch.autograd.grad``), the
contenders run in interleaved rounds (common.interleaved) and the median per-round time
is reported; peak memory is measured once per contender: max_memory_allocated above the
inputs (h, W, targets), with everything the pass returns alive (for "fwd" the graph
saved for backward, for "fwd+bwd" the gradients).

* coda: ``coda.fusions.linear_cross_entropy`` as called by default (fused epilogues,
  logits never whole; in training the automatic choice is the gradient-in-forward path,
  3 logits-sized GEMMs: its "fwd" pass computes the logits, their statistics and
  gradient, and dh, dW of every row chunk but the last, whose dh and dW GEMMs the
  backward runs with the upstream gradient folded into their epilogue; with one row
  chunk the forward runs no dh / dW GEMM).
* coda_recompute: the same with ``grad_in_forward=False``, the low-memory path (forward
  statistics, the backward recomputes the logits: 4 GEMMs). Reported in the workspace
  and sweep sections only, so the issue's row schema stays as it is.
* coda_forward_gemms, coda_fused_tiles, coda_coop_chunks, coda_stats_map,
  coda_stats_epilogue: coda with
  ``ce_fused`` knobs set (A/B candidates, in the workspace section): with one row chunk,
  dh and dW in the forward and scaled in the backward instead of deferred
  (``DEFER_ONE_CHUNK=False``); the deferred GEMMs on the fused default tiles instead of
  the plain GEMM's (``BACKWARD_TILES=None``); the row chunks' dh / dW GEMMs on
  cooperative 256 x 192 tiles (``CHUNK_DH_TILES``, ``CHUNK_DW_TILES``); the logits GEMM
  plain with its statistics from a map pass over the stored acc at every H
  (``STATS_PASS="map"``), or the statistics in the logits GEMM's epilogue at every H
  (``STATS_PASS="epilogue"``;
  the default takes the map pass from H = ``ce_fused.STATS_MAP_MIN_K`` on).
* coda_map_grad: coda with the logits stored and the gradient's map pass over them
  (``GRAD_PASS="map"``) instead of the shifted softmax (R = exp(z - c) stored by the
  logits GEMM, no M x V pass between the GEMMs).
* coda_dw_heuristic: coda with the row chunks' dW GEMM on the heuristic's 128 x 128 tile
  (``CHUNK_DW_TILES=None``) instead of 128 x 160.
* coda_dh_heuristic: coda with the row chunks' dh GEMM on the heuristic's 128 x 128 tile
  (``CHUNK_DH_TILES=None``) instead of cooperative 256 x 128 (the default since
  2026-11-28; the ``coda_coop_dh`` extra of earlier results files timed it as an A/B).
* eager: ``F.cross_entropy((h @ W.T).float(), t)``, Hugging Face's formulation.
* compile: ``torch.compile`` of the same function.
* liger: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (``liger-kernel``).
* cce: Cut Cross-Entropy's ``linear_cross_entropy`` (``cut-cross-entropy``).

A contender whose package is missing, or that runs out of memory, gets null. The JSON has
the issue's rows ``{"H", "M", "V", "pass", "coda_ms", "eager_ms", "compile_ms", "liger_ms",
"cce_ms", "coda_peak_gib", "compile_peak_gib", "liger_peak_gib", "cce_peak_gib"}`` and, next
to them, ``workspace`` (per contender, coda_recompute included, the peak minus the
returned gradients dh, dW; and coda_recompute's time and peak), ``floor`` (the pass's
GEMMs alone: 1 for fwd, 3 for fwd+bwd, on cuBLAS and on coda's mainloop) and ``sweep``:
fwd+bwd time, peak and workspace of coda_recompute per vocabulary chunk size
(``--sweep``) and of coda per row chunk (``--rows-sweep``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.fusions import ce_fused  # noqa: E402
from coda.fusions.cross_entropy import linear_cross_entropy  # noqa: E402
from coda.mainloop.config import GemmConfig  # noqa: E402
from coda.matmul import gemm  # noqa: E402

GiB = 2**30
CONTENDERS = ("coda", "eager", "compile", "liger", "cce")
PEAKS = ("coda", "compile", "liger", "cce")
#: measured beside the contenders, reported in the workspace section (not in the rows)
EXTRA = (
    "coda_recompute",
    "coda_forward_gemms",
    "coda_fused_tiles",
    "coda_coop_chunks",
    "coda_stats_map",
    "coda_stats_epilogue",
    "coda_coop_dh_dw",
    "coda_map_grad",
    "coda_dw_heuristic",
    "coda_dh_heuristic",
)


def eager_loss(h: torch.Tensor, W: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ W.T).float(), t, ignore_index=-100)


#: contenders that are coda's default loss with ``ce_fused`` module knobs set over the
#: whole pass, forward and backward (A/B candidates)
KNOBS = {
    "coda_forward_gemms": {"DEFER_ONE_CHUNK": False},  # one row chunk: dh, dW in the forward
    "coda_fused_tiles": {"BACKWARD_TILES": None},  # deferred GEMMs on fused 128 x 128 tiles
    # the row chunks' dh / dW GEMMs on cooperative 256 x 192 tiles (not per-GEMM heuristic)
    "coda_coop_chunks": {
        "CHUNK_DH_TILES": GemmConfig(tile_m=256, tile_n=192),
        "CHUNK_DW_TILES": GemmConfig(tile_m=256, tile_n=192),
    },
    # the row chunks' dW GEMM on cooperative 256 x 128 tiles too (dh takes them by
    # default since ce_fused.CHUNK_DH_TILES; the coda_coop_dh extra that timed dh alone on
    # them before is that default now)
    "coda_coop_dh_dw": {
        "CHUNK_DH_TILES": GemmConfig(tile_m=256, tile_n=128),
        "CHUNK_DW_TILES": GemmConfig(tile_m=256, tile_n=128),
    },
    # the logits GEMM plain (coda.gemm's tiles), its statistics from a map pass over it
    "coda_stats_map": {"STATS_PASS": "map"},
    # ... or always in the logits GEMM's epilogue (the default below STATS_MAP_MIN_K)
    "coda_stats_epilogue": {"STATS_PASS": "epilogue"},
    # the logits stored and the gradient's map pass over them (the default before the
    # shifted softmax, and still the path of bias / softcap / smoothing / rstd gradients)
    "coda_map_grad": {"GRAD_PASS": "map"},
    # the row chunks' dW GEMM on the heuristic's tile (128 x 128; the default before
    # ce_fused.CHUNK_DW_TILES took 128 x 160)
    "coda_dw_heuristic": {"CHUNK_DW_TILES": None},
    # the row chunks' dh GEMM on the heuristic's tile (128 x 128; the default before
    # ce_fused.CHUNK_DH_TILES took cooperative 256 x 128)
    "coda_dh_heuristic": {"CHUNK_DH_TILES": None},
}


def _knobs_set(knobs: dict, inner: Callable[[], object]) -> Callable[[], object]:
    def run():
        saved = {k: getattr(ce_fused, k) for k in knobs}
        for k, v in knobs.items():
            setattr(ce_fused, k, v)
        try:
            return inner()
        finally:
            for k, v in saved.items():
                setattr(ce_fused, k, v)

    return run


def loss_functions() -> dict[str, Callable | None]:
    fns: dict[str, Callable | None] = {
        "coda": lambda h, W, t: linear_cross_entropy(h, W, t),
        "coda_recompute": lambda h, W, t: linear_cross_entropy(h, W, t, grad_in_forward=False),
        **{name: linear_cross_entropy for name in KNOBS},
        "eager": eager_loss,
        "compile": torch.compile(eager_loss),
    }
    fns.update(common.peer_losses())
    return fns


def make_pass(fn: Callable, kind: str, h, W, t, knobs: dict | None = None) -> Callable[[], object]:
    if kind == "fwd":
        run = lambda: fn(h, W, t)  # noqa: E731
    else:
        run = lambda: torch.autograd.grad(fn(h, W, t), (h, W))  # noqa: E731
    return _knobs_set(knobs, run) if knobs else run


def peak_gib(run: Callable[[], object]) -> tuple[float, float]:
    """(peak above the current allocation, that minus the bytes of returned tensors)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    returned = 0
    if isinstance(out, tuple):
        returned = sum(g.numel() * g.element_size() for g in out)
    del out
    return peak / GiB, (peak - returned) / GiB


def floor_ms(h, W, kind: str, rounds: int, reps: int, rotate: bool = False) -> dict:
    """The GEMMs of the pass alone (the logits-sized ones a fused loss cannot avoid)."""
    M, V = h.shape[0], W.shape[0]
    logits = torch.empty(M, V, dtype=h.dtype, device=h.device)
    dh, dW = torch.empty_like(h), torch.empty_like(W)

    def cublas():
        torch.mm(h, W.t(), out=logits)
        if kind != "fwd":
            torch.mm(logits, W, out=dh)
            torch.mm(logits.t(), h, out=dW)

    def coda():
        gemm(h, W, out=logits)
        if kind != "fwd":
            gemm(logits, W.t(), out=dh)
            gemm(logits.t(), h.t(), out=dW)

    times = common.interleaved(
        {"cublas": cublas, "coda": coda}, rounds=rounds, reps=reps, rotate=rotate
    )
    return {
        "cublas_ms": common.median(times["cublas"]),
        "coda_gemm_ms": common.median(times["coda"]),
    }


def sweep_row(key: dict, contender: str, knob: str, value: int, fn, h, W, t, rounds) -> dict:
    """fwd+bwd time, peak and workspace of ``fn`` at one chunking ``knob=value``."""
    run = make_pass(fn, "fwd+bwd", h, W, t)
    peak, work = peak_gib(run)
    ts = common.interleaved({"c": run}, rounds=rounds, reps=2, warmup=1)["c"]
    row = {**key, "contender": contender, "chunk_size": None, "chunk_rows": None}
    row[knob] = value
    row.update(ms=common.median(ts), peak_gib=peak, workspace_gib=work)
    return row


def bench_shape(
    H: int,
    M: int,
    V: int,
    rounds: int,
    fns: dict,
    sweep: list[int],
    rows_sweep: list[int],
    dtype: torch.dtype = torch.bfloat16,
    rotate: bool = False,
) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(M, H, device="cuda", generator=g) / 2).to(dtype).requires_grad_()
    W = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dtype)
    W.requires_grad_()
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    out = {"rows": [], "workspace": [], "floor": [], "sweep": []}
    for kind in ("fwd", "fwd+bwd"):
        flops = 2 * M * H * V * (1 if kind == "fwd" else 3)
        reps = max(2, min(20, int(3e14 / flops)))
        key = {"H": H, "M": M, "V": V, "pass": kind}
        row = {**key, **{f"{c}_ms": None for c in CONTENDERS}}
        row.update({f"{c}_peak_gib": None for c in PEAKS})
        space = {**key, **{f"{c}_workspace_gib": None for c in CONTENDERS + EXTRA}}
        space.update({f"{c}_{x}": None for c in EXTRA for x in ("ms", "peak_gib")})
        runs = {}
        for name, fn in fns.items():
            if fn is None:
                continue
            run = make_pass(fn, kind, h, W, t, KNOBS.get(name))
            try:
                peak, work = peak_gib(run)
            except torch.cuda.OutOfMemoryError:
                print(f"{name} {kind} H={H} M={M}: out of memory", file=sys.stderr)
                continue
            if name in PEAKS:
                row[f"{name}_peak_gib"] = peak
            if name in EXTRA:
                space[f"{name}_peak_gib"] = peak
            space[f"{name}_workspace_gib"] = work
            runs[name] = run
        times = common.interleaved(runs, rounds=rounds, reps=reps, warmup=2, rotate=rotate)
        for name, ts in times.items():
            (space if name in EXTRA else row)[f"{name}_ms"] = common.median(ts)
        out["rows"].append(row)
        out["workspace"].append(space)
        floor = floor_ms(h.detach(), W.detach(), kind, rounds, reps, rotate)
        out["floor"].append({**key, **floor})
        gc.collect()
        torch.cuda.empty_cache()
    key = {"H": H, "M": M, "V": V}
    for size in sweep:
        fn = lambda h, W, t, size=size: linear_cross_entropy(  # noqa: E731
            h, W, t, grad_in_forward=False, chunk_size=size
        )
        out["sweep"].append(
            sweep_row(key, "coda_recompute", "chunk_size", size, fn, h, W, t, rounds)
        )
    for rows in rows_sweep:
        fn = lambda h, W, t, rows=rows: linear_cross_entropy(h, W, t, chunk_rows=rows)  # noqa: E731
        out["sweep"].append(sweep_row(key, "coda", "chunk_rows", rows, fn, h, W, t, rounds))
    return out


def plot(rows: list[dict], path: str) -> None:
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, kind in zip(axes[:2], ("fwd", "fwd+bwd"), strict=True):
        sel = [r for r in rows if r["pass"] == kind]
        labels = [f"H={r['H']}\nM={r['M']}" for r in sel]
        width = 0.8 / len(CONTENDERS)
        for i, c in enumerate(CONTENDERS):
            ys = [r[f"{c}_ms"] / r["compile_ms"] if r[f"{c}_ms"] and r["compile_ms"] else 0
                  for r in sel]  # fmt: skip
            ax.bar([x + i * width for x in range(len(sel))], ys, width, label=c)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sel))], labels)
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"{kind}: time / torch.compile (lower is better)")
    sel = [r for r in rows if r["pass"] == "fwd+bwd"]
    width = 0.8 / len(PEAKS)
    for i, c in enumerate(PEAKS):
        ys = [r[f"{c}_peak_gib"] or 0 for r in sel]
        axes[2].bar([x + i * width for x in range(len(sel))], ys, width, label=c)
    axes[2].set_xticks(
        [x + 0.4 - width / 2 for x in range(len(sel))],
        [f"H={r['H']}\nM={r['M']}" for r in sel],
    )
    axes[2].set_title("fwd+bwd peak memory above inputs (GiB)")
    axes[0].legend()
    fig.suptitle(f"LM head + cross-entropy, V={sel[0]['V'] if sel else ''}")
    common.save_figure(plt, fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--H", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--M", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--sweep", type=int, nargs="*", default=[], help="coda_recompute's vocabulary chunks"
    )
    p.add_argument("--rows-sweep", type=int, nargs="*", default=[], help="coda's row chunks")
    p.add_argument(
        "--extras",
        nargs="*",
        default=list(EXTRA),
        choices=EXTRA,
        help="which A/B contenders of EXTRA to time beside the five (default: all)",
    )
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=[c for c in CONTENDERS if c not in ("coda", "compile")],
        help="leave these contenders out (A/B runs of coda against torch.compile)",
    )
    p.add_argument(
        "--dtype", default="bf16", choices=("bf16", "fp16"), help="h and W (the issue's: bf16)"
    )
    common.add_rotate_option(p)
    p.add_argument("--out", default="benchmarks/results/cross_entropy_h200.json")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    fns = loss_functions()
    for name in (set(EXTRA) - set(args.extras)) | set(args.skip):
        fns[name] = None
    result: dict = {"rows": [], "workspace": [], "floor": [], "sweep": []}
    env = {**common.environment_with_peers(), "dtype": args.dtype}
    for H in args.H:
        for M in args.M:
            # a static torch.compile per shape (one shared cache would turn dynamic)
            torch._dynamo.reset()
            fns["compile"] = torch.compile(eager_loss)
            part = bench_shape(
                H, M, args.V, args.rounds, fns, args.sweep, args.rows_sweep, dtype, args.rotate
            )
            for k in result:
                result[k] += part[k]
            # after every shape: a run cut short keeps the shapes it finished
            common.write_json(args.out, {**env, **result})
    plot(result["rows"], os.path.splitext(args.out)[0] + ".png")
    common.print_table(result["floor"], ["H", "M", "pass", "cublas_ms", "coda_gemm_ms"])
    cols = ["H", "M", "pass"] + [f"{c}_ms" for c in CONTENDERS]
    cols += [f"{c}_peak_gib" for c in PEAKS]
    common.print_table(result["rows"], cols)
    extra = ["H", "M", "pass"] + [f"{c}_{x}" for c in EXTRA for x in ("ms", "peak_gib")]
    common.print_table(result["workspace"], extra + [f"{c}_workspace_gib" for c in CONTENDERS])
    if result["sweep"]:
        common.print_table(
            result["sweep"],
            ["H", "M", "contender", "chunk_size", "chunk_rows", "ms", "peak_gib", "workspace_gib"],
        )


if __name__ == "__main__":
    main()
