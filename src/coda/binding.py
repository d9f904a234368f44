"""coda.binding: call-time checks of the tensors passed to an epilogue.

``bind(epilogue, A, B, tensors)`` checks A (M, K) and B (N, K) (2-D, same K, same float
dtype, same device), N against the epilogue's alignment, that exactly the epilogue's input
tensors are passed (missing and unexpected names listed), and each tensor's shape, dtype
and device; then lets each primitive check the contents of its inputs (``check_tensors``).
Every failure is an ``InputError`` naming the tensor and what was expected.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from coda.errors import InputError
from coda.geometry import Problem
from coda.specs import FLOAT_DTYPES, dtype_name

if TYPE_CHECKING:
    from coda.epilogue import Epilogue

__all__ = ["bind"]


def _check_operand(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != 2:
        raise InputError(f"{name} must be 2-D; got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise InputError(f"{name} must be bfloat16, float16 or float32; got {dtype_name(t.dtype)}")
    if 0 in t.shape:
        raise InputError(f"{name} must not be empty; got shape {tuple(t.shape)}")
    return t


def bind(
    epilogue: Epilogue, A: Any, B: Any, tensors: Mapping[str, Any], *, contents: bool = True
) -> Problem:
    """Check the call's arguments against ``epilogue``; return the Problem (M, N, K).
    ``contents=False`` skips the primitives' checks of tensor *values* (``check_tensors``,
    e.g. targets in range), which read GPU memory and so synchronize with the device."""
    A, B = _check_operand("A", A), _check_operand("B", B)
    if A.shape[1] != B.shape[1]:
        raise InputError(
            f"A is (M, K) = {tuple(A.shape)} and B is (N, K) = {tuple(B.shape)} (like an "
            f"nn.Linear weight): their K must agree ({A.shape[1]} != {B.shape[1]})"
        )
    if A.dtype != B.dtype:
        raise InputError(
            f"A and B must have the same dtype; got {dtype_name(A.dtype)} and {dtype_name(B.dtype)}"
        )
    if A.device != B.device:
        raise InputError(f"A is on {A.device} but B is on {B.device}")
    problem = Problem(M=A.shape[0], N=B.shape[0], K=A.shape[1])
    if problem.N % epilogue.n_alignment:
        raise InputError(
            f"this epilogue has half-width values or column pairs, so N must be a multiple "
            f"of {epilogue.n_alignment}; got N={problem.N}"
        )
    expected = {s.name: s for s in epilogue.inputs}
    missing = [s for n, s in expected.items() if n not in tensors]
    unexpected = [n for n in tensors if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append("missing: " + "; ".join(s.describe() for s in missing))
        for n in unexpected:
            close = difflib.get_close_matches(n, list(expected), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            parts.append(f"unexpected tensor {n!r}{hint}")
        wanted = ", ".join(expected) or "none"
        raise InputError(f"{'; '.join(parts)}. This epilogue's inputs: {wanted}.")
    for name, spec in expected.items():
        value = tensors[name]
        if spec.role == "scalar":
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise InputError(
                    f"{name!r} is a scalar argument: pass a Python float; got "
                    f"{type(value).__name__}"
                )
            continue
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{spec.describe()}: got {type(value).__name__}, not a tensor")
        shape = spec.shape(problem.M, problem.N)
        if tuple(value.shape) != shape:
            raise InputError(
                f"{spec.describe()}: expected shape {shape} for M={problem.M}, "
                f"N={problem.N}; got {tuple(value.shape)}"
            )
        if value.dtype != spec.dtype:
            raise InputError(
                f"{spec.describe()}: expected dtype {dtype_name(spec.dtype)}; got "
                f"{dtype_name(value.dtype)}"
            )
        if value.device != A.device:
            raise InputError(f"{name!r} is on {value.device} but A is on {A.device}")
    if contents:
        for p in epilogue.primitives:
            p.check_tensors(tensors, problem, epilogue.values)
    return problem
