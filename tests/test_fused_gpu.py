"""Composed epilogues fused into the GEMM on the GPU (marker ``gpu``; needs Hopper).

Each composition runs through ``coda.testing.fuzz.check_example``: outputs pre-filled
with NaN, compared against a float64-accumulator reference and against eager PyTorch
(bf16 GEMM output, then the epilogue): err(coda) <= 2 * err(eager) + 1e-3.
"""

from __future__ import annotations

import attrs
import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda import Epilogue  # noqa: E402
from coda.caches import BoundedCache  # noqa: E402
from coda.mainloop.config import GemmConfig, choose_epilogue_config  # noqa: E402
from coda.primitives import Elementwise, TileLoad, TileReduce, TileStore, VecLoad, ops  # noqa: E402
from coda.runtime import epilogue_kernels, finalize  # noqa: E402
from coda.runtime.fused import in_kernel_axes, n_multiple  # noqa: E402
from coda.testing import fns  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.fuzz import check_example  # noqa: E402
from coda.testing.layouts import LAYOUTS, operands  # noqa: E402
from coda.testing.strategies import make_inputs  # noqa: E402
from coda.testing.tolerance import compare  # noqa: E402

bf16 = torch.bfloat16
CONFIG = GemmConfig(tile_n=128, cluster_m=2)
SHAPES = [(128, 128, 64), (300, 520, 264), (1000, 776, 136), (7, 8, 8), (4096, 1024, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(EPILOGUES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_matches_reference(name, shape, layout):
    _check(EPILOGUES[name], shape, layout)


#: a ragged problem whose plain GEMM runs 128 x 192 tiles, at K <= WIDE_EPILOGUE_MAX_K:
#: ``choose_epilogue_config`` gives its fused calls 128 x 192 tiles too
WIDE_TILE_SHAPE = (1000, 3000, 200)


@pytest.mark.parametrize("name", list(EPILOGUES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_short_k_wide_tile_heuristic_matches_reference(name, layout):
    """Every catalogue epilogue, every layout, on the 128 x 192 tile the heuristic picks
    for short mainloops (as ``check_example`` passes it explicitly: also where the tile
    spills, which a default call would narrow)."""
    epi = EPILOGUES[name]
    m, n, k = WIDE_TILE_SHAPE
    n = -(-n // n_multiple(epi)) * n_multiple(epi)
    assert choose_epilogue_config(m, n, k).tile_n == 192
    _check(epi, (m, n, k), layout)


#: both warpgroups' epilogues at once (the map passes' config); enough tiles that every CTA
#: runs several, so the two warpgroups overlap
CONCURRENT = GemmConfig(
    tile_n=128, cluster_m=2, epi_stages=8, load_stages=16, concurrent_epilogues=True
)


@pytest.mark.parametrize(
    "shape",
    [(3000, 2056, 40), (2100, 2056, 264), (1000, 776, 40)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_concurrent_epilogues_match_reference(name, shape):
    """Split store buffers and scratch per warpgroup: every catalogue epilogue on ragged
    problems of one k-tile (the map passes) and of several; the smallest has few enough
    tiles that the GEMM kernel finalizes its results itself."""
    _check(EPILOGUES[name], shape, config=CONCURRENT)


def _check(epi, shape, layout="fwd", config=None):
    m, n, k = shape
    step = n_multiple(epi)
    n = -(-n // step) * step  # N rounded up to what the epilogue's tensors need
    A, B, tensors = make_inputs(epi, m, n, k, bf16, seed=m + n + k)
    tensors = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in tensors.items()}
    A, B = operands(A.cuda(), B.cuda(), layout)
    record = check_example(epi, A, B, tensors, config=config)
    assert not record["failed"], record


@pytest.mark.parametrize("where", ["in_gemm", "finalize_kernel"])
def test_fused_call_replays_in_a_cuda_graph(where, monkeypatch):
    """A fused epilogue (loads, stores, row reduction + finalize) captured in a CUDA graph
    with caller-owned outputs replays correctly on new inputs: finalized in the GEMM
    kernel, or by the finalize kernel (a programmatic dependent launch in the graph)."""
    if where == "finalize_kernel":
        monkeypatch.setattr(finalize, "IN_GEMM_MAX_TILES_PER_SM", 0)
    epi = EPILOGUES["rmsnorm_fwd"]
    m, n, k = 1000, 512, 264
    A, B, tensors = make_inputs(epi, m, n, k, bf16, seed=11)
    A, B = A.cuda(), B.cuda()
    tensors = {key: v.cuda() for key, v in tensors.items()}
    outs = {
        s.name: torch.empty(s.shape(m, n, (128, 128)), dtype=s.dtype, device="cuda")
        for s in epi.outputs
    }
    epi(A, B, outputs=outs, config=CONFIG, **tensors)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        epi(A, B, outputs=outs, config=CONFIG, **tensors)
    for seed in (12, 13):
        A2, B2, t2 = make_inputs(epi, m, n, k, bf16, seed=seed)
        A.copy_(A2)
        B.copy_(B2)
        for key, v in t2.items():
            tensors[key].copy_(v)
        for t in outs.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        truth = epi.reference(A, B, tile=(128, 128), acc=A.double() @ B.double().T, **tensors)
        eager = epi.reference(A, B, tile=(128, 128), acc=(A @ B.T).float(), **tensors)
        for name, t in truth.items():
            c = compare(outs[name], t, name=name, baseline=eager[name], atol=1e-3, floor=1.0)
            assert c.passed, (seed, name, c)


def _swap(a, b):
    return b, a


# Width and layout corners the catalogue does not reach: a pair map at width 1/2 (the
# pair's columns sit in neighbouring lanes), column reductions of width-1/2 and width-2
# values, a width-2 col vector, a width-2 fp32 store.
CORNERS = {
    "half_width_pair_map": Epilogue()
    .add(Elementwise("y", ops.swiglu, ins=("acc",), pairwise="reduce"))
    .add(Elementwise("z", _swap, ins=("y",), pairwise="map"))
    .add(TileStore("z", bf16))
    .add(TileReduce("zc", of="z", op="sumsq", per="col"))
    .add(TileReduce("zr", of="z", op="max")),
    "double_width_cols": Epilogue()
    .add(TileLoad("gu", bf16, width=2))
    .add(VecLoad("g2", per="col", dtype=bf16, width=2))
    .add(Elementwise("p", ops.mul, ins=("gu", "g2")))
    .add(TileReduce("pc", of="p", op="max", per="col"))
    .add(Elementwise("q", fns.swiglu_plus, ins=("p", "acc"), pairwise="reduce"))
    .add(TileReduce("qc", of="q", op="sum", per="col"))
    .add(TileStore("p", torch.float32)),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(CORNERS))
def test_width_corners_match_reference(name, shape):
    _check(CORNERS[name], shape)


#: the catalogue epilogues whose results are finalized on the GPU
REDUCING = [n for n in EPILOGUES if finalize.uses_kernel(EPILOGUES[n])]
REDUCING_ALL = {**{n: EPILOGUES[n] for n in REDUCING}, **CORNERS}


@pytest.mark.parametrize(
    "shape", [(1000, 776, 136), (4096, 1024, 512), (7, 8, 8), (5000, 264, 64), (3000, 2056, 40)]
)
@pytest.mark.parametrize("name", REDUCING + list(CORNERS))
def test_finalize_kernel_path_matches_reference(name, shape, monkeypatch):
    """With the GEMM kernel's own finalize turned off (thresholds at 0), the finalize
    kernel runs after the GEMM (a programmatic dependent launch) and gives the same
    results: row results and column results with ``finalize.lanes``' threads each,
    ragged column counts (widths 1/2 and 2) and columns of 1 to 40 tiles."""
    monkeypatch.setattr(finalize, "ROWS_IN_GEMM_MAX_N", 0)
    monkeypatch.setattr(finalize, "COLS_IN_GEMM_MAX_M", 0)
    epi = REDUCING_ALL[name]
    _check(epi, shape)


@pytest.mark.parametrize("lanes", [(16, 16), (8, 4), (2, 32), (32, 8)], ids=str)
@pytest.mark.parametrize("shape", [(1000, 776, 136), (5000, 264, 64), (3000, 2056, 40)])
@pytest.mark.parametrize("name", REDUCING + list(CORNERS))
def test_finalize_kernel_lanes_match_reference(name, shape, lanes, monkeypatch):
    """The finalize kernel with other thread counts per row result and per column result
    (``finalize.lanes``): 2 to 32 threads per row (butterflies over that many lanes, the
    log-sum-exp's merge too), 4 to 32 per column."""
    monkeypatch.setattr(finalize, "ROWS_IN_GEMM_MAX_N", 0)
    monkeypatch.setattr(finalize, "COLS_IN_GEMM_MAX_M", 0)
    for short_or_long in ("SHORT", "LONG"):
        monkeypatch.setattr(finalize, f"{short_or_long}_ROW_LANES", lanes[0])
        monkeypatch.setattr(finalize, f"{short_or_long}_COL_LANES", lanes[1])
    _check(REDUCING_ALL[name], shape)


def _inputs(epi, m, n, k, seed):
    A, B, tensors = make_inputs(epi, m, n, k, bf16, seed=seed)
    return A.cuda(), B.cuda(), {key: v.cuda() for key, v in tensors.items()}


def _assert_matches(epi, A, B, tensors, got, tile=(128, 128)):
    truth = epi.reference(A, B, tile=tile, acc=A.double() @ B.double().T, **tensors)
    eager = epi.reference(A, B, tile=tile, acc=(A @ B.T).float(), **tensors)
    assert set(got) == {s.name for s in epi.outputs if not s.is_partials}
    for name in got:  # the results and M x N outputs (the partials are scratch)
        c = compare(got[name], truth[name], name=name, baseline=eager[name], atol=1e-3, floor=1.0)
        assert c.passed, (name, c)


@pytest.mark.parametrize("name", REDUCING)
def test_in_kernel_finalize_counters_reset_across_calls_and_streams(name):
    """The arrival counters live in one buffer per stream and every launch leaves them
    at zero: back-to-back calls on one stream, then on two streams at once (no sync in
    between), all finalize right."""
    epi = EPILOGUES[name]
    m, k = 1000, 136
    n = -(-776 // n_multiple(epi)) * n_multiple(epi)
    assert finalize.in_gemm(epi, CONFIG, m, n, 132)
    runs = [_inputs(epi, m, n, k, seed) for seed in range(4)]
    outs = [epi(A, B, config=CONFIG, **t) for A, B, t in runs[:2]]  # same stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs.append(epi(*runs[2][:2], config=CONFIG, **runs[2][2]))
    with torch.cuda.stream(side):
        outs.append(epi(*runs[3][:2], config=CONFIG, **runs[3][2]))
    torch.cuda.synchronize()
    for (A, B, t), got in zip(runs, outs, strict=True):
        _assert_matches(epi, A, B, t, got)


#: the catalogue epilogues an early finalize applies to (row results only)
EARLY = [n for n in REDUCING if in_kernel_axes(EPILOGUES[n]) == (True, False)]


@pytest.mark.parametrize("name", EARLY)
def test_early_finalize_counters_reset_across_calls_streams_and_plans(name, monkeypatch):
    """Row results finalized early (opt-in: each row band by the finalize kernel as soon
    as the GEMM's tiles of it are in): back-to-back calls, a call whose GEMM finalizes
    itself in between (it needs the shared counters back at zero), and two streams at
    once (no sync in between) all finalize right, and every stream's counters end at
    zero."""
    monkeypatch.setattr(finalize, "EARLY_ROWS", True)
    monkeypatch.setattr(epilogue_kernels, "_plans", BoundedCache(4096))
    monkeypatch.setattr(epilogue_kernels, "_calls", BoundedCache(4096))
    epi = EPILOGUES[name]
    assert finalize.early_rows(epi, CONFIG, in_kernel=False)
    mult = n_multiple(epi)
    big = (8192 + 77, -(-1000 // mult) * mult, 136)  # 65 rows of tiles, 520 tiles
    small = (1000, -(-776 // mult) * mult, 136)
    assert not finalize.in_gemm(epi, CONFIG, big[0], big[1], 132)
    assert finalize.in_gemm(epi, CONFIG, small[0], small[1], 132)
    runs = [_inputs(epi, *shape, seed) for seed, shape in enumerate([big, small, big, big, big])]
    outs = [epi(A, B, config=CONFIG, **t) for A, B, t in runs[:4]]  # one stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs.append(epi(*runs[4][:2], config=CONFIG, **runs[4][2]))
    torch.cuda.synchronize()
    for (A, B, t), got in zip(runs, outs, strict=True):
        _assert_matches(epi, A, B, t, got)
    device = runs[0][0].device
    assert not epilogue_kernels._scratch(device).counters(1).any()
    with torch.cuda.stream(side):
        assert not epilogue_kernels._scratch(device).counters(1).any()


@pytest.mark.parametrize("where", ["in_gemm", "finalize_kernel"])
@pytest.mark.parametrize("name", REDUCING)
def test_repeated_calls_run_the_bound_call_right(name, where, monkeypatch):
    """Calls without ``outputs`` (the bound call: generated straight-line host code, the
    first call through the full checks, the next ones through the signature look-up)
    on new inputs of the same signature: every call's results match its reference, with
    the finalize in the GEMM kernel or in the finalize kernel."""
    if where == "finalize_kernel":
        monkeypatch.setattr(finalize, "IN_GEMM_MAX_TILES_PER_SM", 0)
    # the signature cache does not see the threshold: start this case from an empty one
    monkeypatch.setattr(epilogue_kernels, "_calls", BoundedCache(4096))
    epi = EPILOGUES[name]
    m, k = 1000, 136
    n = -(-776 // n_multiple(epi)) * n_multiple(epi)
    assert finalize.in_gemm(epi, CONFIG, m, n, 132) == (where == "in_gemm")
    runs = [_inputs(epi, m, n, k, seed) for seed in range(3)]
    outs = [epi(A, B, config=CONFIG, **t) for A, B, t in runs]
    torch.cuda.synchronize()
    for (A, B, t), got in zip(runs, outs, strict=True):
        _assert_matches(epi, A, B, t, got)


def test_results_never_alias_each_other():
    """Finalized results (and M x N outputs) own their storage: custom ops and autograd
    may return or save them side by side; only the per-tile partials share one buffer."""
    epi = EPILOGUES["lse_target"]
    A, B, tensors = make_inputs(epi, 300, 520, 64, bf16, seed=3)
    tensors = {key: v.cuda() for key, v in tensors.items()}
    out = epi(A.cuda(), B.cuda(), **tensors)
    results = [out[s.name] for s in epi.outputs if not s.is_partials]
    storages = {t.untyped_storage().data_ptr() for t in results}
    assert len(storages) == len(results)


#: ``GemmConfig.staggered_copies`` (opt-in): 32-bit register <-> shared copies take their
#: two column halves in an order staggered by lane parity. Every epilogue with such a
#: copy: swiglu_bwd (packed width-2 load and store), fp32 tiles in and out, a width-2
#: fp32 store next to packed loads, in every layout
STAGGERED = GemmConfig(tile_n=128, cluster_m=2, staggered_copies=True)
STAGGERED_EPILOGUES = {
    "swiglu_bwd": EPILOGUES["swiglu_bwd"],
    "fp32_tiles": Epilogue()
    .add(TileLoad("r", torch.float32))
    .add(Elementwise("x", ops.add, ins=("acc", "r")))
    .add(TileStore("x", torch.float32))
    .add(TileReduce("xs", of="x", op="sumsq")),
    "double_width_cols": CORNERS["double_width_cols"],
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(STAGGERED_EPILOGUES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staggered_copies_match_reference(name, shape, layout):
    _check(STAGGERED_EPILOGUES[name], shape, layout, config=STAGGERED)


#: a 2x2 cluster (A and B both multicast; opt-in): the epilogue runs per CTA as with 2x1
CLUSTER_2X2 = GemmConfig(tile_n=128, cluster_m=2, cluster_n=2)


@pytest.mark.parametrize(
    "shape", [(300, 520, 264), (1000, 776, 136)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_cluster_2x2_epilogues_match_reference(name, shape):
    _check(EPILOGUES[name], shape, config=CLUSTER_2X2)


#: 128 x 192 tiles, as a caller may ask for them: the catalogue runs at that width whether
#: or not it spills (``epilogue_choice`` would narrow a spilling one, but it must be right)
WIDE = GemmConfig(tile_n=192, cluster_m=2)


@pytest.mark.parametrize(
    "shape", [(300, 520, 264), (1000, 776, 136)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("name", list(EPILOGUES))
@pytest.mark.parametrize("layout", ["fwd", "wgrad"])
def test_wide_tile_epilogues_match_reference(name, shape, layout):
    _check(EPILOGUES[name], shape, layout, config=WIDE)


#: 64-column epilogue subtiles (``GemmConfig.epi_n=64``): every catalogue epilogue, ragged
#: shapes, every operand layout; with the epilogues taking turns and running at once
EPI64 = GemmConfig(tile_n=128, cluster_m=2, epi_n=64)
EPI64_CONCURRENT = GemmConfig(
    tile_n=128, cluster_m=2, epi_n=64, epi_stages=8, load_stages=16, concurrent_epilogues=True
)


@pytest.mark.parametrize(
    "shape",
    [(300, 520, 264), (1000, 776, 136), (4096, 1024, 512)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("name", list(EPILOGUES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_wide_subtile_epilogues_match_reference(name, shape, layout):
    _check(EPILOGUES[name], shape, layout, config=EPI64)


@pytest.mark.parametrize(
    "shape", [(3000, 2056, 40), (1000, 776, 8)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_map_pass_default_config_matches_reference(name, shape):
    """One-k-tile problems with no config given run what ``epilogue_choice`` picks for
    them (64-column subtiles, concurrent epilogues, unless that spills): every catalogue
    epilogue on ragged shapes."""
    from coda.runtime.epilogue_kernels import epilogue_choice

    m, n, k = shape
    cfg = epilogue_choice(
        EPILOGUES[name], bf16, m, n, k, torch.cuda.get_device_properties(0).multi_processor_count
    )[0]
    assert cfg.concurrent_epilogues, cfg
    _check(EPILOGUES[name], shape)


@pytest.mark.parametrize(
    "shape", [(3000, 2056, 40), (1000, 776, 40)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_wide_subtile_concurrent_epilogues_match_reference(name, shape):
    _check(EPILOGUES[name], shape, config=EPI64_CONCURRENT)


@pytest.mark.parametrize(
    "shape", [(300, 520, 264), (1000, 776, 136), (4096, 1024, 512), (100, 264, 72)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_catalogue_epilogue_on_cooperative_tiles(name, shape, layout):
    """Every catalogue epilogue (M x N loads, row and column reductions, vectors) with
    an explicit cooperative config: both warpgroups run it on their 128-row halves of
    each 256-row tile at once, their loads alternating in one ring; ragged M, N, K (a
    half past the last row: M = 300, 100; a 2 x 1 cluster past it: M = 100)."""
    _check(EPILOGUES[name], shape, layout, config=GemmConfig(tile_m=256, tile_n=128))


@pytest.mark.parametrize("tile_n", [192, 128])
@pytest.mark.parametrize("name", ["rmsnorm_fwd", "swiglu_bwd", "lse_target", "dgamma_colsum"])
def test_catalogue_epilogue_on_wide_cooperative_tiles(name, tile_n):
    """256 x 192 tiles (the plain GEMM's pick for long runs) and 256 x 128 (its pick for
    long K, which ``config="gemm"`` hands light epilogues) with 1 x 2 clusters."""
    cfg = GemmConfig(tile_m=256, tile_n=tile_n, cluster_m=1, cluster_n=2)
    _check(EPILOGUES[name], (1000, 1160, 200), "wgrad", config=cfg)
    _check(EPILOGUES[name], (600, 776, 520), "fwd", config=cfg)


#: a rolled epilogue: each 64-row band's subtiles in a runtime loop over one copy of
#: the subtile code (``GemmConfig.rolled_epilogue``)
ROLLED = GemmConfig(tile_n=128, cluster_m=2, rolled_epilogue=True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(EPILOGUES) + list(CORNERS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rolled_epilogues_match_reference(name, shape, layout):
    """Every catalogue epilogue and width corner rolled: row state (reductions,
    log-sum-exp, target selection) carried across the runtime subtile loop in
    registers, column reductions, vectors loaded per subtile; ragged M, N, K."""
    epi = EPILOGUES[name] if name in EPILOGUES else CORNERS[name]
    _check(epi, shape, layout, config=ROLLED)


@pytest.mark.parametrize(
    "config",
    [
        attrs.evolve(CONCURRENT, rolled_epilogue=True),
        GemmConfig(tile_m=256, tile_n=128, rolled_epilogue=True),
        GemmConfig(tile_n=192, cluster_m=2, epi_n=64, rolled_epilogue=True),
    ],
    ids=["concurrent", "cooperative", "wide_subtiles"],
)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_rolled_epilogues_in_other_schedules(name, config):
    """Rolled with concurrent epilogues (one k-tile and several), on cooperative tiles and
    on 128 x 192 tiles of 64-column subtiles (3 subtiles a band)."""
    for shape in [(3000, 2056, 40), (1000, 776, 136)]:
        _check(EPILOGUES[name], shape, "fwd", config=config)
