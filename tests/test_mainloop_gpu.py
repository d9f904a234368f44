"""GPU numerics of the PingPong GEMM (marker ``gpu``; skipped without a Hopper GPU).

Error is measured against a float64 reference; coda passes when its error is at most
twice eager PyTorch's own error for the same output dtype, plus a tiny atol.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda.mainloop.config import GemmConfig  # noqa: E402
from coda.matmul import gemm  # noqa: E402
from coda.testing.layouts import LAYOUTS, operands  # noqa: E402

# (M, N, K): aligned, ragged in every dimension, tiny, tall, wide.
SHAPES = [
    (128, 192, 64),
    (256, 384, 128),
    (1024, 1024, 1024),
    (4096, 4096, 512),
    (1, 8, 8),
    (7, 8, 16),
    (100, 200, 64),
    (129, 200, 72),
    (255, 136, 520),
    (1000, 1000, 1000),
    (1023, 1032, 1016),
    (333, 4104, 264),
    (4097, 264, 4104),
    (2048, 8, 2048),
    (8, 2048, 2048),
    (3000, 5000, 200),
    (517, 1231 + 1, 952),
    (64, 64, 4096),
    (16384, 24, 128),
    (24, 16384, 128),
    (1536, 1544, 8),
]


def _errors(a, b, out, out_dtype):
    ref = a.double() @ b.double().t()
    eager = (a @ b.t()) if out_dtype == a.dtype else (a.float() @ b.float().t()).to(out_dtype)
    scale = ref.abs().max().item() + 1e-30
    err = (out.double() - ref).abs().max().item() / scale
    base = (eager.double() - ref).abs().max().item() / scale
    return err, base


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_gemm_matches_float64_reference(shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 13 + k)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poison
    gemm(a, b, out=out)
    assert not out.isnan().any(), "unwritten output elements"
    err, base = _errors(a, b, out, torch.bfloat16)
    assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("ab_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemm_dtypes(ab_dtype, out_dtype):
    m, n, k = 777, 1000, 520
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(m, k, device="cuda", generator=g).to(ab_dtype)
    b = torch.randn(n, k, device="cuda", generator=g).to(ab_dtype)
    out = gemm(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    err, base = _errors(a, b, out, out_dtype)
    assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(tile_n=128, cluster_m=1),
        GemmConfig(tile_n=192, cluster_m=2),
        GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
        GemmConfig(tile_n=160, cluster_m=2, group_m=1),
        # 2x2 clusters (A and B both multicast; not yet run on a GPU when added)
        GemmConfig(tile_n=128, cluster_m=2, cluster_n=2),
        GemmConfig(tile_n=192, cluster_m=2, cluster_n=2, group_m=1),
    ],
    ids=str,
)
def test_gemm_configs_ragged(config):
    m, n, k = 1111, 1320, 1048
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(a, b, out=out, config=config)
    err, base = _errors(a, b, out, torch.bfloat16)
    assert not out.isnan().any()
    assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(1111, 1320, 1048), (129, 136, 72), (4096, 4096, 512)])
def test_gemm_cluster_2x2_every_layout(layout, shape):
    """A 2x2 cluster in every operand layout, ragged and not, odd and even tile counts (an
    odd count leaves a cluster with CTAs past the edge, which still load and release)."""
    _check_layout(GemmConfig(tile_n=128, cluster_m=2, cluster_n=2), layout, shape, seed=5)


def _check_layout(config: GemmConfig, layout: str, shape, seed: int) -> None:
    """bf16 ``A @ B.T`` with ``config`` on ``layout``'s operand views into a NaN-poisoned
    output: every element written, error against float64 within 2x eager bf16's."""
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a_v, b_v = operands(a, b, layout)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(a_v, b_v, out=out, config=config)
    err, base = _errors(a, b, out, torch.bfloat16)
    assert not out.isnan().any()
    assert err <= 2 * base + 1e-6, (err, base)


COOPERATIVE = [
    GemmConfig(tile_m=256, tile_n=128, cluster_m=2),
    GemmConfig(tile_m=256, tile_n=192, cluster_m=2),
    GemmConfig(tile_m=256, tile_n=128, cluster_m=1),
    GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2),
]


#: 64-column epilogue subtiles (``GemmConfig.epi_n``): half as many per tile
WIDE_SUBTILES = [
    GemmConfig(tile_n=128, cluster_m=2, epi_n=64),
    GemmConfig(tile_n=192, cluster_m=2, epi_n=64),
    GemmConfig(tile_m=256, tile_n=128, cluster_m=2, epi_n=64),
]


@pytest.mark.parametrize("config", COOPERATIVE + WIDE_SUBTILES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(1111, 1320, 1048), (129, 136, 72), (4096, 2048, 1024)])
def test_gemm_cooperative_and_wide_subtiles_every_layout(config, layout, shape):
    """The cooperative schedule (256-row tiles, both warpgroups on each) and 64-column
    epilogue subtiles: every operand layout, ragged M / N / K (a 256-row tile whose
    second half is past M), one tile row and many, into NaN-poisoned outputs."""
    _check_layout(config, layout, shape, seed=7)


@pytest.mark.parametrize("layout", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(tile_m=256, tile_n=128),
        GemmConfig(tile_m=256, tile_n=192),
        GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2),  # long-K heuristic
        GemmConfig(tile_n=128, epi_n=64),
    ],
    ids=str,
)
def test_gemm_cooperative_and_wide_subtiles_accumulate(layout, config):
    """``out += A @ B^T`` (fp32 TMA reduce-add) with cooperative tiles and with 64-column
    subtiles."""
    m, n, k = 1000, 1320, 520
    g = torch.Generator(device="cuda").manual_seed(8)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a_v, b_v = operands(a, b, layout)
    base = torch.randn(m, n, device="cuda", generator=g)
    out = base.clone()
    gemm(a_v, b_v, out=out, accumulate=True, config=config)
    ref = base.double() + a.double() @ b.double().T
    assert (out.double() - ref).abs().max().item() < 1e-3 * ref.abs().max().item()


def test_gemm_strided_views():
    """Row strides larger than the width (a column slice of a wider buffer) are supported."""
    g = torch.Generator(device="cuda").manual_seed(4)
    big_a = torch.randn(300, 256, device="cuda", generator=g).to(torch.bfloat16)
    big_b = torch.randn(200, 256, device="cuda", generator=g).to(torch.bfloat16)
    a, b = big_a[:, :128], big_b[:, :128]
    out_buf = torch.zeros(300, 256, device="cuda", dtype=torch.bfloat16)
    out = out_buf[:, :200]
    gemm(a, b, out=out)
    err, base = _errors(a, b, out, torch.bfloat16)
    assert err <= 2 * base + 1e-6
    assert (out_buf[:, 200:] == 0).all(), "wrote outside the output view"


LAYOUT_SHAPES = [(128, 192, 64), (129, 200, 72), (1023, 1032, 1016), (7, 8, 13), (333, 520, 1)]


def _check_poisoned_gemm(m, n, k, layout, seed):
    """coda.gemm of seeded bf16 operands stored in ``layout`` into a NaN-poisoned bf16 out:
    every element written, within the float64 error rule. Returns (a0, b0, a, b, g): the
    operands, their ``layout`` views and the generator, for further checks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a0 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a, b = operands(a0, b0, layout)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(a, b, out=out)
    assert not out.isnan().any(), "unwritten output elements"
    err, base = _errors(a0, b0, out, torch.bfloat16)
    assert err <= 2 * base + 1e-6, (err, base)
    return a0, b0, a, b, g


@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in LAYOUT_SHAPES])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gemm_every_operand_major(layout, shape):
    """Forward, dgrad, wgrad and the fourth layout: transposed views, no copies, ragged M,
    N, K (K need not be a multiple of 8 when no operand is K-major)."""
    m, n, k = shape
    if "k" in LAYOUTS[layout] and k % 8:
        k = -(-k // 8) * 8  # a K-major operand's rows are padded, its K is then free too
    _check_poisoned_gemm(m, n, k, layout, seed=m + n + k)


def test_linear_forward_dgrad_wgrad_without_copies():
    """The three GEMMs of an nn.Linear, as a training step calls them."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1000, 264, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(520, 264, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(1000, 520, device="cuda", generator=g).to(torch.bfloat16)
    for out, (a, b) in (
        (gemm(x, w), (x, w)),  # y = x @ w.T
        (gemm(dy, w.t()), (dy, w.t())),  # dx = dy @ w
        (gemm(dy.t(), x.t()), (dy.t(), x.t())),  # dw = dy.T @ x
    ):
        err, base = _errors(a, b, out, torch.bfloat16)
        assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fwd", "wgrad"])
def test_accumulate_adds_into_out(layout, out_dtype):
    """out += A @ B.T through TMA reduce-add: chunks of a wgrad summed into one buffer
    equal the whole product (fp32), and a bf16 out gets out + A @ B.T rounded once."""
    m, n, k = 777, 520, 1000
    g = torch.Generator(device="cuda").manual_seed(6)
    a0 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    init = torch.randn(m, n, device="cuda", generator=g).to(out_dtype)
    out = init.clone()
    chunks = [(0, 256), (256, 600), (600, k)]
    for lo, hi in chunks:
        a, b = operands(a0[:, lo:hi], b0[:, lo:hi], layout)
        gemm(a, b, out=out, accumulate=True)
    ref = init.double() + a0.double() @ b0.double().t()
    eager = (init.float() + a0.float() @ b0.float().t()).to(out_dtype)
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs().max().item() / scale
    base = (eager.double() - ref).abs().max().item() / scale
    assert err <= 2 * base + 1e-5, (err, base)


SPLIT_SHAPES = [(2048, 2048, 131072 + 520), (1000, 1032, 40000), (129, 136, 9000)]


def _rel_err(out, ref):
    return (out.double() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("layout", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SPLIT_SHAPES])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_k_matches_the_unsplit_kernel(shape, layout, accumulate, splits):
    """Long-K GEMMs into fp32: split-K units add through reduce-add into a zeroed (or,
    accumulating, the given) output; K ragged, so the last split reads past K (zero-
    filled). The baseline is the same kernel unsplit: at K ~ 1e5 the tensor cores' fp32
    accumulation is far from an fp32 FFMA GEMM's, and shorter splits can only do better.
    The second call of each takes the validated fast path."""
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a0 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a, b = operands(a0, b0, layout)
    init = torch.randn(m, n, device="cuda", generator=g)
    ref = a0.double() @ b0.double().t() + (init.double() if accumulate else 0)
    errs = {}
    for s in (1, splits):
        cfg = GemmConfig(tile_n=192, cluster_m=2, split_k=s)
        out = init.clone() if accumulate else torch.full((m, n), float("nan"), device="cuda")
        for _ in range(2):
            if accumulate:
                out.copy_(init)
            gemm(a, b, out=out, accumulate=accumulate, config=cfg)
        assert not out.isnan().any()
        errs[s] = _rel_err(out, ref)
    assert errs[splits] <= 2 * errs[1] + 1e-6, errs


def test_grid_holds_only_the_clusters_that_fit():
    """The persistent grid's SMs per cluster size, as the driver answers: every SM for
    one-CTA clusters, otherwise a multiple of the cluster size never above the SM count
    (an H200: 132, 132 and 120 for clusters of 1, 2 and 4 CTAs)."""
    from coda.runtime import occupancy

    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert occupancy.grid_sms(dev, 1) == sms
    for size in (2, 4):
        got = occupancy.grid_sms(dev, size)
        assert 0 < got <= sms and got % size == 0, (size, got)


def test_explicit_split_k_under_deterministic_algorithms(deterministic_algorithms):
    """Split sums land in finishing order: under torch.use_deterministic_algorithms(True)
    an explicit split config raises before launching (``out`` untouched), with
    ``warn_only=True`` it warns and runs; the unsplit GEMM is bitwise repeatable."""
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(256, 8192, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(512, 8192, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.full((256, 512), float("nan"), device="cuda")
    deterministic_algorithms()
    with pytest.raises(RuntimeError, match="split_k=4"):
        gemm(a, b, out=out, config=GemmConfig(split_k=4))
    assert out.isnan().all()
    first = gemm(a, b, out_dtype=torch.float32)
    assert torch.equal(first, gemm(a, b, out_dtype=torch.float32))
    deterministic_algorithms(warn_only=True)
    with pytest.warns(UserWarning, match="split_k=4"):
        gemm(a, b, out=out, config=GemmConfig(split_k=4))
    torch.testing.assert_close(out, first, rtol=1e-4, atol=1e-2)  # |C| ~ 90


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("layout", ["fwd", "wgrad"])
def test_heuristic_splits_few_tile_fp32_outputs(layout, accumulate, deterministic_algorithms):
    """The shape heuristic splits K for an fp32 output of few tiles (64 here, K = 8192):
    the result as accurate as the unsplit kernel's, written or accumulated, on the first
    call and on the validated fast path's; under deterministic algorithms the same call
    signature (already cached as a split launch) runs unsplit, bitwise repeatable, and
    accumulating included (the cache remembers a split, not only a zeroing)."""
    from coda import matmul
    from coda.mainloop.config import choose_config
    from coda.runtime import checks

    m, n, k = 512, 2048, 8192 + 40
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert matmul.AUTO_SPLIT_K and choose_config(m, n, k, sms, split_ok=True).split_k > 1
    g = torch.Generator(device="cuda").manual_seed(11)
    a0 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a, b = operands(a0, b0, layout)
    init = torch.randn(m, n, device="cuda", generator=g)
    ref = a0.double() @ b0.double().t() + (init.double() if accumulate else 0)

    def call(out):
        if accumulate:
            out.copy_(init)
        return gemm(a, b, out=out, accumulate=accumulate)

    unsplit = init.clone() if accumulate else torch.full((m, n), float("nan"), device="cuda")
    short = checks.short_swizzle_groups(a.device)
    plain = matmul._heuristic(m, n, k, sms, False, short)  # what deterministic calls run
    assert plain.split_k == 1
    gemm(a, b, out=unsplit, accumulate=accumulate, config=plain)
    base = _rel_err(unsplit, ref)
    for _ in range(2):  # the heuristic's path, then the validated fast path
        out = call(torch.full((m, n), float("nan"), device="cuda"))
        assert not out.isnan().any()
        assert _rel_err(out, ref) <= 2 * base + 1e-6, (_rel_err(out, ref), base)
    deterministic_algorithms()
    first = call(torch.empty(m, n, device="cuda"))
    again = call(torch.empty(m, n, device="cuda"))
    assert torch.equal(first, again)
    assert torch.equal(first, unsplit)  # the unsplit kernel, bit for bit


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_explicit_split_k_config(splits):
    """A split_k config runs any K (fewer k-tiles than splits included) into fp32 and bf16
    outputs, as accurately as the unsplit kernel (bf16: one rounding of the sum of
    fp32-rounded partials)."""
    g = torch.Generator(device="cuda").manual_seed(splits)
    for m, n, k in [(300, 264, 1000), (128, 192, 64), (513, 200, 4104)]:
        a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = a.double() @ b.double().t()
        for dtype in (torch.float32, torch.bfloat16):
            errs = []
            for s in (1, splits):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                gemm(a, b, out=out, config=GemmConfig(tile_n=192, cluster_m=2, split_k=s))
                errs.append(_rel_err(out, ref))
            bound = 2 * errs[0] + (2e-2 if dtype == torch.bfloat16 else 1e-6)
            assert errs[1] <= bound, (m, n, k, dtype, errs)


def test_gemm_replays_in_a_cuda_graph():
    """coda.gemm captured in a CUDA graph replays correctly on new inputs (no host sync,
    no allocation inside the capture when `out` is given)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(512, 512, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(512, 384, device="cuda", dtype=torch.bfloat16)
    gemm(a, b.t().contiguous().t(), out=out)  # compile outside the capture
    bt = b.t().contiguous().t()
    gemm(a, bt, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a, bt, out=out)
    for seed in (8, 9):
        g.manual_seed(seed)
        a.copy_(torch.randn(a.shape, device="cuda", generator=g))
        bt.copy_(torch.randn(bt.shape, device="cuda", generator=g))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err, base = _errors(a, bt, out, torch.bfloat16)
        assert err <= 2 * base + 1e-6, (seed, err, base)


def test_gemm_runs_on_the_current_stream():
    g = torch.Generator(device="cuda").manual_seed(10)
    a = torch.randn(2048, 2048, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", generator=g).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = gemm(a, b)
        later = out * 1  # ordered after the GEMM only if it ran on `side`
    torch.cuda.current_stream().wait_stream(side)
    err, base = _errors(a, b, later, torch.bfloat16)
    assert err <= 2 * base + 1e-6, (err, base)


AUTOTUNE_SHAPES = [(1023, 1032, 1016), (300, 520, 4104)]


@pytest.mark.parametrize(
    "shape", AUTOTUNE_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in AUTOTUNE_SHAPES]
)
@pytest.mark.parametrize("layout", ["fwd", "dgrad", "wgrad"])
def test_autotune_picks_a_candidate_and_matches_the_reference(layout, shape):
    """config="autotune" times its candidates (the heuristic's config, its shorter swizzle
    groups, the fixed tiles) once per shape and layout, and its output is right."""
    from coda.runtime import autotune

    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a0 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a, b = operands(a0, b0, layout)
    for _ in range(2):  # the second call reuses the remembered choice
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm(a, b, out=out, config="autotune")
        assert not out.isnan().any(), "unwritten output elements"
        err, base = _errors(a0, b0, out, torch.bfloat16)
        assert err <= 2 * base + 1e-6, (err, base)
    from coda.runtime.checks import short_swizzle_groups

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    short = short_swizzle_groups(a.device)
    majors = LAYOUTS[layout]
    chosen = [
        cfg for key, cfg in autotune._best.items() if key[:3] == (m, n, k) and key[-1] == majors
    ]
    assert len(chosen) == 1 and chosen[0] in autotune.candidates(m, n, k, sms, short)


@pytest.mark.parametrize("layout", ["fwd", "dgrad", "wgrad"])
def test_short_swizzle_groups_on_a_long_k_ragged_gemm(layout):
    """group_m = 1 (what the heuristic picks for long-K GEMMs on H100-class cards) and the
    default 8 write every element of a ragged long-K problem correctly."""
    m, n, k = 1100, 1032, 10248
    g = torch.Generator(device="cuda").manual_seed(7)
    a0 = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b0 = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    a, b = operands(a0, b0, layout)
    for group_m in (1, 8):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm(a, b, out=out, config=GemmConfig(tile_n=128, cluster_m=2, group_m=group_m))
        assert not out.isnan().any(), "unwritten output elements"
        err, base = _errors(a0, b0, out, torch.bfloat16)
        assert err <= 2 * base + 1e-6, (group_m, err, base)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(2500, 3000, 9000), (2000, 2000, 8192)], ids=str)
def test_default_heuristic_on_ragged_long_k(layout, shape):
    """The heuristic's cooperative 256 x 128 / 1 x 2 pick for K >= 8192 (a batch's weight
    gradients), ragged, every layout: a NaN-poisoned bf16 out fully written within the
    float64 error rule, and an fp32 out accumulated into."""
    from coda.mainloop.config import choose_config
    from coda.runtime.checks import short_swizzle_groups

    m, n, k = shape
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = choose_config(m, n, k, sms, short_groups=short_swizzle_groups(device))
    if not short_swizzle_groups(device):  # H200-class memory: the cooperative pick
        assert (cfg.tile_m, cfg.cluster_m, cfg.cluster_n) == (256, 1, 2)
    a0, b0, a, b, g = _check_poisoned_gemm(m, n, k, layout, seed=m + k)
    init = torch.randn(m, n, device="cuda", generator=g)
    acc = init.clone()
    gemm(a, b, out=acc, accumulate=True)
    ref = init.double() + a0.double() @ b0.double().t()
    eager = init + a0.float() @ b0.float().t()
    scale = ref.abs().max().item()
    err = (acc.double() - ref).abs().max().item() / scale
    base = (eager.double() - ref).abs().max().item() / scale
    assert err <= 2 * base + 1e-5, (err, base)
