"""coda.fusions.ce_chunks: how the cross-entropy walks the vocabulary, and its workspace.

Sits under ``coda.fusions.cross_entropy``; pure Python (no tensors). The vocabulary V is
split into chunks of ``size`` columns (a multiple of 8: TMA moves M x N tiles in rows of
16 bytes), the last one ragged; the final V mod 8 columns form a separate *padded* chunk
that runs over an 8-row zero-padded copy of its weight rows (see ``ce_epilogues``).

Workspace (bytes beyond inputs, outputs and gradients), with B = ``WORKSPACE_BYTES``
unless a chunk size is given:

* forward: per chunk the fused kernel writes n fp32 partials per row per 128-column tile
  (n = 3, or 4 with label smoothing): M * ceil(size / 128) * 4n bytes; the chunk is the
  largest with that <= B (one chunk for V = 128256 up to M = 16384 with B = 256 MiB).
* backward: the dlogits chunk, M * size * e bytes (e = 2 for bf16/fp16), size the largest
  multiple of 256 with that <= B (at least 256); an fp32 dh accumulator M * H * 4 when
  there is more than one chunk (one chunk writes dh directly); per-chunk partials of the
  dbias / drstd reductions (<= 2 * B / 64); O(M) row vectors.

So the peak workspace of this recompute path is about B + 4 M H (+ B / 32), independent
of V and of M x V: at M = 16384, H = 4096 that is 0.25 + 0.25 GiB where materialized
logits and their gradient take 2 x 4 GiB.

**Gradient-in-forward path** (``coda.fusions.ce_fused``): the rows are walked in chunks of
``rows`` rows (``grad_rows``: a multiple of ``ROW_STEP``, a row buffer of rows x
``main_cols(V)`` elements of h's dtype within ``GRAD_ROWS_BYTES``); the vocabulary is one
GEMM over its first ``main_cols(V)`` columns per row chunk, the V mod 8 tail columns plain
torch. Workspace (``grad_in_forward_workspace``): the row buffer (the stored acc, which
the dlogits overwrite in place; a second buffer only when the acc is stored in another
dtype), and with more than one row chunk an fp32 V x H dW accumulator and dh of the rows
before the last chunk, the per-chunk partials of the fused reductions, fp32 rows x H
temporaries when V mod 8 != 0, O(M) vectors. With several chunks the backward holds the
same (the last chunk's dlogits in the row buffer, the accumulators) while its GEMMs
write dh and dW, with one chunk likewise (``ce_fused.DEFER_ONE_CHUNK``, the default;
with it off, the backward scales the saved dh and dW, a copy of them when the graph is
kept).
"""

from __future__ import annotations

import attrs

__all__ = [
    "GRAD_ROWS_BYTES",
    "ROW_STEP",
    "TMA_COLS",
    "WORKSPACE_BYTES",
    "Chunk",
    "chunks",
    "grad_chunk_size",
    "grad_in_forward_workspace",
    "grad_rows",
    "main_cols",
    "round_up",
    "row_chunks",
    "stats_chunk_size",
]

#: Default workspace budget per pass (see the module doc).
WORKSPACE_BYTES = 256 * 2**20
#: Chunk widths are multiples of this (16-byte rows of 16-bit elements).
TMA_COLS = 8
#: Automatic backward chunks are multiples of this (whole 128-wide tiles, even counts).
GRAD_STEP = 256
#: Column tile of the fused forward (its partials are per 128 columns).
STATS_TILE = 128
#: Default budget of the gradient-in-forward path's row buffer (of each, when the acc is
#: stored in another dtype than the dlogits and they take two). 1 GiB (4096 rows of
#: V = 128256) was measured on an H200 (2026-11-26, the shifted softmax): 3-4% faster
#: fwd+bwd at H = 2048 in an interleaved A/B, not visible in a full run, and a peak above
#: torch.compile's at (H, M) = (2048, 8192) (2.493 vs 2.478 GiB; 2.013 at 512 MiB)
#: (``results/cross_entropy_rows_ab_h200.json``, ``cross_entropy_rows4096_h200.json``).
GRAD_ROWS_BYTES = 512 * 2**20
#: Automatic row chunks of the gradient-in-forward path are multiples of this (tile_m).
ROW_STEP = 128
#: Narrowest column tile the fused kernels fall back to (partials per this many columns).
MIN_TILE = 64


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@attrs.frozen
class Chunk:
    """Columns [start, stop) of the vocabulary; ``padded``: the V mod 8 tail, run as
    ``TMA_COLS`` columns over a zero-padded weight copy."""

    start: int
    stop: int

    @property
    def cols(self) -> int:
        return self.stop - self.start

    @property
    def padded(self) -> bool:
        return self.cols % TMA_COLS != 0

    @property
    def gemm_cols(self) -> int:
        """Columns of this chunk's GEMM (N)."""
        return TMA_COLS if self.padded else self.cols


def chunks(V: int, size: int) -> tuple[Chunk, ...]:
    """Chunks of ``size`` columns (a multiple of 8) covering [0, V); see the module doc."""
    if size <= 0 or size % TMA_COLS:
        raise ValueError(f"chunk size must be a positive multiple of {TMA_COLS}; got {size}")
    main = V - V % TMA_COLS
    out = [Chunk(v, min(v + size, main)) for v in range(0, main, size)]
    if main < V:
        out.append(Chunk(main, V))
    return tuple(out)


def stats_chunk_size(M: int, V: int, n_partials: int, budget: int | None = None) -> int:
    """Forward chunk: partials M * ceil(size / 128) * 4 * n_partials bytes <= budget
    (default: ``WORKSPACE_BYTES``, read at call time)."""
    budget = WORKSPACE_BYTES if budget is None else budget
    tiles = max(1, budget // (max(M, 1) * 4 * n_partials))
    return min(tiles * STATS_TILE, round_up(max(V, 1), TMA_COLS))


def grad_chunk_size(M: int, V: int, elem_bytes: int, budget: int | None = None) -> int:
    """Backward chunk: the dlogits chunk M * size * elem_bytes <= budget (size >= 256;
    default budget: ``WORKSPACE_BYTES``, read at call time)."""
    budget = WORKSPACE_BYTES if budget is None else budget
    size = max(GRAD_STEP, budget // (max(M, 1) * elem_bytes) // GRAD_STEP * GRAD_STEP)
    return min(size, round_up(max(V, 1), TMA_COLS))


# ---- the gradient-in-forward path ---------------------------------------------------------


def main_cols(V: int) -> int:
    """Vocabulary columns that run through the fused GEMM: V without its V mod 8 tail."""
    return V - V % TMA_COLS


def grad_rows(
    M: int,
    V: int,
    elem_bytes: int,
    budget: int | None = None,
    dw_hidden: int = 0,
    deferred: bool = True,
) -> int:
    """Rows per chunk: rows * main_cols(V) * elem_bytes <= budget (one row buffer; default
    ``GRAD_ROWS_BYTES``, read at call time), a multiple of ``ROW_STEP`` (at least one
    step), and no more than M rounded up to a step (one chunk when everything fits).

    ``dw_hidden``: H when dW is computed, which with several chunks needs an fp32 V x H
    accumulator. Then ONE chunk is taken whenever its workspace
    (``grad_in_forward_workspace``) is no larger than the budget chunks': less peak
    memory, and dW one GEMM over all tokens, rounded once, with no accumulator pass (e.g.
    M = 8192, V = 128256: one chunk from H = 4096 on, a 2.0 GiB buffer where four chunks
    take 0.5 GiB + a 2.0 GiB accumulator). ``deferred``: as ``grad_in_forward_workspace``
    takes it."""
    budget = GRAD_ROWS_BYTES if budget is None else budget
    per_row = max(main_cols(V), 1) * elem_bytes
    rows = max(ROW_STEP, budget // per_row // ROW_STEP * ROW_STEP)
    whole = round_up(max(M, 1), ROW_STEP)
    if rows >= whole:
        return whole

    def ws(r: int) -> int:
        return grad_in_forward_workspace(M, V, dw_hidden, elem_bytes, r, deferred=deferred)

    if dw_hidden and ws(whole) <= ws(rows):
        return whole
    return rows


def row_chunks(M: int, rows: int) -> tuple[tuple[int, int], ...]:
    """Row ranges [r0, r1) of ``rows`` rows (the last ragged) covering [0, M)."""
    if rows <= 0:
        raise ValueError(f"rows per chunk must be positive; got {rows}")
    return tuple((r, min(r + rows, M)) for r in range(0, M, rows))


def grad_in_forward_workspace(
    M: int,
    V: int,
    H: int,
    elem_bytes: int,
    rows: int,
    acc_bytes: int | None = None,
    deferred: bool = True,
) -> int:
    """Upper bound (bytes) of the gradient-in-forward path's workspace: its peak memory
    minus inputs, the loss and the gradients (dh, dW, dbias, drstd) it returns, for h of
    ``elem_bytes`` per element and the acc stored in ``acc_bytes`` (default: the same):
    the row buffer (one, the dlogits written in place over the stored acc, when
    ``acc_bytes == elem_bytes``, else two), with more than one row chunk the fp32 dW
    accumulator and dh of the rows before the last chunk, per-chunk partials at the
    narrowest tile, the tail's fp32 temporaries, 8 fp32 vectors of M; with several chunks
    the backward holds no more (the row buffer with the last chunk's dlogits and the
    accumulators while its GEMMs write dh and dW); with one chunk likewise when its GEMMs
    are ``deferred`` to the backward (``ce_fused.DEFER_ONE_CHUNK``, the default), else the
    backward may copy dh and dW (the saved gradients times the upstream gradient, out of
    place when the graph is kept)."""
    acc_bytes = elem_bytes if acc_bytes is None else acc_bytes
    m, n = min(rows, M), main_cols(V)
    tiles_n, tiles_m = -(-n // MIN_TILE), -(-m // MIN_TILE)
    in_place = acc_bytes == elem_bytes
    forward = m * n * (acc_bytes if in_place else acc_bytes + elem_bytes)
    forward += 4 * V * H + elem_bytes * M * H if M > rows else 0  # dW sum, dh rows
    forward += 4 * (m * tiles_n * 5 + tiles_m * n)  # lse/zt/zsum/drstd (row), dbias (col)
    forward += 2 * 4 * m * H if V % TMA_COLS else 0
    forward += 8 * 4 * M + 4 * V
    # one chunk, not deferred: the backward's out-of-place copy of the saved dh and dW
    backward = (M + V) * H * elem_bytes if M <= rows and not deferred else 0
    return max(forward, backward)
