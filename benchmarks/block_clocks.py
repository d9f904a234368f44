"""One decoder block's pass per contender: time, SM clock, board power, and the span the
profiler sees, to tell a slower clock from idle gaps.

    python benchmarks/block_clocks.py [--configs h4096-trunc] [--passes fwd+bwd]
        [--seconds 1.5] [--rounds 2] [--batch 5] [--out FILE]

The ``train_step.py`` block (one Hugging Face Llama decoder layer on ``--seq`` tokens,
its fused twin ``coda.nn.FusedLlamaDecoderLayer``, and the two GEMM + SDPA floors) with
the contenders ``coda``, ``compile``, ``cublas_floor``, ``coda_floor``. Each round runs
every contender back to back for ``--seconds`` (batches of ``--batch`` passes timed with
CUDA events) while a thread samples board power and SM clock
(``common.interleaved_sampled``: the rounds rotate the order). Then each
contender once under torch.profiler (``kernel_profile.profile``): the GPU span of a pass
and the sum of its kernels. A contender whose timed ms exceeds its profiled span by more
than the others' did spends that time at a lower clock or in gaps the profiler run did not
have. JSON rows ``{"H", "M", "pass", "contender", "ms", "sm_mhz", "watts", "joules",
"passes", "profiled_span_ms", "profiled_gpu_ms", "profiled_idle_ms"}`` (medians over
rounds of ms / MHz / W / J).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import kernel_profile  # noqa: E402
import train_step as ts  # noqa: E402

MEASURED = ("ms", "sm_mhz", "watts", "joules")
COLUMNS = ("contender", "pass", *MEASURED, "profiled_span_ms", "profiled_gpu_ms")


def bench(size: ts.LlamaSize, M: int, pass_: str, args: argparse.Namespace) -> list[dict]:
    blk = ts.Block(size, M)
    backward = pass_ == "fwd+bwd"
    fns = {}
    for key, build in blk.contenders().items():
        fn = build(backward)
        for _ in range(3):
            fn()
        fns[key] = fn
    torch.cuda.synchronize()
    runs = common.interleaved_sampled(fns, args.rounds, args.seconds, args.batch)
    rows = []
    for key, fn in fns.items():
        prof = kernel_profile.profile(fn, args.batch)
        rows.append(
            {
                "H": size.hidden,
                "M": M,
                "pass": pass_,
                "contender": key,
                **{f: common.median([x[f] for x in runs[key]]) for f in MEASURED},
                "passes": sum(x["passes"] for x in runs[key]),
                "profiled_span_ms": prof["span_ms"],
                "profiled_gpu_ms": prof["gpu_ms"],
                "profiled_idle_ms": prof["idle_ms"],
            }
        )
    del blk, fns
    torch._dynamo.reset()
    ts._free()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="h4096-trunc")
    p.add_argument("--passes", default="fwd+bwd")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/block_clocks_h200.json")
    args = p.parse_args(argv)
    sizes = ts.configs(2)
    rows = []
    for name in args.configs.split(","):
        for pass_ in args.passes.split(","):
            rows += bench(sizes[name], args.seq, pass_, args)
    env = ts.environment()
    payload = {**env, "command": "python3 " + " ".join(sys.argv), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    print(" ".join(f"{c:>16}" for c in COLUMNS))
    for r in rows:
        cells = (f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS)
        print(" ".join(f"{c:>16}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
