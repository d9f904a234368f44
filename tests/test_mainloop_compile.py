"""CPU CI for the mainloop: compile the PingPong GEMM for sm_90a and check its SASS.

No GPU needed: CuTeDSL lowers to PTX and cubin here (CUTE_DSL_ARCH=sm_90a), and nvdisasm
from the nvidia-cuda-nvdisasm wheel turns the cubin into SASS.
"""

from __future__ import annotations

import re

import pytest
import torch

from coda.mainloop.config import GemmConfig
from coda.mainloop.visitor import AccStore
from coda.runtime import gemm_kernels
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts

pytestmark = pytest.mark.compile

CASES = [
    (
        GemmConfig(tile_n=192, cluster_m=2),
        torch.bfloat16,
        torch.bfloat16,
        "HGMMA.64x192x16.F32.BF16",
    ),
    (
        GemmConfig(tile_n=128, cluster_m=1),
        torch.bfloat16,
        torch.float32,
        "HGMMA.64x128x16.F32.BF16",
    ),
    (
        GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
        torch.float16,
        torch.float16,
        "HGMMA.64x128x16.F32",
    ),
    (
        GemmConfig(tile_n=160, cluster_m=2, group_m=4),
        torch.bfloat16,
        torch.float16,
        "HGMMA.64x160x16.F32.BF16",
    ),
    (
        GemmConfig(tile_n=128, cluster_m=2, cluster_n=2),
        torch.bfloat16,
        torch.bfloat16,
        "HGMMA.64x128x16.F32.BF16",
    ),
    # 64-column epilogue subtiles (GemmConfig.epi_n=64)
    (
        GemmConfig(tile_n=128, cluster_m=2, epi_n=64),
        torch.bfloat16,
        torch.bfloat16,
        "HGMMA.64x128x16.F32.BF16",
    ),
    (
        GemmConfig(tile_m=256, tile_n=192, cluster_m=2, epi_n=64),
        torch.bfloat16,
        torch.float32,
        "HGMMA.64x192x16.F32.BF16",
    ),
    # the cooperative schedule: 256-row tiles, each warpgroup on its 128-row half
    (
        GemmConfig(tile_m=256, tile_n=128, cluster_m=2),
        torch.bfloat16,
        torch.bfloat16,
        "HGMMA.64x128x16.F32.BF16",
    ),
    (
        GemmConfig(tile_m=256, tile_n=192, cluster_m=2),
        torch.bfloat16,
        torch.float32,
        "HGMMA.64x192x16.F32.BF16",
    ),
]


@pytest.fixture(scope="module")
def sass_of(tmp_path_factory):
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    memo = {}

    def get(config, ab, d, a_major="k", b_major="k", accumulate=False):
        key = gemm_kernels.GemmKernelKey(
            config, ab, AccStore(d, accumulate), a_major=a_major, b_major=b_major
        )
        if key not in memo:
            ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path_factory.mktemp("dump")))
            memo[key] = (ptx, disassemble(cubin))
        return memo[key]

    return get


@pytest.mark.parametrize(
    "config,ab,d,hgmma", CASES, ids=lambda v: str(v) if isinstance(v, str) else None
)
def test_sass_has_wgmma_tma_and_no_spills(sass_of, config, ab, d, hgmma):
    ptx, sass = sass_of(config, ab, d)
    ops = opcode_counts(sass)
    assert ops[hgmma] > 0, (
        f"expected {hgmma}; HGMMA seen: {[o for o in ops if o.startswith('HGMMA')]}"
    )
    assert count_prefix(ops, "UTMALDG") >= 2, "TMA loads of A and B"
    assert count_prefix(ops, "UTMASTG") > 0, "TMA stores of D"
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "local-memory spills"
    # register rebalancing between producer and consumers
    assert count_prefix(ops, "USETMAXREG") >= 2
    if config.cluster_m * config.cluster_n > 1:
        assert any(op.startswith("UTMALDG") and "MULTICAST" in op for op in ops), (
            "cluster multicast"
        )
    assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx


def test_gemm_lets_a_programmatic_dependent_start_early(sass_of):
    """Every CTA of the GEMM signals griddepcontrol.launch_dependents (the finalize kernel,
    launched with use_pdl, may take SMs as the GEMM's tiles finish); the GEMM itself is a
    plain launch and does not wait on a predecessor."""
    ptx, _ = sass_of(*CASES[0][:3])
    assert "griddepcontrol.launch_dependents" in ptx
    assert "griddepcontrol.wait" not in ptx


def _tma_policies(ptx: str) -> dict[str, set[int]]:
    """{"load" | "store": the L2 cache-policy values of the kernel's TMA copies}."""
    import re

    movs = dict(re.findall(r"mov\.b64\s+(%rd\d+),\s*(-?\d+);", ptx))
    out: dict[str, set[int]] = {"load": set(), "store": set()}
    for line in ptx.splitlines():
        if "cp.async.bulk.tensor" in line and "L2::cache_hint" in line:
            reg = re.search(r"(%rd\d+);\s*$", line.strip()).group(1)
            kind = "store" if ".global.shared::cta" in line else "load"
            out[kind].add(int(movs.get(reg, -1)))
    return out


def test_output_stores_are_evict_first_and_operand_loads_are_not(sass_of):
    """The epilogue's TMA stores carry the L2 evict-first hint (they stream through L2
    once); the A / B loads, re-read from L2 by every tile of a row or column, do not."""
    from coda.mainloop.config import EPILOGUE_L2_HINT, L2_EVICT_FIRST

    assert EPILOGUE_L2_HINT == L2_EVICT_FIRST
    ptx, _ = sass_of(*CASES[0][:3])
    policies = _tma_policies(ptx)
    assert policies["store"] == {L2_EVICT_FIRST}
    assert policies["load"] and L2_EVICT_FIRST not in policies["load"]


def test_sass_stores_use_stmatrix_for_16bit_output(sass_of):
    _, sass = sass_of(*CASES[0][:3])
    assert count_prefix(opcode_counts(sass), "STSM") > 0


@pytest.mark.parametrize(
    "a_major,b_major,accumulate",
    [("k", "n", False), ("m", "n", False), ("m", "k", False), ("m", "n", True), ("k", "k", True)],
)
def test_every_operand_major_and_accumulate_compile(sass_of, a_major, b_major, accumulate):
    """dgrad (B N-major), wgrad (A M-major, B N-major) and the fourth layout run on the same
    WGMMA mainloop (operands read from swizzled shared memory in either major), with TMA
    loads and no spills; accumulate stores through TMA reduce-add (UTMAREDG) instead of
    plain TMA stores, so the output is never read."""
    config = GemmConfig(tile_n=192, cluster_m=2)
    ptx, sass = sass_of(config, torch.bfloat16, torch.float32, a_major, b_major, accumulate)
    ops = opcode_counts(sass)
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "UTMALDG") >= 2
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "local-memory spills"
    if accumulate:
        assert count_prefix(ops, "UTMAREDG") > 0 and count_prefix(ops, "UTMASTG") == 0
        assert "cp.reduce.async.bulk.tensor" in ptx
    else:
        assert count_prefix(ops, "UTMASTG") > 0 and count_prefix(ops, "UTMAREDG") == 0


@pytest.mark.parametrize("a_major,b_major", [("k", "k"), ("k", "n")])
def test_split_k_compiles_to_reduce_add_stores(sass_of, a_major, b_major):
    """Split-K units store through TMA reduce-add only (their partial sums add in global
    memory), on the same spill-free WGMMA mainloop."""
    config = GemmConfig(tile_n=192, cluster_m=2, split_k=3)
    ptx, sass = sass_of(config, torch.bfloat16, torch.float32, a_major, b_major, True)
    ops = opcode_counts(sass)
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "UTMAREDG") > 0 and count_prefix(ops, "UTMASTG") == 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "local-memory spills"


def test_split_k_refuses_visitors_that_do_not_only_accumulate():
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import PingPongGemm

    with pytest.raises(ValueError, match="split_k=2"):
        PingPongGemm(
            GemmConfig(split_k=2), to_cutlass(torch.bfloat16), AccStore(torch.float32, False)
        )


def test_cooperative_tiles_plan_loads_and_scratch_per_warpgroup():
    """256-row (cooperative) tiles run every epilogue: the warpgroups' epilogues run at
    once, so the load ring alternates the two 128-row halves' subtiles (an even ring,
    one consumer per stage) and each warpgroup has its own scratch, sized for its
    128-row half."""
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import PingPongGemm
    from coda.runtime.fused import FusedVisitor
    from coda.testing.catalog import EPILOGUES

    cfg = GemmConfig(tile_m=256, tile_n=128)
    half = cfg.warpgroup_config
    for name in ("rmsnorm_fwd", "residual_store", "lse_target", "swiglu_bwd"):
        visitor = FusedVisitor(EPILOGUES[name])
        kernel = PingPongGemm(cfg, to_cutlass(torch.bfloat16), visitor)
        assert kernel.cooperative and kernel.concurrent and kernel.config.tile_m == 128
        assert kernel.scratch_copies == 2
        assert kernel.scratch_floats == visitor.smem_bytes(half) // 4
        if visitor.load_dtypes:
            assert kernel.load_stages % 2 == 0 and kernel.load_stages >= 2
        else:
            assert kernel.load_stages == 0
        assert kernel.ab_stages >= 3
    kernel = PingPongGemm(cfg, to_cutlass(torch.bfloat16), AccStore(torch.float32, True))
    assert kernel.cooperative and kernel.concurrent and kernel.config.tile_m == 128
    assert kernel.ab_stages >= 4  # 256 x 128 x 64 A/B stages beside fp32 store buffers


def test_cooperative_config_validation():
    with pytest.raises(ValueError, match="cooperative"):
        GemmConfig(tile_m=256, split_k=2)
    with pytest.raises(ValueError, match="tile_m"):
        GemmConfig(tile_m=192)
    assert GemmConfig(tile_m=256).warpgroup_config.tile_m == 128
    assert GemmConfig().warpgroup_config == GemmConfig()


def _kloop(sass: str) -> list[str]:
    """The SASS lines of the consumer's k-loop: from the label that the backward branch
    after the in-loop ``wait_group(1)`` (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) jumps to, to
    that branch."""
    lines = sass.splitlines()
    wait = next(i for i, line in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line)
    labels = {
        line.strip().rstrip(":"): i for i, line in enumerate(lines) if line.strip().endswith(":")
    }
    for j in range(wait, len(lines)):
        if " BRA " in lines[j]:
            label = lines[j].split("BRA")[1].strip(" ;`()")
            start = labels.get(label)
            if start is not None and start < wait:
                return lines[start : j + 1]
    raise AssertionError("no backward branch after the k-loop's wait_group(1)")


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["cluster2x1", "cluster1x2"])
def test_kloop_releases_stages_without_reading_the_thread_index(sass_of, case):
    """Stages are released by one elected lane per warp (cf9bc15): the k-loop holds the
    HGMMAs and remote arrives but no S2R SR_TID.X, which stalled the tensor-core issue
    behind the other warpgroup's epilogue on the H200."""
    config, ab, d, hgmma = case
    _, sass = sass_of(config, ab, d)
    loop = _kloop(sass)
    assert any(hgmma in line for line in loop)
    assert any("ELECT" in line for line in loop)
    assert any("SYNCS.ARRIVE" in line for line in loop)
    assert not [line for line in loop if "S2R" in line], "thread-index read in the k-loop"


@pytest.mark.parametrize(
    "cluster,peers", [((2, 1), 2), ((1, 2), 2), ((2, 2), 3)], ids=["2x1", "1x2", "2x2"]
)
def test_stage_release_arrives_on_the_ctas_that_multicast_into_it(sass_of, cluster, peers):
    """A consumer warp releases an A/B stage on every CTA whose TMA multicast fills it:
    both CTAs of a 2x1 / 1x2 cluster, and 3 of a 2x2 one (itself, its A peer, its B peer;
    an arrive on the diagonal CTA would break that CTA's barrier phase). The k-loop has
    two release sites (in the loop and after it)."""
    cfg = GemmConfig(tile_n=128, cluster_m=cluster[0], cluster_n=cluster[1])
    ptx, sass = sass_of(cfg, torch.bfloat16, torch.bfloat16)
    remote = re.findall(r"mbarrier\.arrive[^;]*shared::cluster", ptx)
    assert len(remote) == 2 * peers
    multicast = [op for op in opcode_counts(sass) if op.startswith("UTMALDG") and "MULTICAST" in op]
    ops = opcode_counts(sass)
    assert sum(ops[op] for op in multicast) >= (2 if cluster == (2, 2) else 1)  # A and B


def test_fuzz_cooperative_config_takes_what_fits():
    """``python -m coda.testing.fuzz --cooperative`` runs a drawn composition on 256 x 128
    tiles when its buffers fit shared memory there, and on the default config when not
    (four width-2 fp32 loads and stores: 32 KB per subtile stage)."""
    from coda import Epilogue
    from coda.primitives import TileLoad, TileStore
    from coda.testing.catalog import EPILOGUES
    from coda.testing.fuzz import cooperative_config

    cfg = cooperative_config(EPILOGUES["swiglu_bwd"], 1000, torch.bfloat16)
    assert cfg is not None and cfg.cooperative and cfg.cluster_m == 2
    assert cooperative_config(EPILOGUES["rmsnorm_fwd"], 200, torch.float16).cluster_m == 1
    heavy = Epilogue()
    for i in range(4):
        heavy = heavy.add(TileLoad(f"x{i}", torch.float32, width=2))
        heavy = heavy.add(TileStore(f"x{i}", torch.float32, name=f"y{i}"))
    assert cooperative_config(heavy, 1000, torch.bfloat16) is None


def test_concurrent_config_falls_back_to_one_store_buffer_taking_turns(tmp_path):
    """A map-pass config (concurrent epilogues, 64 x 64 subtiles) whose epilogue's
    buffers fit neither split per warpgroup nor doubled: the kernel takes turns with one
    store buffer (drawn by the GPU fuzzer, seed 9: a width-2 fp32 load and store, a
    half-width fp16 pair and an fp32 store, 53 KB stored per subtile) and compiles."""
    from coda import Epilogue
    from coda.mainloop.config import choose_epilogue_config
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import PingPongGemm
    from coda.primitives import Elementwise, TileLoad, TileStore
    from coda.primitives.math import maximum
    from coda.runtime.fused import FusedVisitor

    epi = (
        Epilogue()
        .add(Elementwise("v1", maximum, ins=("acc", "acc")))
        .add(TileLoad("t2", torch.float16, width=0.5))
        .add(TileLoad("t3", torch.float32, width=2))
        .add(TileStore("v1", torch.float32, name="v1_out4"))
        .add(TileStore("t2", torch.float16, name="t2_out5"))
        .add(TileStore("t3", torch.float32, name="t3_out6"))
    )
    cfg = choose_epilogue_config(2, 16, 8)
    assert cfg.concurrent_epilogues and cfg.epi_n == 64
    kernel = PingPongGemm(cfg, to_cutlass(torch.bfloat16), FusedVisitor(epi))
    assert not kernel.concurrent and kernel.epi_stages == 1 and kernel.ab_stages >= 2
    key = gemm_kernels.GemmKernelKey(cfg, torch.bfloat16, FusedVisitor(epi))
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    assert "wgmma.mma_async" in ptx and len(cubin) > 0
