"""One coda GEMM and one cuBLAS GEMM of the same problem between cudaProfilerStart/Stop,
for Nsight Compute's counters (what each kernel moves and issues, side by side).

    ncu --clock-control none --profile-from-start off --csv \\
        --metrics dram__bytes_read.sum,lts__t_bytes.sum,smsp__inst_executed.sum \\
        python3 benchmarks/gemm_counters.py fwd:8192x4096x14336 [more shapes ...]

Each shape is ``layout:MxNxK`` (``fwd``, ``dgrad``, ``wgrad``: the operand views of
``coda.testing.layouts.operands``, cuBLAS on the same views as ``gemm.py``); coda runs
its heuristic config unless ``--config`` names one (a ``gemm_configs.py`` label). Three
warm-up calls of each (compile, load) run before the profiled pair.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import layout_operands  # noqa: E402
from gemm_configs import parse_config  # noqa: E402

from coda.matmul import gemm  # noqa: E402


def pair(layout: str, m: int, n: int, k: int, config) -> tuple:
    """(coda call, cuBLAS call) of one problem, on the same operand views and output."""
    a, b = layout_operands(layout, m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bt = b.t()
    kwargs = {"config": config} if config is not None else {}
    return (lambda: gemm(a, b, out=out, **kwargs)), (lambda: torch.mm(a, bt, out=out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+", help="layout:MxNxK")
    p.add_argument("--config", default="", help="a config label, e.g. 256x128_c2x1_g8")
    args = p.parse_args(argv)
    config = parse_config(args.config) if args.config else None
    calls = []
    for item in args.shapes:
        layout, shape = item.split(":")
        m, n, k = (int(v) for v in shape.split("x"))
        calls += pair(layout, m, n, k, config)
    for fn in calls:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
