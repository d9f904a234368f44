"""Where a fused epilogue's extra time goes, and what each lever could win: the item-4
budget, read from per-tile timelines (runs on any machine; no GPU).

    python benchmarks/epilogue_budget.py TIMELINE.json [TIMELINE.json ...]
        [--overhead benchmarks/results/epilogue_overhead_h200.json]
        [--out benchmarks/results/epilogue_budget_h200.json] (+ a PNG)

Each TIMELINE is a result of ``epilogue_timeline.py`` holding the plain GEMM's work
(``store_acc``) beside the epilogues at one N = K; several files of one N = K are runs of
the same measurement, and each number below is their median. Per epilogue, with ``p``
the plain GEMM's row and every share a fraction of the plain GEMM's span (an SM's
cycles from its first tile to its last epilogue's end: ``tiles`` mainloops, the
epilogue time the tensor cores wait for, the last tile's epilogue, start-up):

* ``mainloop_share``: tiles x (mainloop - p.mainloop) / p.span: the k-loop slowed
  beside the other warpgroup's epilogue (its FP32-pipe math, its M x N traffic);
* ``steady_exposed_share``: (exposed_frac x span - p's) / p.span: tensor cores waiting
  for a warpgroup still in its previous epilogue (an epilogue longer than a mainloop);
* ``last_epilogue_share``: (epilogue - p.epilogue) / p.span: the extra length of each
  SM's last epilogue, which no mainloop overlaps;
* ``rest_share``: span / p.span - 1 minus the three (hand-overs, start-up, noise);
* ``clock_ratio``: p.sm_mhz / sm_mhz, the plain GEMM kernel's SM clock over the fused
  one's (span cycles over the GEMM kernel's time: a fused kernel spends more energy a
  tile, so the power-limited card clocks it lower);
* ``tail_share``: (tail_us - p.tail_us) / p.gemm_us: what the fused call's finalize
  kernel adds after its GEMM beyond the plain call's (every timed call has the
  Timeline's own finalize);
* ``kernel_ratio``: kernel_us / p.kernel_us, the timeline's own fused / plain call time
  from CUDA events over its burst; ``model_ratio``: span ratio x clock ratio + tail
  share, the same from the terms (a burst's hiccup moves the first, not the second);
* what-ifs, each removing one term and keeping the others, on that model:
  ``ratio_last_hidden`` ((span ratio - last_epilogue_share) x clock_ratio + tail_share),
  ``ratio_last_halved`` (half of it: the most a split of the last tile's epilogue
  between the two warpgroups could take), ``ratio_mainloop_unslowed`` (without
  mainloop_share and steady_exposed_share), ``ratio_no_tail`` (without tail_share),
  ``ratio_same_clock`` (clock_ratio 1).

Timelines written before ``gemm_us`` / ``tail_us`` / ``sm_mhz`` were recorded lack the
split: their clock_ratio is p.mhz / mhz from the call's time (the finalize tail folded
in) and their tail_share is 0.
* ``item4_ratios``: the item-4 table's fused / plain of the epilogue at this N = K, per
  layout, from ``--overhead`` (another protocol: rotated rounds without clock reads).

JSON: ``{"sources": [{"path", "command", "note"}], "rows": [{"epilogue", "N", "K",
"runs", "span_ratio", "mainloop_share", "steady_exposed_share", "last_epilogue_share",
"rest_share", "clock_ratio", "tail_share", "kernel_ratio", "model_ratio", "ratio_last_hidden",
"ratio_last_halved", "ratio_mainloop_unslowed", "ratio_no_tail", "ratio_same_clock",
"item4_ratios"}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PLAIN = "store_acc"
SHARES = ("mainloop_share", "steady_exposed_share", "last_epilogue_share", "rest_share")
WHAT_IFS = ("ratio_last_hidden", "ratio_last_halved", "ratio_mainloop_unslowed", "ratio_no_tail")


def budget(row: dict, plain: dict) -> dict:
    """One timeline row's budget against the plain GEMM's row of the same run."""
    span_p = plain["span"]
    span_ratio = row["span"] / span_p
    mainloop = row["tiles"] * (row["mainloop"] - plain["mainloop"]) / span_p
    steady = (row["exposed_frac"] * row["span"] - plain["exposed_frac"] * span_p) / span_p
    last = (row["epilogue"] - plain["epilogue"]) / span_p
    if "sm_mhz" in row and "sm_mhz" in plain:
        clock = plain["sm_mhz"] / row["sm_mhz"]
        tail = (row["tail_us"] - plain["tail_us"]) / plain["gemm_us"]
    else:  # an older timeline: the call's time, the finalize tail folded into the clock
        clock, tail = plain["mhz"] / row["mhz"], 0.0

    def model(span: float, clock: float = clock, tail: float = tail) -> float:
        return span * clock + tail

    return {
        "span_ratio": span_ratio,
        "mainloop_share": mainloop,
        "steady_exposed_share": steady,
        "last_epilogue_share": last,
        "rest_share": span_ratio - 1.0 - mainloop - steady - last,
        "clock_ratio": clock,
        "tail_share": tail,
        "kernel_ratio": row["kernel_us"] / plain["kernel_us"],
        "model_ratio": model(span_ratio),
        "ratio_last_hidden": model(span_ratio - last),
        "ratio_last_halved": model(span_ratio - last / 2),
        "ratio_mainloop_unslowed": model(span_ratio - mainloop - steady),
        "ratio_no_tail": model(span_ratio, tail=0.0),
        "ratio_same_clock": model(span_ratio, clock=1.0),
    }


def item4_ratios(overhead_rows: list[dict], epilogue: str, n: int, k: int) -> dict:
    """layout -> fused / plain of ``epilogue`` at (N, K) in the item-4 table."""
    return {
        r["layout"]: r["ratio"]
        for r in overhead_rows
        if r["epilogue"] == epilogue and r["N"] == n and r["K"] == k
    }


def combine(runs: list[list[dict]], overhead_rows: list[dict]) -> list[dict]:
    """Median budgets over the runs (each a timeline's rows) of every N = K, per epilogue;
    the plain GEMM's own row left out."""
    by_key: dict[tuple, list[dict]] = {}
    for rows in runs:
        plains = [r for r in rows if r["variant"] == PLAIN]
        if len(plains) != 1:
            raise ValueError(f"a timeline needs exactly one {PLAIN!r} row, found {len(plains)}")
        plain = plains[0]
        for r in rows:
            if r["variant"] == PLAIN or r["mainloop"] <= 0:
                continue
            if (r["N"], r["K"]) != (plain["N"], plain["K"]):
                raise ValueError(f"{r['variant']} is not at the plain row's N, K")
            by_key.setdefault((r["K"], r["N"], r["variant"]), []).append(budget(r, plain))
    out = []
    for (k, n, name), budgets in sorted(by_key.items()):
        med = {f: statistics.median(b[f] for b in budgets) for f in budgets[0]}
        out.append(
            {
                "epilogue": name,
                "N": n,
                "K": k,
                "runs": len(budgets),
                **med,
                "item4_ratios": item4_ratios(overhead_rows, name, n, k),
            }
        )
    return out


def chart(payload: dict, path: str) -> None:
    """Per N = K, each epilogue's fused / plain as stacked shares from 1.0 (the span's
    terms, the clock's part span_ratio x (clock_ratio - 1) and the finalize tail's;
    negative ones stacked downwards), the timeline's call ratio (dots), the item-4
    table's worst layout (bars) and the 1.03 line."""
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    sizes = sorted({r["K"] for r in payload["rows"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    for ax, k in zip(axes[0], sizes, strict=True):
        rows = [r for r in payload["rows"] if r["K"] == k]
        xs = range(len(rows))
        up, down = [1.0] * len(rows), [1.0] * len(rows)
        parts = [(s, [r[s] for r in rows]) for s in SHARES]
        parts.append(("clock", [r["span_ratio"] * (r["clock_ratio"] - 1.0) for r in rows]))
        parts.append(("finalize tail", [r["tail_share"] for r in rows]))
        for label, ys in parts:
            base = [u if y >= 0 else d for u, d, y in zip(up, down, ys, strict=True)]
            ax.bar(xs, ys, bottom=base, label=label.replace("_share", ""))
            up = [u + max(y, 0.0) for u, y in zip(up, ys, strict=True)]
            down = [d + min(y, 0.0) for d, y in zip(down, ys, strict=True)]
        ax.plot(xs, [r["kernel_ratio"] for r in rows], "ko", markersize=4, label="timeline call")
        worst = [max(r["item4_ratios"].values(), default=float("nan")) for r in rows]
        ax.plot(xs, worst, "k_", markersize=18, label="item-4 table, worst layout")
        ax.axhline(1.03, color="red", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(xs), [r["epilogue"] for r in rows], rotation=35, ha="right")
        ax.set_ylim(min(0.98, min(down) - 0.005), max(1.1, max(up) + 0.01))
        ax.set_ylabel("fused / plain")
        ax.set_title(f"N = K = {k}: where the extra time goes")
        ax.legend(fontsize=7)
    common.save_figure(plt, fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("timelines", nargs="+", help="epilogue_timeline.py results")
    p.add_argument("--overhead", default=None, help="epilogue_overhead.py result (item 4)")
    p.add_argument("--out", default="benchmarks/results/epilogue_budget_h200.json")
    args = p.parse_args(argv)
    runs, sources = [], []
    for path in args.timelines:
        with open(path) as f:
            data = json.load(f)
        runs.append(data["rows"])
        sources.append({"path": path, "command": data.get("command"), "note": data.get("note")})
    overhead_rows = []
    if args.overhead:
        with open(args.overhead) as f:
            data = json.load(f)
        overhead_rows = data["rows"]
        sources.append({"path": args.overhead, "command": data.get("command"), "note": None})
    rows = combine(runs, overhead_rows)
    payload = {"command": " ".join(["python", *sys.argv]), "sources": sources, "rows": rows}
    common.write_json(args.out, payload)
    chart(payload, common.png_beside(args.out))
    common.print_table(
        rows,
        ["epilogue", "K", "runs", "kernel_ratio", "model_ratio", *SHARES]
        + ["clock_ratio", "tail_share"]
        + list(WHAT_IFS),
    )


if __name__ == "__main__":
    main()
