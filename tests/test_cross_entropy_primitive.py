"""The ``OneHot`` primitive (added for the cross-entropy backward) and the vocabulary
chunking of ``coda.fusions.ce_chunks``, on CPU.

OneHot: its ``reference`` and the tile simulator against a one-hot matrix built in the
test from the targets, at every width, on ragged tiles, with targets outside [0, C)
(sentinels, other chunks' columns), composed with reductions and stores.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coda
from coda import Elementwise, Epilogue, TileReduce, TileStore, ops
from coda.fusions import ce_chunks
from coda.primitives import OneHot
from coda.primitives import math as cm
from coda.specs import TensorSpec, ValueSpec
from coda.testing import examples


def one_hot_matrix(target: torch.Tensor, cols: int) -> torch.Tensor:
    out = torch.zeros(target.shape[0], cols)
    for m, t in enumerate(target.tolist()):
        if 0 <= t < cols:
            out[m, t] = 1.0
    return out


@st.composite
def cases(draw):
    width = draw(st.sampled_from([Fraction(1, 2), Fraction(1), Fraction(2)]))
    tm, tn = draw(st.sampled_from([(32, 16), (16, 8), (64, 32)]))
    sm, sn = tm // draw(st.sampled_from([1, 2])), tn // draw(st.sampled_from([1, 2]))
    M = draw(st.integers(1, 70))
    N = draw(st.integers(1, 40)) * (2 if width == Fraction(1, 2) else 1)
    cols = int(N * width)
    target = draw(st.lists(st.integers(-3, cols + 3), min_size=M, max_size=M).map(torch.tensor))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return dict(width=width, tile=(tm, tn), subtile=(sm, sn), M=M, N=N, target=target.to(dtype))


@settings(max_examples=examples(150))
@given(cases(), st.integers(0, 2**31 - 1))
def test_onehot_reference_and_simulator(c, seed):
    width, M, N = c["width"], c["M"], c["N"]
    cols = int(N * width)
    g = torch.Generator().manual_seed(seed)
    A, B = torch.randn(M, 8, generator=g), torch.randn(N, 8, generator=g)
    x = torch.randn(M, cols, generator=g)
    epi = Epilogue().add(
        OneHot("hot", target="t", target_dtype=c["target"].dtype, width=width),
        coda.TileLoad("x", torch.float32, width=width),
        Elementwise("picked", ops.mul, ins=("x", "hot")),
        TileStore("hot", torch.float32),
        TileReduce("rowsum", of="picked", op="sum"),
        TileReduce("colsum", of="hot", op="sum", per="col"),
    )
    want = one_hot_matrix(c["target"], cols)
    ref = epi.reference(A, B, t=c["target"], x=x, tile=c["tile"])
    sim = coda.simulate(epi, A, B, tile=c["tile"], subtile=c["subtile"], t=c["target"], x=x)
    for out in (ref, sim):
        assert torch.equal(out["hot"], want)
        torch.testing.assert_close(out["rowsum"], (x * want).sum(1), rtol=0, atol=1e-6)
        assert torch.equal(out["colsum"], want.sum(0))
        assert torch.equal(out["rowsum.partials"], ref["rowsum.partials"])


def test_onehot_dataflow():
    p = OneHot("hot", target="labels", target_dtype=torch.int32, width="1/2")
    assert p.reads == () and p.writes == ("hot",)
    assert p.label == "OneHot('hot' = column == labels, width 1/2)"
    assert p.infer({}) == (ValueSpec("hot", "tile", Fraction(1, 2)),)
    assert p.tensors({}) == (TensorSpec("labels", "row", torch.int32),)
    assert p == OneHot("hot", target="labels", target_dtype=torch.int32, width=Fraction(1, 2))
    with pytest.raises(coda.EpilogueError, match="width"):
        OneHot("hot", width=3)
    with pytest.raises(coda.EpilogueError, match="target_dtype"):
        OneHot("hot", target_dtype=torch.float32)


@settings(max_examples=examples(200))
@given(st.integers(1, 300_000), st.integers(1, 40).map(lambda k: 8 * k))
def test_chunks_cover_the_vocabulary(V, size):
    plan = ce_chunks.chunks(V, size)
    assert plan[0].start == 0 and plan[-1].stop == V
    for a, b in zip(plan, plan[1:], strict=False):
        assert a.stop == b.start
    for c in plan[:-1]:
        assert not c.padded and c.cols % 8 == 0 and c.cols <= size
    last = plan[-1]
    assert last.padded == (V % 8 != 0)
    if last.padded:
        assert last.cols == V % 8 and last.gemm_cols == 8
    assert all(c.gemm_cols % 8 == 0 for c in plan)


@pytest.mark.parametrize("V", [128256, 32000, 151936, 50257])
@pytest.mark.parametrize("M", [1, 8192, 16384, 65536])
def test_automatic_chunks_respect_the_workspace_bound(V, M):
    budget = ce_chunks.WORKSPACE_BYTES
    size = ce_chunks.grad_chunk_size(M, V, 2)
    assert size % 8 == 0 and size <= ce_chunks.round_up(V, 8)
    assert M * size * 2 <= max(budget, M * ce_chunks.GRAD_STEP * 2)
    for n in (3, 4):
        s = ce_chunks.stats_chunk_size(M, V, n)
        assert s % 8 == 0
        assert M * -(-s // ce_chunks.STATS_TILE) * 4 * n <= max(budget, M * 4 * n)
    if V == 128256 and M <= 16384:  # the benchmark shapes: the forward is one fused GEMM
        assert len(ce_chunks.chunks(V, ce_chunks.stats_chunk_size(M, V, 4))) == 1


def test_chunk_size_must_be_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        ce_chunks.chunks(100, 12)


@settings(max_examples=examples(200))
@given(st.integers(1, 70_000), st.sampled_from([1000, 32000, 50257, 128256, 151936]))
def test_row_chunks_cover_the_rows_and_respect_the_budget(M, V):
    """Gradient-in-forward rows: a multiple of 128, each row buffer within the budget
    (unless one step of 128 rows exceeds it), no more than M rounded up to 128; the row
    chunks tile [0, M)."""
    rows = ce_chunks.grad_rows(M, V, 2)
    assert rows % ce_chunks.ROW_STEP == 0 and rows <= ce_chunks.round_up(M, 128)
    assert rows * ce_chunks.main_cols(V) * 2 <= max(
        ce_chunks.GRAD_ROWS_BYTES, 128 * ce_chunks.main_cols(V) * 2
    )
    plan = ce_chunks.row_chunks(M, rows)
    assert plan[0][0] == 0 and plan[-1][1] == M
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:], strict=False))
    assert all(0 < r1 - r0 <= rows for r0, r1 in plan)


def test_grad_in_forward_workspace_terms():
    """The bound's terms at Llama 3's vocabulary: ONE bf16 buffer of 2048 rows (dlogits
    written in place over the stored acc; two buffers with the acc stored in fp32), the
    fp32 dW accumulator and the earlier rows' dh only with several row chunks, tail
    temporaries only when V % 8."""
    M, V, H = 8192, 128256, 2048
    rows = ce_chunks.grad_rows(M, V, 2)
    assert rows == 2048
    several = ce_chunks.grad_in_forward_workspace(M, V, H, 2, rows)
    one = ce_chunks.grad_in_forward_workspace(M, V, H, 2, M)
    buffer = rows * V * 2
    sums = 4 * V * H + 2 * M * H  # the fp32 dW sum, dh of the earlier rows
    assert sums <= several - buffer < sums + buffer / 4  # + partials, vectors
    assert M * V * 2 < one < M * V * 2 * 1.25  # no accumulator: the larger buffer dominates
    acc32 = ce_chunks.grad_in_forward_workspace(M, V, H, 2, rows, acc_bytes=4)
    assert acc32 - several == rows * V * 4  # fp32 acc (2x) + a separate bf16 dlogits buffer
    ragged = ce_chunks.grad_in_forward_workspace(M, V + 1, H, 2, rows)
    assert ragged - several >= 8 * rows * H  # fp32 h rows and dh rows of the tail


def test_round_to_is_a_store_and_load():
    """cm.round_to (the rounding of the gradient-in-forward path's stored logits): the
    nearest value of the narrow dtype, returned in the input's dtype."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        got = cm.round_to(x, dt)
        assert got.dtype == torch.float32 and torch.equal(got, x.to(dt).float())
    assert torch.equal(cm.round_to(x.double(), torch.bfloat16), x.to(torch.bfloat16).double())
    with pytest.raises(TypeError, match="float dtype"):
        cm.round_to(x, torch.int32)


def test_grad_rows_takes_one_chunk_when_the_dW_accumulator_would_cost_more():
    """With dW computed (``dw_hidden=H``), several row chunks need an fp32 V x H
    accumulator: one chunk is taken whenever its workspace is no larger than the budget
    chunks' (Llama 3's vocabulary: from H = 4096 at M = 8192)."""
    V = 128256
    assert ce_chunks.grad_rows(8192, V, 2, dw_hidden=2048) == 2048
    assert ce_chunks.grad_rows(8192, V, 2, dw_hidden=4096) == 8192
    assert ce_chunks.grad_rows(16384, V, 2, dw_hidden=4096) == 2048
    assert ce_chunks.grad_rows(8192, V, 2) == 2048  # no dW: the budget alone


@settings(max_examples=examples(200))
@given(
    st.integers(1, 40_000),
    st.sampled_from([1000, 32000, 50257, 128256, 151936]),
    st.sampled_from([512, 1024, 2048, 3072, 4096, 8192]),
)
def test_grad_rows_with_dW_never_raises_the_workspace(M, V, H):
    """The rows chosen with ``dw_hidden`` never give a larger workspace bound than the
    budget's rows."""
    plain = ce_chunks.grad_rows(M, V, 2)
    chosen = ce_chunks.grad_rows(M, V, 2, dw_hidden=H)
    assert chosen in (plain, ce_chunks.round_up(M, ce_chunks.ROW_STEP))
    ws = ce_chunks.grad_in_forward_workspace
    assert ws(M, V, H, 2, chosen) <= ws(M, V, H, 2, plain)
