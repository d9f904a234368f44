"""coda.geometry: problem sizes and tilings (a leaf module, used by the reference, the tile
simulator and, later, the kernel launcher).

A GEMM C = A @ B^T has A: (M, K), B: (N, K), so ``acc`` is (M, N). The output is cut into
tiles of ``tile = (tm, tn)`` accumulator elements; tiles on the last row/column of tiles
are *ragged*: partly outside (M, N). Inside a tile, the epilogue visits subtiles of
``subtile = (sm, sn)`` elements, row-major (all subtiles of the first subtile row left to
right, then the next row). A value of width w covers ``tn * w`` columns of its own tensor
per tile and ``sn * w`` per subtile.
"""

from __future__ import annotations

from fractions import Fraction

import attrs

from coda.errors import InputError

__all__ = ["Problem", "Tiling", "ceil_div"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pair(value: object) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise InputError(f"expected a pair of positive ints, got {value!r}")
    return (value[0], value[1])


@attrs.frozen
class Problem:
    """The sizes of one GEMM: A (M, K), B (N, K), acc (M, N)."""

    M: int
    N: int
    K: int

    def cols(self, width: Fraction) -> int:
        """Number of columns of a width-``width`` value: N * width (must be an integer)."""
        cols = self.N * Fraction(width)
        if cols.denominator != 1:
            raise InputError(f"N={self.N} * width {width} is not an integer")
        return int(cols)


@attrs.frozen
class Tiling:
    """Tile and subtile shapes in accumulator elements, validated against each other.

    ``tile = (tm, tn)``, ``subtile = (sm, sn)``: sm must divide tm and sn divide tn.
    ``subtile=None`` picks ``(min(64, tm), min(32, tn))`` when those divide the tile,
    else the whole tile.
    """

    tile: tuple[int, int] = attrs.field(default=(128, 128), converter=_pair)
    subtile: tuple[int, int] = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        tm, tn = self.tile
        if self.subtile is None:
            sm = 64 if tm % 64 == 0 else tm
            sn = 32 if tn % 32 == 0 else tn
            object.__setattr__(self, "subtile", (sm, sn))
        else:
            object.__setattr__(self, "subtile", _pair(self.subtile))
        sm, sn = self.subtile
        if tm % sm or tn % sn:
            raise InputError(
                f"subtile {self.subtile} must divide tile {self.tile} (sm | tm and sn | tn)"
            )

    def check_alignment(self, n_alignment: int) -> None:
        """Tiles and subtiles must not split a column pair or a half-width column:
        tn and sn must be multiples of the epilogue's ``n_alignment``."""
        tn, sn = self.tile[1], self.subtile[1]
        if tn % n_alignment or sn % n_alignment:
            raise InputError(
                f"this epilogue needs tile and subtile widths that are multiples of "
                f"{n_alignment} (it has half-width values or column pairs); "
                f"got tn={tn}, sn={sn}"
            )

    def n_tiles(self, problem: Problem) -> tuple[int, int]:
        """(n_tiles_m, n_tiles_n): how many tiles cover (M, N), ragged ones included."""
        return ceil_div(problem.M, self.tile[0]), ceil_div(problem.N, self.tile[1])
