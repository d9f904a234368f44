"""Ragged-shape GEMMs in every operand layout, plain, accumulating and fused (RMSNorm
forward; column reductions; width-2 operands with a row reduction), for
compute-sanitizer (memcheck / racecheck) runs on the device.

compute-sanitizer --tool memcheck  python benchmarks/sanitize_gemm.py
compute-sanitizer --tool racecheck python benchmarks/sanitize_gemm.py

The fused epilogues run twice: with the finalize in the GEMM kernel (arrival counters;
what this size gets) and with it forced into the finalize kernel. Then 64-column epilogue
subtiles (``GemmConfig.epi_n=64``), plain and fused. Last, a map pass (one k-tile: the
two warpgroups' epilogues run at once) over a ragged problem where every CTA runs
several tiles. Cooperative 256-row tiles run three catalogue epilogues in every layout
(loads alternating the two 128-row halves in one ring, row and column reductions, a
half past the last row); ``--cooperative-only`` runs just those (a quicker racecheck).
Rolled epilogues (``GemmConfig.rolled_epilogue``: each band's subtiles in a runtime loop)
run four catalogue epilogues in every layout, with the finalize in the GEMM kernel and in
the finalize kernel (column-only finalizes spread over the SMs); ``--rolled-only`` runs
just those. Few epilogue buffers first: the training ops' SwiGLU backward in its own
plan (5 A/B stages with 2 store and 2 load buffers for its three stored and two loaded
streams: ``coda.mainloop.kernel.FEWEST_MAINLOOP_AB_STAGES``) and two catalogue epilogues
with 1 store and 1 load buffer, NaN-poisoned and checked against the float64 reference
by the fuzzer's rule, on a problem where each warpgroup runs several tiles (every ring
wraps within a tile and across tiles); ``--few-buffers-only`` runs just those, and
``--layout=NAME`` (repeatable) keeps those layouts.
"""

import sys

import torch

from coda import Epilogue
from coda.fusions import epilogues as fusion_epilogues
from coda.fusions._dispatch import run_map
from coda.mainloop.config import GemmConfig
from coda.matmul import gemm
from coda.primitives import TileLoad, TileStore
from coda.runtime import finalize
from coda.testing.catalog import EPILOGUES
from coda.testing.fuzz import check_example
from coda.testing.layouts import LAYOUTS, operands
from coda.testing.strategies import make_inputs

IN_GEMM = finalize.IN_GEMM_MAX_TILES_PER_SM
m, n, k = 333, 520, 200  # ragged in M, N and K; several tiles and both warpgroups busy
a0 = torch.randn(m, k, device="cuda").to(torch.bfloat16)
b0 = torch.randn(n, k, device="cuda").to(torch.bfloat16)
ref = a0.float() @ b0.float().t()
COOPERATIVE = GemmConfig(tile_m=256, tile_n=128)
ONE_BUFFER = GemmConfig(tile_n=128, epi_stages=1, load_stages=1)
mf, nf = 8000, 1096  # 63 x 9 tiles of 128 x 128 (both ragged): about 2 per warpgroup on 132 SMs
picked = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--layout=")]
for layout in picked or LAYOUTS:
    runs = [(fusion_epilogues.swiglu_backward(torch.bfloat16), None)]
    runs += [(EPILOGUES[name], ONE_BUFFER) for name in ("rmsnorm_fwd", "swiglu_bwd")]
    for epi, config in runs:
        A, B, more = make_inputs(epi, mf, nf, k, torch.bfloat16, seed=5)
        a, b = operands(A.cuda(), B.cuda(), layout)
        record = check_example(epi, a, b, {key: v.cuda() for key, v in more.items()}, config)
        assert not record["failed"], (layout, config, record)
    torch.cuda.synchronize()
    print(f"sanitize_gemm {layout} {mf}x{nf}x{k}: few-buffer epilogues match float64")
if "--few-buffers-only" in sys.argv:
    sys.exit(0)
ROLLED = GemmConfig(tile_n=128, cluster_m=2, rolled_epilogue=True)
for layout in LAYOUTS:
    a, b = operands(a0, b0, layout)
    for tiles_per_sm in (IN_GEMM, 0):  # the finalize in the GEMM kernel, then in its own
        finalize.IN_GEMM_MAX_TILES_PER_SM = tiles_per_sm
        for name in ("rmsnorm_fwd", "dgamma_colsum", "swiglu_bwd", "lse_target"):
            other = EPILOGUES[name]
            _, _, more = make_inputs(other, m, n, k, torch.bfloat16, seed=4)
            got = other(a, b, config=ROLLED, **{key: v.cuda() for key, v in more.items()})
            assert all(torch.isfinite(t).all() for t in got.values() if t.is_floating_point())
    finalize.IN_GEMM_MAX_TILES_PER_SM = IN_GEMM
    torch.cuda.synchronize()
    print(f"sanitize_gemm {layout} {m}x{n}x{k}: rolled epilogues ran")
if "--rolled-only" in sys.argv:
    sys.exit(0)
mc, nc = 1000, 8200  # 2 clusters of 256-row tiles x 65 columns: CTAs run two tiles
a1 = torch.randn(mc, k, device="cuda").to(torch.bfloat16)
b1 = torch.randn(nc, k, device="cuda").to(torch.bfloat16)
for layout in LAYOUTS:
    a, b = operands(a1, b1, layout)
    for name in ("rmsnorm_fwd", "dgamma_colsum", "swiglu_bwd"):
        other = EPILOGUES[name]
        _, _, more = make_inputs(other, mc, nc, k, torch.bfloat16, seed=3)
        got = other(a, b, config=COOPERATIVE, **{key: v.cuda() for key, v in more.items()})
        assert all(torch.isfinite(t).all() for t in got.values() if t.is_floating_point())
    torch.cuda.synchronize()
    print(f"sanitize_gemm {layout} {mc}x{nc}x{k}: cooperative epilogues ran")
for layout in [] if "--cooperative-only" in sys.argv else LAYOUTS:
    a, b = operands(a0, b0, layout)
    out = gemm(a, b)
    acc = torch.ones(m, n, device="cuda")
    gemm(a, b, out=acc, accumulate=True)
    epi = EPILOGUES["rmsnorm_fwd"]
    _, _, tensors = make_inputs(epi, m, n, k, torch.bfloat16, seed=1)
    tensors = {key: v.cuda() for key, v in tensors.items()}
    for tiles_per_sm in (IN_GEMM, 0):  # the finalize in the GEMM kernel, then in its own
        finalize.IN_GEMM_MAX_TILES_PER_SM = tiles_per_sm
        fused = epi(a, b, **tensors)
        # column reductions (the reduce-scatter across lanes, shared-memory slots) and
        # width-2 loads / stores with a row reduction
        for name in ("dgamma_colsum", "swiglu_bwd"):
            other = EPILOGUES[name]
            _, _, more = make_inputs(other, m, n, k, torch.bfloat16, seed=2)
            got = other(a, b, **{key: v.cuda() for key, v in more.items()})
            assert all(torch.isfinite(t).all() for t in got.values() if t.is_floating_point())
    finalize.IN_GEMM_MAX_TILES_PER_SM = IN_GEMM
    wide = GemmConfig(tile_n=128, epi_n=64)
    out64 = gemm(a, b, config=wide)
    assert (out64.float() - ref).abs().max().item() < 0.5
    got = EPILOGUES["swiglu_bwd"](a, b, config=wide, **{k_: v.cuda() for k_, v in more.items()})
    assert all(torch.isfinite(t).all() for t in got.values() if t.is_floating_point())
    torch.cuda.synchronize()
    err = (out.float() - ref).abs().max().item()
    err_acc = (acc - 1 - ref).abs().max().item()
    print(f"sanitize_gemm {layout} {m}x{n}x{k}: max abs err {err:.4f}, accumulate {err_acc:.4f}")
    assert err < 0.5 and err_acc < 0.05
    assert torch.isfinite(fused["rstd"]).all()

if "--cooperative-only" in sys.argv:
    sys.exit(0)
mm, nn = 1000, 8200  # ~4 cluster tiles per cluster: both warpgroups run several epilogues
x = torch.randn(mm, nn, device="cuda").to(torch.bfloat16)
copy = Epilogue((TileLoad("x", torch.bfloat16), TileStore("x", torch.bfloat16, name="y")))
y = run_map(copy, mm, nn, x, x=x)["y"]
torch.cuda.synchronize()
print(f"sanitize_gemm map pass {mm}x{nn}: exact copy {torch.equal(y, x)}")
assert torch.equal(y, x)
