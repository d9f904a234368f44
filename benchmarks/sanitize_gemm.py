"""Ragged-shape GEMMs in every operand layout, plain, accumulating and fused (RMSNorm
forward; column reductions; width-2 operands with a row reduction), for
compute-sanitizer (memcheck / racecheck) runs on the device.

compute-sanitizer --tool memcheck  python benchmarks/sanitize_gemm.py
compute-sanitizer --tool racecheck python benchmarks/sanitize_gemm.py
    [--sections few_buffers,split_wide,rolled,cooperative,plain,map] [--layout=NAME ...]

Sections, in this order (``--sections`` picks some; ``--layout=NAME``, repeatable, keeps
those operand layouts in every section but the map pass; ``benchmarks/sanitize_report.py``
runs sections and layouts as parallel processes):

* ``few_buffers``: the training ops' SwiGLU backward in its own plan (5 A/B stages with 2
  store and 2 load buffers for its three stored and two loaded streams:
  ``coda.mainloop.kernel.FEWEST_MAINLOOP_AB_STAGES``) and two catalogue epilogues with 1
  store and 1 load buffer, on a problem where each warpgroup runs several tiles (every
  ring wraps within a tile and across tiles);
* ``split_wide``: split-K (2-way writing an fp32 output, 3-way accumulating into one, the
  last split partly past K), four catalogue epilogues on 128 x 192 tiles and the
  column-reducing one on 128 x 128 tiles at the few-buffer size (each CTA runs several
  column-reducing tiles);
* ``rolled``: four catalogue epilogues with ``GemmConfig.rolled_epilogue`` (each band's
  subtiles in a runtime loop), with the finalize in the GEMM kernel and in the finalize
  kernel (column-only finalizes spread over the SMs);
* ``cooperative``: three catalogue epilogues on cooperative 256-row tiles (loads
  alternating the two 128-row halves in one ring, row and column reductions, a half past
  the last row), CTAs running two tiles;
* ``plain``: the plain and accumulating GEMM and three fused epilogues, each with the
  finalize in the GEMM kernel (arrival counters: what this size gets) and forced into the
  finalize kernel, then 64-column epilogue subtiles (``GemmConfig.epi_n=64``);
* ``map``: a map pass (no mainloop: the two warpgroups' epilogues run at once) over a
  ragged problem where every CTA runs several tiles.

The few-buffer and split-K / wide-tile outputs are NaN-poisoned and checked against the
float64 reference by the fuzzer's rule, with every reference computed on the CPU so that
racecheck sees coda's kernels alone; the others check finiteness and the plain GEMM's
error. Older flags: ``--few-buffers-only`` (few_buffers), ``--split-wide-only``
(few_buffers, split_wide), ``--rolled-only`` (up to rolled), ``--cooperative-only`` (up to
cooperative).
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

SECTIONS = ("few_buffers", "split_wide", "rolled", "cooperative", "plain", "map")
#: the flags of the script before ``--sections``, and the sections each ran
ONLY_FLAGS = {
    "--few-buffers-only": SECTIONS[:1],
    "--split-wide-only": SECTIONS[:2],
    "--rolled-only": SECTIONS[:3],
    "--cooperative-only": SECTIONS[:4],
}
IN_GEMM = finalize.IN_GEMM_MAX_TILES_PER_SM
m, n, k = 333, 520, 200  # ragged in M, N and K; several tiles and both warpgroups busy
mf, nf = 8000, 1096  # 63 x 9 tiles of 128 x 128 (both ragged): about 2 per warpgroup on 132 SMs
COOPERATIVE = GemmConfig(tile_m=256, tile_n=128)
ONE_BUFFER = GemmConfig(tile_n=128, epi_stages=1, load_stages=1)
ROLLED = GemmConfig(tile_n=128, cluster_m=2, rolled_epilogue=True)
WIDE_TILE = GemmConfig(tile_n=192, cluster_m=2)
PINGPONG = GemmConfig(tile_n=128, cluster_m=2)


def parse_args(argv: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(sections to run in order, layouts) from the command line."""
    sections: tuple[str, ...] = SECTIONS
    for flag, chosen in ONLY_FLAGS.items():
        if flag in argv:
            sections = chosen
    for arg in argv:
        if arg.startswith("--sections="):
            sections = tuple(arg.split("=", 1)[1].split(","))
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}: one of {SECTIONS}")
    layouts = [a.split("=", 1)[1] for a in argv if a.startswith("--layout=")]
    return tuple(s for s in SECTIONS if s in sections), layouts or list(LAYOUTS)


def _cuda(tensors: dict) -> dict:
    return {key: v.cuda() for key, v in tensors.items()}


def _finite(got: dict) -> None:
    assert all(torch.isfinite(t).all() for t in got.values() if t.is_floating_point())


def _matches_float64(epi, mnk, layout, config, seed) -> None:
    A, B, more = make_inputs(epi, *mnk, torch.bfloat16, seed=seed)
    a, b = operands(A.cuda(), B.cuda(), layout)
    record = check_example(epi, a, b, _cuda(more), config, reference_device="cpu")
    assert not record["failed"], (layout, config, record)


def _operands(rows: int, cols: int, depth: int):
    """bf16 (rows, depth) and (cols, depth) operands and their product in float64,
    computed on the CPU (no cuBLAS kernel under racecheck)."""
    a = torch.randn(rows, depth).to(torch.bfloat16)
    b = torch.randn(cols, depth).to(torch.bfloat16)
    return a.cuda(), b.cuda(), (a.double() @ b.double().t()).cuda()


def few_buffers(layout: str) -> None:
    runs = [(fusion_epilogues.swiglu_backward(torch.bfloat16), None)]
    runs += [(EPILOGUES[name], ONE_BUFFER) for name in ("rmsnorm_fwd", "swiglu_bwd")]
    for epi, config in runs:
        _matches_float64(epi, (mf, nf, k), layout, config, seed=5)
    torch.cuda.synchronize()
    print(f"sanitize_gemm {layout} {mf}x{nf}x{k}: few-buffer epilogues match float64")


def split_wide(layout: str) -> None:
    # split-K (units over K ranges adding into the output through TMA reduce-add: the
    # heuristic's pick for few-tile fp32 outputs) and fused epilogues on 128 x 192 tiles
    # (what fused calls take at K <= 2048 where the plain GEMM does:
    # coda.mainloop.config.WIDE_EPILOGUE_MAX_K), both ragged in M, N and K
    ks = 1000  # 16 k-tiles of 64 (the last ragged): 2- and 3-way splits keep several each
    a2, b2, ref2 = _operands(m, n, ks)
    a, b = operands(a2, b2, layout)
    split = gemm(a, b, out_dtype=torch.float32, config=GemmConfig(tile_n=128, split_k=2))
    summed = torch.ones(m, n, device="cuda")
    gemm(a, b, out=summed, accumulate=True, config=GemmConfig(tile_n=128, split_k=3))
    torch.cuda.synchronize()
    err_split = (split.double() - ref2).abs().max().item()
    err_summed = (summed.double() - 1 - ref2).abs().max().item()
    assert err_split < 0.05 and err_summed < 0.05, (layout, err_split, err_summed)
    # (and a column reduction on 128 x 128 tiles, several a CTA: its per-warp scratch
    # slots reused tile after tile by both warpgroups)
    wide = [(name, WIDE_TILE) for name in ("rmsnorm_fwd", "swiglu_bwd", "lse_target")]
    for name, config in [*wide, ("dgamma_colsum", WIDE_TILE), ("dgamma_colsum", PINGPONG)]:
        _matches_float64(EPILOGUES[name], (mf, nf, k), layout, config, seed=6)
    torch.cuda.synchronize()
    print(
        f"sanitize_gemm {layout} split-K {m}x{n}x{ks}: max abs err {err_split:.4f}, "
        f"accumulate {err_summed:.4f}; 128 x 192 fused epilogues and 128 x 128 column "
        f"sums match float64"
    )


def rolled(layout: str) -> None:
    a0, b0, _ = _operands(m, n, k)
    a, b = operands(a0, b0, layout)
    for tiles_per_sm in (IN_GEMM, 0):  # the finalize in the GEMM kernel, then in its own
        finalize.IN_GEMM_MAX_TILES_PER_SM = tiles_per_sm
        for name in ("rmsnorm_fwd", "dgamma_colsum", "swiglu_bwd", "lse_target"):
            other = EPILOGUES[name]
            _, _, more = make_inputs(other, m, n, k, torch.bfloat16, seed=4)
            _finite(other(a, b, config=ROLLED, **_cuda(more)))
    finalize.IN_GEMM_MAX_TILES_PER_SM = IN_GEMM
    torch.cuda.synchronize()
    print(f"sanitize_gemm {layout} {m}x{n}x{k}: rolled epilogues ran")


def cooperative(layout: str) -> None:
    mc, nc = 1000, 8200  # 2 clusters of 256-row tiles x 65 columns: CTAs run two tiles
    a1, b1, _ = _operands(mc, nc, k)
    a, b = operands(a1, b1, layout)
    for name in ("rmsnorm_fwd", "dgamma_colsum", "swiglu_bwd"):
        other = EPILOGUES[name]
        _, _, more = make_inputs(other, mc, nc, k, torch.bfloat16, seed=3)
        _finite(other(a, b, config=COOPERATIVE, **_cuda(more)))
    torch.cuda.synchronize()
    print(f"sanitize_gemm {layout} {mc}x{nc}x{k}: cooperative epilogues ran")


def plain(layout: str) -> None:
    a0, b0, ref = _operands(m, n, k)
    a, b = operands(a0, b0, layout)
    out = gemm(a, b)
    acc = torch.ones(m, n, device="cuda")
    gemm(a, b, out=acc, accumulate=True)
    epi = EPILOGUES["rmsnorm_fwd"]
    _, _, tensors = make_inputs(epi, m, n, k, torch.bfloat16, seed=1)
    tensors = _cuda(tensors)
    for tiles_per_sm in (IN_GEMM, 0):  # the finalize in the GEMM kernel, then in its own
        finalize.IN_GEMM_MAX_TILES_PER_SM = tiles_per_sm
        fused = epi(a, b, **tensors)
        # column reductions (the reduce-scatter across lanes, shared-memory slots) and
        # width-2 loads / stores with a row reduction
        for name in ("dgamma_colsum", "swiglu_bwd"):
            other = EPILOGUES[name]
            _, _, more = make_inputs(other, m, n, k, torch.bfloat16, seed=2)
            _finite(other(a, b, **_cuda(more)))
    finalize.IN_GEMM_MAX_TILES_PER_SM = IN_GEMM
    wide = GemmConfig(tile_n=128, epi_n=64)
    out64 = gemm(a, b, config=wide)
    assert (out64.double() - ref).abs().max().item() < 0.5
    _finite(EPILOGUES["swiglu_bwd"](a, b, config=wide, **_cuda(more)))
    torch.cuda.synchronize()
    err = (out.double() - ref).abs().max().item()
    err_acc = (acc.double() - 1 - ref).abs().max().item()
    print(f"sanitize_gemm {layout} {m}x{n}x{k}: max abs err {err:.4f}, accumulate {err_acc:.4f}")
    assert err < 0.5 and err_acc < 0.05
    assert torch.isfinite(fused["rstd"]).all()


def map_pass() -> None:
    mm, nn = 1000, 8200  # ~4 cluster tiles per cluster: both warpgroups run several epilogues
    x = torch.randn(mm, nn, device="cuda").to(torch.bfloat16)
    copy = Epilogue((TileLoad("x", torch.bfloat16), TileStore("x", torch.bfloat16, name="y")))
    y = run_map(copy, mm, nn, x, x=x)["y"]
    torch.cuda.synchronize()
    print(f"sanitize_gemm map pass {mm}x{nn}: exact copy {torch.equal(y, x)}")
    assert torch.equal(y, x)


def main(argv: list[str]) -> None:
    sections, layouts = parse_args(argv)
    by_layout = {
        "few_buffers": few_buffers,
        "split_wide": split_wide,
        "rolled": rolled,
        "cooperative": cooperative,
        "plain": plain,
    }
    for section in sections:
        if section == "map":
            map_pass()
            continue
        for layout in layouts:
            by_layout[section](layout)


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1:])
