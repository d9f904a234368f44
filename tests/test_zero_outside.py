"""``coda.runtime.fused.zero_outside``: the values a fused kernel holds as exact zeros
outside M x N, whose sums then skip the per-element bounds mask (CPU: the analysis on
the catalogue and on hand-made compositions, and the masks' absence in the SASS)."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from coda import Elementwise, Epilogue, ScalarLoad, TileLoad, TileReduce, VecLoad, ops
from coda.fusions import epilogues as fusion_epilogues
from coda.runtime import gemm_kernels
from coda.runtime.epilogue_kernels import epilogue_choice
from coda.runtime.fused import FusedVisitor, zero_outside
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts
from coda.testing.catalog import EPILOGUES

bf16 = torch.bfloat16


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rmsnorm_fwd", {"acc", "residual", "x"}),  # h = x * gamma: a vector, not assumed
        ("swiglu_bwd", {"acc", "gu", "dgu", "zdz_terms"}),
        ("silu_max", {"acc", "y"}),  # silu(0) = 0
        ("lse_target", {"acc"}),
        ("row_scale", {"acc"}),  # acc * r * alpha: a row vector and a scalar
    ],
)
def test_catalogue(name, expected):
    assert zero_outside(EPILOGUES[name]) == expected


def test_ops_that_are_not_zero_on_zeros_stay_masked():
    epi = Epilogue().add(
        TileLoad("x", bf16),
        Elementwise("s", ops.sigmoid, ins=("acc",)),  # sigmoid(0) = 0.5
        Elementwise("t", ops.add, ins=("s", "x")),  # built on a non-zero value
        Elementwise("u", ops.mul, ins=("acc", "x")),
        VecLoad("g", per="col", dtype=bf16),
        Elementwise("v", ops.mul, ins=("u", "g")),  # a vector input: not assumed
        TileReduce("r", of="v", op="sum"),
    )
    assert zero_outside(epi) == {"acc", "x", "u"}


def _shift_by_probe(a, r):
    """0 on zeros only where r is 1.5 (one of the analysis' two probe values)."""
    return a + (r - 1.5)


@pytest.mark.parametrize("per", ["row", "col"])
def test_products_with_a_vector_are_zero_past_the_edge_the_vector_spans(per):
    """acc * r with r a row vector is 0 in the columns past N of the rows inside M (where
    r holds a real value per row): a per-row sum of it needs no mask; a per-column sum
    still does (rows past M hold whatever r is there), and the strict set is unchanged.
    A column vector the other way round."""
    epi = Epilogue().add(
        VecLoad("r", per=per, dtype=torch.float32),
        ScalarLoad("alpha"),
        Elementwise("s", ops.scale, ins=("acc", "r")),
        Elementwise("t", ops.mul, ins=("s", "alpha")),
        Elementwise("u", ops.add, ins=("acc", "r")),  # r where acc is 0: not kept
        Elementwise("w", _shift_by_probe, ins=("acc", "r")),  # 0 at one probe only
        TileReduce("row_sum", of="t", op="sum"),
        TileReduce("col_sum", of="t", op="sum", per="col"),
    )
    zero = zero_outside(epi)
    assert zero == {"acc"}
    kept, other = (zero.past_n, zero.past_m) if per == "row" else (zero.past_m, zero.past_n)
    assert kept == {"acc", "s", "t"}
    assert other == {"acc"}
    row_sum, col_sum = epi.primitives[-2:]
    assert row_sum.masks_edges(zero) is (per == "col")
    assert col_sum.masks_edges(zero) is (per == "row")
    # a primitive handed a plain frozenset reads it as zero past both edges
    assert row_sum.masks_edges(frozenset(zero)) and col_sum.masks_edges(frozenset(zero))


def test_the_fusions_backward_producers_sum_without_masks():
    """The training ops' SwiGLU backward and the RoPE / norm passes reduce rZdZ from
    rstd-scaled values (products with a row vector): their row sums are unmasked."""
    for epi in (
        fusion_epilogues.swiglu_backward(bf16),
        fusion_epilogues.rope_backward(bf16),
        fusion_epilogues.scaled_grad(bf16),
    ):
        zero = zero_outside(epi)
        assert "rzdz_terms" in zero.past_n and "rzdz_terms" not in zero
        assert not FusedVisitor(epi).splits_interior


def _fusion_swiglu_backward():
    return fusion_epilogues.swiglu_backward(bf16)


@pytest.mark.compile
@pytest.mark.parametrize(
    "name", ["rmsnorm_fwd", "swiglu_bwd", "dgamma_colsum", "fusion_swiglu_backward"]
)
def test_sums_over_zero_outside_values_compile_without_bounds_selects(name, tmp_path):
    epi = _fusion_swiglu_backward() if name.startswith("fusion") else EPILOGUES[name]
    cfg = epilogue_choice(epi, bf16, 16384, 2048, 2048, num_sms=132, majors=("k", "k"))[0]
    key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi), 132, "k", "k")
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops_ = opcode_counts(disassemble(cubin))
    assert count_prefix(ops_, "LDL") == 0 and count_prefix(ops_, "STL") == 0
    # the row sums select nothing; dgamma's column max still masks (out-of-bounds
    # elements must not win a max), its column sum does not
    if name == "dgamma_colsum":
        assert ops_.get("FSEL", 0) > 0
    else:
        assert ops_.get("FSEL", 0) == 0


@pytest.mark.parametrize(
    ("name", "splits"),
    [
        ("lse_target", True),  # -inf outside, whatever acc holds there
        ("silu_max", True),  # a max: out-of-bounds zeros must not win it
        ("dgamma_colsum", True),  # its column max of acc
        ("rmsnorm_fwd", False),  # a sum over x, 0 outside
        ("swiglu_bwd", False),
        ("residual_store", False),
        ("rope", False),
    ],
)
def test_epilogues_that_mask_are_traced_apart_for_interior_tiles(name, splits):
    assert FusedVisitor(EPILOGUES[name]).splits_interior is splits


class _InteriorOnly(FusedVisitor):
    """The interior trace alone: every tile traced as lying inside M x N."""

    @property
    def splits_interior(self) -> bool:
        return False

    def begin_tile(self, tctx):
        return super().begin_tile(attrs.evolve(tctx, interior=True))


def _bounds_selects(visitor, tmp_path) -> int:
    """FSELs of -inf (a max's or log-sum-exp's bounds mask) in the kernel's SASS."""
    cfg = epilogue_choice(visitor.epilogue, bf16, 16384, 2048, 2048, num_sms=132)[0]
    key = gemm_kernels.GemmKernelKey(cfg, bf16, visitor, 132, "k", "k")
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    sass = disassemble(cubin)
    ops_ = opcode_counts(sass)
    assert count_prefix(ops_, "LDL") == 0 and count_prefix(ops_, "STL") == 0
    return len(re.findall(r"FSEL\b[^;]*-INF", sass))


@pytest.mark.compile
def test_the_interior_trace_of_a_log_sum_exp_has_no_bounds_masks(tmp_path):
    # the kernel holds both traces: the edge tiles' masks remain, the interior's go
    epi = EPILOGUES["lse_target"]
    assert _bounds_selects(FusedVisitor(epi), tmp_path / "split") > 0
    assert _bounds_selects(_InteriorOnly(epi), tmp_path / "interior") == 0
