"""Probe: results finalized in the GEMM kernel vs by the finalize kernel, at many tiles per SM.

    python benchmarks/probes/finalize_in_gemm.py OUT [--compile i/n]

Sits in benchmarks/probes/ (one-off experiments behind a committed result; run from the
repository root on a Hopper GPU). ``coda.runtime.finalize.IN_GEMM_MAX_TILES_PER_SM``
decides where an epilogue's reductions are finalized; this probe sets it per call (2,
the engine's value, or unbounded) so that the same process times both plans beside
coda's plain GEMM in the same config: lse_target, rmsnorm_fwd, silu_max and swiglu_bwd
at M = 16384, N = K = 2048 and 4096, 6 interleaved rotated rounds of 20 calls, rows
``{epilogue, M, N, K, layout, kernel_ratio, in_gemm_ratio, plain_ms, max_abs_diff}``
(the two plans' results compared). ``--compile i/n`` compiles the i-th of n shares of
the cases (run n of them at once to fill the kernel cache first).
Result: ``benchmarks/results/finalize_in_gemm_probe_h200.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402
import torch  # noqa: E402

from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.runtime import finalize  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.layouts import operands  # noqa: E402

UNBOUNDED = 10**9
CASES = [
    (name, size)
    for size in (2048, 4096)
    for name in ("lse_target", "rmsnorm_fwd", "silu_max", "swiglu_bwd")
]


def fused(epi, A, B, cfg, tensors, limit: int):
    """``epi``'s call with ``IN_GEMM_MAX_TILES_PER_SM`` = ``limit`` (part of the plan key)."""

    def call():
        finalize.IN_GEMM_MAX_TILES_PER_SM = limit
        return epi(A, B, config=cfg, **tensors)

    return call


def case(name: str, size: int, compile_only: bool) -> dict | None:
    m, n, k = 16384, size, size
    epi = EPILOGUES[name]
    A, B, tensors = common.cuda_inputs(epi, m, n, k)
    A, B = operands(A, B, "fwd")
    cfg = choose_epilogue_config(m, n, k)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    kernel, in_gemm = fused(epi, A, B, cfg, tensors, 2), fused(epi, A, B, cfg, tensors, UNBOUNDED)
    ref, got = kernel(), in_gemm()
    torch.cuda.synchronize()
    diff = {
        key: float((ref[key].float() - got[key].float()).abs().max())
        for key in ref
        if ref[key].is_floating_point()
    }
    if compile_only:
        print(name, size, diff, flush=True)
        return None
    plain = lambda: gemm(A, B, out=out, config=cfg)  # noqa: E731
    contenders = {"kernel": kernel, "in_gemm": in_gemm, "plain": plain}
    times = common.interleaved(contenders, rounds=6, reps=20, rotate=True)
    return dict(
        epilogue=name,
        M=m,
        N=n,
        K=k,
        layout="fwd",
        kernel_ratio=common.median_ratio(times["kernel"], times["plain"]),
        in_gemm_ratio=common.median_ratio(times["in_gemm"], times["plain"]),
        plain_ms=common.median(times["plain"]),
        max_abs_diff=diff,
    )


def main(argv: list[str]) -> None:
    out, part = argv[0], None
    if "--compile" in argv:
        i, n = argv[argv.index("--compile") + 1].split("/")
        part = (int(i), int(n))
    rows = []
    for index, (name, size) in enumerate(CASES):
        if part and index % part[1] != part[0]:
            continue
        row = case(name, size, part is not None)
        if row is not None:
            print(row, flush=True)
            rows.append(row)
    finalize.IN_GEMM_MAX_TILES_PER_SM = 2
    if part is None:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
