"""coda.specs: the vocabulary shared by every layer (a leaf module).

* ``ValueSpec``: a named value inside an epilogue (what primitives read and write). Every
  value is float32. Its ``kind`` says its shape relative to the GEMM output ``acc`` (M, N):

  ====== ==================== ==============================================
  kind   shape                example
  ====== ==================== ==============================================
  tile   (M, N * width)       acc, x = acc + residual, the SwiGLU output
  row    (M,)  per="row"      rstd (one entry per row), broadcast over columns
  col    (N * width,)         gamma, a bias (one entry per column), broadcast over rows
  scalar ()                   a runtime float argument, broadcast everywhere
  ====== ==================== ==============================================

  ``width`` is a Fraction relative to N: 1, 1/2 (e.g. SwiGLU output) or 2 (e.g. an
  interleaved gate/up operand read by SwiGLU backward). Row and scalar values have width 1.

* ``TensorSpec``: a tensor bound to the epilogue, either an input the user passes or an
  output the epilogue returns. Roles: ``tile`` (M, N*width), ``row`` (M,), ``col``
  (N*width,), ``scalar`` (a Python float), and, for outputs only, ``partials_row``
  (M, n_tiles_n) and ``partials_col`` (n_tiles_m, N*width).
"""

from __future__ import annotations

import keyword
from fractions import Fraction
from typing import Literal

import attrs
import torch

from coda.errors import InvalidArgumentError, InvalidNameError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "KINDS",
    "RESERVED_NAMES",
    "ROLES",
    "WIDTHS",
    "TensorSpec",
    "ValueSpec",
    "check_name",
    "dtype_name",
    "to_width",
    "width_str",
]

#: Widths a tile-shaped value may have, relative to the GEMM's N.
WIDTHS: tuple[Fraction, ...] = (Fraction(1, 2), Fraction(1), Fraction(2))
#: Storage dtypes of tile and vector tensors (loads and stores).
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
#: Dtypes of index vectors (the target of ``TargetSelect``).
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32)
KINDS: tuple[str, ...] = ("tile", "row", "col", "scalar")
ROLES: tuple[str, ...] = ("tile", "row", "col", "scalar", "partials_row", "partials_col")
#: Names no value or tensor may take: the predefined value and the keyword arguments of
#: ``Epilogue.reference`` and ``coda.simulate``.
RESERVED_NAMES: frozenset[str] = frozenset(
    {"A", "B", "acc", "tile", "subtile", "oob_fill"}
    # the other parameters of ``Epilogue.__call__`` / ``reference`` and ``coda.simulate``,
    # which a keyword tensor of that name would collide with
    | {"self", "epi", "config", "check_contents", "outputs"}
)

Kind = Literal["tile", "row", "col", "scalar"]
Role = Literal["tile", "row", "col", "scalar", "partials_row", "partials_col"]


def to_width(value: object) -> Fraction:
    """Convert ``1``, ``2``, ``0.5``, ``"1/2"`` or a Fraction into a valid width."""
    try:
        width = Fraction(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"width must be one of 1/2, 1, 2 (relative to N); got {value!r}"
        ) from None
    if width not in WIDTHS:
        raise InvalidArgumentError(f"width must be one of 1/2, 1, 2 (relative to N); got {value!r}")
    return width


def width_str(width: Fraction) -> str:
    """``Fraction(1, 2)`` -> ``"1/2"``, ``Fraction(2)`` -> ``"2"``."""
    return str(Fraction(width))


def width_note(width: Fraction) -> str:
    """The suffix a primitive's label gives its width: ``""`` at width 1, else
    ``", width 1/2"``."""
    return "" if width == 1 else f", width {width_str(width)}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def check_name(name: object, what: str = "name") -> str:
    """Validate a value/tensor name: a Python identifier (so it can be a keyword argument),
    not a keyword, not reserved. Returns it; raises InvalidNameError otherwise."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidNameError(
            f"{what} must be a Python identifier (it becomes a keyword argument or a "
            f"dict key); got {name!r}"
        )
    if name in RESERVED_NAMES:
        raise InvalidNameError(
            f"{what} {name!r} is reserved (reserved: {', '.join(sorted(RESERVED_NAMES))})"
        )
    return name


def _check_kind(_: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in KINDS:
        raise InvalidArgumentError(f"value kind must be one of {KINDS}; got {value!r}")


@attrs.frozen
class ValueSpec:
    """A named fp32 value inside an epilogue: its kind (tile/row/col/scalar) and width."""

    name: str
    kind: Kind = attrs.field(validator=_check_kind)
    width: Fraction = attrs.field(default=Fraction(1), converter=to_width)

    @property
    def has_cols(self) -> bool:
        """True for values with a column dimension (tile and col): they have a width."""
        return self.kind in ("tile", "col")

    def describe(self) -> str:
        """E.g. ``"tile, width 1/2"`` or ``"row vector"``."""
        if self.kind == "tile":
            return f"tile, width {width_str(self.width)}"
        if self.kind == "col":
            return f"col vector, width {width_str(self.width)}"
        return "row vector" if self.kind == "row" else "scalar"


def _check_role(_: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in ROLES:
        raise InvalidArgumentError(f"tensor role must be one of {ROLES}; got {value!r}")


def _check_direction(_: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in ("in", "out"):
        raise InvalidArgumentError(f"tensor direction must be 'in' or 'out'; got {value!r}")


@attrs.frozen
class TensorSpec:
    """A tensor bound to an epilogue: an input the caller passes or an output it returns.

    ``shape(M, N, tile)`` gives the exact shape; partial roles need the tile shape.
    Scalars are Python floats (``dtype`` float32 documents their precision).
    """

    name: str
    role: Role = attrs.field(validator=_check_role)
    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))
    width: Fraction = attrs.field(default=Fraction(1), converter=to_width)
    direction: Literal["in", "out"] = attrs.field(default="in", validator=_check_direction)

    @property
    def is_partials(self) -> bool:
        return self.role.startswith("partials")

    def shape(self, M: int, N: int, tile: tuple[int, int] | None = None) -> tuple[int, ...]:
        """The tensor's shape for a GEMM output of (M, N) (and a tile shape for partials)."""
        cols = N * self.width
        if cols.denominator != 1:
            raise InvalidArgumentError(
                f"tensor {self.name!r} has width {width_str(self.width)}: N={N} gives "
                f"{cols} columns, not an integer"
            )
        ncols = int(cols)
        if self.role == "tile":
            return (M, ncols)
        if self.role == "row":
            return (M,)
        if self.role == "col":
            return (ncols,)
        if self.role == "scalar":
            return ()
        if tile is None:
            raise InvalidArgumentError(f"the shape of partials {self.name!r} needs a tile shape")
        tm, tn = tile
        if self.role == "partials_row":
            return (M, -(-N // tn))
        return (-(-M // tm), ncols)

    def describe(self) -> str:
        """E.g. ``"residual: tile (M, N) bfloat16"``."""
        w = "N" if self.width == 1 else f"N*{width_str(self.width)}"
        shapes = {
            "tile": f"(M, {w})",
            "row": "(M,)",
            "col": f"({w},)",
            "scalar": "python float",
            "partials_row": "(M, n_tiles_n)",
            "partials_col": f"(n_tiles_m, {w})",
        }
        return f"{self.name}: {self.role} {shapes[self.role]} {dtype_name(self.dtype)}"
