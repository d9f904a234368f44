"""Probe: how much of the finalize kernel's tail after its GEMM is the launch, how much its work.

    for v in base empty t256 t512; do   # each variant in its own process and kernel cache
      CODA_CACHE_DIR=/tmp/kc_$v python3 benchmarks/probes/finalize_floor.py $v fin_$v.json
    done

Sits in benchmarks/probes/ (one-off experiments behind a committed result; run from the
repository root on a Hopper GPU). It patches coda's finalize kernel before anything
compiles, so give every variant a kernel cache of its own (the disk cache's key does not
see the patch): ``empty`` replaces the kernel's body with ``griddepcontrol.wait`` alone
(wrong results: timing only), ``tNNN`` launches NNN-thread CTAs, ``base`` is the engine.
For lse_target, dgamma_colsum and rmsnorm_fwd at M = 16384, N = K = 2048 and 4096 it
prints and writes rows ``{variant, epilogue, shape, gemm_us, finalize_us, span_us,
tail_us, tails}`` (torch.profiler, ``epilogue_anatomy._kernel_split``: the median of
three runs of 20 calls). ``--compile`` only compiles (to fill the variant's cache first).
Result: ``benchmarks/results/finalize_floor_probe_h200.json``.
"""

import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from epilogue_anatomy import _kernel_split  # noqa: E402

import coda.runtime.finalize_kernel as fk  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402

EPILOGUE_NAMES = ("lse_target", "dgamma_colsum", "rmsnorm_fwd")
SHAPES = ("16384x2048x2048", "16384x4096x4096")


@cute.kernel
def _wait_only(self, tensors, counters, m, n, arrivals):
    cute.arch.griddepcontrol_wait()


def patch(variant: str) -> None:
    """Apply ``variant`` to the finalize kernel (before anything compiles)."""
    if variant == "empty":
        fk.FinalizeKernel.kernel = _wait_only
    elif variant.startswith("t"):
        fk.THREADS = int(variant[1:])


def measure(call) -> tuple:
    """(gemm_us, finalize_us, span_us, tail_us, tails): the median of three profiles."""
    runs = []
    for _ in range(3):
        g, f, s = _kernel_split(call, reps=20)
        runs.append((g, f, s, s - g))
    runs.sort(key=lambda r: r[3])
    return (*runs[1], [r[3] for r in runs])


def main(argv: list[str]) -> None:
    variant, out = argv[0], argv[1]
    compile_only = "--compile" in argv
    patch(variant)
    rows = []
    for name in EPILOGUE_NAMES:
        epi = EPILOGUES[name]
        for shape in SHAPES:
            m, n, k = (int(x) for x in shape.split("x"))
            A, B, tensors = common.cuda_inputs(epi, m, n, k)
            call = functools.partial(epi, A, B, **tensors)
            call()
            torch.cuda.synchronize()
            if compile_only:
                continue
            gemm_us, fin_us, span_us, tail_us, tails = measure(call)
            row = dict(variant=variant, epilogue=name, shape=shape, gemm_us=gemm_us)
            row |= dict(finalize_us=fin_us, span_us=span_us, tail_us=tail_us, tails=tails)
            print(row, flush=True)
            rows.append(row)
    if not compile_only:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
