"""coda.testing.fns: the catalogue of ``fn``s that random compositions draw from.

Named module-level functions (readable in hypothesis' failure reports, equal across
draws), written with operators and ``coda.primitives.math`` so every backend runs them.
They are chosen to keep values O(1) through long chains (bounded or at most linear growth:
no unbounded products, no division by values that may cross zero) and to be continuous,
so fp32-vs-float64 differences stay small and comparisons stay meaningful. A few
realistic ones (``swiglu``, ``rope``) come from ``coda.primitives.ops``.
"""

from __future__ import annotations

from typing import Any

from coda.primitives import math as cm
from coda.primitives import ops

__all__ = [
    "BINARY",
    "PAIR_MAP",
    "PAIR_MAP_3",
    "PAIR_MAP_4",
    "PAIR_REDUCE",
    "PAIR_REDUCE_3",
    "TERNARY",
    "UNARY",
]


def soft_clip(x: Any) -> Any:
    return x / (1.0 + cm.abs(x))


def gauss(x: Any) -> Any:
    return cm.exp(-(x * x))


def log1p_sq(x: Any) -> Any:
    return cm.log1p(x * x)


def rsqrt_1p(x: Any) -> Any:
    return cm.rsqrt(1.0 + x * x)


def affine(x: Any) -> Any:
    return 0.5 * x - 0.25


def mul_tanh(a: Any, b: Any) -> Any:
    return a * cm.tanh(b)


def mul_sigmoid(a: Any, b: Any) -> Any:
    return a * cm.sigmoid(b)


def average(a: Any, b: Any) -> Any:
    return 0.5 * (a + b)


def hypot1(a: Any, b: Any) -> Any:
    return cm.sqrt(a * a + b * b + 1.0)


def ratio(a: Any, b: Any) -> Any:
    return a / (1.0 + b * b)


def maximum(a: Any, b: Any) -> Any:
    return cm.maximum(a, b)


def minimum(a: Any, b: Any) -> Any:
    return cm.minimum(a, b)


def lerp_sigmoid(a: Any, b: Any, c: Any) -> Any:
    s = cm.sigmoid(c)
    return a * s + b * (1.0 - s)


def fma_tanh(a: Any, b: Any, c: Any) -> Any:
    return a * cm.tanh(b) + c


def clipped_swiglu(g: Any, u: Any) -> Any:
    return cm.silu(g) * soft_clip(u)


def pair_sum(e: Any, o: Any) -> Any:
    return e + o


def pair_max(e: Any, o: Any) -> Any:
    return cm.maximum(e, o)


def swiglu_plus(g: Any, u: Any, y: Any) -> Any:
    return cm.silu(g) * soft_clip(u) + y


def swap(e: Any, o: Any) -> tuple[Any, Any]:
    return o, e


def butterfly(e: Any, o: Any) -> tuple[Any, Any]:
    return 0.5 * (e + o), 0.5 * (e - o)


def rotate_by(e: Any, o: Any, angle: Any) -> tuple[Any, Any]:
    c, s = cm.cos(angle), cm.sin(angle)
    return e * c - o * s, o * c + e * s


UNARY = (
    ops.tanh,
    ops.sigmoid,
    ops.silu,
    ops.gelu_tanh,
    ops.neg,
    ops.identity,
    cm.sin,
    cm.cos,
    cm.abs,
    soft_clip,
    gauss,
    log1p_sq,
    rsqrt_1p,
    affine,
)
BINARY = (ops.add, ops.sub, mul_tanh, mul_sigmoid, average, hypot1, ratio, maximum, minimum)
TERNARY = (lerp_sigmoid, fma_tanh)
#: pairwise "reduce": (even, odd) -> one value
PAIR_REDUCE = (ops.swiglu, clipped_swiglu, pair_sum, pair_max)
#: pairwise "reduce": (even, odd, half-width-or-broadcast) -> one value
PAIR_REDUCE_3 = (swiglu_plus,)
#: pairwise "map": (even, odd) -> (even, odd)
PAIR_MAP = (swap, butterfly)
#: pairwise "map" with one extra broadcast argument: (even, odd, angle) -> (even, odd)
PAIR_MAP_3 = (rotate_by,)
#: pairwise "map" with two extra arguments: RoPE (even, odd, pos, freq)
PAIR_MAP_4 = (ops.rope, ops.rope_inverse)
