"""coda.demo: the README's first command, ``python -m coda demo``.

It composes the deferred RMSNorm forward of DESIGN.md section 5 as two GEMM epilogues and
checks what coda computes against a textbook formulation:

* GEMM1 (e.g. the attention out-projection) epilogue: x = acc + residual, store x (bf16);
  h = x * gamma, store h (bf16); TileReduce sumsq(x) per row -> per-tile partials;
  finalize rstd = rsqrt(sum / N + eps).
* GEMM2 (h @ W^T, e.g. the next up-projection) epilogue: z = rstd * acc, the normalized
  projection: z = rmsnorm(x) @ W^T because rstd is a per-row scalar.

Both epilogues run through ``Epilogue.reference`` (whole tensors) and ``coda.simulate`` (the
tile simulator: ragged tiles, subtiles, partials). Errors are normwise relative, against
float64 textbook math (x = A B^T + residual, F.rms_norm(x) * gamma, ...); an output passes
when its error is at most twice eager bf16 PyTorch's error plus a small atol (the rule of
DESIGN.md 6.3), and simulator and reference agree within the output dtype's tolerance.
Later issues add the fused kernel (compiled on CPU, run on the GPU) to the same report.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from coda.epilogue import Epilogue
from coda.geometry import Tiling, ceil_div
from coda.primitives import Elementwise, TileLoad, TileReduce, TileStore, VecLoad, ops
from coda.primitives import math as cm
from coda.simulator import simulate
from coda.specs import dtype_name
from coda.testing.tolerance import compare, rel_err, tolerance

__all__ = ["DemoReport", "gemm1_epilogue", "gemm2_epilogue", "run_demo"]

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def gemm1_epilogue(eps: float) -> Epilogue:
    """x = acc + residual; store x, h = x * gamma; rstd = rsqrt(sum(x^2)/N + eps)."""

    def rstd(total: torch.Tensor, n: int) -> torch.Tensor:
        return cm.rsqrt(total / n + eps)

    return Epilogue().add(
        TileLoad("residual", BF16),
        Elementwise("x", ops.add, ins=("acc", "residual")),
        TileStore("x", BF16),
        VecLoad("gamma", per="col", dtype=BF16),
        Elementwise("h", ops.mul, ins=("x", "gamma")),
        TileStore("h", BF16),
        TileReduce("rstd", of="x", op="sumsq", per="row", post=rstd),
    )


def gemm2_epilogue() -> Epilogue:
    """z = rstd * acc (rows scaled by the finalized rstd of GEMM1)."""
    return Epilogue().add(
        VecLoad("rstd", per="row", dtype=F32),
        Elementwise("z", ops.scale, ins=("acc", "rstd")),
        TileStore("z", F32),
    )


@attrs.frozen
class DemoReport:
    """What the demo printed and whether every check passed."""

    lines: tuple[str, ...]
    passed: bool


def _row(name: str, cells: list[str], widths: list[int]) -> str:
    return (
        "    "
        + name.ljust(widths[0])
        + "".join(c.rjust(w) for c, w in zip(cells, widths[1:], strict=True))
    )


def run_demo(
    M: int = 300,
    N: int = 520,
    K: int = 256,
    N2: int = 384,
    tile: tuple[int, int] = (128, 128),
    subtile: tuple[int, int] = (64, 32),
    seed: int = 0,
    eps: float = 1e-6,
    emit: Callable[[str], None] = print,
) -> DemoReport:
    """Run the demo (see the module doc); ``emit`` receives each printed line."""
    lines: list[str] = []

    def say(line: str = "") -> None:
        lines.append(line)
        emit(line)

    g = torch.Generator().manual_seed(seed)
    A = (torch.randn(M, K, generator=g) * K**-0.5).to(BF16)
    B = torch.randn(N, K, generator=g).to(BF16)  # the out-projection weight (N, K)
    residual = torch.randn(M, N, generator=g).to(BF16)
    gamma = (1.0 + 0.1 * torch.randn(N, generator=g)).to(BF16)
    W = (torch.randn(N2, N, generator=g) * N**-0.5).to(BF16)  # the next weight (N2, N)
    tiling = Tiling(tile, subtile)
    epi1, epi2 = gemm1_epilogue(eps), gemm2_epilogue()

    say("coda demo: RMSNorm forward, deferred (docs/fusions.md), on CPU")
    say(
        f"  GEMM1: acc = A @ B^T, A {tuple(A.shape)} bf16, B {tuple(B.shape)} bf16 "
        f"-> acc {(M, N)} fp32, then:"
    )
    for i, p in enumerate(epi1):
        say(f"    [{i}] {p.label}")
    n_tm, n_tn = ceil_div(M, tile[0]), ceil_div(N, tile[1])
    sm, sn = tiling.subtile
    say(
        f"  tiling: {n_tm} x {n_tn} tiles of {tile[0]}x{tile[1]} (edge tiles ragged: last "
        f"{M - (n_tm - 1) * tile[0]} rows, last {N - (n_tn - 1) * tile[1]} columns), each "
        f"visited in {(tile[0] // sm) * (tile[1] // sn)} subtiles of {sm}x{sn}, row-major"
    )

    tensors1 = {"residual": residual, "gamma": gamma}
    ref1 = epi1.reference(A, B, tile=tile, **tensors1)
    sim1 = simulate(epi1, A, B, tile=tile, subtile=subtile, **tensors1)

    # GEMM2 consumes GEMM1's outputs: A2 = h (stored bf16), per-row rstd (finalized).
    say(f"  GEMM2: acc = h @ W^T, W {tuple(W.shape)} bf16, then:")
    for i, p in enumerate(epi2):
        say(f"    [{i}] {p.label}")
    ref2 = epi2.reference(ref1["h"], W, rstd=ref1["rstd"])
    sim2 = simulate(epi2, sim1["h"], W, tile=tile, subtile=subtile, rstd=sim1["rstd"])

    # Textbook, float64: no fusion, no deferral.
    x64 = A.to(F64) @ B.to(F64).T + residual.to(F64)
    g64 = gamma.to(F64)
    rstd64 = torch.rsqrt((x64 * x64).mean(1) + eps)
    truth = {
        "x": x64,
        "h": x64 * g64,
        "rstd": rstd64,
        "z": F.rms_norm(x64, (N,), g64, eps) @ W.to(F64).T,
    }
    # Eager bf16 PyTorch, the baseline of DESIGN.md 6.3.
    x_bf = A @ B.T + residual
    eager = {
        "x": x_bf,
        "h": x_bf * gamma,
        "rstd": torch.rsqrt(x_bf.float().pow(2).mean(1) + eps),
        "z": F.rms_norm(x_bf, (N,), gamma, eps) @ W.T,
    }
    sims = {**sim1, **sim2}
    refs = {**ref1, **ref2}

    meaning = {
        "x": "acc + residual, the new residual stream",
        "h": "x * gamma, the next GEMM's operand",
        "rstd": "rsqrt(sum(x^2)/N + eps), finalized from the partials",
        "rstd.partials": "per-tile sums of x^2, one column per tile",
        "z": "rstd * (h @ W^T) = rmsnorm(x) @ W^T (GEMM2)",
    }
    say("  outputs (simulator):")
    for name, t in sims.items():
        shape = str(tuple(t.shape))
        say(f"    {name:<14}{shape:<12}{dtype_name(t.dtype):<10}{meaning[name]}")

    widths = [15, 16, 16, 16, 16, 8]
    say("  agreement (normwise relative error; f64 = textbook math in float64):")
    say(_row("output", ["sim vs ref", "sim vs f64", "ref vs f64", "eager bf16", ""], widths))
    passed = True
    for name in ("x", "h", "rstd", "z"):
        s, r, t, e = sims[name], refs[name], truth[name], eager[name]
        same = compare(s, r, tol=tolerance(r.dtype), floor=0.0)
        c_sim = compare(s, t, baseline=e, atol=1e-4)
        c_ref = compare(r, t, baseline=e, atol=1e-4)
        ok = same.passed and c_sim.passed and c_ref.passed
        passed &= ok
        cells = [
            f"{same.err:.2e}",
            f"{c_sim.err:.2e}",
            f"{c_ref.err:.2e}",
            f"{rel_err(e, t):.2e}",
            "ok" if ok else "FAIL",
        ]
        say(_row(name, cells, widths))
    # partials: per-tile sums of x^2, simulator (subtile by subtile) vs reference (whole)
    tn = tile[1]
    p64 = torch.stack([(x64[:, j : j + tn] ** 2).sum(1) for j in range(0, N, tn)], dim=1)
    same = compare(sims["rstd.partials"], refs["rstd.partials"], tol=tolerance(F32))
    vs64 = compare(sims["rstd.partials"], p64, tol=tolerance(BF16))
    ok = same.passed and vs64.passed
    passed &= ok
    say(
        _row(
            "rstd.partials",
            [
                f"{same.err:.2e}",
                f"{vs64.err:.2e}",
                f"{rel_err(refs['rstd.partials'], p64):.2e}",
                "",
                "ok" if ok else "FAIL",
            ],
            widths,
        )
    )
    say(
        "  rule: sim == ref within the output dtype's tolerance, and err vs f64 <= 2 x eager "
        "bf16's + 1e-4"
    )
    say(
        "PASS: the tile simulator and the reference agree, and match textbook RMSNorm"
        if passed
        else "FAIL: see the rows marked FAIL above"
    )
    return DemoReport(tuple(lines), passed)
