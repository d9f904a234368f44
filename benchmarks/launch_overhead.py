"""Host time per call: coda's GEMM and fused epilogues vs the same work in eager PyTorch.

    python benchmarks/launch_overhead.py [--out benchmarks/results/launch_overhead_h200.json]

What a training step built on coda pays on the CPU for each kernel call, once the kernel
is compiled and cached: checks, the cached launch plan, output allocation, the launch
itself and any finalize launch. Each contender runs ``--calls`` times back to back behind
a GPU sleep kernel (``torch.cuda._sleep``) long enough that the GPU is still busy when
the host has issued every call: the wall time of the loop (before the closing
synchronize) over the number of calls is then the host's cost per call, whatever the
GPU time of the work (512^3 and 2048^3 alike). Eager PyTorch does the same work with its
usual ops (``torch.mm`` and elementwise/reduction kernels).
Contenders alternate over ``--rounds`` rounds; the median is reported. Rows:
``{"kind": "gemm"|"epilogue", "name", "shape", "coda_us", "eager_us"}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.matmul import gemm  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402

SHAPES = [(512, 512, 512), (2048, 2048, 2048)]


#: GPU cycles of the sleep issued before each timed loop (~0.1 s at H200 clocks)
SLEEP_CYCLES = 200_000_000


def _loop_us(fn, calls: int, busy: bool) -> float:
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_us(fn, calls: int) -> float:
    """Host microseconds per call of ``calls`` back-to-back calls: the loop's wall time
    while the GPU is kept busy (the host never waits for it), or, if that is larger (the
    contender synchronized or blocked on the busy GPU somewhere), the loop's wall time
    with an idle GPU, which bounds the host's cost from above."""
    return min(_loop_us(fn, calls, busy=True), _loop_us(fn, calls, busy=False))


def eager_version(name: str, A, B, tensors):
    """The same work as the catalogue epilogue ``name`` in plain eager PyTorch."""
    if name == "rmsnorm_fwd":
        r, g = tensors["residual"], tensors["gamma"]

        def run():
            x = torch.addmm(r, A, B.t())
            h = x * g
            rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
            return x, h, rstd

    elif name == "swiglu_fwd":

        def run():
            y = A @ B.t()
            return F.silu(y[:, 0::2]) * y[:, 1::2]

    elif name == "lse_target":
        target = tensors["target"]

        def run():
            logits = (A @ B.t()).float()
            return torch.logsumexp(logits, -1), logits.gather(1, target[:, None].clamp(min=0))

    else:
        raise KeyError(name)
    return run


def measure(kind: str, name: str, shape, calls: int, rounds: int) -> dict:
    m, n, k = shape
    if kind == "gemm":
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        bt = b.t()
        contenders = {
            "coda": lambda: gemm(a, b, out=out),
            "eager": lambda: torch.mm(a, bt, out=out),
        }
    else:
        epi = EPILOGUES[name]
        A, B, tensors = common.cuda_inputs(epi, m, n, k)
        contenders = {
            "coda": lambda: epi(A, B, **tensors),
            "eager": eager_version(name, A, B, tensors),
        }
    for fn in contenders.values():  # compile, load, warm up
        for _ in range(5):
            fn()
    times = {c: [] for c in contenders}
    for _ in range(rounds):
        for c, fn in contenders.items():
            times[c].append(host_us(fn, calls))
    return {
        "kind": kind,
        "name": name,
        "shape": list(shape),
        "coda_us": common.median(times["coda"]),
        "eager_us": common.median(times["eager"]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/launch_overhead_h200.json")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    rows = []
    for shape in SHAPES:
        rows.append(measure("gemm", "gemm", shape, args.calls, args.rounds))
        for name in ("rmsnorm_fwd", "swiglu_fwd", "lse_target"):
            rows.append(measure("epilogue", name, shape, args.calls, args.rounds))
    common.write_json(
        args.out,
        {**common.environment(), "calls": args.calls, "rounds": args.rounds, "rows": rows},
    )
    common.print_table(
        [dict(r, shape="x".join(map(str, r["shape"]))) for r in rows],
        ["kind", "name", "shape", "coda_us", "eager_us"],
    )


if __name__ == "__main__":
    main()
