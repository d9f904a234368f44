"""coda.fusions._dispatch: the one place where a fusion picks the fused kernel or the reference.

Sits at the bottom of ``coda.fusions``, right above ``coda.runtime``: every fusion calls its
epilogues and GEMMs through these helpers, never ``epi(...)`` / ``coda.gemm`` /
``epi.reference`` directly, so the SAME ``Epilogue`` objects define the GPU path and the
CPU path, and CI (CPU) tests exactly the algebra the GPU runs.

* ``run_epilogue(epi, A, B, outputs=None, **tensors)``: on CUDA tensors the fused kernel
  ``epi(A, B, **tensors)`` (A, B row-major or transposed views; ``outputs``: caller
  buffers it writes its M x N outputs into); on CPU tensors ``epi.reference(A, B,
  **tensors)`` (fp32 inside, outputs in their declared dtypes, new tensors). Finalized
  results are under their names either way (the GPU also returns partials).
* ``run_map(epi, M, N, like, outputs=None, **tensors)``: an epilogue that never reads
  ``acc`` (a pure elementwise/reduction pass over M x N tensors), run after a GEMM of
  zeros with K = ``MAP_K``; on CUDA ``outputs`` names caller buffers to write into. The
  engine has no GEMM-free launch yet; the zero GEMM costs one k-block of TMA loads per
  tile, negligible next to the M x N streams the pass moves.
* ``matmul(A, B, out=None, accumulate=False)``: ``A @ B.T`` by ``coda.gemm`` on CUDA, by
  ``A.float() @ B.float().T`` on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from coda.epilogue import Epilogue

__all__ = ["MAP_K", "matmul", "run_epilogue", "run_map"]

#: K of the zero GEMM under ``run_map``: the smallest whose 16-bit rows are 16 bytes (TMA).
MAP_K = 8


def run_epilogue(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    outputs: dict[str, torch.Tensor] | None = None,
    **tensors: Any,
) -> dict:
    """``epi`` after acc = A @ B.T: fused on CUDA (into ``outputs`` where given),
    ``epi.reference`` on CPU (``outputs`` ignored: the reference returns new tensors)."""
    if A.is_cuda:
        if outputs:
            return epi(A, B, outputs=outputs, **tensors)
        return epi(A, B, **tensors)
    return epi.reference(A, B, **tensors)


def run_map(
    epi: Epilogue,
    M: int,
    N: int,
    like: torch.Tensor,
    outputs: dict[str, torch.Tensor] | None = None,
    **tensors: Any,
) -> dict:
    """Run ``epi`` (which must not read ``acc``) over an (M, N) problem on ``like``'s device,
    with ``like``'s dtype for the (unused) GEMM operands. ``outputs``: on CUDA, caller
    tensors the kernel writes its M x N outputs into (ignored on CPU, where the reference
    returns new tensors)."""
    if any("acc" in p.reads for p in epi.primitives):
        raise ValueError("run_map runs epilogues that do not read acc; this one does")
    A = torch.zeros((M, MAP_K), dtype=like.dtype, device=like.device)
    B = torch.zeros((N, MAP_K), dtype=like.dtype, device=like.device)
    return run_epilogue(epi, A, B, outputs, **tensors)


def matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """``A @ B.T`` (A: (M, K), B: (N, K), each row-major or a transposed view) into a new
    tensor of ``out_dtype`` (default A's), or into ``out`` (``out += A @ B.T`` with
    ``accumulate=True``). fp32 accumulation on both paths."""
    if A.is_cuda:
        from coda.matmul import gemm

        extra = {"accumulate": True} if accumulate else {}
        return gemm(A, B, out, out_dtype=out_dtype, **extra)
    product = A.float() @ B.float().T
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out tensor to accumulate into")
        return product.to(out_dtype or A.dtype)
    if accumulate:
        out.copy_((out.float() + product).to(out.dtype))
    else:
        out.copy_(product.to(out.dtype))
    return out
