"""CPU CI for fused epilogues: the catalogue's representative epilogues and 30 hypothesis-
drawn compositions trace into the PingPong kernel, compile for sm_90a, and their SASS
shows HGMMA and no local-memory traffic (LDL/STL)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda.mainloop.config import GemmConfig
from coda.runtime import finalize, gemm_kernels
from coda.runtime.epilogue_kernels import epilogue_choice
from coda.runtime.fused import FusedVisitor, in_kernel_axes, unsupported
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts
from coda.testing.catalog import EPILOGUES
from coda.testing.strategies import epilogues

pytestmark = pytest.mark.compile
CONFIG = GemmConfig(tile_n=128, cluster_m=2)


#: (A major, B major) of the forward, dgrad and wgrad GEMMs of an nn.Linear
LAYOUTS = {"fwd": ("k", "k"), "dgrad": ("k", "n"), "wgrad": ("m", "n")}


def _compile(epi, tmp_path, layout=("k", "k")):
    key = gemm_kernels.GemmKernelKey(
        CONFIG, torch.bfloat16, FusedVisitor(epi), a_major=layout[0], b_major=layout[1]
    )
    return gemm_kernels.compile_artifacts(key, str(tmp_path))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_catalogue_epilogue_sass(name, layout, tmp_path):
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = EPILOGUES[name]
    assert unsupported(epi) is None
    _, cubin = _compile(epi, tmp_path, LAYOUTS[layout])
    ops = opcode_counts(disassemble(cubin))
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "spills"
    stores = sum(1 for p in epi.primitives if type(p).__name__ == "TileStore")
    assert (count_prefix(ops, "UTMASTG") > 0) == (stores > 0)


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_catalogue_epilogue_sass_with_concurrent_epilogues(name, tmp_path):
    """The config of one-k-tile problems (map passes: ``choose_epilogue_config`` at K <= 64)
    runs both warpgroups' epilogues at once on split store buffers and scratch: every
    catalogue epilogue fits shared memory there and compiles with no local memory."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = EPILOGUES[name]
    cfg = epilogue_choice(epi, torch.bfloat16, 8192, 8192, 8, num_sms=132)[0]
    assert cfg.concurrent_epilogues and cfg.epi_stages == 8, cfg
    key = gemm_kernels.GemmKernelKey(cfg, torch.bfloat16, FusedVisitor(epi))
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    sass = disassemble(cubin)
    ops = opcode_counts(sass)
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "spills"
    # no epilogue turns: warpgroup 0's first arrive on them (named barrier 5) is gone
    assert "BAR.ARV 0x5" not in sass


@pytest.mark.parametrize("layout", ["fwd", "wgrad"])
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_catalogue_epilogue_sass_on_cooperative_tiles(name, layout, tmp_path):
    """Cooperative 256 x 128 tiles run every catalogue epilogue (M x N loads, reductions,
    vectors and states included): each warpgroup runs it on its 128-row half at once
    with the other, on its own store buffers, load-ring half and scratch. It compiles
    with HGMMA, no local memory, and the epilogue loads' TMA where it loads."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = EPILOGUES[name]
    cfg = GemmConfig(tile_m=256, tile_n=128, cluster_m=2)
    major = LAYOUTS[layout]
    key = gemm_kernels.GemmKernelKey(
        cfg, torch.bfloat16, FusedVisitor(epi), a_major=major[0], b_major=major[1]
    )
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    ops = opcode_counts(disassemble(cubin))
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "spills"
    loads = FusedVisitor(epi).load_dtypes
    assert count_prefix(ops, "UTMALDG") >= 2 + (1 if loads else 0)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(epilogues(), st.sampled_from(sorted(LAYOUTS.values())))
def test_drawn_compositions_compile_for_sm90_without_spills(tmp_path_factory, epi, layout):
    """30 random compositions (all widths, pairs, row/col reductions, states) per run, in
    the config ``epi(A, B)`` would pick (``epilogue_choice``: 128 x 128 tiles, narrower if
    those spill, the finalize in the kernel where it fits): they compile, and the SASS
    runs the GEMM on HGMMA with no local memory."""
    assert unsupported(epi) is None, unsupported(epi)
    cfg, in_kernel = epilogue_choice(
        epi, torch.bfloat16, 8192, 8192, 8192, num_sms=132, majors=layout
    )
    key = gemm_kernels.GemmKernelKey(
        cfg, torch.bfloat16, FusedVisitor(epi, in_kernel), a_major=layout[0], b_major=layout[1]
    )
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path_factory.mktemp("k")))
    assert "wgmma.mma_async" in ptx and len(cubin) > 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = opcode_counts(disassemble(cubin))
    # an epilogue that never reads acc leaves the GEMM's result dead: ptxas drops it
    if any("acc" in p.reads for p in epi.primitives):
        assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "spills"


@pytest.mark.parametrize(
    "lanes", sorted({finalize.lanes(m, n) for m in (1, 10**6) for n in (1, 10**6)})
)
@pytest.mark.parametrize("name", [n for n in EPILOGUES if finalize.uses_kernel(EPILOGUES[n])])
def test_catalogue_finalize_kernel_compiles(name, lanes, tmp_path):
    """Every reducing catalogue epilogue finalizes its partials in ONE small kernel: it
    compiles for sm_90a with each (row, column) thread count ``finalize.lanes`` picks,
    reads the partials and writes the results, with no local memory (and the
    log-sum-exp's exp runs in it)."""
    epi = EPILOGUES[name]
    ptx, cubin = finalize.compile_artifacts(epi, str(tmp_path), lanes)
    assert "ld.global" in ptx and "st.global" in ptx and len(cubin) > 0
    if any(type(p).__name__ == "LogSumExp" for p in epi.primitives):
        assert "ex2.approx" in ptx
    if find_nvdisasm() is not None:
        ops = opcode_counts(disassemble(cubin))
        assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


@pytest.mark.parametrize("name", [n for n in EPILOGUES if finalize.uses_kernel(EPILOGUES[n])])
def test_catalogue_epilogue_finalizes_in_the_gemm_kernel(name, tmp_path):
    """With ``finalize_in_kernel`` every reducing catalogue epilogue compiles with its
    finalize inside the GEMM kernel: one GPU-scope atomic arrival per row (column) of
    tiles between acquire-release fences, the partials read back, no local memory."""
    epi = EPILOGUES[name]
    key = gemm_kernels.GemmKernelKey(CONFIG, torch.bfloat16, FusedVisitor(epi, True))
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    assert "atom.global.add.u32" in ptx and "fence.acq_rel.gpu" in ptx
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = opcode_counts(disassemble(cubin))
    assert count_prefix(ops, "HGMMA") > 0
    arrivals = sum(in_kernel_axes(epi))  # one per kind of result (rows, columns)
    assert count_prefix(ops, "ATOMG") == arrivals
    assert count_prefix(ops, "MEMBAR.ALL.GPU") == 2 * arrivals
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


@pytest.mark.parametrize("name", [n for n in EPILOGUES if finalize.uses_kernel(EPILOGUES[n])])
def test_in_kernel_finalize_compiles_with_concurrent_epilogues(name, tmp_path):
    """The map passes' config (both warpgroups' epilogues at once, a scratch each) with
    the finalize in the kernel: it fits, arrives once per kind of result, no spills."""
    epi = EPILOGUES[name]
    cfg = epilogue_choice(epi, torch.bfloat16, 1000, 776, 8, num_sms=132)[0]
    assert cfg.concurrent_epilogues
    key = gemm_kernels.GemmKernelKey(cfg, torch.bfloat16, FusedVisitor(epi, True))
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    assert ptx.count("atom.global.add.u32") == sum(in_kernel_axes(epi))
    if find_nvdisasm() is not None:
        ops = opcode_counts(disassemble(cubin))
        assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


@pytest.mark.parametrize("name", ["dgamma_colsum", "rmsnorm_fwd"])
def test_finalize_kernel_waits_for_the_gemm_grid(name, tmp_path):
    """The finalize kernel is a programmatic dependent launch: it waits for the GEMM grid
    (griddepcontrol.wait) before its first load; column results fold across
    ``COL_LANES`` threads (butterfly shuffles)."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ptx, cubin = finalize.compile_artifacts(EPILOGUES[name], str(tmp_path))
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    ops = opcode_counts(disassemble(cubin))
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0
    assert count_prefix(ops, "SHFL.BFLY") > 0


@pytest.mark.parametrize("name", ["lse_target", "rmsnorm_fwd"])
def test_early_finalize_waits_for_its_row_of_tiles(name, tmp_path, monkeypatch):
    """The early finalize (row results): one thread polls its row of tiles' counter with
    GPU-scope acquire loads before any partial is read, each CTA counts itself done (one
    atomic add), and the grid's last CTA still waits for the GEMM grid after its work;
    the GEMM kernel arrives once per tile (fence, then one atomic add)."""
    monkeypatch.setattr(finalize, "EARLY_ROWS", True)
    epi = EPILOGUES[name]
    cfg = epilogue_choice(epi, torch.bfloat16, 16384, 2048, 2048, num_sms=132)[0]
    assert finalize.early_rows(epi, cfg, in_kernel=False)
    (tmp_path / "fin").mkdir()
    (tmp_path / "gemm").mkdir()
    ptx, cubin = finalize.compile_artifacts(epi, str(tmp_path / "fin"), (16, 4), early=True)
    first_acquire = ptx.index("ld.acquire.gpu")
    loads = [i for i in range(len(ptx)) if ptx.startswith("ld.global", i)]
    assert loads and first_acquire < min(loads)
    assert ptx.count("atom.global.add") == 1
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.index("griddepcontrol.wait") > min(loads)
    key = gemm_kernels.GemmKernelKey(cfg, torch.bfloat16, FusedVisitor(epi, False, True))
    gptx, gcubin = gemm_kernels.compile_artifacts(key, str(tmp_path / "gemm"))
    assert gptx.count("atom.global.add") == 1 and gptx.count("fence.acq_rel.gpu") == 1
    if find_nvdisasm() is not None:
        for binary in (cubin, gcubin):
            ops = opcode_counts(disassemble(binary))
            assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


def test_finalize_kernel_extent_covers_rows_and_column_lanes():
    """A warp per row; COL_LANES threads per column in whole warps of 32 / COL_LANES
    columns (a ragged last warp included)."""
    from coda.primitives.base import COL_LANES

    per_warp = 32 // COL_LANES
    cols = finalize.plan(EPILOGUES["dgamma_colsum"])
    assert cols.extent(16384, 2048) == COL_LANES * 2048
    assert cols.extent(16384, 2056) == 32 * -(-2056 // per_warp)
    rows = finalize.plan(EPILOGUES["rmsnorm_fwd"])
    assert rows.extent(1000, 8192) == 32 * 1000


@pytest.mark.parametrize("name", [n for n in EPILOGUES if n != "silu_max"])
def test_catalogue_compiles_with_wide_subtiles(name, tmp_path):
    """64-column epilogue subtiles (``GemmConfig.epi_n=64``, opt-in): half the subtiles
    per tile, so half the per-subtile barriers; the catalogue compiles with no local
    memory (silu_max spills there and keeps 32-column subtiles)."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    cfg = GemmConfig(tile_n=128, cluster_m=2, epi_n=64)
    key = gemm_kernels.GemmKernelKey(cfg, torch.bfloat16, FusedVisitor(EPILOGUES[name]))
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    ops = opcode_counts(disassemble(cubin))
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


def test_only_reducing_epilogues_have_a_finalize_kernel():
    assert not finalize.uses_kernel(EPILOGUES["residual_store"])
    assert not finalize.uses_kernel(EPILOGUES["swiglu_fwd"])
    assert finalize.uses_kernel(EPILOGUES["lse_target"])


#: global loads (LDG) in the kernel of a catalogue epilogue whose vectors are loaded once
#: per band of subtiles (``TraceSubtile.per_band``); per subtile they were 64, 16, 48.
#: A 128 x 128 tile has 2 x 4 subtiles of 64 x 32: a row vector (rstd) is loaded in 2 of
#: them, a column vector (gamma, freq) in 4 instead of 8.
BAND_LOADS = {"rmsnorm_fwd": 32, "row_scale": 4, "rope": 20}


@pytest.mark.parametrize("name", list(BAND_LOADS))
def test_vectors_are_loaded_once_per_band_of_subtiles(name, tmp_path):
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    _, cubin = _compile(EPILOGUES[name], tmp_path)
    opcodes = opcode_counts(disassemble(cubin))
    assert count_prefix(opcodes, "LDG") <= BAND_LOADS[name], opcodes
    assert count_prefix(opcodes, "LDL") == 0 and count_prefix(opcodes, "STL") == 0


def test_column_reductions_reduce_scatter_across_lanes(tmp_path):
    """dgamma_colsum reduces two values per column (a sum and a max). A thread holds 8
    columns of each 64 x 32 subtile; combining them over the 8 lanes that share columns
    by reduce-scatter takes 7 shuffles per reduction per subtile (a butterfly per column:
    24) and one shared-memory update per lane (before: 8 per lane in lanes 0-3), so a
    128 x 128 tile's 8 subtiles make 2 x 8 x 7 = 112 shuffles (before: 384), in each of
    the kernel's two traces of the tile epilogue (its column max masks the rows past M:
    traced apart for the tiles inside M x N, ``FusedVisitor.splits_interior``)."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = EPILOGUES["dgamma_colsum"]
    traces = 2 if FusedVisitor(epi).splits_interior else 1
    _, cubin = _compile(epi, tmp_path, LAYOUTS["dgrad"])
    ops = opcode_counts(disassemble(cubin))
    assert count_prefix(ops, "SHFL") <= traces * 2 * 8 * 7, ops
    assert count_prefix(ops, "STS") <= traces * 2 * 8, ops
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


def test_a_spilling_tile_is_narrowed_to_the_widest_that_does_not():
    """``epilogue_choice`` walks ``tile_candidates`` from the heuristic's tile down: a
    proposed 128 x 192 tile that spills (the loss's statistics + stored logits) becomes
    128 x 128, without local memory."""
    from coda.fusions.ce_epilogues import stats_store_epilogue
    from coda.runtime.epilogue_kernels import tile_candidates

    bf16 = torch.bfloat16
    stats = FusedVisitor(stats_store_epilogue(bf16, None, False, None, False))
    wide = GemmConfig(tile_n=192, cluster_m=2)
    assert [c.tile_n for c in tile_candidates(wide)] == [192, 128, 96, 64]
    spills = [
        gemm_kernels.local_memory_bytes(gemm_kernels.kernel_key(c, bf16, stats, 132, "k", "k"))
        for c in tile_candidates(wide)[:2]
    ]
    assert spills[0] > 0 and spills[1] == 0


def test_epilogue_that_never_reads_acc_runs_no_mainloop(tmp_path):
    """A map pass (an epilogue that does not read ``acc``: the loss's gradient map, the
    RMSNorm / RoPE backward maps) compiles with no WGMMA and no A/B loads: its only TMA
    loads are its own operands', so its kernel moves nothing but the epilogue's bytes. A
    GEMM epilogue keeps its mainloop."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    from coda.fusions.ce_epilogues import grad_map_epilogue

    grad = grad_map_epilogue(torch.bfloat16, torch.bfloat16, None, False, None, False, False, False)
    assert not FusedVisitor(grad).reads_acc
    assert FusedVisitor(EPILOGUES["rmsnorm_fwd"]).reads_acc
    for epi, mainloop in ((grad, False), (EPILOGUES["residual_store"], True)):
        cfg = epilogue_choice(epi, torch.bfloat16, 2048, 8192, 8, num_sms=132)[0]
        key = gemm_kernels.GemmKernelKey(cfg, torch.bfloat16, FusedVisitor(epi))
        _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path / str(mainloop)))
        ops = opcode_counts(disassemble(cubin))
        assert (count_prefix(ops, "HGMMA") > 0) == mainloop
        assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0
        assert count_prefix(ops, "UTMALDG") > 0  # the epilogue's own operand
        # a mainloop's B tile is multicast to the 2 x 1 cluster's CTAs
        multicast = [op for op in ops if op.startswith("UTMALDG") and "MULTICAST" in op]
        assert bool(multicast) == mainloop
