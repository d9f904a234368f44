"""coda.primitives.math: backend-polymorphic math for ``Elementwise`` functions.

An ``Elementwise`` ``fn`` runs on fp32 ``torch.Tensor`` blocks in ``Epilogue.reference`` and
in the tile simulator, and (in a later issue) on CuTeDSL ``TensorSSA`` register fragments
when traced into the fused kernel. Write ``fn`` with the operators ``+ - * /`` (which both
backends overload), comparisons, and the functions of this module, never ``torch.*``
directly, and the same ``fn`` will serve both::

    from coda.primitives import math as cm
    fn = lambda g, u: cm.silu(g) * u

Each function dispatches on its tensor arguments: ``torch.Tensor`` -> the torch op (dtype
preserved, so tests can also evaluate ``fn`` in float64). Python numbers are accepted next
to a tensor. Any other type raises ``TypeError``; the CuTeDSL branch arrives with ``trace``.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "abs",
    "clamp",
    "cos",
    "erf",
    "exp",
    "exp2",
    "gelu_tanh",
    "log",
    "log1p",
    "log2",
    "maximum",
    "minimum",
    "relu",
    "rsqrt",
    "sigmoid",
    "silu",
    "sin",
    "softplus",
    "sqrt",
    "tanh",
    "where",
]


def _tensor_arg(fname: str, args: tuple[Any, ...]) -> torch.Tensor:
    """The first torch.Tensor among args (the dispatch key); TypeError for foreign types."""
    first = None
    for a in args:
        if isinstance(a, torch.Tensor):
            if first is None:
                first = a
        elif not isinstance(a, numbers.Real):
            raise TypeError(
                f"coda.primitives.math.{fname}: unsupported argument type "
                f"{type(a).__module__}.{type(a).__qualname__}; supported today: torch.Tensor "
                "(reference and tile simulator) and Python numbers. The CuTeDSL (TensorSSA) "
                "backend arrives with Primitive.trace in a later issue."
            )
    if first is None:
        raise TypeError(
            f"coda.primitives.math.{fname}: needs at least one torch.Tensor argument "
            f"(got only Python numbers: {args!r}); use the math module for constants"
        )
    return first


def _as_tensor(x: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def _unary(fname: str, op: Any, doc: str) -> Any:
    def fn(x: Any) -> Any:
        _tensor_arg(fname, (x,))
        return op(x)

    fn.__name__ = fn.__qualname__ = fname
    fn.__doc__ = doc
    return fn


exp = _unary("exp", torch.exp, "e**x")
exp2 = _unary("exp2", torch.exp2, "2**x")
log = _unary("log", torch.log, "natural logarithm")
log2 = _unary("log2", torch.log2, "base-2 logarithm")
log1p = _unary("log1p", torch.log1p, "log(1 + x), accurate near 0")
sqrt = _unary("sqrt", torch.sqrt, "square root")
rsqrt = _unary("rsqrt", torch.rsqrt, "1 / sqrt(x)")
sigmoid = _unary("sigmoid", torch.sigmoid, "1 / (1 + exp(-x))")
silu = _unary("silu", F.silu, "x * sigmoid(x) (a.k.a. swish)")
tanh = _unary("tanh", torch.tanh, "hyperbolic tangent")
relu = _unary("relu", torch.relu, "max(x, 0)")
softplus = _unary("softplus", F.softplus, "log(1 + exp(x))")
erf = _unary("erf", torch.erf, "the error function")
cos = _unary("cos", torch.cos, "cosine (radians)")
sin = _unary("sin", torch.sin, "sine (radians)")
abs = _unary("abs", torch.abs, "absolute value")  # noqa: A001 (mirrors torch/numpy naming)


def gelu_tanh(x: Any) -> Any:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    _tensor_arg("gelu_tanh", (x,))
    return F.gelu(x, approximate="tanh")


def maximum(a: Any, b: Any) -> Any:
    """Elementwise max(a, b); either may be a Python number."""
    t = _tensor_arg("maximum", (a, b))
    return torch.maximum(_as_tensor(a, t), _as_tensor(b, t))


def minimum(a: Any, b: Any) -> Any:
    """Elementwise min(a, b); either may be a Python number."""
    t = _tensor_arg("minimum", (a, b))
    return torch.minimum(_as_tensor(a, t), _as_tensor(b, t))


def clamp(x: Any, lo: float, hi: float) -> Any:
    """min(max(x, lo), hi) with constant bounds."""
    _tensor_arg("clamp", (x, lo, hi))
    return torch.clamp(x, lo, hi)


def where(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` else ``b`` (cond: a boolean tensor, e.g. ``x > 0``)."""
    t = _tensor_arg("where", (cond, a, b))
    like = a if isinstance(a, torch.Tensor) else b if isinstance(b, torch.Tensor) else None
    if like is None:
        like = torch.empty((), dtype=torch.float32, device=t.device)
    return torch.where(cond, _as_tensor(a, like), _as_tensor(b, like))
