"""Time, SM clock, board power and energy of fused epilogues beside their plain GEMM.

    python benchmarks/epilogue_power.py [--m 16384] [--size 2048] [--seconds 1.5]
        [--rounds 2] [--epilogues NAME,...] [--out benchmarks/results/epilogue_power_h200.json]

``epilogue_overhead.py`` reports fused / plain *time*. A GEMM of these shapes runs at the
card's power limit, where the SM clock is set by the energy the kernel draws: an
epilogue can be hidden in the mainloop's shadow in *cycles* and still cost time, because
moving its bytes (DRAM, L2, shared memory) costs energy and so clock. This script splits
the two: each epilogue (the catalogue's and ``epilogue_anatomy.py``'s variants, in the
config the fused heuristics pick) and the plain GEMM in that config run back to back for
``--seconds`` (batches of ``--batch`` calls timed with CUDA events) while a thread samples
board power and SM clock (:func:`common.sampled`); plain and fused alternate, in
``--rounds`` interleaved rounds.

JSON rows ``{"epilogue", "M", "N", "K", "round", "variant": "fused"|"plain", "ms",
"watts", "sm_mhz", "mj", "kcycles"}`` (median ms per call, mean board watts, median SM
MHz, millijoules per call = watts x ms, thousands of SM cycles per call = ms x MHz), and
``summary`` rows ``{"epilogue", "time_ratio", "cycle_ratio", "energy_ratio",
"fused_watts", "plain_watts", "fused_mhz", "plain_mhz"}`` (medians over rounds of the
per-round fused / plain ratios). ``cycle_ratio`` near 1 with a larger ``time_ratio``
means the epilogue hides in cycles and what it costs is clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from epilogue_anatomy import variants  # noqa: E402

from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402


def candidates() -> dict:
    """The catalogue's epilogues, then the anatomy's variants not in it."""
    return {**EPILOGUES, **{k: v for k, v in variants().items() if k not in EPILOGUES}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/epilogue_power_h200.json")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--size", type=int, default=2048, help="N = K")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epilogues", default=None, help="comma-separated subset")
    args = p.parse_args(argv)
    m, n = args.m, args.size
    k = n
    every = candidates()
    names = args.epilogues.split(",") if args.epilogues else list(every)
    cfg = choose_epilogue_config(m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    calls = {}
    for name in names:
        epi = every[name]
        A, B, tensors = common.cuda_inputs(epi, m, n, k)

        def fused(epi=epi, A=A, B=B, tensors=tensors):
            return epi(A, B, config=cfg, **tensors)

        def plain(A=A, B=B):
            return gemm(A, B, out=out, config=cfg)

        fused()  # compile / load before any timing
        calls[name] = {"plain": plain, "fused": fused}
    torch.cuda.synchronize()
    rows = []
    for r in range(args.rounds):
        for name in names:
            for variant in ("plain", "fused"):
                got = common.sampled(calls[name][variant], args.seconds, args.batch)
                row = {
                    "epilogue": name, "M": m, "N": n, "K": k, "round": r, "variant": variant,
                    "ms": got["ms"], "watts": got["watts"], "sm_mhz": got["sm_mhz"],
                    "mj": got["joules"] * 1e3, "kcycles": got["ms"] * got["sm_mhz"],
                }  # fmt: skip
                rows.append(row)
                print(
                    f"round {r} {name:15s} {variant:5s} {row['ms'] * 1e3:8.1f} us "
                    f"{row['watts']:6.0f} W {row['sm_mhz']:6.0f} MHz {row['kcycles']:8.1f} kcyc",
                    flush=True,
                )
    summary = []
    for name in names:
        per = {
            v: [x for x in rows if x["epilogue"] == name and x["variant"] == v]
            for v in ("plain", "fused")
        }

        def ratio(key, per=per):
            return statistics.median(
                f[key] / p[key] for f, p in zip(per["fused"], per["plain"], strict=True)
            )

        def med(variant, key, per=per):
            return statistics.median(x[key] for x in per[variant])

        summary.append(
            {
                "epilogue": name,
                "time_ratio": ratio("ms"),
                "cycle_ratio": ratio("kcycles"),
                "energy_ratio": ratio("mj"),
                "fused_watts": med("fused", "watts"),
                "plain_watts": med("plain", "watts"),
                "fused_mhz": med("fused", "sm_mhz"),
                "plain_mhz": med("plain", "sm_mhz"),
            }
        )
    config = f"{cfg.tile_m}x{cfg.tile_n} cluster {cfg.cluster_m}x{cfg.cluster_n}"
    common.write_json(
        args.out,
        {
            **common.environment(),
            "seconds": args.seconds,
            "batch": args.batch,
            "rounds": args.rounds,
            "config": config,
            "rows": rows,
            "summary": summary,
        },
    )
    common.print_table(
        summary,
        ["epilogue", "time_ratio", "cycle_ratio", "energy_ratio", "fused_mhz", "plain_mhz",
         "fused_watts", "plain_watts"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
