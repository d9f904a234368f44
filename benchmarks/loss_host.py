"""The LM-head loss's host path: host time, GPU time and step time of a forward + backward.

    python benchmarks/loss_host.py [--H 2048] [--V 128256] [--Ms 256,1024,4096]
        [--steps 6] [--rounds 5] [--profile FILE] [--out FILE] [--replot JSON]

A training step's loss call is a chain of kernel launches; where the GPU work is short
(small batches, short sequences) the host's Python between the launches sets the pace.
Per contender (coda's default ``linear_cross_entropy``, eager PyTorch, torch.compile,
Liger-Kernel, Cut Cross-Entropy: ``cross_entropy.loss_functions``), for
``torch.autograd.grad(loss(h, W, t), (h, W))``, and the same step of coda and of
torch.compile captured in a CUDA graph and replayed (``coda_graph``, ``compile_graph``:
``common.graphed``, the host cost of a step one graph launch), and coda's step under
``torch.use_deterministic_algorithms(True)`` (``coda_deterministic``: no split-K):

* ``host_ms``: host milliseconds per step, ``--steps`` steps issued back to back behind
  a GPU sleep kernel (``launch_overhead.host_us``: the loop's wall time while the GPU
  is busy, so the host never waits for it);
* ``gpu_ms``: GPU milliseconds per step, CUDA events around the same steps issued behind
  a sleep kernel (the host has queued them all before the GPU reaches the first, so the
  events time the kernels back to back, without host gaps);
* ``step_ms``: milliseconds per step of the same loop with an idle GPU, synchronized
  at its end: what a training loop pays, about max(host_ms, gpu_ms).

Contenders alternate within each of ``--rounds`` rounds; medians. Rows ``{"H", "M", "V",
"<contender>_host_ms", "<contender>_gpu_ms", "<contender>_step_ms"}``; ``--profile``
writes a cProfile of coda's steps at the first M (top functions by own and cumulative
time) to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from cross_entropy import eager_loss, loss_functions, make_pass  # noqa: E402
from launch_overhead import SLEEP_CYCLES, host_us  # noqa: E402

CONTENDERS = (
    "coda", "eager", "compile", "liger", "cce", "coda_graph", "compile_graph",
    "coda_deterministic",
)  # fmt: skip


def deterministic(run):
    """``run`` under ``torch.use_deterministic_algorithms(True)`` (the caller's setting
    restored after each step): coda's small batches then skip split-K."""

    def step():
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return run()
        finally:
            torch.use_deterministic_algorithms(before)

    return step


def gpu_ms(fn, steps: int) -> float:
    """GPU milliseconds per step: ``steps`` steps queued behind a sleep kernel, timed
    by CUDA events recorded after the sleep and after the last step."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def step_ms(fn, steps: int) -> float:
    """Wall milliseconds per step of ``steps`` steps from an idle GPU to a synchronize."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def timed_fields(
    steps: dict, contenders: tuple[str, ...], rounds: int, n_steps: int
) -> dict[str, float | None]:
    """``{"<contender>_host_ms", "<contender>_gpu_ms", "<contender>_step_ms"}`` for every
    name of ``contenders`` (None where ``steps`` has no callable for it): each callable
    warmed up (compiles, loads, the allocator), then timed in ``rounds`` interleaved
    rounds of ``n_steps`` steps (``host_us``, ``gpu_ms``, ``step_ms``), medians."""
    for fn in steps.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times = {c: {"host": [], "gpu": [], "step": []} for c in steps}
    for _ in range(rounds):
        for c, fn in steps.items():
            times[c]["host"].append(host_us(fn, n_steps) / 1e3)
            times[c]["gpu"].append(gpu_ms(fn, n_steps))
            times[c]["step"].append(step_ms(fn, n_steps))
    return {
        f"{c}_{kind}_ms": common.median(times[c][kind]) if c in times else None
        for c in contenders
        for kind in ("host", "gpu", "step")
    }


def profile_text(fn, steps: int, top: int = 45) -> str:
    """cProfile of ``steps`` steps of ``fn`` (GPU busy behind a sleep kernel): the top
    functions by own time, then by cumulative time."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def plot(result: dict, path: str) -> None:
    """Two panels over M: each contender's step time, and its host time per step beside
    its GPU time (the step is about the larger of the two)."""
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    rows = result["rows"]
    Ms = [r["M"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for c in CONTENDERS:
        if rows and rows[0].get(f"{c}_step_ms") is None:
            continue
        line = axes[0].plot(Ms, [r[f"{c}_step_ms"] for r in rows], marker="o", label=c)[0]
        axes[1].plot(Ms, [r[f"{c}_host_ms"] for r in rows], marker="o", color=line.get_color(),
                     label=f"{c} host")  # fmt: skip
        axes[1].plot(Ms, [r[f"{c}_gpu_ms"] for r in rows], ls="--", color=line.get_color(),
                     label=f"{c} GPU")  # fmt: skip
    for ax, title in zip(axes, ("step (ms, synchronized)", "host vs GPU per step (ms)"),
                         strict=True):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    H, V = (rows[0]["H"], rows[0]["V"]) if rows else ("", "")
    fig.suptitle(f"LM head + cross-entropy forward + backward, H={H}, V={V}: {result['device']}")
    common.save_figure(plt, fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--H", type=int, default=2048)
    parser.add_argument("--V", type=int, default=128256)
    parser.add_argument("--Ms", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--out", default="benchmarks/results/loss_host_h200.json")
    common.add_replot_option(parser)
    args = parser.parse_args(argv)
    if common.replotted(args, plot):
        return
    torch.manual_seed(0)
    all_fns = loss_functions()
    rows = []
    for i, M in enumerate(int(m) for m in args.Ms.split(",")):
        shape = f"{args.H}x{M}"
        _, _, h, W, t, _ = next(common.lm_head_problems(shape, args.V))
        torch._dynamo.reset()  # a static compile per shape, as cross_entropy.py
        all_fns["compile"] = torch.compile(eager_loss)
        steps = {}
        for c in args.only:
            fn = all_fns.get(c.removesuffix("_graph").removesuffix("_deterministic"))
            if fn is not None:
                run = make_pass(fn, "fwd+bwd", h, W, t)
                if c.endswith("_deterministic"):
                    run = deterministic(run)
                steps[c] = common.graphed(run) if c.endswith("_graph") else run
        row = {"H": args.H, "M": M, "V": args.V}
        row.update(timed_fields(steps, CONTENDERS, args.rounds, args.steps))
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
        if args.profile and i == 0 and "coda" in steps:
            with open(args.profile, "w") as f:
                f.write(profile_text(steps["coda"], args.steps))
        del h, W, t, steps
    payload = {**common.environment_with_peers(), "rows": rows}
    common.write_json(args.out, payload)
    plot(payload, common.png_beside(args.out))
    cols = ["M"] + [f"{c}_{k}_ms" for c in ("coda", "compile", "eager") for k in ("host", "step")]
    common.print_table(rows, cols)


if __name__ == "__main__":
    main()
