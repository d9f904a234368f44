"""coda.testing.tolerance: the error measures and the two pass rules."""

from __future__ import annotations

import math

import pytest
import torch

from coda.testing.tolerance import (
    assert_close_to_reference,
    compare,
    max_abs_err,
    rel_err,
    tolerance,
)

F64 = torch.float64


def test_normwise_relative_error_and_floor():
    truth = torch.tensor([1.0, -4.0, 2.0], dtype=F64)
    actual = torch.tensor([1.0, -4.0, 2.5])
    assert max_abs_err(actual, truth) == 0.5
    assert rel_err(actual, truth) == 0.5 / 4.0
    tiny = truth * 1e-3
    assert rel_err(tiny + 1e-4, tiny) == pytest.approx(1e-4 / 4e-3)
    assert rel_err(tiny + 1e-4, tiny, floor=1.0) == pytest.approx(1e-4)


def test_dtype_tolerance_rule():
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(64, 64, generator=g, dtype=F64)
    assert compare(truth.to(torch.bfloat16), truth).passed
    assert compare(truth.to(torch.float32), truth).passed
    assert not compare(truth.to(torch.bfloat16), truth, tol=tolerance(torch.float16)).passed
    assert tolerance(torch.bfloat16) > tolerance(torch.float16) > tolerance(torch.float32)


def test_baseline_rule():
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(128, generator=g, dtype=F64)
    eager = truth.to(torch.bfloat16)
    good = (truth + 1e-3 * truth.abs().max()).to(torch.float32)
    bad = (truth + 5e-2 * truth.abs().max()).to(torch.float32)
    c = compare(good, truth, baseline=eager)
    assert c.passed and c.baseline_err == pytest.approx(rel_err(eager, truth))
    assert not compare(bad, truth, baseline=eager).passed


def test_assert_reports_the_worst_element():
    truth = torch.zeros(3, 4, dtype=F64) + 1.0
    actual = truth.clone().float()
    actual[2, 1] = 1.5
    with pytest.raises(
        AssertionError,
        match=r"x: err 0\.5 > limit 0\.01: FAIL; worst at index "
        r"\(2, 1\): got 1\.5, reference 1",
    ):
        assert_close_to_reference(actual, truth, name="x", tol=0.01)


def test_non_finite_entries():
    truth = torch.tensor([1.0, -math.inf, 3.0], dtype=F64)
    assert rel_err(torch.tensor([1.0, -math.inf, 3.0]), truth) == 0.0
    with pytest.raises(AssertionError, match=r"non-finite mismatch at index \(1,\)"):
        rel_err(torch.tensor([1.0, 0.0, 3.0]), truth)
    with pytest.raises(AssertionError, match=r"non-finite mismatch at index \(2,\)"):
        rel_err(torch.tensor([1.0, -math.inf, math.nan]), truth)
    with pytest.raises(AssertionError, match=r"shape \(2,\) != reference shape \(3,\)"):
        rel_err(torch.ones(2), truth)


def test_default_tolerances_of_other_dtypes():
    """Integers and bool compare exactly; float8 by one rounding of its mantissa; a dtype
    without a default (complex) asks for an explicit tol instead of borrowing bf16's."""
    from coda.testing.tolerance import tolerance

    assert tolerance(torch.int32) == tolerance(torch.bool) == 0.0
    assert tolerance(torch.float8_e4m3fn) == 2.0**-3 and tolerance(torch.float8_e5m2) == 2.0**-2
    with pytest.raises(TypeError, match="no default for torch.complex64"):
        tolerance(torch.complex64)


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_examples_needs_a_positive_int(n):
    from coda.testing.profiles import examples

    with pytest.raises(ValueError, match="n must be a positive int"):
        examples(n)


def test_make_inputs_names_an_n_the_epilogue_cannot_take():
    from coda.errors import InputError
    from coda.testing.catalog import EPILOGUES
    from coda.testing.strategies import make_inputs

    with pytest.raises(InputError, match="N=7 is not a multiple of 2"):
        make_inputs(EPILOGUES["swiglu_fwd"], 8, 7, 16, torch.bfloat16, 0)
