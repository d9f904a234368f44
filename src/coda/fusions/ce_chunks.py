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

So the peak workspace is about B + 4 M H (+ B / 32), independent of V and of M x V: at
M = 16384, H = 4096 that is 0.25 + 0.25 GiB where materialized logits and their gradient
take 2 x 4 GiB.
"""

from __future__ import annotations

import attrs

__all__ = [
    "TMA_COLS",
    "WORKSPACE_BYTES",
    "Chunk",
    "chunks",
    "grad_chunk_size",
    "round_up",
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
