"""Where a fused call's host time goes: each step of the call path timed on its own.

    python benchmarks/host_breakdown.py [--shape 512] [--calls 200] [--out FILE]

For the RMSNorm-forward, SwiGLU-forward and LSE+target catalogue epilogues (cached
kernels, GPU kept busy by a sleep kernel so only the host is timed, as in
``launch_overhead.py``): the whole ``epi(A, B, **tensors)`` call, ``epilogue_kernels.run``
alone, the plan's hot path (``EpiloguePlan.launch``: allocations + launches, no
look-ups), the bound call alone (``bound``: the generated code a repeated call runs,
:mod:`coda.runtime.bound_call`) beside the plan's generic code doing the same work
(``generic``), and its pieces: the call signature and its look-up, the cached sizes, the
output allocations, the stream scratch, the GEMM launch and the finalize launch (when
the plan has one), each in a loop of its own. Writes JSON rows ``{"name", "shape", "step", "us"}``.
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
from coda.testing.catalog import EPILOGUES  # noqa: E402

NAMES = ("rmsnorm_fwd", "swiglu_fwd", "lse_target")


def steps(name: str, size: int) -> dict:
    """Name -> zero-argument callable for each step of one call of ``name``."""
    epi = EPILOGUES[name]
    A, B, t = common.cuda_inputs(epi, size, size, size)
    epi(A, B, **t)  # compile / load, build the plan and the call signature's entry
    sig = ek._signature(epi, None, A, B, t)
    m, n = A.shape[0], B.shape[0]
    plan = next(p for key, p in ek._plans.items() if key[0] is epi)
    bound = ek._calls[sig]
    outs, work, extent, slots = plan.sizes(m, n)
    device = plan.device
    out = {name: torch.empty(*shape, dtype=dtype, device=device) for name, shape, dtype, _ in outs}
    counters = None
    if work[0] or slots:
        partials, counters = ek._scratch(device).get(plan, m, n, work, slots)
        out.update(partials)
    stores = tuple(out[s] for s in plan.store_names)
    loads = tuple(t[s] for s in plan.load_names)
    extras = [
        (float(t[s]) if scalar else (out[s] if is_out else t[s]))
        for s, is_out, scalar in plan.extras
    ]
    if counters is not None:
        extras.append(counters)
    extras = tuple(extras)

    def allocate():
        for _, shape, dtype, _ in outs:
            torch.empty(*shape, dtype=dtype, device=device)

    def generic():
        """The same call through the plan's generic code (the path of calls that pass
        ``outputs``, and every repeated call before the bound call): loops over names."""
        o = {nm: torch.empty(*shape, dtype=dtype, device=device) for nm, shape, dtype, _ in outs}
        c = None
        if work[0] or slots:
            partials, c = ek._scratch(device).get(plan, m, n, work, slots)
            o.update(partials)
        plan._launch(A, B, t, o, c, m, n, extent, {})
        return {nm: o[nm] for nm in plan.result_names}

    fns = {
        "call": lambda: epi(A, B, **t),
        # the same call without Epilogue.__call__, then without the signature look-up
        "run": lambda: ek.run(epi, A, B, t),
        "launch": lambda: plan.launch(A, B, t, m, n),
        # the bound call alone (what a repeated call runs after its look-up) beside the
        # generic code doing the same work
        "bound": lambda: bound(A, B, t),
        "generic": generic,
        "signature": lambda: ek._signature(epi, None, A, B, t),
        "lookup": lambda: ek._calls.get(sig),
        "sizes": lambda: plan.sizes(m, n),
        "allocate": allocate,
        "scratch": lambda: ek._scratch(device).get(plan, m, n, work, slots),
        "gemm_launch": lambda: plan.kernel(A, B, stores, loads, extras),
    }
    if plan.after and not plan.early:  # an early finalize waits for its GEMM's arrivals
        fns["finalize_launch"] = lambda: plan.finalizer(
            out, m, n, extent, {}, plan._no_counters, 0
        )
    # what the GEMM launch is made of: TVM-FFI's conversion of the same arguments (its
    # no-op test function), and a bare kernel launch through torch (a 1-cycle sleep)
    import tvm_ffi

    nop = tvm_ffi.get_global_func("testing.nop")
    fns["ffi_args"] = lambda: nop(A, B, stores, loads, extras)
    fns["bare_launch"] = lambda: torch.cuda._sleep(1)
    fns["empty_one"] = lambda: torch.empty(16, device=device)
    fns["empty_out"] = lambda: torch.empty(*outs[0][1], dtype=outs[0][2], device=device)
    return fns


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, default=512)
    # 200 as in launch_overhead.py (2026-11-26, one H200 host, 2000 calls per loop: whole
    # calls timed up to 1.4-2x the sum of their steps, e.g. RMSNorm forward 28.0 us
    # against 20.0 at 200 calls in the same run; thousands of launches queued behind the
    # sleep are suspected of filling the launch queue, so the loop waits for the GPU)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
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
