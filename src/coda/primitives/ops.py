"""coda.primitives.ops: ready-made, named ``fn``s for ``Elementwise``.

Plain functions written with operators and ``coda.primitives.math``, so they run on every
backend. Being module-level functions (not lambdas) they have stable identities and
readable reprs, which makes epilogues that use them equal across calls (one cache entry).

Pairwise helpers follow the Elementwise pairwise convention: an input at the pair width
arrives as two arguments (even columns, odd columns); a "map" returns ``(even, odd)``.
"""

from __future__ import annotations

from typing import Any

from coda.primitives import math as cm

__all__ = [
    "add",
    "gelu_tanh",
    "identity",
    "mul",
    "neg",
    "pair_products",
    "rope",
    "rope_inverse",
    "scale",
    "sigmoid",
    "silu",
    "square",
    "sub",
    "swiglu",
    "swiglu_backward",
    "tanh",
]


def identity(x: Any) -> Any:
    """x (a copy of a value under a new name)."""
    return x


def add(a: Any, b: Any) -> Any:
    """a + b (e.g. acc + residual, acc + bias)."""
    return a + b


def sub(a: Any, b: Any) -> Any:
    """a - b."""
    return a - b


def mul(a: Any, b: Any) -> Any:
    """a * b (e.g. x * gamma)."""
    return a * b


def scale(x: Any, s: Any) -> Any:
    """x * s, with s a row vector (e.g. rstd) or a scalar."""
    return x * s


def neg(x: Any) -> Any:
    """-x."""
    return -x


def square(x: Any) -> Any:
    """x * x."""
    return x * x


def silu(x: Any) -> Any:
    """x * sigmoid(x)."""
    return cm.silu(x)


def sigmoid(x: Any) -> Any:
    """1 / (1 + exp(-x))."""
    return cm.sigmoid(x)


def tanh(x: Any) -> Any:
    """tanh(x)."""
    return cm.tanh(x)


def gelu_tanh(x: Any) -> Any:
    """GELU, tanh approximation."""
    return cm.gelu_tanh(x)


def swiglu(g: Any, u: Any) -> Any:
    """SwiGLU forward, pairwise "reduce": y = silu(g) * u from an interleaved (gate, up)
    operand (gate in even columns, up in odd columns). silu by ``cm.silu_fast``: its
    result is stored in 16 bits."""
    return cm.silu_fast(g) * u


def swiglu_backward(g: Any, u: Any, dy: Any) -> tuple[Any, Any]:
    """SwiGLU backward, pairwise "map": from the interleaved (gate, up) operand (width W,
    two args) and dy (width W/2), return (dg, du), interleaved back to width W:
    dg = dy * u * sig(g) * (1 + g (1 - sig(g))), du = dy * silu(g). sig by
    ``cm.sigmoid_fast`` (dg and du are stored in 16 bits).

    Written for the fewest FP32 instructions (they are what slows the other warpgroup's
    tensor cores beside an epilogue): with dys = dy sig(g) and du = dys g,
    dg = u (dys + du (1 - sig(g))): a subtract, an FMA and a multiply where the textbook
    form takes four instructions."""
    s = cm.sigmoid_fast(g)
    dys = dy * s  # shared by both
    du = dys * g  # dy silu(g)
    dg = u * (dys + du * (1.0 - s))  # = dys u (1 + g (1 - s))
    return dg, du


def pair_products(a: Any, b: Any, da: Any, db: Any) -> tuple[Any, Any]:
    """(a da, b db) over a column pair, pairwise "map" (e.g. the ZdZ terms of SwiGLU's
    backward, (g dg, u du)). Left at the pair's width, a TileReduce sum takes each product
    with one FMA; a pairwise "reduce" to a da + b db would cost an FMA, a multiply and an
    add."""
    return a * da, b * db


def rope(x: Any, y: Any, pos: Any, freq: Any) -> tuple[Any, Any]:
    """Rotary embedding, pairwise "map", interleaved pairs (x, y) = (even, odd) columns:
    angle = pos * freq (pos: row vector, one position per token; freq: col vector of
    width W/2, one frequency per pair), the product taken exactly
    (``math.cos_fast_of_product``); returns (x c - y s, y c + x s)."""
    c, s = cm.cos_fast_of_product(pos, freq), cm.sin_fast_of_product(pos, freq)
    return x * c - y * s, y * c + x * s


def rope_inverse(x: Any, y: Any, pos: Any, freq: Any) -> tuple[Any, Any]:
    """The inverse rotation of ``rope`` (its backward, since rotations are orthogonal):
    (x c + y s, y c - x s)."""
    c, s = cm.cos_fast_of_product(pos, freq), cm.sin_fast_of_product(pos, freq)
    return x * c + y * s, y * c - x * s
