"""Operand checks of every coda GEMM (plain or fused): A (M, K), B (N, K), the output.

Sits in ``coda.runtime`` (under :mod:`coda.matmul` and the fused-epilogue runner). Each
check raises a readable error before anything is launched. A and B may each be
row-major or a transposed view (:func:`operand_majors`); :func:`cached_problem` answers
the same question for a repeated call signature with a dictionary look-up.
"""

from __future__ import annotations

import torch

from ..caches import BoundedCache
from ..errors import InputError
from ..mainloop.dtypes import OPERAND_DTYPES, OUTPUT_DTYPES
from . import checks


def operand_majors(A: torch.Tensor, B: torch.Tensor) -> tuple[str, str]:
    """(A's contiguous dim: "k" or "m", B's: "k" or "n"), checking TMA's contract."""
    return checks.tma_major("A", A, ("m", "k")), checks.tma_major("B", B, ("n", "k"))


def check_gemm_operands(A: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int]:
    """Validate A (M, K) and B (N, K); return (M, N, K). Raises before any launch."""
    return gemm_problem(A, B)[:3]


def gemm_problem(A: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int, str, str]:
    """Validate A (M, K) and B (N, K); return (M, N, K, A's major, B's major)."""
    checks.tensor("A", A)
    checks.tensor("B", B)
    checks.rank("A", A, 2, "(M, K) activations")
    checks.rank("B", B, 2, "(N, K) weight, as stored by nn.Linear")
    checks.dtype_in("A", A, OPERAND_DTYPES)
    checks.dtype_in("B", B, OPERAND_DTYPES)
    if A.dtype != B.dtype:
        raise TypeError(f"A and B must have the same dtype, got {A.dtype} and {B.dtype}")
    (m, k), (n, kb) = A.shape, B.shape
    if k != kb:
        raise InputError(
            f"A is (M={m}, K={k}) but B is (N={n}, K={kb}); B is an nn.Linear weight (N, K) "
            f"and its K must match A's"
        )
    return (m, n, k, *operand_majors(A, B))


def check_output(out: torch.Tensor, m: int, n: int, name: str = "out") -> None:
    checks.tensor(name, out)
    checks.rank(name, out, 2, "(M, N) output")
    checks.dtype_in(name, out, OUTPUT_DTYPES)
    if tuple(out.shape) != (m, n):
        raise InputError(f"{name} has shape {tuple(out.shape)}, expected ({m}, {n})")
    checks.row_major_tma(name, out, written=True)


_problems: BoundedCache[tuple, tuple[int, int, int, str, str]] = BoundedCache(4096)


def cached_problem(A: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int, str, str]:
    """:func:`gemm_problem`, remembered per (dtypes, devices, shapes, strides): a repeated
    signature costs a look-up plus the per-call pointer-alignment check."""
    try:
        sig = (A.dtype, B.dtype, A.device, B.device, A.shape, B.shape, A.stride(), B.stride())
    except (AttributeError, TypeError):
        return gemm_problem(A, B)
    hit = _problems.get(sig)
    if hit is None or (A.data_ptr() | B.data_ptr()) & 15:
        hit = _problems.put(sig, gemm_problem(A, B))
    return hit
