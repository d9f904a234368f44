"""coda.simulator: the CPU tile simulator, the executable specification of the fused kernel.

``simulate(epi, A, B, tile=(tm, tn), subtile=(sm, sn), **tensors)`` evaluates an epilogue
the way the fused GPU kernel will, and returns the same dict as
``epi.reference(A, B, tile=tile, **tensors)`` (stores, finalized results, partials):

1. acc = A.float() @ B.float().T (the mainloop's job; computed once, like the reference,
   so any difference comes from the epilogue's schedule).
2. For every output tile (i, j), in row-major order (the order is irrelevant to results:
   each tile owns its outputs and partials, nothing is accumulated across tiles):
   ``state_p = p.begin_tile(tile)`` for every primitive p; then for every subtile (a, b),
   row-major inside the tile, the subtile's ``acc`` block is loaded and every primitive
   runs ``p.visit(subtile, state_p)`` in chain order; then ``p.end_tile(tile, state_p)``
   writes per-tile partials.
3. After the last tile, ``p.finalize(partials, problem, specs)`` combines the partials.

Ragged edges: tiles and subtiles that reach past (M, N) are visited whole (the GPU computes
full fragments too), but out-of-bounds elements are never written and must not contribute
to partials. Loads read out-of-bounds elements as ``oob_fill``: NaN by default, a poison
that makes any missing mask visible in the results; the GPU reads zeros there (TMA OOB
fill), ``oob_fill=0.0`` mirrors that exactly. Outputs are pre-filled with NaN, so an element
that no tile writes shows up too.
"""

from __future__ import annotations

import numbers

import torch

from coda.binding import bind
from coda.epilogue import Epilogue, check_outputs
from coda.errors import EpilogueError
from coda.geometry import Tiling
from coda.primitives.context import Subtile, Tile

__all__ = ["simulate"]


def simulate(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    *,
    tile: tuple[int, int] = (128, 128),
    subtile: tuple[int, int] | None = None,
    oob_fill: float = float("nan"),
    **tensors: torch.Tensor | float,
) -> dict[str, torch.Tensor]:
    """Run ``epi`` tile by tile, subtile by subtile (see the module doc). ``subtile=None``
    picks (64, 32) when it divides the tile, else the whole tile along that dimension."""
    if not isinstance(epi, Epilogue):
        raise TypeError(
            f"simulate: epi must be a coda.Epilogue (Epilogue().add(...)); got {type(epi).__name__}"
        )
    if isinstance(oob_fill, bool) or not isinstance(oob_fill, numbers.Real):
        raise TypeError(f"simulate: oob_fill must be a float; got {oob_fill!r}")
    if not epi.outputs:
        raise EpilogueError(
            "this epilogue has no outputs: add a TileStore, TileReduce or StateTransition"
        )
    problem = bind(epi, A, B, tensors)
    tiling = Tiling(tile, subtile)
    tiling.check_alignment(epi.n_alignment)
    (tm, tn), (sm, sn) = tiling.tile, tiling.subtile
    device = A.device

    outputs: dict[str, torch.Tensor] = {}
    for spec in epi.outputs:
        if spec.role == "tile" or spec.is_partials:
            shape = spec.shape(problem.M, problem.N, tiling.tile)
            outputs[spec.name] = torch.full(shape, float("nan"), dtype=spec.dtype, device=device)
    bound = {**tensors, "acc": A.float() @ B.float().T}

    n_tm, n_tn = tiling.n_tiles(problem)
    for i in range(n_tm):
        for j in range(n_tn):
            t = Tile(
                problem=problem,
                specs=epi.values,
                tensors=bound,
                outputs=outputs,
                index=(i, j),
                shape=(tm, tn),
                fill=oob_fill,
                device=device,
            )
            states = [p.begin_tile(t) for p in epi.primitives]
            for a in range(tm // sm):
                for b in range(tn // sn):
                    sub = Subtile(t, (a, b), (sm, sn))
                    sub.values["acc"] = sub.load_tile("acc", 1)
                    for p, state in zip(epi.primitives, states, strict=True):
                        p.visit(sub, state)
            for p, state in zip(epi.primitives, states, strict=True):
                p.end_tile(t, state)

    for k, p in enumerate(epi.primitives):
        partials = {s.name: outputs[s.name] for s in epi.bindings(k) if s.is_partials}
        outputs.update(p.finalize(partials, problem, epi.values))
    return check_outputs(outputs, list(epi.outputs), problem, tiling.tile, epi)
