"""Shared benchmark plumbing: interleaved CUDA-event timing, environment record, output files.

Protocol (DESIGN.md section 7): contenders are timed in interleaved rounds (A B A B ...)
in one process so clock and thermal drift cancel; each measurement is the mean of
``reps`` back-to-back launches timed with CUDA events after warm-up; the reported time
is the median over rounds, and ratios are computed per round before taking the median.
With ``rotate=True`` each round starts at the next contender (A B, B A, ...): on the
power-limited H200 a fixed order measured the contender run right after a heavy one up
to several percent slow (docs/gemm.md, "Cooperative 256 x 128 tiles for long K").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch


def time_once(fn: Callable[[], object], reps: int) -> float:
    """Mean milliseconds per call over ``reps`` back-to-back calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def interleaved(
    contenders: dict[str, Callable[[], object]],
    rounds: int = 7,
    reps: int = 20,
    warmup: int = 5,
    rotate: bool = False,
) -> dict[str, list[float]]:
    """Per-contender list of per-round times (ms), contenders alternating within a round.

    ``rotate``: round r starts at the r-th contender (cyclically), so that over a multiple
    of len(contenders) rounds each contender runs in each place once as often: on a
    power-limited card the contender after a heavy one can start at a lower clock, a
    bias a fixed order gives the same contender every round."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in round_order(list(contenders), r, rotate):
            times[name].append(time_once(contenders[name], reps))
    return times


def round_order(names: list, r: int, rotate: bool) -> list:
    """The order of round ``r`` of an interleaved run: ``names`` as given, or with
    ``rotate`` starting at the (r mod len)-th."""
    shift = r % len(names) if rotate and names else 0
    return names[shift:] + names[:shift]


class PowerSampler(threading.Thread):
    """Board power (W) and SM clock (MHz) of GPU 0 every ``period`` seconds until stopped
    (``torch.cuda.power_draw`` and ``torch.cuda.clock_rate``, through NVML)."""

    def __init__(self, period: float = 0.01):
        super().__init__(daemon=True)
        self.period, self.watts, self.mhz = period, [], []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.watts.append(torch.cuda.power_draw() / 1000.0)
            self.mhz.append(torch.cuda.clock_rate())
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def precompile(script: str, argv: list[str], procs: int) -> None:
    """Run ``procs`` copies of ``script`` with ``argv`` plus ``--compile-part i/procs`` and
    wait for them: each compiles its share of the kernels a benchmark will time into the
    on-disk kernel cache (kernels whose keys have a stable identity), which the timing
    process then loads. On the lent GPU machine a cold run is otherwise one core
    compiling. ``argv`` must not hold ``--precompile`` itself."""
    running = [
        subprocess.Popen([sys.executable, script, *argv, "--compile-part", f"{i}/{procs}"])
        for i in range(procs)
    ]
    codes = [p.wait() for p in running]
    if any(codes):
        raise SystemExit(f"precompile processes failed: exit codes {codes}")


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def energy_mj() -> float | None:
    """The GPU's cumulative energy counter in millijoules (NVML's
    ``nvmlDeviceGetTotalEnergyConsumption``, through torch's NVML handle), or None where
    NVML or the counter is unavailable."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler()
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:  # no NVML, no GPU, a counter the board does not keep
        return None


def sampled(fn: Callable[[], object], seconds: float, batch: int = 1) -> dict:
    """``fn`` back to back for ``seconds`` while a :class:`PowerSampler` samples: batches
    of ``batch`` calls, each batch timed with CUDA events and synchronized (``batch`` = 1:
    every call on its own). Returns the median ms per call, the median SM MHz, the calls
    made, and the energy: from the board's energy counter read before and after the loop
    (``energy_source`` "counter": ``joules`` = the loop's energy / its calls, ``watts`` =
    its energy / its wall time), else from the power samples (``energy_source``
    "samples": ``watts`` their mean, ``joules`` = watts x ms; NVML's power reading is an
    average over up to a second, so over windows of a few tenths of a second it lags the
    previous contender's draw)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    sampler = PowerSampler()
    sampler.start()
    times = []
    e0 = energy_mj()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        times.append(time_once(fn, batch))
    elapsed = time.perf_counter() - start
    e1 = energy_mj()
    sampler.stop()
    ms, calls = statistics.median(times), len(times) * batch
    if e0 is not None and e1 is not None and e1 > e0:
        joules = (e1 - e0) / 1e3
        energy = {"watts": joules / elapsed, "joules": joules / calls, "energy_source": "counter"}
    else:
        watts = statistics.mean(sampler.watts)
        energy = {"watts": watts, "joules": watts * ms / 1e3, "energy_source": "samples"}
    return {"ms": ms, "sm_mhz": statistics.median(sampler.mhz), "passes": calls, **energy}


def interleaved_sampled(
    contenders: dict[str, Callable[[], object]], rounds: int, seconds: float, batch: int
) -> dict[str, list[dict]]:
    """Per-contender list of per-round :func:`sampled` results (ms, watts, sm_mhz,
    joules, passes): each contender back to back for ``seconds`` in batches of ``batch``,
    rounds rotated (:func:`round_order`)."""
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in round_order(list(contenders), r, True):
            runs[name].append(sampled(contenders[name], seconds, batch))
    return runs


def timed_rounds(
    contenders: dict[str, Callable[[], object]],
    rounds: int,
    reps: int,
    rotate: bool,
    seconds: float = 0.0,
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Per-contender per-round ms, and per-contender power medians. ``seconds`` = 0:
    :func:`interleaved` (short bursts of ``reps`` calls; no power). ``seconds`` > 0:
    :func:`interleaved_sampled` (each contender back to back for ``seconds`` at the clock
    its power draw settles to, rounds rotated), and for each contender the medians over
    rounds of ``sm_mhz``, ``watts`` and ``joules`` (energy per call) and the
    ``energy_source`` of its rounds (:func:`sampled`)."""
    if not seconds:
        return interleaved(contenders, rounds=rounds, reps=reps, rotate=rotate), {}
    runs = interleaved_sampled(contenders, rounds, seconds, reps)
    times = {name: [x["ms"] for x in xs] for name, xs in runs.items()}
    power = {
        name: {f: median([x[f] for x in xs]) for f in ("sm_mhz", "watts", "joules")}
        | {"energy_source": "/".join(sorted({x.get("energy_source", "samples") for x in xs}))}
        for name, xs in runs.items()
    }
    return times, power


def add_seconds_option(parser) -> None:
    parser.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="each contender back to back this long per round (the power limit), power sampled",
    )


def cuda_inputs(epi, m: int, n: int, k: int, seed: int = 0) -> tuple:
    """(A, B, tensors) for ``epi`` at (m, n, k), bf16 operands, on the GPU
    (``coda.testing.strategies.make_inputs``; scalars stay Python numbers)."""
    from coda.testing.strategies import make_inputs

    A, B, tensors = make_inputs(epi, m, n, k, torch.bfloat16, seed=seed)
    moved = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in tensors.items()}
    return A.cuda(), B.cuda(), moved


def graphed(step: Callable[[], object], warmup: int = 2) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (warmed up first on a side stream: compiles,
    caches, the allocator): a callable replaying it, the host cost of a whole step one
    ``cudaGraphLaunch``. The graph's outputs stay in its private memory pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def profiled_kernels(fn: Callable[[], object], reps: int) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, lower-case name) of every CUDA kernel of ``reps`` calls of
    ``fn`` under torch.profiler (after one unprofiled call), in start order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sorted(
        (e.start_ns(), e.duration_ns(), e.name().lower())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
    )


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[i] / den[i]."""
    return float(statistics.median(a / b for a, b in zip(num, den, strict=True)))


def environment() -> dict:
    import cutlass

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nvidia-cutlass-dsl": cutlass.__version__,
        },
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def peak_above_gib(fn: Callable[[], object]) -> float:
    """GiB of CUDA memory ``fn`` allocates at its peak above what was allocated before it
    (its results freed when it returns: the workspace and what its graph keeps alive
    inside the call)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def add_lm_head_args(parser, out: str, rounds: int) -> None:
    """The LM-head loss benchmarks' shared options: --shapes (H x M pairs), --V, --rounds,
    --reps, --out and --replot."""
    parser.add_argument("--shapes", default="2048x8192,4096x8192", help="HxM pairs")
    parser.add_argument("--V", type=int, default=128256)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=out)
    add_replot_option(parser)


def lm_head_problems(shapes: str, V: int):
    """Per "HxM" of ``shapes`` (comma-separated): (H, M, h, W, t, g), bf16 hidden states h
    (M, H) ~ N(0, 1/4) and LM head W (V, H) ~ N(0, 1/H), both requiring grad, int64
    targets t, and the CUDA generator that drew them (seed 0, for further draws)."""
    for shape in shapes.split(","):
        H, M = (int(x) for x in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        W = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
        W.requires_grad_()
        t = torch.randint(0, V, (M,), device="cuda", generator=g)
        yield H, M, h, W, t, g


def measured_row(row: dict, fns: dict, rounds: int, reps: int) -> dict:
    """``row`` plus each contender's median time over interleaved rounds (``<name>_ms``)
    and its peak memory above what was allocated before it (``<name>_peak_gib``),
    printed."""
    times = interleaved(fns, rounds=rounds, reps=reps, warmup=2)
    row = {**row, **{f"{k}_ms": median(v) for k, v in times.items()}}
    row.update({f"{k}_peak_gib": peak_above_gib(fn) for k, fn in fns.items()})
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return row


PEERS = ("liger_kernel", "cut_cross_entropy")


def peer_losses(reduction: str = "mean") -> dict[str, Callable | None]:
    """The fused LM-head losses of the peers as ``fn(h, W, t) -> loss`` (``reduction``
    "mean" or "none", ignore_index -100): "liger", Liger-Kernel's
    ``LigerFusedLinearCrossEntropyLoss``, and "cce", Cut Cross-Entropy's
    ``linear_cross_entropy``; None where the package is not installed."""
    fns: dict[str, Callable | None] = {"liger": None, "cce": None}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction=reduction)
        fns["liger"] = lambda h, W, t: liger(W, h, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        fns["cce"] = lambda h, W, t: cce(h, W, t, ignore_index=-100, reduction=reduction)
    except ImportError:
        pass
    return fns


def environment_with_peers() -> dict:
    """``environment()`` plus the peers' package versions (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    env = environment()
    for pkg in PEERS:
        try:
            env["versions"][pkg] = version(pkg.replace("_", "-"))
        except PackageNotFoundError:
            env["versions"][pkg] = None
    return env


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---- charts -------------------------------------------------------------------------------


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed
    (charts are optional; the JSON is the result)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, png: str) -> None:
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def png_beside(json_path: str) -> str:
    """The chart's path next to its JSON."""
    return os.path.splitext(json_path)[0] + ".png"


def add_rotate_option(parser) -> None:
    parser.add_argument(
        "--rotate", action="store_true", help="start each round at the next contender"
    )


def add_precompile_options(parser) -> None:
    parser.add_argument(
        "--precompile", type=int, default=0, help="compile in this many processes first"
    )
    parser.add_argument("--compile-part", default=None, help=argparse.SUPPRESS)


def precompiled(args, argv: list[str], script: str, jobs: list, compile_one) -> bool:
    """The ``--precompile`` / ``--compile-part`` dispatch of a benchmark script. In a
    ``--compile-part i/n`` process: ``compile_one`` on its share of ``jobs`` (every n-th
    from the i-th), then True (the process has nothing else to run). With ``--precompile
    N``: N such processes of ``script``, waited for (:func:`precompile`), then False."""
    if args.compile_part:
        part, parts = (int(x) for x in args.compile_part.split("/"))
        for job in jobs[part::parts]:
            compile_one(job)
        torch.cuda.synchronize()
        return True
    if args.precompile:
        precompile(script, without_option(argv, "--precompile"), args.precompile)
    return False


def add_replot_option(parser) -> None:
    parser.add_argument("--replot", metavar="JSON", help="run nothing: redraw this JSON's PNG")


def replotted(args, chart: Callable[[dict, str], object]) -> bool:
    """With ``--replot JSON``: ``chart`` drawn from that JSON beside it (any machine), and
    True (nothing else to run); else False."""
    if not args.replot:
        return False
    with open(args.replot) as f:
        chart(json.load(f), png_beside(args.replot))
    return True
