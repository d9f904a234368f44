"""Each primitive's ``reference`` against plain eager PyTorch written independently here,
in float64 (and each math/ops function against its textbook formula)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import (
    Elementwise,
    Epilogue,
    InputError,
    LogSumExp,
    ScalarLoad,
    SoftmaxEntropy,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
)
from coda import math as cm
from coda.testing.tolerance import assert_close_to_reference, tolerance

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
M, N, K = 37, 44, 24  # ragged against every tile used below


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def operands(dtype=BF16, m=M, n=N, k=K, seed=0):
    g = gen(seed)
    A = (torch.randn(m, k, generator=g) * k**-0.25).to(dtype)
    B = (torch.randn(n, k, generator=g) * k**-0.25).to(dtype)
    return A, B


def acc64(A, B):
    return A.to(F64) @ B.to(F64).T


def close(actual, truth, dtype=None, **kw):
    kw.setdefault("floor", 1.0)
    assert_close_to_reference(actual, truth, tol=tolerance(dtype or actual.dtype), **kw)


# ---- loads and stores ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_tileload_tilestore(dtype):
    A, B = operands()
    r = torch.randn(M, N, generator=gen(1)).to(dtype)
    epi = Epilogue().add(
        TileLoad("r", dtype),
        Elementwise("x", ops.add, ins=("acc", "r")),
        TileStore("x", dtype),
        TileStore("acc", F32, name="c"),
    )
    out = epi.reference(A, B, r=r)
    assert out["x"].dtype == dtype and out["x"].shape == (M, N)
    close(out["x"], acc64(A, B) + r.to(F64))
    close(out["c"], acc64(A, B))


@pytest.mark.parametrize("width", [0.5, 2])
def test_tileload_width(width):
    A, B = operands()
    cols = int(N * width)
    t = torch.randn(M, cols, generator=gen(2)).to(BF16)
    epi = Epilogue().add(
        TileLoad("t", BF16, width=width),
        Elementwise("y", ops.tanh, ins="t"),
        TileStore("y", F32),
    )
    out = epi.reference(A, B, t=t)
    assert out["y"].shape == (M, cols)
    close(out["y"], torch.tanh(t.to(F64)))


def test_vecload_row_col_and_scalar():
    A, B = operands(F16)
    g = gen(3)
    rstd, gamma = torch.rand(M, generator=g) + 0.5, torch.randn(N, generator=g)
    epi = Epilogue().add(
        VecLoad("rstd", per="row", dtype=F32),
        VecLoad("gamma", per="col", dtype=BF16),
        ScalarLoad("alpha"),
        Elementwise("y", lambda a, r, gm, s: a * r * gm + s, ins=("acc", "rstd", "gamma", "alpha")),
        Elementwise("outer", ops.mul, ins=("rstd", "gamma")),  # row x col -> tile
        TileStore("y", F32),
        TileStore("outer", F32),
    )
    out = epi.reference(A, B, rstd=rstd, gamma=gamma.to(BF16), alpha=0.75)
    g64 = gamma.to(BF16).to(F64)
    close(out["y"], acc64(A, B) * rstd.to(F64)[:, None] * g64[None, :] + 0.75)
    close(out["outer"], rstd.to(F64)[:, None] * g64[None, :])
    assert epi.values["outer"].kind == "tile"


def test_vector_only_elementwise_stays_a_vector():
    A, B = operands()
    r = torch.rand(M, generator=gen(4)) + 0.1
    epi = Epilogue().add(
        VecLoad("r", per="row", dtype=F32),
        Elementwise("r2", lambda r: cm.sqrt(r), ins="r"),
        Elementwise("y", ops.scale, ins=("acc", "r2")),
        TileStore("y", F32),
    )
    assert epi.values["r2"].kind == "row"
    out = epi.reference(A, B, r=r)
    close(out["y"], acc64(A, B) * r.to(F64).sqrt()[:, None])


# ---- elementwise math ------------------------------------------------------------------
def sig64(x):
    return 1.0 / (1.0 + torch.exp(-x))


TEXTBOOK = {
    "exp": (cm.exp, torch.exp),
    "exp2": (cm.exp2, lambda x: 2.0**x),
    "log": (lambda x: cm.log(x * x + 0.5), lambda x: torch.log(x * x + 0.5)),
    "log2": (lambda x: cm.log2(x * x + 0.5), lambda x: torch.log(x * x + 0.5) / math.log(2)),
    "log1p": (lambda x: cm.log1p(x * x), lambda x: torch.log(1 + x * x)),
    "sqrt": (lambda x: cm.sqrt(x * x + 1), lambda x: (x * x + 1) ** 0.5),
    "rsqrt": (lambda x: cm.rsqrt(x * x + 1), lambda x: (x * x + 1) ** -0.5),
    "sigmoid": (cm.sigmoid, sig64),
    "silu": (cm.silu, lambda x: x * sig64(x)),
    "tanh": (cm.tanh, lambda x: (torch.exp(2 * x) - 1) / (torch.exp(2 * x) + 1)),
    "relu": (cm.relu, lambda x: x * (x > 0)),
    "softplus": (cm.softplus, lambda x: torch.log(1 + torch.exp(x))),
    "erf": (cm.erf, torch.special.erf),
    "cos": (cm.cos, torch.cos),
    "sin": (cm.sin, torch.sin),
    "abs": (cm.abs, lambda x: torch.where(x < 0, -x, x)),
    "gelu_tanh": (
        cm.gelu_tanh,
        lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "maximum": (lambda x: cm.maximum(x, 0.25), lambda x: torch.where(x > 0.25, x, 0.25)),
    "minimum": (lambda x: cm.minimum(-0.5, x), lambda x: torch.where(x < -0.5, x, -0.5)),
    "clamp": (lambda x: cm.clamp(x, -1.0, 0.5), lambda x: x.clamp(-1.0, 0.5)),
    "where": (lambda x: cm.where(x > 0, x, 0.1 * x), lambda x: torch.where(x > 0, x, 0.1 * x)),
}


@pytest.mark.parametrize("name", sorted(TEXTBOOK))
def test_math_function_through_elementwise(name):
    fn, textbook = TEXTBOOK[name]
    A, B = operands(F32)
    out = Epilogue().add(Elementwise("y", fn), TileStore("y", F32)).reference(A, B)
    close(out["y"], textbook(acc64(A, B)))


def test_math_rejects_foreign_types():
    with pytest.raises(TypeError, match=r"math\.exp: unsupported argument type .*list"):
        cm.exp([1.0])
    with pytest.raises(TypeError, match="CuTeDSL"):
        cm.silu("x")
    with pytest.raises(TypeError, match=r"maximum: needs at least one torch.Tensor"):
        cm.maximum(1.0, 2.0)


def test_elementwise_constant_result_broadcasts():
    A, B = operands()
    out = Epilogue().add(Elementwise("one", lambda a: 1.5), TileStore("one", F32)).reference(A, B)
    assert torch.equal(out["one"], torch.full((M, N), 1.5))


def test_elementwise_bad_result_shape_is_reported():
    A, B = operands()
    epi = Epilogue().add(Elementwise("y", lambda a: a.sum(1)), TileStore("y", F32))
    with pytest.raises(ValueError, match=r"Elementwise\('y' = <lambda>\(acc\)\) returned shape"):
        epi.reference(A, B)


@pytest.mark.parametrize(
    "fn", [lambda a: a.mean(), lambda a: a.sum(0, keepdim=True)], ids=["mean", "col_sum"]
)
def test_elementwise_fn_that_reduces_is_refused(fn):
    """A reduction inside fn whose result broadcasts back would reduce over one subtile
    in the kernel (reference and simulator disagreed by 0.44 for the mean before):
    refused on both. (One broadcast back inside fn, ``a - a.amax(1, keepdim=True)``,
    keeps the shape and cannot be told apart: docs/primitives.md.)"""
    A, B = operands()
    epi = Epilogue().add(Elementwise("y", fn), TileStore("y", F32))
    with pytest.raises(ValueError, match="must act element by element"):
        epi.reference(A, B)
    with pytest.raises(ValueError, match="must act element by element"):
        coda.simulate(epi, A, B, tile=(8, 8), subtile=(8, 8))


# ---- pairwise --------------------------------------------------------------------------
def test_swiglu_forward_on_interleaved_operand():
    A, B = operands()
    gu = torch.randn(M, 2 * N, generator=gen(5)).to(BF16)
    epi = Epilogue().add(
        TileLoad("gu", BF16, width=2),
        Elementwise("y", ops.swiglu, ins="gu", pairwise="reduce"),
        TileStore("y", BF16),
    )
    assert epi.values["y"].width == 1
    out = epi.reference(A, B, gu=gu)
    g, u = gu.to(F64)[:, 0::2], gu.to(F64)[:, 1::2]
    close(out["y"], g * sig64(g) * u)


def test_swiglu_of_acc_halves_the_width():
    A, B = operands()
    epi = Epilogue().add(Elementwise("y", ops.swiglu, pairwise="reduce"), TileStore("y", F32))
    assert epi.values["y"].width == 0.5 and epi.n_alignment == 2
    out = epi.reference(A, B)
    acc = acc64(A, B)
    assert out["y"].shape == (M, N // 2)
    close(out["y"], F.silu(acc[:, 0::2]) * acc[:, 1::2])


def test_swiglu_backward_matches_autograd():
    """(dg, du) from dy (width 1, here acc) and the gate/up operand (width 2)."""
    A, B = operands()
    gu = torch.randn(M, 2 * N, generator=gen(6)).to(BF16)
    epi = Epilogue().add(
        TileLoad("gu", BF16, width=2),
        Elementwise("dgu", ops.swiglu_backward, ins=("gu", "acc"), pairwise="map"),
        TileStore("dgu", F32),
    )
    assert epi.values["dgu"].width == 2
    out = epi.reference(A, B, gu=gu)
    g = gu.to(F64)[:, 0::2].clone().requires_grad_()
    u = gu.to(F64)[:, 1::2].clone().requires_grad_()
    dy = acc64(A, B)
    dg, du = torch.autograd.grad((F.silu(g) * u * dy).sum(), (g, u))
    expected = torch.empty(M, 2 * N, dtype=F64)
    expected[:, 0::2], expected[:, 1::2] = dg, du
    close(out["dgu"], expected)


def test_rope_is_complex_rotation_and_inverse_undoes_it():
    A, B = operands(F32)
    g = gen(7)
    pos = torch.arange(M, dtype=F32) * 0.25
    freq = torch.rand(N // 2, generator=g)
    epi = Epilogue().add(
        VecLoad("pos", per="row", dtype=F32),
        VecLoad("freq", per="col", dtype=F32, width=0.5),
        Elementwise("q", ops.rope, ins=("acc", "pos", "freq"), pairwise="map"),
        Elementwise("back", ops.rope_inverse, ins=("q", "pos", "freq"), pairwise="map"),
        TileStore("q", F32),
        TileStore("back", F32),
    )
    out = epi.reference(A, B, pos=pos, freq=freq)
    acc = acc64(A, B)
    z = torch.view_as_complex(acc.reshape(M, N // 2, 2).contiguous())
    rot = torch.polar(torch.ones(M, N // 2, dtype=F64), pos.to(F64)[:, None] * freq.to(F64))
    expected = torch.view_as_real(z * rot).reshape(M, N)
    close(out["q"], expected)
    close(out["back"], acc)


def test_pairwise_reduce_with_half_width_input():
    A, B = operands()
    y = torch.randn(M, N // 2, generator=gen(8)).to(F16)
    epi = Epilogue().add(
        TileLoad("y", F16, width=0.5),
        Elementwise("z", lambda e, o, y: e * o + y, ins=("acc", "y"), pairwise="reduce"),
        TileStore("z", F32),
    )
    out = epi.reference(A, B, y=y)
    acc = acc64(A, B)
    close(out["z"], acc[:, 0::2] * acc[:, 1::2] + y.to(F64))


# ---- reductions ------------------------------------------------------------------------
def fold64(x, op, dim):
    if op == "sumsq":
        return (x * x).sum(dim)
    return x.sum(dim) if op == "sum" else x.max(dim).values


@pytest.mark.parametrize("op", ["sum", "sumsq", "max"])
@pytest.mark.parametrize("per", ["row", "col"])
@pytest.mark.parametrize("tile", [(8, 16), (16, 8), (64, 64)])
def test_tilereduce(op, per, tile):
    A, B = operands()
    epi = Epilogue().add(TileReduce("red", of="acc", op=op, per=per))
    out = epi.reference(A, B, tile=tile)
    acc = acc64(A, B)
    dim = 1 if per == "row" else 0
    close(out["red"], fold64(acc, op, dim))
    tm, tn = tile
    if per == "row":
        expected = torch.stack([fold64(acc[:, j : j + tn], op, 1) for j in range(0, N, tn)], dim=1)
    else:
        expected = torch.stack([fold64(acc[i : i + tm], op, 0) for i in range(0, M, tm)], dim=0)
    assert out["red.partials"].shape == expected.shape
    close(out["red.partials"], expected)


def test_tilereduce_post_rmsnorm_rstd_and_without_tile_no_partials():
    A, B = operands()
    eps = 1e-5
    epi = Epilogue().add(
        TileReduce("rstd", of="acc", op="sumsq", post=lambda s, n: cm.rsqrt(s / n + eps)),
        TileReduce("colmean", of="acc", op="sum", per="col", post=lambda s, n: s / n),
    )
    out = epi.reference(A, B)
    assert set(out) == {"rstd", "colmean"}
    acc = acc64(A, B)
    close(out["rstd"], 1 / torch.sqrt((acc * acc).mean(1) + eps))
    close(out["colmean"], acc.mean(0))


def test_tilereduce_of_wide_value_per_col():
    A, B = operands()
    t = torch.randn(M, 2 * N, generator=gen(9)).to(F32)
    epi = Epilogue().add(TileLoad("t", F32, width=2), TileReduce("s", of="t", per="col"))
    out = epi.reference(A, B, t=t, tile=(16, 16))
    assert out["s"].shape == (2 * N,) and out["s.partials"].shape == (3, 2 * N)
    close(out["s"], t.to(F64).sum(0))


# ---- state transitions -----------------------------------------------------------------
@pytest.mark.parametrize("tile", [(8, 8), (16, 32), (128, 128)])
def test_logsumexp_and_partials(tile):
    A, B = operands()
    shift = 40.0  # large logits: exp would overflow without the running max
    epi = Epilogue().add(Elementwise("z", lambda a: a * 8.0 + shift), LogSumExp("lse", of="z"))
    out = epi.reference(A, B, tile=tile)
    z = acc64(A, B) * 8.0 + shift
    close(out["lse"], torch.logsumexp(z, 1))
    tn = tile[1]
    pm = torch.stack([z[:, j : j + tn].max(1).values for j in range(0, N, tn)], 1)
    ps = torch.stack(
        [
            torch.exp(z[:, j : j + tn] - pm[:, k : k + 1]).sum(1)
            for k, j in enumerate(range(0, N, tn))
        ],
        1,
    )
    close(out["lse.partials_max"], pm)
    close(out["lse.partials_sumexp"], ps, floor=1.0)
    combined = pm.max(1).values + torch.log((ps * torch.exp(pm - pm.max(1, True).values)).sum(1))
    close(out["lse"], combined)


def _textbook_entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z, 1)
    return -(logp.exp() * logp).sum(1)


@pytest.mark.parametrize("tile", [(8, 8), (16, 32), (128, 128)])
def test_softmax_entropy_reference_partials_and_simulator(tile):
    """The entropy of each row's softmax, with logits far from 0 (40 + 8 acc: lse - E_p[z]
    in fp32 would lose ulp(48) = 4e-6 of an entropy near 2) against float64; its per-tile
    (max, sum, weighted sum) partials; the tile simulator (online, subtile by subtile)
    against the reference; and the merge of the partials."""
    A, B = operands()
    epi = Epilogue().add(
        Elementwise("z", lambda a: a * 8.0 + 40.0),
        SoftmaxEntropy("ent", of="z", lse="lse_e"),
        LogSumExp("lse", of="z"),
    )
    out = epi.reference(A, B, tile=tile)
    z = acc64(A, B) * 8.0 + 40.0
    want = _textbook_entropy(z)
    assert_close_to_reference(out["ent"], want, tol=2e-6, name="entropy")
    tn = tile[1]
    blocks = [z[:, j : j + tn] for j in range(0, N, tn)]
    pm = torch.stack([b.max(1).values for b in blocks], 1)
    ps = torch.stack([torch.exp(b - pm[:, k, None]).sum(1) for k, b in enumerate(blocks)], 1)
    pt = torch.stack(
        [
            (torch.exp(b - pm[:, k, None]) * (b - pm[:, k, None])).sum(1)
            for k, b in enumerate(blocks)
        ],
        1,
    )
    close(out["ent.partials_max"], pm)
    close(out["ent.partials_sumexp"], ps, floor=1.0)
    close(out["ent.partials_wsum"], pt, floor=1.0)
    sim = coda.simulate(epi, A, B, tile=tile, subtile=(min(tile[0], 8), min(tile[1], 8)))
    assert_close_to_reference(sim["ent"], want, tol=2e-6, name="simulated entropy")
    for got in (out["lse_e"], sim["lse_e"]):  # its log-sum-exp, from the same state
        close(got, torch.logsumexp(z, 1))
    for name in ("ent.partials_max", "ent.partials_sumexp", "ent.partials_wsum"):
        close(sim[name], out[name].to(F64), floor=1.0)


def test_softmax_entropy_edges():
    """A row of one finite logit has entropy 0; uniform logits log C; -inf entries (masked
    columns) count as p = 0; a row with no finite entry gives 0, not NaN."""
    A, B = operands(m=4, n=44)
    z = acc64(A, B).to(F32)
    cols = torch.arange(N)
    z[0] = torch.where(cols == 7, 3.0, float("-inf"))  # one-hot: entropy 0
    z[1] = 5.0  # uniform: log N
    z[2] = torch.where(cols < 10, z[2], float("-inf"))  # only 10 columns count
    z[3] = float("-inf")  # nothing: 0
    epi = Epilogue().add(TileLoad("z", F32), SoftmaxEntropy("ent", of="z"))
    for ent in (
        epi.reference(A, B, z=z, tile=(8, 16))["ent"],
        coda.simulate(epi, A, B, z=z, tile=(8, 16), subtile=(8, 8))["ent"],
    ):
        ent = ent.to(F64)
        assert torch.isfinite(ent).all()
        assert abs(float(ent[0])) < 1e-6 and abs(float(ent[3])) < 1e-12
        assert abs(float(ent[1]) - math.log(N)) < 1e-5
        assert abs(float(ent[2]) - float(_textbook_entropy(z[2:3, :10].to(F64))[0])) < 1e-5


@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32])
def test_target_select_and_cross_entropy(tdtype):
    A, B = operands()
    t = torch.randint(0, N, (M,), generator=gen(10))
    t[::5] = -100
    epi = Epilogue().add(
        LogSumExp("lse", of="acc"),
        TargetSelect("picked", of="acc", target="labels", target_dtype=tdtype),
    )
    out = epi.reference(A, B, labels=t.to(tdtype), tile=(16, 16))
    acc = acc64(A, B)
    picked = torch.tensor([acc[m, t[m]] if t[m] != -100 else 0.0 for m in range(M)], dtype=F64)
    close(out["picked"], picked)
    partials = torch.zeros(M, 3, dtype=F64)
    for m in range(M):
        if t[m] != -100:
            partials[m, int(t[m]) // 16] = acc[m, t[m]]
    close(out["picked.partials"], partials)
    loss = out["lse"] - out["picked"]
    keep = t != -100
    expected = F.cross_entropy(acc, t, ignore_index=-100, reduction="none")
    close(loss[keep], expected[keep])


def test_target_select_rejects_out_of_range_targets():
    A, B = operands()
    t = torch.zeros(M, dtype=torch.int64)
    t[3] = N
    epi = Epilogue().add(TargetSelect("p", of="acc"))
    msg = r"TargetSelect\('p' = 'acc'\[target\]\): target\[3\] = 44 is not a column index"
    with pytest.raises(InputError, match=msg):
        epi.reference(A, B, target=t)
    with pytest.raises(InputError, match=msg):
        coda.simulate(epi, A, B, target=t)


def test_target_select_custom_ignore_index():
    A, B = operands()
    t = torch.randint(0, N, (M,), generator=gen(11))
    t[0] = 7
    epi = Epilogue().add(TargetSelect("p", of="acc", ignore_index=7))
    out = epi.reference(A, B, target=t)
    acc = acc64(A, B)
    expected = torch.where(t == 7, 0.0, acc.gather(1, t[:, None])[:, 0])
    close(out["p"], expected)
