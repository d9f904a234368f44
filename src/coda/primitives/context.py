"""coda.primitives.context: what a primitive sees when it runs.

* ``ReferenceEnv``: the whole-tensor world of ``Primitive.reference``. Values are fp32 and
  always 2-D so that broadcasting in an ``fn`` is plain PyTorch broadcasting:
  tile (M, C), row (M, 1), col (1, C), scalar (1, 1), where C = N * width.
* ``Tile`` and ``Subtile``: the tile simulator's world (``begin_tile``/``visit``/``end_tile``).
  A ``Subtile`` holds the same 2-D layout restricted to one subtile: tile values
  (sm, sn * width), row (sm, 1), col (1, sn * width), scalar (1, 1). Loads read the bound
  tensors with an out-of-bounds fill (what TMA does on the GPU: zeros; the simulator poisons
  with NaN by default so a missing mask shows up), stores write only in-bounds elements.

These classes belong to the primitive layer so primitives never import the epilogue or the
simulator (dependency direction: primitives -> epilogue -> simulator).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

import torch

from coda.geometry import Problem
from coda.specs import ValueSpec

__all__ = ["ReferenceEnv", "Subtile", "Tile"]

Bound = Mapping[str, "torch.Tensor | float"]


def value_shape(spec: ValueSpec, rows: int, cols: int) -> tuple[int, int]:
    """The 2-D shape of a value of ``spec`` in a block of ``rows`` x ``cols`` (cols already
    scaled by the value's width)."""
    if spec.kind == "tile":
        return (rows, cols)
    if spec.kind == "row":
        return (rows, 1)
    if spec.kind == "col":
        return (1, cols)
    return (1, 1)


def _as_fp32_scalar(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.tensor([[float(value)]], dtype=torch.float32, device=device)


class ReferenceEnv:
    """The evaluation environment of ``Primitive.reference`` (whole tensors).

    Attributes: ``problem`` (M, N, K); ``specs`` (every value's ValueSpec); ``tensors``
    (the bound input tensors, as passed by the user); ``values`` (name -> fp32 2-D tensor;
    primitives add what they write); ``outputs`` (name -> output tensor; primitives add
    theirs); ``tile`` ((tm, tn) or None: when set, reductions also return their per-tile
    partials for that tiling).
    """

    def __init__(
        self,
        problem: Problem,
        specs: Mapping[str, ValueSpec],
        tensors: Bound,
        device: torch.device,
        tile: tuple[int, int] | None = None,
    ) -> None:
        self.problem = problem
        self.specs = specs
        self.tensors = tensors
        self.device = device
        self.tile = tile
        self.values: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}

    def shape(self, spec: ValueSpec) -> tuple[int, int]:
        """The 2-D shape of a whole value (see module doc)."""
        return value_shape(spec, self.problem.M, self.problem.cols(spec.width))

    def load(self, name: str, kind: str) -> torch.Tensor:
        """A bound input as an fp32 value of ``kind`` (2-D layout)."""
        t = self.tensors[name]
        if kind == "scalar":
            return _as_fp32_scalar(t, self.device)
        t = t.to(torch.float32)
        if kind == "row":
            return t.reshape(-1, 1)
        if kind == "col":
            return t.reshape(1, -1)
        return t


class Tile:
    """One output tile as the simulator visits it.

    ``index = (i, j)``: tile row/column. ``origin = (r0, c0)``: its first accumulator
    element. ``shape = (tm, tn)``; ``valid = (vm, vn)``: how many of its rows/columns lie
    inside (M, N) (less than the shape on ragged edges). Column quantities of a value of
    width w scale by w. Primitives keep per-tile state from ``begin_tile`` to ``end_tile``
    and write their partials with ``write_row_partial`` / ``write_col_partial``.
    """

    def __init__(
        self,
        *,
        problem: Problem,
        specs: Mapping[str, ValueSpec],
        tensors: Bound,
        outputs: dict[str, torch.Tensor],
        index: tuple[int, int],
        shape: tuple[int, int],
        fill: float,
        device: torch.device,
    ) -> None:
        self.problem = problem
        self.specs = specs
        self.tensors = tensors
        self.outputs = outputs
        self.index = index
        self.shape = shape
        self.fill = fill
        self.device = device
        tm, tn = shape
        self.origin = (index[0] * tm, index[1] * tn)
        self.valid = (min(tm, problem.M - self.origin[0]), min(tn, problem.N - self.origin[1]))

    def cols(self, width: Fraction) -> int:
        """Columns of a width-``width`` value in this tile (tn * width)."""
        return int(self.shape[1] * width)

    def valid_cols(self, width: Fraction) -> int:
        """In-bounds columns of a width-``width`` value in this tile (vn * width)."""
        return int(self.valid[1] * width)

    def col_origin(self, width: Fraction) -> int:
        """First column of this tile in a width-``width`` tensor (c0 * width)."""
        return int(self.origin[1] * width)

    def full_rows(self, fill: float) -> torch.Tensor:
        """A (tm,) fp32 per-row state initialized to ``fill``."""
        return torch.full((self.shape[0],), fill, dtype=torch.float32, device=self.device)

    def full_cols(self, width: Fraction, fill: float) -> torch.Tensor:
        """A (tn * width,) fp32 per-column state initialized to ``fill``."""
        return torch.full((self.cols(width),), fill, dtype=torch.float32, device=self.device)

    def write_row_partial(self, name: str, state: torch.Tensor) -> None:
        """Write this tile's per-row partial (tm,) into column j of output ``name``
        (M, n_tiles_n); only the tile's in-bounds rows are written."""
        r0, vm = self.origin[0], self.valid[0]
        self.outputs[name][r0 : r0 + vm, self.index[1]] = state[:vm]

    def write_col_partial(self, name: str, state: torch.Tensor, width: Fraction) -> None:
        """Write this tile's per-column partial (tn * width,) into row i of output ``name``
        (n_tiles_m, N * width); only in-bounds columns are written."""
        c0, vc = self.col_origin(width), self.valid_cols(width)
        self.outputs[name][self.index[0], c0 : c0 + vc] = state[:vc]


class Subtile:
    """One subtile of a tile, the unit the fused visitor runs on.

    ``index = (a, b)``: subtile row/column inside the tile; ``origin = (r0, c0)``: its first
    accumulator element (global); ``shape = (sm, sn)``. ``values`` maps value names to fp32
    blocks (layout in the module doc); primitives read their inputs there and put their
    outputs there. Masks say which elements lie inside (M, N * width).
    """

    def __init__(self, tile: Tile, index: tuple[int, int], shape: tuple[int, int]) -> None:
        self.tile = tile
        self.index = index
        self.shape = shape
        self.origin = (
            tile.origin[0] + index[0] * shape[0],
            tile.origin[1] + index[1] * shape[1],
        )
        self.values: dict[str, torch.Tensor] = {}

    # -- geometry -------------------------------------------------------------------------
    @property
    def specs(self) -> Mapping[str, ValueSpec]:
        return self.tile.specs

    def cols(self, width: Fraction) -> int:
        """Columns of a width-``width`` value in this subtile (sn * width)."""
        return int(self.shape[1] * width)

    def col_origin(self, width: Fraction) -> int:
        """First column of this subtile in a width-``width`` tensor."""
        return int(self.origin[1] * width)

    def local_rows(self) -> slice:
        """This subtile's rows inside its tile (index into a (tm,) tile state)."""
        start = self.origin[0] - self.tile.origin[0]
        return slice(start, start + self.shape[0])

    def local_cols(self, width: Fraction) -> slice:
        """This subtile's columns inside its tile, for a width-``width`` value."""
        start = self.col_origin(width) - self.tile.col_origin(width)
        return slice(start, start + self.cols(width))

    def shape_of(self, spec: ValueSpec) -> tuple[int, int]:
        """The 2-D block shape of value ``spec`` in this subtile."""
        return value_shape(spec, self.shape[0], self.cols(spec.width))

    def row_index(self) -> torch.Tensor:
        """(sm, 1) int64 global row indices."""
        r0 = self.origin[0]
        return torch.arange(r0, r0 + self.shape[0], device=self.tile.device).reshape(-1, 1)

    def col_index(self, width: Fraction) -> torch.Tensor:
        """(1, sn * width) int64 global column indices of a width-``width`` tensor."""
        c0 = self.col_origin(width)
        return torch.arange(c0, c0 + self.cols(width), device=self.tile.device).reshape(1, -1)

    def row_mask(self) -> torch.Tensor:
        """(sm, 1) bool: rows inside M."""
        return self.row_index() < self.tile.problem.M

    def col_mask(self, width: Fraction) -> torch.Tensor:
        """(1, sn * width) bool: columns inside N * width."""
        return self.col_index(width) < self.tile.problem.cols(width)

    def mask(self, width: Fraction) -> torch.Tensor:
        """(sm, sn * width) bool: elements inside (M, N * width)."""
        return self.row_mask() & self.col_mask(width)

    # -- global memory --------------------------------------------------------------------
    def _block(self, t: torch.Tensor, rows: slice | None, cols: slice | None) -> torch.Tensor:
        """Read t[rows, cols] clipped to t's bounds, padded to the full block with the
        tile's OOB fill (fp32), like a TMA load of a partially out-of-bounds box."""
        sm = self.shape[0]
        out_rows = sm if rows is not None else 1
        if cols is not None:
            out_cols = cols.stop - cols.start
        else:
            out_cols = 1
        fill = self.tile.fill if t.is_floating_point() else -1
        dtype = torch.float32 if t.is_floating_point() else torch.int64
        out = torch.full((out_rows, out_cols), fill, dtype=dtype, device=self.tile.device)
        if t.dim() == 1 and rows is not None:
            src = t[rows].reshape(-1, 1)
        elif t.dim() == 1:
            src = t[cols].reshape(1, -1)
        else:
            src = t[rows, cols]
        out[: src.shape[0], : src.shape[1]] = src.to(dtype)
        return out

    def load_tile(self, name: str, width: Fraction) -> torch.Tensor:
        """(sm, sn * width) fp32 block of input tile ``name``; OOB elements = fill."""
        r0, c0 = self.origin[0], self.col_origin(width)
        rows = slice(r0, r0 + self.shape[0])
        cols = slice(c0, c0 + self.cols(width))
        return self._block(self.tile.tensors[name], rows, cols)

    def load_row(self, name: str) -> torch.Tensor:
        """(sm, 1) block of row vector ``name``: fp32 for float tensors (OOB = fill),
        int64 for index tensors (OOB = -1, which matches no column)."""
        r0 = self.origin[0]
        return self._block(self.tile.tensors[name], slice(r0, r0 + self.shape[0]), None)

    def load_col(self, name: str, width: Fraction) -> torch.Tensor:
        """(1, sn * width) fp32 block of column vector ``name``; OOB = fill."""
        c0 = self.col_origin(width)
        return self._block(self.tile.tensors[name], None, slice(c0, c0 + self.cols(width)))

    def load_scalar(self, name: str) -> torch.Tensor:
        """(1, 1) fp32 scalar argument ``name``."""
        return _as_fp32_scalar(self.tile.tensors[name], self.tile.device)

    def store(self, name: str, value: torch.Tensor, width: Fraction) -> None:
        """Write the in-bounds part of an (sm, sn * width) block into output tile ``name``
        (converted to that output's dtype); out-of-bounds elements are never written."""
        out = self.tile.outputs[name]
        r0, c0 = self.origin[0], self.col_origin(width)
        vm = max(0, min(self.shape[0], out.shape[0] - r0))
        vc = max(0, min(self.cols(width), out.shape[1] - c0))
        if vm and vc:
            out[r0 : r0 + vm, c0 : c0 + vc] = value[:vm, :vc].to(out.dtype)
