"""How long a reducing epilogue's finalize kernel runs on after its GEMM.

    python benchmarks/finalize_tail.py [--epilogues lse_target,rmsnorm_fwd]
        [--shapes 16384x2048x2048,2048x128256x2048] [--tag new]
        [--out benchmarks/results/finalize_tail_h200.json]

Sits in benchmarks/ (run from the repository root); needs a Hopper GPU. For each
catalogue epilogue and (M, N, K), torch.profiler times 20 calls: the GEMM kernel, the
finalize kernel (a programmatic dependent launch: its duration includes its wait for the
GEMM grid) and the call's GPU span (the GEMM's start to the end of its finalize), per
call (``epilogue_anatomy._kernel_split``). ``tail_us`` = span - GEMM: what the finalize
adds to the call. Rows ``{"tag", "epilogue", "M", "N", "K", "gemm_us", "finalize_us",
"span_us", "tail_us"}``; ``--tag`` labels the rows (A/B runs of two code versions, each
run from its own checkout).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from epilogue_anatomy import _kernel_split  # noqa: E402

from coda.testing.catalog import EPILOGUES  # noqa: E402

SHAPES = "16384x2048x2048,16384x4096x4096,2048x128256x2048,8192x128256x4096"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epilogues", default="lse_target")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--tag", default="")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/finalize_tail_h200.json")
    args = p.parse_args(argv)
    rows = []
    for name in args.epilogues.split(","):
        epi = EPILOGUES[name]
        for shape in args.shapes.split(","):
            m, n, k = (int(x) for x in shape.split("x"))
            A, B, tensors = common.cuda_inputs(epi, m, n, k)
            call = functools.partial(epi, A, B, **tensors)
            gemm, fin, span = _kernel_split(call, reps=args.reps)
            row = {"tag": args.tag, "epilogue": name, "M": m, "N": n, "K": k}
            row |= {"gemm_us": gemm, "finalize_us": fin, "span_us": span, "tail_us": span - gemm}
            rows.append(row)
            print(row, flush=True)
    common.write_json(args.out, {**common.environment(), "rows": rows})
    common.print_table(
        rows, ["tag", "epilogue", "M", "N", "K", "gemm_us", "finalize_us", "span_us", "tail_us"]
    )


if __name__ == "__main__":
    main()
