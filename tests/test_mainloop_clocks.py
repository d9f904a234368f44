"""The mainloop's clock hook: a primitive with ``reads_clocks`` gets two SM clocks per tile
(``TraceTile.mainloop_clocks``: the warpgroup ready for the mainloop, its last WGMMA
done); kernels without one read no clock at all (compiled for sm_90a on the CPU, PTX and
SASS inspected)."""

from __future__ import annotations

import pytest
import torch

import coda
from coda import Epilogue, TileStore
from coda.runtime import gemm_kernels
from coda.runtime.epilogue_kernels import epilogue_choice
from coda.runtime.fused import FusedVisitor
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts
from coda.testing.probes import MainloopCycles

bf16 = torch.bfloat16


def _ptx_sass(epi, mnk, tmp_path):
    cfg = epilogue_choice(epi, bf16, *mnk, num_sms=132, majors=("k", "k"))[0]
    key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi), 132, "k", "k")
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    ops = opcode_counts(disassemble(cubin)) if find_nvdisasm() else None
    return ptx, ops


def test_probe_composes_and_is_zero_off_the_gpu():
    epi = Epilogue().add(TileStore("acc", bf16)).add(MainloopCycles("cycles"))
    A, B = torch.randn(40, 24), torch.randn(36, 24)
    ref = epi.reference(A, B)
    assert ref["cycles"].shape == (40,) and not ref["cycles"].any()
    sim = coda.simulate(epi, A, B, tile=(16, 16), subtile=(8, 8))
    assert sim["cycles.partials"].shape == (40, 3) and not sim["cycles"].any()


@pytest.mark.compile
def test_only_a_visitor_that_asks_reads_the_clock(tmp_path):
    plain = Epilogue().add(TileStore("acc", bf16))
    timed = plain.add(MainloopCycles("cycles"))
    assert not FusedVisitor(plain).wants_clocks and FusedVisitor(timed).wants_clocks
    ptx, ops = _ptx_sass(plain, (4096, 2048, 2048), tmp_path / "plain")
    assert "%clock64" not in ptx
    ptx, ops = _ptx_sass(timed, (4096, 2048, 2048), tmp_path / "timed")
    # the mainloop's start and end, in the one traced mainloop
    assert ptx.count("%clock64") == 2
    if ops is not None:
        assert count_prefix(ops, "HGMMA") > 0
        assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


@pytest.mark.compile
def test_a_map_pass_reports_its_epilogue_start_as_both_clocks(tmp_path):
    # no mainloop (K = one k-tile and acc never read): both clocks are one reading
    from coda import TileLoad

    epi = Epilogue().add(TileLoad("x", bf16), TileStore("x", bf16, name="y"))
    epi = epi.add(MainloopCycles("cycles"))
    ptx, _ = _ptx_sass(epi, (4096, 2048, 64), tmp_path)
    assert "wgmma.mma_async" not in ptx and ptx.count("%clock64") == 1


@pytest.mark.compile
def test_the_wait_profile_reads_the_clock_in_the_k_loop_only_when_asked(tmp_path):
    import attrs

    @attrs.frozen
    class Waits(MainloopCycles):
        reads_waits = True

    timed = Epilogue().add(TileStore("acc", bf16)).add(MainloopCycles("cycles"))
    waits = Epilogue().add(TileStore("acc", bf16)).add(Waits("cycles"))
    assert not FusedVisitor(timed).wants_waits and FusedVisitor(waits).wants_waits
    ptx, _ = _ptx_sass(waits, (4096, 2048, 2048), tmp_path / "waits")
    # four reads in the k-loop (around its stage wait and its WGMMA wait) and one before
    # the last WGMMA wait, beside the two of the clocks alone
    assert ptx.count("%clock64") == 2 + 5
