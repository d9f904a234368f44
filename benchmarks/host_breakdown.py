"""Where a fused call's host time goes: each step of the call path timed on its own.

    python benchmarks/host_breakdown.py [--shape 512] [--calls 2000] [--out FILE]

For the RMSNorm-forward, SwiGLU-forward and LSE+target catalogue epilogues (cached
kernels, GPU kept busy by a sleep kernel so only the host is timed, as in
``launch_overhead.py``): the whole ``epi(A, B, **tensors)`` call, ``epilogue_kernels.run``
alone, the plan's own call (allocations + launches, no look-ups or checks), and the
pieces of
``coda.runtime.epilogue_kernels.run``: the problem look-up, the plan look-up, the fast
checks, the cached sizes, the output allocations, the GEMM launch and the finalize
launch, each in a loop of its own. Writes JSON rows ``{"name", "shape", "step", "us"}``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from launch_overhead import host_us  # noqa: E402

from coda.runtime import epilogue_kernels as ek  # noqa: E402
from coda.runtime.operands import cached_problem  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.strategies import make_inputs  # noqa: E402

NAMES = ("rmsnorm_fwd", "swiglu_fwd", "lse_target")


def steps(name: str, size: int) -> dict:
    """Name -> zero-argument callable for each step of one call of ``name``."""
    epi = EPILOGUES[name]
    A, B, t = make_inputs(epi, size, size, size, torch.bfloat16, seed=0)
    A, B = A.cuda(), B.cuda()
    t = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    epi(A, B, **t)  # compile / load, build the plan
    m, n, k, am, bm = cached_problem(A, B)
    plan = ek._plan(epi, A, B, (am, bm), None, m, n, k)
    out = plan(A, B, t, None)
    outs, (floats, views), extent = plan.sizes(m, n)
    stores = tuple(out[s] for s in plan.store_names)
    loads = tuple(t[s] for s in plan.load_names)
    extras = tuple(
        (float(t[s]) if scalar else (out[s] if is_out else t[s]))
        for s, is_out, scalar in plan.extras
    )

    def allocate():
        for _, shape, dtype, _ in outs:
            torch.empty(shape, dtype=dtype, device="cuda")
        if floats:
            torch.empty(floats, dtype=torch.float32, device="cuda")

    fns = {
        "call": lambda: epi(A, B, **t),
        # the same call without Epilogue.__call__, then without the look-ups and checks
        "run": lambda: ek.run(epi, A, B, t),
        "plan_call": lambda: plan(A, B, t, None),
        "sizes": lambda: plan.sizes(m, n),
        "problem": lambda: cached_problem(A, B),
        "plan": lambda: ek._plan(epi, A, B, (am, bm), None, m, n, k),
        "checks": lambda: plan.fast_checks_pass(A, B, t, m, n),
        "allocate": allocate,
        "gemm_launch": lambda: plan.kernel(A, B, stores, loads, extras),
    }
    if plan.finalizer is not None:
        fns["finalize_launch"] = lambda: plan.finalizer(out, m, n, extent, {})
    fns["empty_one"] = lambda: torch.empty(16, device="cuda")
    return fns


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, default=512)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/host_breakdown_h200.json")
    args = p.parse_args(argv)
    rows = []
    for name in NAMES:
        fns = steps(name, args.shape)
        for step, fn in fns.items():
            for _ in range(20):
                fn()
            us = common.median([host_us(fn, args.calls) for _ in range(args.rounds)])
            rows.append({"name": name, "shape": [args.shape] * 3, "step": step, "us": us})
            print(f"{name:12s} {step:16s} {us:8.2f} us", flush=True)
    common.write_json(args.out, {**common.environment(), "rows": rows})


if __name__ == "__main__":
    main()
