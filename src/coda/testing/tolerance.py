"""coda.testing.tolerance: error measures against a float64 reference, and assertions.

Errors are *normwise relative*: ``max|actual - truth| / max(max|truth|, floor)``, computed
in float64. Normwise (rather than elementwise) relative error is the right measure for
tensors whose entries cross zero; ``floor`` turns it into an absolute error for tensors
that are tiny everywhere (e.g. floor=1 when inputs are O(1), so cancellation down to ~0
is not mistaken for a large relative error).

Two ways to pass:

* against a dtype tolerance: ``err <= tol`` (default ``tolerance(actual.dtype)``: about one
  unit in the last place of bf16/fp16, a few hundred fp32 ulps for fp32 results of chains
  of math and reductions);
* against a baseline (DESIGN.md 6.3): ``err <= factor * err(baseline) + atol``, e.g. the
  fused kernel's error at most twice eager bf16 PyTorch's, both against float64.

Non-finite entries of the truth must be matched exactly (same inf, NaN where NaN); a NaN
in ``actual`` where the truth is finite always fails.
"""

from __future__ import annotations

import attrs
import torch

__all__ = [
    "Comparison",
    "assert_close_to_reference",
    "compare",
    "max_abs_err",
    "rel_err",
    "tolerance",
]

_TOLERANCE = {
    torch.bfloat16: 2.0**-7,
    torch.float16: 2.0**-10,
    torch.float32: 2.0**-15,
    torch.float64: 1e-12,
}


def tolerance(dtype: torch.dtype) -> float:
    """Default normwise relative tolerance of a result stored in ``dtype``: about one
    rounding of its mantissa for the floating dtypes, 0 (exact) for integers and bool."""
    if dtype in _TOLERANCE:
        return _TOLERANCE[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tolerance: expected a torch.dtype; got {dtype!r}")
    if not dtype.is_floating_point and not dtype.is_complex:
        return 0.0
    if dtype.itemsize == 1:  # the float8 formats: e4m3 (3 mantissa bits), e5m2 (2)
        return 2.0**-3 if "e4m3" in str(dtype) else 2.0**-2
    raise TypeError(f"tolerance: no default for {dtype}; pass tol= explicitly")


def _as64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float64)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _finite_pair(actual: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(actual, truth) restricted to the truth's finite entries, as float64; raise
    AssertionError if the shapes differ or the non-finite entries do not match."""
    a, t = _as64(actual), _as64(truth)
    if a.shape != t.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != reference shape {tuple(t.shape)}")
    finite = torch.isfinite(t)
    bad = finite & ~torch.isfinite(a)
    bad |= torch.isnan(t) & ~torch.isnan(a)
    bad |= torch.isinf(t) & (a != t)
    if bad.any():
        idx = _first(bad)
        raise AssertionError(
            f"non-finite mismatch at index {idx}: got {a[idx].item()}, reference "
            f"{t[idx].item()} ({int(bad.sum())} such entries)"
        )
    return a[finite], t[finite]


def max_abs_err(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """max |actual - truth| over finite reference entries (float64)."""
    a, t = _finite_pair(actual, truth)
    return float((a - t).abs().max()) if a.numel() else 0.0


def rel_err(actual: torch.Tensor, truth: torch.Tensor, *, floor: float = 0.0) -> float:
    """Normwise relative error: max|actual - truth| / max(max|truth|, floor)."""
    a, t = _finite_pair(actual, truth)
    if not a.numel():
        return 0.0
    scale = max(float(t.abs().max()), floor, 1e-30)
    return float((a - t).abs().max()) / scale


@attrs.frozen
class Comparison:
    """The outcome of ``compare``: the error, the limit it was held to, and the verdict."""

    name: str
    err: float
    limit: float
    baseline_err: float | None = None

    @property
    def passed(self) -> bool:
        return self.err <= self.limit

    def __str__(self) -> str:
        base = "" if self.baseline_err is None else f", baseline err {self.baseline_err:.3g}"
        if self.passed:
            return f"{self.name}: err {self.err:.3g} <= limit {self.limit:.3g}{base}: ok"
        return f"{self.name}: err {self.err:.3g} > limit {self.limit:.3g}{base}: FAIL"


def compare(
    actual: torch.Tensor,
    truth: torch.Tensor,
    *,
    name: str = "output",
    baseline: torch.Tensor | None = None,
    tol: float | None = None,
    factor: float = 2.0,
    atol: float = 1e-5,
    floor: float = 0.0,
) -> Comparison:
    """Measure ``actual`` against float64 ``truth`` (see the module doc for the rule)."""
    err = rel_err(actual, truth, floor=floor)
    if baseline is None:
        limit = tolerance(actual.dtype) if tol is None else tol
        return Comparison(name, err, limit)
    base = rel_err(baseline, truth, floor=floor)
    return Comparison(name, err, factor * base + atol, base)


def assert_close_to_reference(
    actual: torch.Tensor,
    truth: torch.Tensor,
    *,
    name: str = "output",
    baseline: torch.Tensor | None = None,
    tol: float | None = None,
    factor: float = 2.0,
    atol: float = 1e-5,
    floor: float = 0.0,
) -> Comparison:
    """``compare`` and raise AssertionError (with the worst element) if it fails."""
    c = compare(
        actual,
        truth,
        name=name,
        baseline=baseline,
        tol=tol,
        factor=factor,
        atol=atol,
        floor=floor,
    )
    if not c.passed:
        a, t = _as64(actual), _as64(truth)
        diff = torch.where(torch.isfinite(t), (a - t).abs(), torch.zeros_like(a))
        idx = _first(diff == diff.max())
        raise AssertionError(
            f"{c}; worst at index {idx}: got {a[idx].item():.6g}, reference {t[idx].item():.6g}"
        )
    return c
