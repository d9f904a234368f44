"""Fused epilogue vs coda's own plain GEMM on the same shape, layout and config.

    python benchmarks/epilogue_overhead.py [--out benchmarks/results/epilogue_overhead_h200.json]
                                           [--sizes 2048,4096,8192] [--layouts fwd,dgrad,wgrad]
                                           [--rotate] [--precompile 14] [--seconds 0.5]

For each representative epilogue of ``coda.testing.catalog`` (``--epilogues`` may also
name the training ops' of :data:`TRAINING_EPILOGUES` and the experiments of
:data:`EXPERIMENTAL_EPILOGUES`), each shape (M=16384,
N=K in ``--sizes``) and each operand layout (``coda.testing.layouts``: forward, dgrad
with B N-major, wgrad with A M-major and B N-major), the fused kernel
(``epi(A, B, **tensors)``, finalize included) and the plain GEMM (``coda.gemm`` with the
same config and layout, bf16 output) are timed in interleaved rounds; fused_ms / plain_ms
is the epilogue's cost. ``--staggered`` also times the fused kernel with
``GemmConfig.staggered_copies`` in the same rounds (row fields ``staggered_ms`` and
``staggered_ratio``: its fused / plain). ``--epi-n W`` also times the fused kernel and
the plain GEMM with W-column epilogue subtiles (``GemmConfig.epi_n``) in the same rounds
(row fields ``epi{W}_ms``, ``epi{W}_plain_ms``, ``epi{W}_ratio``: its fused / the
default plain, and ``epi{W}_own_ratio``: its fused / its plain). ``--rolled`` also
times the fused kernel with ``GemmConfig.rolled_epilogue`` (``rolled_ms``,
``rolled_ratio``: its fused / plain). ``--tile-n W`` also times the fused kernel and the
plain GEMM on W-wide output tiles (``GemmConfig.tile_n``; fields ``tile{W}_ms``,
``tile{W}_plain_ms``, ``tile{W}_ratio``, ``tile{W}_own_ratio`` as for ``--epi-n``).
``--buffers E/L`` also times it with ``E`` epilogue
store buffers and ``L`` load buffers (``GemmConfig.epi_stages`` / ``load_stages``: fewer
buffers leave shared memory for more A/B stages; ``buffers_ms``, ``buffers_ratio``).
``--baseline PATH`` (an earlier result, e.g. the committed one) adds each row's
``baseline_ratio`` (the same epilogue, layout and shape there; null where it has none)
and prints the rows whose ratio rose by more than ``--tolerance`` (default 0.02) as
regressions (what would have flagged the log-sum-exp's finalize regression found on
2026-11-27, ``results/epilogue_overhead_rerun_h200.json``).
``--rotate``: fused and plain take turns starting a round (A B, B A, ...) instead of the
fused kernel always first (``common.interleaved(rotate=True)``). ``--precompile N``
compiles every timed kernel in N processes first (``common.precompile``).
``--seconds S``: each method runs back to back for S seconds per round (rounds rotated)
while board power and SM clock are sampled, so both kernels are timed at the clock their
own power draw settles to, as in a training step (``common.timed_rounds``); rows then add
``fused_sm_mhz``, ``plain_sm_mhz``, ``fused_joules`` and ``plain_joules`` (medians over
rounds; joules = energy per call) and ``energy_source`` ("counter": the board's energy
counter; "samples": NVML's averaged power, which lags at windows under a second:
``common.sampled``).
The PNG beside the JSON shows every row's fused / plain against the 1.03 target
(``--replot FILE`` redraws it from a written JSON, on any machine with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.epilogue import Epilogue  # noqa: E402
from coda.fusions import epilogues as fusion_epilogues  # noqa: E402
from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.primitives import ops  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.layouts import operands  # noqa: E402

M = 16384

#: the training ops' GEMM epilogues that ``--epilogues`` may name beside the catalogue's
TRAINING_EPILOGUES = {
    # the MLP's down-projection dgrad: SwiGLU backward, rstd-scaled (dg, du), rZdZ, y
    "fusion_swiglu_bwd": lambda: fusion_epilogues.swiglu_backward(torch.bfloat16),
}


#: experiments of ``epilogue_timeline.py`` that ``--epilogues`` may name, timed by this
#: script's protocol (their values are not checked: e.g. SwiGLU backward's products on
#: packed bf16 pairs, beside the catalogue's ``swiglu_bwd``)
EXPERIMENTAL_EPILOGUES = {
    **{
        f"swiglu_bwd_packed_{w}": (lambda w=w: _timeline().swiglu_bwd_packed(w))
        for w in ("bf16", "f16")
    },
    # the rotary angle in fixed-point turns (refuted: epilogue_timeline.py's section on
    # it): with a conversion, with integer adds instead, with T handed in, and the
    # catalogue's rope with only its fp64 part added; ``rope_product`` is the catalogue's
    # rope by another name (what the committed A/Bs call it)
    "rope_fixed_turns": lambda: _timeline().rope_variant(_timeline()._rope_fixed_turns),
    "rope_product": lambda: _timeline().rope_variant(ops.rope),
    "rope_bits": lambda: _timeline().rope_variant(_timeline()._rope_bits),
    "rope_host_turns": lambda: _timeline().rope_variant(
        _timeline()._rope_host_turns, ("t_lo", "t_hi")
    ),
    "rope_f64_live": lambda: _timeline().rope_variant(_timeline()._rope_f64_live),
}


def _timeline():
    import epilogue_timeline

    return epilogue_timeline


def epilogue_named(name: str) -> Epilogue:
    """A catalogue epilogue or one of :data:`TRAINING_EPILOGUES` or
    :data:`EXPERIMENTAL_EPILOGUES`, by name."""
    if name in EPILOGUES:
        return EPILOGUES[name]
    for table in (TRAINING_EPILOGUES, EXPERIMENTAL_EPILOGUES):
        if name in table:
            return table[name]()
    known = [*EPILOGUES, *TRAINING_EPILOGUES, *EXPERIMENTAL_EPILOGUES]
    raise SystemExit(f"unknown epilogue {name!r}: one of {known}")


def contenders(
    name: str,
    m: int,
    n: int,
    k: int,
    layout: str = "fwd",
    staggered: bool = False,
    epi_n: int | None = None,
    rolled: bool = False,
    buffers: tuple[int, int] | None = None,
    tile_n: int | None = None,
) -> tuple:
    """(config, {method: call}) of one row: the fused kernel, the plain GEMM in the same
    config and layout, and the optional variants."""
    epi = epilogue_named(name)
    A, B, tensors = common.cuda_inputs(epi, m, n, k)
    A, B = operands(A, B, layout)
    cfg = choose_epilogue_config(m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    methods = {
        "fused": lambda: epi(A, B, config=cfg, **tensors),
        "plain": lambda: gemm(A, B, out=out, config=cfg),
    }
    if staggered:
        stag = attrs.evolve(cfg, staggered_copies=True)
        methods["staggered"] = lambda: epi(A, B, config=stag, **tensors)
    if epi_n:
        alt = attrs.evolve(cfg, epi_n=epi_n)
        methods["alt"] = lambda: epi(A, B, config=alt, **tensors)
        methods["alt_plain"] = lambda: gemm(A, B, out=out, config=alt)
    if rolled:
        roll = attrs.evolve(cfg, rolled_epilogue=True)
        methods["rolled"] = lambda: epi(A, B, config=roll, **tensors)
    if buffers:
        few = attrs.evolve(cfg, epi_stages=buffers[0], load_stages=buffers[1])
        methods["buffers"] = lambda: epi(A, B, config=few, **tensors)
    if tile_n:
        wide = attrs.evolve(cfg, tile_n=tile_n)
        methods["tile"] = lambda: epi(A, B, config=wide, **tensors)
        methods["tile_plain"] = lambda: gemm(A, B, out=out, config=wide)
    return cfg, methods


def bench(
    name: str,
    m: int,
    n: int,
    k: int,
    rounds: int,
    layout: str = "fwd",
    staggered: bool = False,
    epi_n: int | None = None,
    rolled: bool = False,
    buffers: tuple[int, int] | None = None,
    tile_n: int | None = None,
    rotate: bool = False,
    seconds: float = 0.0,
) -> dict:
    cfg, methods = contenders(name, m, n, k, layout, staggered, epi_n, rolled, buffers, tile_n)
    reps = max(3, min(30, int(2e13 / (2 * m * n * k))))
    times, power = common.timed_rounds(methods, rounds, reps, rotate, seconds)
    fused, plain = common.median(times["fused"]), common.median(times["plain"])
    extra = {}
    if power:
        for method in ("fused", "plain"):
            extra[f"{method}_sm_mhz"] = power[method]["sm_mhz"]
            extra[f"{method}_joules"] = power[method]["joules"]
        extra["energy_source"] = power["fused"]["energy_source"]
    if staggered:
        extra |= {
            "staggered_ms": common.median(times["staggered"]),
            "staggered_ratio": common.median_ratio(times["staggered"], times["plain"]),
        }
    if rolled:
        extra |= {
            "rolled_ms": common.median(times["rolled"]),
            "rolled_ratio": common.median_ratio(times["rolled"], times["plain"]),
        }
    if buffers:
        extra |= {
            "buffers_ms": common.median(times["buffers"]),
            "buffers_ratio": common.median_ratio(times["buffers"], times["plain"]),
        }
    if epi_n:
        extra |= variant_fields(f"epi{epi_n}", times, "alt")
    if tile_n:
        extra |= variant_fields(f"tile{tile_n}", times, "tile")
    return {
        "epilogue": name,
        "layout": layout,
        "M": m,
        "N": n,
        "K": k,
        "fused_ms": fused,
        "plain_ms": plain,
        "ratio": common.median_ratio(times["fused"], times["plain"]),
        "config": f"{cfg.tile_m}x{cfg.tile_n} cluster {cfg.cluster_m}x{cfg.cluster_n}",
        **extra,
    }


def variant_columns(prefix: str) -> list[str]:
    """A config variant's row fields (:func:`variant_fields`), in table order."""
    return [f"{prefix}{suffix}" for suffix in ("_ms", "_plain_ms", "_ratio", "_own_ratio")]


def variant_fields(prefix: str, times: dict, method: str) -> dict:
    """A config variant's row fields: its fused and plain medians, its fused / the
    default plain (``_ratio``) and its fused / its own plain (``_own_ratio``)."""
    fused, plain = times[method], times[f"{method}_plain"]
    values = (
        common.median(fused),
        common.median(plain),
        common.median_ratio(fused, times["plain"]),
        common.median_ratio(fused, plain),
    )
    return dict(zip(variant_columns(prefix), values, strict=True))


def row_key(row: dict) -> tuple:
    """What identifies a row across runs: epilogue, layout and shape."""
    return (row["epilogue"], row["layout"], row["M"], row["N"], row["K"])


def against_baseline(rows: list[dict], baseline: list[dict], tolerance: float) -> list[dict]:
    """Set each row's ``baseline_ratio`` (None where ``baseline`` has no such row) and
    return the rows whose ratio exceeds it by more than ``tolerance``, worst first."""
    before = {row_key(r): r["ratio"] for r in baseline}
    for r in rows:
        r["baseline_ratio"] = before.get(row_key(r))
    worse = [
        r
        for r in rows
        if r["baseline_ratio"] is not None and r["ratio"] - r["baseline_ratio"] > tolerance
    ]
    return sorted(worse, key=lambda r: r["baseline_ratio"] - r["ratio"])


#: the issue's bound on fused_ms / plain_ms, drawn on the chart
TARGET_RATIO = 1.03


def chart(payload: dict, png: str) -> bool:
    """fused / plain per epilogue, one panel per N = K, a bar per layout, the 1.03 target
    as a line; False without matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = payload["rows"]
    sizes = sorted({r["N"] for r in rows})
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    names = list(dict.fromkeys(r["epilogue"] for r in rows))
    ratio = {(r["epilogue"], r["layout"], r["N"]): r["ratio"] for r in rows}
    width = 0.8 / len(layouts)
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.6 * len(sizes), 4.2), sharey=True)
    axes = list(axes) if len(sizes) > 1 else [axes]
    for ax, n in zip(axes, sizes, strict=True):
        for j, layout in enumerate(layouts):
            xs = [i + (j - (len(layouts) - 1) / 2) * width for i in range(len(names))]
            ys = [ratio.get((name, layout, n), float("nan")) for name in names]
            ax.bar(xs, [y - 1 for y in ys], width, bottom=1, label=layout)
        ax.axhline(TARGET_RATIO, color="black", lw=0.8, ls="--", label=f"target {TARGET_RATIO}")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set_title(f"M = {rows[0]['M']}, N = K = {n}", fontsize=9)
    axes[0].set_ylabel("fused / plain GEMM")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Epilogue cost in coda's GEMM, {payload['device']}", fontsize=10)
    common.save_figure(plt, fig, png)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/epilogue_overhead_h200.json")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="2048,4096,8192")
    p.add_argument("--layouts", default="fwd,dgrad,wgrad")
    p.add_argument("--epilogues", default=",".join(EPILOGUES))
    p.add_argument("--staggered", action="store_true", help="also time GemmConfig.staggered_copies")
    p.add_argument("--epi-n", type=int, default=None, help="also time this epilogue subtile width")
    p.add_argument("--rolled", action="store_true", help="also time GemmConfig.rolled_epilogue")
    p.add_argument("--tile-n", type=int, default=None, help="also time this output tile width")
    p.add_argument(
        "--buffers",
        default=None,
        metavar="E/L",
        help="also time GemmConfig(epi_stages=E, load_stages=L): fewer epilogue buffers",
    )
    p.add_argument("--baseline", default=None, help="an earlier result JSON to compare rows with")
    p.add_argument("--tolerance", type=float, default=0.02, help="ratio rise that is a regression")
    common.add_rotate_option(p)
    common.add_seconds_option(p)
    common.add_precompile_options(p)
    common.add_replot_option(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    jobs = [
        (name, size, layout)
        for size in (int(x) for x in args.sizes.split(","))
        for layout in args.layouts.split(",")
        for name in args.epilogues.split(",")
    ]
    for name in {job[0] for job in jobs}:  # an unknown name fails before any GPU work
        epilogue_named(name)
    buffers = tuple(int(x) for x in args.buffers.split("/")) if args.buffers else None
    extras = (args.staggered, args.epi_n, args.rolled, buffers, args.tile_n)

    def compile_one(job: tuple) -> None:  # one call of each method compiles its kernels
        name, size, layout = job
        for call in contenders(name, M, size, size, layout, *extras)[1].values():
            call()

    if common.precompiled(args, argv, os.path.abspath(__file__), jobs, compile_one):
        return
    baseline = None
    if args.baseline:  # read first: a bad path fails before any GPU work
        with open(args.baseline) as f:
            baseline = json.load(f)["rows"]
    timing = {"rotate": args.rotate, "seconds": args.seconds}
    rows = [
        bench(name, M, size, size, args.rounds, layout, *extras, **timing)
        for name, size, layout in jobs
    ]
    worst = max(r["ratio"] for r in rows)
    regressed = against_baseline(rows, baseline, args.tolerance) if baseline is not None else []
    payload = {**common.environment(), "max_ratio": worst, "rows": rows}
    common.write_json(args.out, payload)
    chart(payload, common.png_beside(args.out))
    cols = ["epilogue", "layout", "M", "N", "K", "fused_ms", "plain_ms", "ratio"]
    if args.seconds:
        cols += ["fused_sm_mhz", "plain_sm_mhz", "fused_joules", "plain_joules"]
    if args.staggered:
        cols += ["staggered_ms", "staggered_ratio"]
    if args.rolled:
        cols += ["rolled_ms", "rolled_ratio"]
    if buffers:
        cols += ["buffers_ms", "buffers_ratio"]
    for prefix, on in ((f"epi{args.epi_n}", args.epi_n), (f"tile{args.tile_n}", args.tile_n)):
        if on:
            cols += variant_columns(prefix)
    if baseline is not None:
        cols += ["baseline_ratio"]
    common.print_table(rows, cols)
    print(f"max fused/plain = {worst:.3f}")
    for r in regressed:
        print(
            f"REGRESSED: {r['epilogue']} {r['layout']} N=K={r['N']}: "
            f"{r['baseline_ratio']:.3f} -> {r['ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
