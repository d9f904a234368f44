"""coda.testing.strategies: hypothesis strategies for epilogues, tilings and whole cases.

* ``epilogues(extra=(), max_steps=6)``: random *valid* compositions. A chain is grown one
  step at a time by *factories* (``Factory = (draw, Composer) -> Primitive | list | None``)
  that look at the values defined so far; then every value nobody reads is observed (a
  TileStore, TileReduce, LogSumExp or TargetSelect), so every step influences an output.
  Pass your own factories in ``extra`` to draw your primitive into compositions; with
  ``require_extra=True`` (the default when ``extra`` is given) every drawn epilogue
  contains at least one of them.
* ``tilings(n_alignment)``: tile and subtile shapes (subtiles dividing tiles).
* ``cases(...)``: an epilogue, a tiling, ragged sizes M, N, K (a few tiles per dimension,
  edges ragged most of the time), the GEMM dtype and a seed; ``Case.inputs()`` builds the
  tensors from the seed (hypothesis shrinks the shapes, the seed keeps reports short).

Built-in factories cover every kind: TileLoad (widths 1/2, 1, 2), VecLoad (row/col),
ScalarLoad, Elementwise (unary/binary/ternary, pairwise reduce/map incl. SwiGLU and
RoPE, math on vectors, row x col outer combinations), TileStore, TileReduce
(sum/sumsq/max, per row/col, with and without ``post``), LogSumExp and TargetSelect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from coda.epilogue import Epilogue
from coda.errors import InputError
from coda.geometry import Tiling
from coda.primitives import (
    Elementwise,
    LogSumExp,
    Primitive,
    ScalarLoad,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
)
from coda.primitives import math as cm
from coda.specs import FLOAT_DTYPES, WIDTHS, ValueSpec, dtype_name
from coda.testing import fns

__all__ = [
    "BUILTIN_FACTORIES",
    "Case",
    "Composer",
    "Factory",
    "cases",
    "epilogues",
    "make_inputs",
    "observe",
    "tilings",
]

DrawFn = Callable[[st.SearchStrategy[Any]], Any]


class Composer:
    """The state of a composition being drawn: the epilogue so far and fresh names.

    Factories use ``values`` / ``names(...)`` to find inputs, ``pick`` to draw one,
    ``fresh(prefix)`` for new names; the composer adds what they return.
    """

    def __init__(self) -> None:
        self.widths: tuple[Fraction, ...] = WIDTHS
        self.epilogue = Epilogue()
        self._count = 0
        self.target_dtype: torch.dtype | None = None
        self.ignore_index: int | None = None

    @property
    def values(self) -> dict[str, ValueSpec]:
        return dict(self.epilogue.values)

    def fresh(self, prefix: str) -> str:
        """A name not used yet, e.g. ``v3``."""
        self._count += 1
        return f"{prefix}{self._count}"

    def names(
        self, kinds: Sequence[str] = ("tile",), widths: Sequence[Fraction] | None = None
    ) -> list[str]:
        """Defined values of the given kinds (and widths, for tile/col values)."""
        return [
            n
            for n, s in self.epilogue.values.items()
            if s.kind in kinds and (widths is None or not s.has_cols or s.width in widths)
        ]

    def pick(
        self,
        draw: DrawFn,
        kinds: Sequence[str] = ("tile",),
        widths: Sequence[Fraction] | None = None,
    ) -> str | None:
        """Draw one defined value of the given kinds/widths, or None if there is none.
        The kind is drawn first (among those present), so rare kinds (vectors, scalars)
        are picked as often as the tiles that usually outnumber them."""
        present = [k for k in kinds if self.names((k,), widths)]
        if not present:
            return None
        kind = draw(st.sampled_from(present))
        return draw(st.sampled_from(self.names((kind,), widths)))

    def add(self, primitive: Primitive) -> None:
        self.epilogue = self.epilogue.add(primitive)

    def add_all(self, drawn: Primitive | Sequence[Primitive] | None) -> bool:
        """Add what a factory returned; False if it returned None."""
        if drawn is None:
            return False
        self.epilogue = self.epilogue.add(*([drawn] if isinstance(drawn, Primitive) else drawn))
        return True


#: A factory draws a primitive (or a short list of them) that fits the composition so far,
#: or returns None when it cannot.
Factory = Callable[[DrawFn, Composer], "Primitive | Sequence[Primitive] | None"]

_dtypes = st.sampled_from(FLOAT_DTYPES)


def tile_load(draw: DrawFn, c: Composer) -> Primitive:
    width = draw(st.sampled_from(c.widths))
    return TileLoad(c.fresh("t"), draw(_dtypes), width)


def vec_load(draw: DrawFn, c: Composer) -> Primitive:
    if draw(st.booleans()):
        return VecLoad(c.fresh("r"), "row", draw(_dtypes))
    return VecLoad(c.fresh("g"), "col", draw(_dtypes), draw(st.sampled_from(c.widths)))


def scalar_load(draw: DrawFn, c: Composer) -> Primitive:
    return ScalarLoad(c.fresh("s"))


def _operand(draw: DrawFn, c: Composer, width: Fraction) -> str | None:
    """Anything that combines elementwise with a width-``width`` tile."""
    return c.pick(draw, ("tile", "col", "row", "scalar"), (width,))


def unary(draw: DrawFn, c: Composer) -> Primitive:
    a = c.pick(draw)
    return Elementwise(c.fresh("v"), draw(st.sampled_from(fns.UNARY)), ins=(a,))


def nary(draw: DrawFn, c: Composer) -> Primitive:
    a = c.pick(draw)
    w = c.values[a].width
    fn = draw(st.sampled_from(fns.BINARY + fns.TERNARY))
    n = 3 if fn in fns.TERNARY else 2
    rest = [_operand(draw, c, w) for _ in range(n - 1)]
    ins = [a, *rest]
    order = draw(st.permutations(range(n)))  # the tile need not be the first argument
    return Elementwise(c.fresh("v"), fn, ins=tuple(ins[i] for i in order))


def pair_reduce(draw: DrawFn, c: Composer) -> Primitive | None:
    a = c.pick(draw, ("tile",), (Fraction(1), Fraction(2)))
    if a is None:
        return None
    w = c.values[a].width
    if draw(st.booleans()):
        return Elementwise(c.fresh("y"), draw(st.sampled_from(fns.PAIR_REDUCE)), (a,), "reduce")
    extra = c.pick(draw, ("tile", "col", "row", "scalar"), (w / 2,))
    if extra is None:
        return None
    fn = draw(st.sampled_from(fns.PAIR_REDUCE_3))
    return Elementwise(c.fresh("y"), fn, (a, extra), "reduce")


def pair_map(draw: DrawFn, c: Composer) -> Primitive:
    a = c.pick(draw)
    w = c.values[a].width
    arity = draw(st.sampled_from((2, 3, 4)))
    half = ("tile", "col", "row", "scalar")
    if arity == 3:
        angle = c.pick(draw, half, (w / 2,))
        if angle is not None:
            fn = draw(st.sampled_from(fns.PAIR_MAP_3))
            return Elementwise(c.fresh("p"), fn, (a, angle), "map")
    if arity == 4:
        pos, freq = c.pick(draw, half, (w / 2,)), c.pick(draw, half, (w / 2,))
        if pos is not None and freq is not None:
            fn = draw(st.sampled_from(fns.PAIR_MAP_4))
            return Elementwise(c.fresh("p"), fn, (a, pos, freq), "map")
    return Elementwise(c.fresh("p"), draw(st.sampled_from(fns.PAIR_MAP)), (a,), "map")


def _new_vector(draw: DrawFn, c: Composer, kind: str, width: Fraction) -> Primitive:
    if kind == "row":
        return VecLoad(c.fresh("r"), "row", draw(_dtypes))
    if kind == "col":
        return VecLoad(c.fresh("g"), "col", draw(_dtypes), width)
    return ScalarLoad(c.fresh("s"))


def broadcast(draw: DrawFn, c: Composer) -> list[Primitive]:
    """A tile combined with a new row vector, col vector or scalar (a bias, a gamma, an
    rstd, a scale), or a new row vector combined with a new col vector (outer)."""
    kind = draw(st.sampled_from(("row", "col", "scalar", "outer")))
    if kind == "outer":
        w = draw(st.sampled_from(c.widths))
        loads = [_new_vector(draw, c, "row", w), _new_vector(draw, c, "col", w)]
    else:
        a = c.pick(draw)
        loads = [_new_vector(draw, c, kind, c.values[a].width)]
    names = [p.writes[0] for p in loads]
    if kind != "outer":
        names = draw(st.permutations([a, *names]))
    fn = draw(st.sampled_from(fns.BINARY))
    return [*loads, Elementwise(c.fresh("v"), fn, ins=tuple(names))]


def vector_math(draw: DrawFn, c: Composer) -> Primitive | None:
    """Math on broadcast values: unary/binary over row, col and scalar values (a row
    meeting a col makes a tile), or a pairwise map over a col vector."""
    a = c.pick(draw, ("row", "col", "scalar"))
    if a is None:
        return None
    spec = c.values[a]
    if spec.kind == "col" and draw(st.booleans()):
        return Elementwise(c.fresh("q"), draw(st.sampled_from(fns.PAIR_MAP)), (a,), "map")
    b = c.pick(draw, ("row", "col", "scalar"), (spec.width,))
    if b is not None and draw(st.booleans()):
        return Elementwise(c.fresh("q"), draw(st.sampled_from(fns.BINARY)), (a, b))
    return Elementwise(c.fresh("q"), draw(st.sampled_from(fns.UNARY)), (a,))


def _post_mean(total: Any, n: int) -> Any:
    return total / n


def _post_rstd(total: Any, n: int) -> Any:
    return cm.rsqrt(total / n + 1e-5)


def observe(draw: DrawFn, c: Composer, value: str) -> Primitive:
    """Draw a primitive that turns tile value ``value`` into an output."""
    choice = draw(st.sampled_from(("store", "store", "reduce", "lse", "select")))
    if choice == "store":
        return TileStore(value, draw(_dtypes), name=c.fresh(f"{value}_out"))
    if choice == "reduce":
        op = draw(st.sampled_from(("sum", "sumsq", "max")))
        posts = {"sum": (None, _post_mean), "sumsq": (None, _post_mean, _post_rstd), "max": (None,)}
        post = draw(st.sampled_from(posts[op]))
        per = draw(st.sampled_from(("row", "col")))
        return TileReduce(c.fresh("red"), value, op, per, post)
    if choice == "lse":
        return LogSumExp(c.fresh("lse"), value)
    if c.target_dtype is None:  # one target tensor shared by every TargetSelect
        c.target_dtype = draw(st.sampled_from((torch.int64, torch.int32)))
        c.ignore_index = draw(st.sampled_from((-100, 0, 1)))  # may be a valid column too
    return TargetSelect(
        c.fresh("sel"),
        value,
        target="target",
        ignore_index=c.ignore_index,
        target_dtype=c.target_dtype,
    )


def observer(draw: DrawFn, c: Composer) -> Primitive:
    """Observe some tile value mid-chain (outputs need not come last)."""
    return observe(draw, c, c.pick(draw))


BUILTIN_FACTORIES: tuple[Factory, ...] = (
    tile_load,
    vec_load,
    scalar_load,
    unary,
    nary,
    nary,
    broadcast,
    pair_reduce,
    pair_map,
    vector_math,
    observer,
)


@st.composite
def epilogues(
    draw: DrawFn,
    *,
    extra: Sequence[Factory] = (),
    max_steps: int = 6,
    builtins: Sequence[Factory] = BUILTIN_FACTORIES,
    require_extra: bool | None = None,
) -> Epilogue:
    """Random valid epilogues (see the module doc); the built-in factories draw only
    primitives that also trace into the fused GPU kernel."""
    c = Composer()
    factories = tuple(builtins) + tuple(extra)
    used_extra = False
    for _ in range(draw(st.integers(1, max_steps))):
        f = draw(st.sampled_from(factories))
        if c.add_all(f(draw, c)):
            used_extra |= f in extra
    if extra and (require_extra if require_extra is not None else True) and not used_extra:
        for f in draw(st.permutations(list(extra))):
            if c.add_all(f(draw, c)):
                break
        else:
            raise ValueError("none of the extra factories could add a primitive")
    read = {n for p in c.epilogue for n in p.reads}
    leaves = [n for n in c.names(("tile",)) if n not in read]
    for leaf in leaves:
        c.add(observe(draw, c, leaf))
    return c.epilogue


def _divisors(n: int, *, multiple_of: int, at_least: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d % multiple_of == 0 and d >= at_least]


@st.composite
def tilings(draw: DrawFn, n_alignment: int = 1, max_subtiles: int = 4) -> Tiling:
    """Tile (tm, tn) in powers of two (tn a multiple of ``n_alignment``) and a subtile that
    divides it, with at most ``max_subtiles`` subtiles per tile dimension."""
    sizes = (4, 8, 16, 32)
    tm = draw(st.sampled_from(sizes))
    tn = draw(st.sampled_from([s for s in sizes if s % n_alignment == 0]))
    sm = draw(st.sampled_from(_divisors(tm, multiple_of=1, at_least=tm // max_subtiles)))
    sn = draw(st.sampled_from(_divisors(tn, multiple_of=n_alignment, at_least=tn // max_subtiles)))
    return Tiling((tm, tn), (sm, sn))


@attrs.frozen
class Case:
    """One drawn problem: an epilogue, sizes, a tiling, the GEMM dtype and a seed.

    ``inputs()`` returns (A, B, tensors) generated from ``seed``: A, B scaled so acc is
    about N(0, 1), tiles and vectors N(0, 1), scalars in [-2, 2], targets uniform over the
    columns with about 1 in 8 rows set to the ignore index.
    """

    epilogue: Epilogue
    M: int
    N: int
    K: int
    dtype: torch.dtype
    tile: tuple[int, int]
    subtile: tuple[int, int]
    seed: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        return make_inputs(self.epilogue, self.M, self.N, self.K, self.dtype, self.seed)

    def __repr__(self) -> str:
        lines = [
            f"Case(M={self.M}, N={self.N}, K={self.K}, dtype={dtype_name(self.dtype)}, "
            f"tile={self.tile}, subtile={self.subtile}, seed={self.seed})",
            self.epilogue.describe(),
        ]
        return "\n".join(lines)


def make_inputs(
    epi: Epilogue, M: int, N: int, K: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Random (A, B, tensors) for ``epi`` at (M, N, K), reproducible from ``seed``.
    Never all-zero: normal entries, acc about N(0, 1)."""
    if N % epi.n_alignment:
        raise InputError(
            f"make_inputs: N={N} is not a multiple of {epi.n_alignment}, which this "
            "epilogue needs (it has half-width values or column pairs)"
        )
    g = torch.Generator().manual_seed(seed)
    s = K**-0.25
    A = (torch.randn(M, K, generator=g) * s).to(dtype)
    B = (torch.randn(N, K, generator=g) * s).to(dtype)
    tensors: dict[str, Any] = {}
    for spec in epi.inputs:
        shape = spec.shape(M, N)
        if spec.role == "scalar":
            tensors[spec.name] = float(torch.rand((), generator=g) * 4 - 2)
        elif spec.dtype.is_floating_point:
            tensors[spec.name] = torch.randn(shape, generator=g).to(spec.dtype)
        else:  # targets: valid for every TargetSelect that shares them
            users = [p for p in epi if isinstance(p, TargetSelect) and p.target == spec.name]
            cols = min(int(N * epi.values[p.of].width) for p in users)
            t = torch.randint(0, cols, shape, generator=g)
            drop = torch.rand(shape, generator=g) < 0.125
            t = torch.where(drop, torch.full_like(t, users[0].ignore_index), t)
            tensors[spec.name] = t.to(spec.dtype)
    return A, B, tensors


@st.composite
def cases(
    draw: DrawFn,
    epilogue: st.SearchStrategy[Epilogue] | Epilogue | None = None,
    *,
    extra: Sequence[Factory] = (),
    max_tiles: int = 3,
    max_k: int = 48,
) -> Case:
    """A full random case. ``epilogue``: a fixed Epilogue, a strategy, or None for
    ``epilogues(extra=extra)``. M and N span 1..``max_tiles`` tiles and are ragged most of
    the time (M % tm != 0); N respects the epilogue's alignment."""
    if epilogue is None:
        epi = draw(epilogues(extra=extra))
    elif isinstance(epilogue, Epilogue):
        epi = epilogue
    else:
        epi = draw(epilogue)
    t = draw(tilings(epi.n_alignment))
    (tm, tn), a = t.tile, epi.n_alignment
    n_tm, n_tn = draw(st.integers(1, max_tiles)), draw(st.integers(1, max_tiles))
    M = draw(st.integers((n_tm - 1) * tm + 1, n_tm * tm))
    N = a * draw(st.integers(((n_tn - 1) * tn) // a + 1, (n_tn * tn) // a))
    K = draw(st.integers(1, max_k))
    dtype = draw(_dtypes)
    seed = draw(st.integers(0, 2**32 - 1))
    return Case(epi, M, N, K, dtype, t.tile, t.subtile, seed)
