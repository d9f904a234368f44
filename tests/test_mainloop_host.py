"""CPU tests of the mainloop's host side: configs, smem plans, tile schedule, input checks."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coda.errors import InputError
from coda.mainloop.config import GemmConfig, choose_config, plan_smem
from coda.mainloop.scheduler import host_tile_order
from coda.matmul import check_gemm_operands, check_output, gemm, gemm_problem


@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12))
def test_schedule_visits_every_cluster_once(cm, cn, group):
    order = host_tile_order(cm, cn, group)
    assert sorted(order) == [(i, j) for i in range(cm) for j in range(cn)]


@given(st.integers(1, 20), st.integers(1, 20), st.integers(1, 6), st.integers(2, 8))
def test_split_schedule_visits_every_cluster_and_split_once(cm, cn, group, splits):
    order = host_tile_order(cm, cn, group, splits)
    assert sorted(order) == [(i, j, s) for i in range(cm) for j in range(cn) for s in range(splits)]
    # the split index is the outermost digit: split s is one whole schedule
    per = cm * cn
    assert [o[:2] for o in order[:per]] == host_tile_order(cm, cn, group)


def test_split_k_only_for_long_k_small_outputs():
    # dh of an LM head chunk: 2048 x 2048 output, K = vocabulary
    assert choose_config(2048, 2048, 128256, split_ok=True).split_k > 1
    assert choose_config(2048, 2048, 128256).split_k == 1  # not allowed (bf16 output)
    # full waves or short K: no split
    assert choose_config(16384, 4096, 4096, split_ok=True).split_k == 1
    assert choose_config(256, 256, 512, split_ok=True).split_k == 1
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(split_k=0)


def test_split_k_where_it_measured_faster_on_the_h200():
    """The heuristic's split boundary on the shapes of ``results/split_k_h200.json``
    (weight gradients into fp32, 132 SMs): it splits the 64- and 96-tile problems, where
    its split ran 1.22-1.87x the unsplit GEMM, and none of 128 tiles or more, where
    forced 2- and 4-way splits ran 0.94-1.01x."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    with open(os.path.join(path, "split_k_h200.json")) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == 24
    for r in rows:
        picked = choose_config(r["M"], r["N"], r["K"], 132, split_ok=True)
        assert (picked.split_k > 1) == (r["auto_ms"] is not None), r
        if r["auto_ms"] is not None:
            assert r["auto_speedup"] > 1.2, r  # measured faster where it splits
        else:
            assert max(r["split2_speedup"], r["split4_speedup"]) < 1.02, r


def test_long_running_problems_take_wide_tiles():
    # the LM head's backward GEMMs (V = 128256), the picks that measured fastest on an
    # H200 (vocab_gemm_configs_coop_h200.json): cooperative 256-row tiles from 8.6 TFLOP
    def tile(m, n, k):
        cfg = choose_config(m, n, k)
        return cfg.tile_m, cfg.tile_n

    assert tile(16384, 8192, 128256) == (256, 192)  # dh, 34 TFLOP
    assert tile(128256, 8192, 16384) == (256, 192)  # dW, 34 TFLOP
    assert tile(8192, 8192, 128256) == (256, 192)  # dh, 17 TFLOP
    assert tile(128256, 2048, 16384) == (256, 192)  # dW, 8.6 TFLOP
    assert tile(16384, 2048, 128256) == (256, 128)  # dh, 8.6 TFLOP: 192 wide leaves a last wave
    assert tile(8192, 2048, 128256) == (128, 128)  # dh, 4.3 TFLOP: PingPong, fuller last wave
    # the same tile counts below the power-limited size keep the wave-quantization pick,
    # but for the cooperative long-K tile on K >= LONG_K (below)
    assert tile(16384, 4096, 4096) == (128, 128)
    assert tile(4096, 4096, 16384) == (256, 128)
    # split-K candidates stay PingPong
    assert choose_config(2048, 2048, 128256, split_ok=True).tile_m == 128


def test_long_k_problems_take_cooperative_tiles_in_1x2_clusters():
    """K in [8192, 32768] below the power-limited size: cooperative 256 x 128 tiles in a
    1 x 2 cluster where the wave-quantized cost says so (the picks measured faster run
    back to back on an H200: gemm_configs_sustained_coop_h200.json)."""

    def pick(m, n, k):
        c = choose_config(m, n, k, 132)
        return c.tile_m, c.tile_n, c.cluster_m, c.cluster_n

    coop = (256, 128, 1, 2)
    assert pick(4096, 2048, 16384) == coop  # H = 2048 QKV wgrad
    assert pick(2048, 2048, 16384) == coop  # O wgrad
    assert pick(16384, 4096, 22016) == coop  # H = 4096 gate / up dgrad
    assert pick(16384, 4096, 11008) == coop  # down projection, forward
    # from K = 8192: the weight gradients of 8192 tokens (gemm_configs_sustained_k8192_h200.json)
    assert pick(4096, 4096, 8192) == coop  # H = 4096 O wgrad
    assert pick(2048, 2048, 8192) == coop  # H = 2048 O wgrad
    assert pick(28672, 4096, 8192) == coop  # gate / up wgrad
    assert pick(16384, 8192, 8192)[:2] == (128, 192)  # many tiles: PingPong 128 x 192 still
    assert pick(4096, 4096, 6144)[0] == 128  # below 8192
    # a last wave the 256-row tile would leave two thirds empty: PingPong
    assert pick(11264, 2048, 16384) == (128, 128, 2, 1)
    assert pick(4096, 11008, 16384) == (128, 128, 2, 1)
    # short K, the LM head's vocabulary-long K, one tile row: as before
    assert pick(16384, 4096, 4096)[0] == 128
    assert pick(8192, 2048, 128256) == (128, 128, 2, 1)
    assert pick(128, 4096, 16384)[0] == 128
    # every pick is a valid config whose cluster divides the grid
    for m, n, k in [(4096, 2048, 16384), (300, 136, 20000), (256, 264, 10240)]:
        c = choose_config(m, n, k, 132)
        assert isinstance(c, GemmConfig)


def test_map_passes_take_wide_subtiles_with_narrow_fallbacks():
    """One-k-tile problems get ``MAP_EPI_N``-column subtiles; GEMMs keep 32. When the
    wide subtile spills, ``tile_candidates`` tries the same tile with 32-column subtiles,
    then the narrower tiles (every candidate a valid config: tile_n a multiple of epi_n)."""
    from coda.mainloop.config import MAP_EPI_N, choose_epilogue_config
    from coda.runtime.epilogue_kernels import tile_candidates

    base = choose_epilogue_config(16384, 128256, 8)
    assert (base.tile_n, base.epi_n) == (128, MAP_EPI_N) == (128, 64)
    assert choose_epilogue_config(16384, 8192, 8192).epi_n == 32
    got = [(c.tile_n, c.epi_n) for c in tile_candidates(base)]
    assert got == [(128, 64), (128, 32), (96, 32), (64, 32)]
    assert all(c.concurrent_epilogues for c in tile_candidates(base))


def test_fused_epilogue_plans_are_shared_within_a_size_class():
    from coda.mainloop.config import choose_epilogue_config, epilogue_size_class

    assert choose_epilogue_config(16384, 44032, 8192).tile_n == 128
    assert choose_epilogue_config(16384, 128256, 8).concurrent_epilogues  # map pass
    # a map pass and a GEMM of the same epilogue get different configs, so different plans
    assert epilogue_size_class(16384, 8192, 8) != epilogue_size_class(16384, 8192, 8192)
    assert epilogue_size_class(100, 8192, 8192) != epilogue_size_class(16384, 8192, 8192)
    assert epilogue_size_class(4096, 4096, 4096) == epilogue_size_class(16384, 44032, 8192)


def test_short_k_fused_epilogues_take_the_plain_gemms_128x192_tile(monkeypatch):
    """At K <= WIDE_EPILOGUE_MAX_K a fused call takes 128 x 192 tiles exactly where the
    plain heuristic does (the 1B model's QKV and gate/up GEMMs), 128 x 128 where the plain
    GEMM keeps 128 (N = K = 2048), on longer K and in map passes; the size class (the
    plan cache's key) carries the width, and 0 turns the rule off."""
    from coda.mainloop import config
    from coda.mainloop.config import choose_config, choose_epilogue_config, epilogue_size_class

    for m, n, k, wide in [
        (16384, 3072, 2048, True),  # Llama 3.2 1B's QKV
        (8192, 16384, 2048, True),  # its gate / up
        (16384, 8192, 2048, True),
        (16384, 2048, 2048, False),  # the plain GEMM keeps 128 x 128 here
        (16384, 3072, 4096, False),  # K above the rule
        (16384, 44032, 8192, False),
        (16384, 128256, 2048, False),  # the LM head: a cooperative plain tile
        (16384, 3072, 8, False),  # a map pass
    ]:
        plain = choose_config(m, n, k)
        got = choose_epilogue_config(m, n, k)
        assert got.tile_n == (192 if wide else 128), (m, n, k)
        assert wide == ((plain.tile_m, plain.tile_n) == (128, 192) and 64 < k <= 2048)
        assert epilogue_size_class(m, n, k)[2] == got.tile_n
        assert (got.tile_m, got.cluster_m, got.epi_n) == (128, 2, 64 if k <= 64 else 32)
    assert epilogue_size_class(16384, 3072, 2048) != epilogue_size_class(16384, 2048, 2048)
    monkeypatch.setattr(config, "WIDE_EPILOGUE_MAX_K", 0)
    assert choose_epilogue_config(16384, 3072, 2048).tile_n == 128


def test_schedule_groups_rows():
    # group of 2 cluster-rows, walked column by column
    assert host_tile_order(3, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


def test_config_validation_errors():
    with pytest.raises(ValueError, match="tile_n=100"):
        GemmConfig(tile_n=100)
    with pytest.raises(ValueError, match="cluster"):
        GemmConfig(cluster_m=4, cluster_n=1)
    with pytest.raises(ValueError, match="epi_n=16"):
        GemmConfig(epi_n=16)
    with pytest.raises(ValueError, match="tile_n=160 must be a multiple of epi_n=64"):
        GemmConfig(tile_n=160, epi_n=64)
    assert GemmConfig(tile_n=192, epi_n=64).subtiles_per_tile == (2, 3)
    for flag in ("concurrent_epilogues", "staggered_copies"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            GemmConfig(**{flag: 1})
    # integers only (128.0 == 128 would pass the range checks and share its cache key)
    for field, value in [("tile_m", 128.0), ("cluster_m", True), ("group_m", 2.5),
                         ("split_k", "2"), ("epi_stages", 1.5)]:  # fmt: skip
        with pytest.raises(TypeError, match=f"GemmConfig.{field} must be an int"):
            GemmConfig(**{field: value})


def test_smem_plan_fits_capacity():
    for tile_n in (64, 96, 128, 160, 192):
        cfg = GemmConfig(tile_n=tile_n)
        plan = plan_smem(cfg, 2, cfg.epi_m * cfg.epi_n * 2)
        assert plan.ab_stages >= 4
        assert plan.total_bytes <= 232448 - 2048


def test_choose_config_is_valid_for_many_shapes():
    for m in (1, 128, 4096, 16384):
        for n in (8, 2048, 44032):
            cfg = choose_config(m, n, 4096)
            assert isinstance(cfg, GemmConfig)


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_operand_checks_accept_valid_and_return_shape():
    assert check_gemm_operands(_bf16(10, 64), _bf16(24, 64)) == (10, 24, 64)


@pytest.mark.parametrize(
    "layout,a,b",
    [
        (("k", "k"), _bf16(10, 64), _bf16(24, 64)),  # forward: X @ W.T
        (("k", "n"), _bf16(10, 64), _bf16(64, 24).t()),  # dgrad: dY @ W
        (("m", "n"), _bf16(64, 16)[:, :10].t(), _bf16(64, 24).t()),  # wgrad: dY.T @ X
        (("m", "k"), _bf16(64, 16).t(), _bf16(24, 64)),
        (("k", "k"), _bf16(10, 72)[:, :64], _bf16(24, 64)),  # padded rows
    ],
)
def test_every_operand_major_is_accepted_without_copy(layout, a, b):
    assert gemm_problem(a, b)[3:] == layout
    assert gemm_problem(a, b)[:3] == (a.shape[0], b.shape[0], a.shape[1])


@pytest.mark.parametrize(
    "a,b,exc,msg",
    [
        ([1, 2], _bf16(8, 8), TypeError, "A must be a torch.Tensor"),
        (_bf16(8), _bf16(8, 8), InputError, "A must be 2-D"),
        (torch.randn(8, 8), _bf16(8, 8), TypeError, "A has dtype float32"),
        (_bf16(8, 8), torch.randn(8, 8).half(), TypeError, "same dtype"),
        (_bf16(8, 16), _bf16(8, 24), InputError, "its K must match"),
        (_bf16(8, 12), _bf16(8, 12), InputError, "multiple of 16 bytes"),
        (_bf16(8, 32)[:, ::2], _bf16(8, 16), InputError, "one of its dimensions must be"),
        (_bf16(16, 12).t(), _bf16(8, 16), InputError, "M-contiguous with a stride of 12"),
        (_bf16(8, 16), _bf16(16, 20)[:, :10].t(), InputError, "N-contiguous with a stride of 20"),
        (_bf16(4, 24)[:, 1:17], _bf16(8, 16), InputError, "not 16-byte aligned"),
        (_bf16(0, 8), _bf16(8, 8), InputError, "empty"),
    ],
)
def test_operand_check_errors(a, b, exc, msg):
    with pytest.raises(exc, match=msg):
        check_gemm_operands(a, b)


def test_output_check_errors():
    with pytest.raises(InputError, match=r"expected \(8, 16\)"):
        check_output(_bf16(8, 8), 8, 16)
    with pytest.raises(TypeError, match="out has dtype int32"):
        check_output(torch.zeros(8, 16, dtype=torch.int32), 8, 16)


def test_gemm_on_cpu_tensors_says_cuda_before_launch():
    with pytest.raises(InputError, match="CUDA tensors"):
        gemm(_bf16(8, 16), _bf16(24, 16))


def test_accumulate_needs_an_output():
    with pytest.raises(InputError, match="accumulate=True adds into `out`"):
        gemm(_bf16(8, 16), _bf16(24, 16), accumulate=True)


def test_accumulate_without_output_is_refused_after_a_cached_call(monkeypatch):
    """Once a plain call of these operands is cached (its launcher stands in here), the
    same operands with accumulate=True and no output still raise, rather than launch a
    plain GEMM."""
    from coda import matmul

    A, B = _bf16(8, 16), _bf16(24, 16)
    launches = []
    monkeypatch.setattr(matmul, "_validated", type(matmul._validated)(8))
    sig = matmul._signature(A, B, None, False, True)
    matmul._validated.put(sig, (lambda *args: launches.append(args), False, False))
    assert gemm(A, B).shape == (8, 24) and len(launches) == 1
    with pytest.raises(InputError, match="accumulate=True adds into `out`"):
        gemm(A, B, accumulate=True)
    assert len(launches) == 1


def _map_kernels():
    """(name, kernel object) of every catalogue epilogue and of the loss's gradient map
    (bf16 and fp32 stored acc, default and every option) under the map passes' config."""
    from coda.fusions.ce_epilogues import grad_map_epilogue
    from coda.mainloop.config import choose_epilogue_config
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import PingPongGemm
    from coda.runtime.fused import FusedVisitor
    from coda.testing.catalog import EPILOGUES

    bf16 = torch.bfloat16
    epis = dict(EPILOGUES)
    for acc in (bf16, torch.float32):
        epis[f"grad_map_{acc}"] = grad_map_epilogue(
            acc, bf16, None, False, None, False, False, False
        )
        epis[f"grad_map_all_{acc}"] = grad_map_epilogue(
            acc, bf16, bf16, True, 15.0, True, True, True
        )
    cfg = choose_epilogue_config(8192, 128256, 8)
    assert cfg.concurrent_epilogues
    return [(n, PingPongGemm(cfg, to_cutlass(bf16), FusedVisitor(e))) for n, e in epis.items()]


def test_concurrent_epilogues_give_each_warpgroup_its_own_load_stages():
    """With concurrent epilogues every load-ring stage must belong to one warpgroup (a
    ring of exactly two tiles' subtiles): a stage both used would let a warpgroup a tile
    ahead pass its mbarrier parity wait on the fill meant for the other (a fp32-loading
    gradient map with a shorter ring faulted on the H200). Each warpgroup also gets an
    even share of >= 1 store buffers. The map passes of the catalogue and of the loss all
    fit this way."""
    for name, k in _map_kernels():
        n_sub = k.config.subtiles_per_tile[0] * k.config.subtiles_per_tile[1]
        assert k.concurrent, name
        if k.load_dtypes:
            assert k.load_stages == 2 * n_sub, (name, k.load_stages)
        assert k.epi_stages >= 2 and k.epi_stages % 2 == 0, (name, k.epi_stages)
        assert k.smem.total_bytes <= 232448 - 2048, name


def test_concurrent_epilogues_take_turns_when_their_load_ring_does_not_fit():
    """Three fp32 M x N loads at 128 x 192 tiles: a two-tile load ring (24 subtiles of
    24 KiB) cannot fit, so the kernel keeps the config but takes turns (``concurrent``
    False, at most one tile's subtiles in the ring); one bf16 load fits concurrently."""
    from coda import Epilogue
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import PingPongGemm
    from coda.primitives import Elementwise, TileLoad, TileStore, ops
    from coda.runtime.fused import FusedVisitor

    f32, bf16 = torch.float32, torch.bfloat16
    cfg = GemmConfig(tile_n=192, cluster_m=2, epi_stages=8, concurrent_epilogues=True)
    heavy = Epilogue(
        (
            TileLoad("x", f32),
            TileLoad("y", f32),
            TileLoad("z", f32),
            Elementwise("s", ops.add, ins=("x", "y")),
            Elementwise("t", ops.add, ins=("s", "z")),
            TileStore("t", bf16),
        )
    )
    k = PingPongGemm(cfg, to_cutlass(bf16), FusedVisitor(heavy))
    assert not k.concurrent and k.load_stages <= 12
    light = Epilogue((TileLoad("x", bf16), TileStore("x", bf16, name="y")))
    k = PingPongGemm(cfg, to_cutlass(bf16), FusedVisitor(light))
    assert k.concurrent and k.load_stages == 24


def test_kernels_with_a_mainloop_keep_five_ab_stages_before_deep_epilogue_buffers():
    """The training ops' SwiGLU backward (3 stored and 2 loaded 16-bit subtile streams)
    left 4 A/B stages with 4 store and 4 load buffers; it now takes 2 of each for a 5th
    stage (measured faster: ``benchmarks/results/epilogue_buffers_h200.json``). Kernels
    with 5 or more keep their 4 / 4 buffers; a map pass (no mainloop) keeps its deep ones."""
    from coda import Elementwise, Epilogue, TileLoad, TileStore, ops
    from coda.fusions import epilogues as fusion_epilogues
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import FEWEST_MAINLOOP_AB_STAGES, PingPongGemm
    from coda.runtime.epilogue_kernels import epilogue_choice
    from coda.runtime.fused import FusedVisitor
    from coda.testing.catalog import EPILOGUES

    bf16 = torch.bfloat16

    def plan(epi, mnk):
        cfg = epilogue_choice(epi, bf16, *mnk, num_sms=132, majors=("k", "k"))[0]
        k = PingPongGemm(cfg, to_cutlass(bf16), FusedVisitor(epi))
        return k.smem.ab_stages, k.epi_stages, k.load_stages

    assert FEWEST_MAINLOOP_AB_STAGES == 5
    swiglu_bwd = fusion_epilogues.swiglu_backward(bf16)
    assert plan(swiglu_bwd, (16384, 11008, 4096)) == (5, 2, 2)
    assert plan(EPILOGUES["swiglu_bwd"], (16384, 4096, 4096)) == (5, 4, 4)
    assert plan(EPILOGUES["rmsnorm_fwd"], (16384, 4096, 4096)) == (5, 4, 4)
    assert plan(EPILOGUES["residual_store"], (16384, 4096, 4096)) == (6, 4, 4)
    # the same streams as a map pass (dy loaded, no GEMM): its deep buffers come first
    as_map = Epilogue(
        (
            TileLoad("dy", bf16),
            TileLoad("gu", bf16, width=2),
            Elementwise("dgu", ops.swiglu_backward, ins=("gu", "dy"), pairwise="map"),
            TileStore("dgu", bf16),
            Elementwise("y", ops.swiglu, ins=("gu",), pairwise="reduce"),
            TileStore("y", bf16),
        )
    )
    assert not as_map.reads_acc
    ab, epi_stages, load_stages = plan(as_map, (16384, 11008, 4096))
    assert (epi_stages, load_stages) != (2, 2) and ab < 5


def test_each_consumer_warpgroup_has_its_own_scratch_when_epilogues_take_turns():
    """A PingPong kernel whose epilogues take turns reserves one scratch per consumer
    warpgroup (a column reduction's per-warp slots): a warpgroup's first writes of a tile
    never meet the other's last reads of the one before, which compute-sanitizer's
    racecheck did not count the epilogue turn's bar.arrive -> bar.sync as ordering
    (``benchmarks/results/sanitize_split_wide_racecheck_before_h200.json``). The shared
    memory plan pays for both copies."""
    from coda.mainloop.config import SMEM_CAPACITY_SM90
    from coda.mainloop.dtypes import to_cutlass
    from coda.mainloop.kernel import PingPongGemm
    from coda.runtime.fused import FusedVisitor
    from coda.testing.catalog import EPILOGUES

    epi = EPILOGUES["dgamma_colsum"]  # two column reductions: 4 warps x tile_n floats each
    for tile_n in (128, 192):
        cfg = GemmConfig(tile_n=tile_n, cluster_m=2)
        k = PingPongGemm(cfg, to_cutlass(torch.bfloat16), FusedVisitor(epi))
        assert not k.concurrent and not k.cooperative
        assert k.scratch_floats == 2 * 4 * tile_n
        assert k.scratch_copies == 2
        x_hat = 64 * 32 * 2  # one bf16 64 x 32 subtile of the loaded x_hat per load stage
        assert k.smem.visitor_bytes == x_hat * k.load_stages + 2 * 4 * k.scratch_floats
        assert k.smem.total_bytes <= SMEM_CAPACITY_SM90


def test_autotune_candidates_start_with_the_heuristic_and_its_raster_variants():
    from coda.runtime import autotune

    for m, n, k in [(16384, 4096, 11008), (4096, 4096, 4096), (128, 128, 64), (22016, 4096, 16384)]:
        got = autotune.candidates(m, n, k, 132)
        base = choose_config(m, n, k, 132)
        assert got[0] == base
        assert [c.group_m for c in got[1 : 1 + len(autotune.GROUP_M_VARIANTS)]] == list(
            autotune.GROUP_M_VARIANTS
        )
        assert all(attrs.evolve(c, group_m=base.group_m) == base for c in got[1:3])
        assert len(set(got)) == len(got)
        assert set(autotune.CANDIDATES) <= set(got)


@pytest.mark.parametrize(
    "rows,k,major_is_k", [(1023, 1016, False), (300, 4104, False), (7, 13, True), (64, 64, True)]
)
def test_autotune_operands_meet_the_tma_stride_rule(rows, k, major_is_k):
    """The operands autotune times on have the caller's shape and major, and a leading
    stride padded to 16 bytes even when the contiguous extent is not a multiple of 8."""
    from coda.runtime.autotune import _operand

    g = torch.Generator().manual_seed(0)
    t = _operand(rows, k, major_is_k, torch.bfloat16, "cpu", g)
    assert tuple(t.shape) == (rows, k)
    lead = t.stride(0) if major_is_k else t.stride(1)
    assert t.stride(1 if major_is_k else 0) == 1
    assert lead % 8 == 0 and lead >= (k if major_is_k else rows)


def test_long_k_problems_take_short_swizzle_groups_only_on_hbm3_cards():
    from coda.mainloop.config import LONG_K_GROUP_M

    long_k = [
        (16384, 4096, 11008),
        (4096, 11008, 16384),
        (16384, 4096, 22016),
        (22016, 4096, 16384),
    ]
    others = [(16384, 22016, 4096), (16384, 4096, 4096), (16384, 2048, 5632), (8192, 8192, 8192)]
    for m, n, k in long_k:
        short = choose_config(m, n, k, 132, short_groups=True)
        assert short.group_m == LONG_K_GROUP_M and short.tile_m == 128
        assert choose_config(m, n, k, 132).group_m == GemmConfig().group_m
    for m, n, k in others:
        assert choose_config(m, n, k, 132, short_groups=True) == choose_config(m, n, k, 132)
    # the H200 takes the cooperative long-K tile where it costs less (not on H100s: their
    # short groups were measured on PingPong tiles); the rest of the H100's config is the
    # H200's PingPong pick
    h200 = [choose_config(m, n, k, 132) for m, n, k in long_k]
    assert [(c.tile_m, c.cluster_m, c.cluster_n) for c in h200] == [
        (256, 1, 2),
        (128, 2, 1),
        (256, 1, 2),
        (256, 1, 2),
    ]
    a = choose_config(4096, 11008, 16384, 132, short_groups=True)
    assert attrs.evolve(a, group_m=GemmConfig().group_m) == h200[1]


def test_short_swizzle_groups_follow_the_device_memory(monkeypatch):
    from types import SimpleNamespace

    from coda.runtime import checks

    for gib, short in [(80, True), (94, True), (141, False)]:
        checks._short_groups.clear()
        props = SimpleNamespace(total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        assert checks.short_swizzle_groups(torch.device("cuda", 0)) is short
    checks._short_groups.clear()
