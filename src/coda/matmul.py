"""The plain PingPong GEMM on torch tensors, out = A @ B^T (exported as ``coda.gemm``).

Sits on top of :mod:`coda.runtime.gemm_kernels`; this module owns the user-facing
contract (validation before launch, output allocation, config choice).
"""

from __future__ import annotations

import torch

from .errors import InputError
from .mainloop.config import GemmConfig, choose_config
from .mainloop.visitor import AccStore
from .runtime import checks
from .runtime.dtypes import OPERAND_DTYPES, OUTPUT_DTYPES


def check_gemm_operands(A: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int]:
    """Validate A (M, K) and B (N, K); return (M, N, K). Raises before any launch."""
    checks.tensor("A", A)
    checks.tensor("B", B)
    checks.rank("A", A, 2, "(M, K) activations")
    checks.rank("B", B, 2, "(N, K) weight, as stored by nn.Linear")
    checks.dtype_in("A", A, OPERAND_DTYPES)
    checks.dtype_in("B", B, OPERAND_DTYPES)
    if A.dtype != B.dtype:
        raise TypeError(f"A and B must have the same dtype, got {A.dtype} and {B.dtype}")
    (m, k), (n, kb) = A.shape, B.shape
    if k != kb:
        raise InputError(
            f"A is (M={m}, K={k}) but B is (N={n}, K={kb}); B is an nn.Linear weight (N, K) "
            f"and its K must match A's"
        )
    checks.row_major_tma("A", A)
    checks.row_major_tma("B", B)
    return m, n, k


def check_output(out: torch.Tensor, m: int, n: int, name: str = "out") -> None:
    checks.tensor(name, out)
    checks.rank(name, out, 2, "(M, N) output")
    checks.dtype_in(name, out, OUTPUT_DTYPES)
    if tuple(out.shape) != (m, n):
        raise InputError(f"{name} has shape {tuple(out.shape)}, expected ({m}, {n})")
    checks.row_major_tma(name, out)


def gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | str | None = None,
) -> torch.Tensor:
    """out = A @ B.T on a Hopper GPU with coda's PingPong kernel.

    A: (M, K) bf16/fp16, row-major. B: (N, K) of the same dtype (an ``nn.Linear``
    weight). out: optional (M, N) bf16/fp16/fp32 tensor to write; otherwise allocated
    with ``out_dtype`` (default: A's dtype). fp32 accumulation. ``config``: a
    :class:`GemmConfig`, ``None`` for the shape heuristic, or ``"autotune"`` to time a few
    configs on first use of a shape and keep the fastest. Row strides must be
    multiples of 16 bytes (K and N multiples of 8 for 16-bit data); M, N, K need not be
    multiples of the tile. Errors are raised before anything is launched.
    """
    from .runtime import gemm_kernels

    m, n, k = check_gemm_operands(A, B)
    if out is None:
        dtype = out_dtype or A.dtype
        if dtype not in OUTPUT_DTYPES:
            checks.dtype_in("out_dtype", torch.empty(0, dtype=dtype), OUTPUT_DTYPES)
        if (n * torch.empty(0, dtype=dtype).element_size()) % 16:
            raise InputError(
                f"N={n} gives an output row of {n} {dtype} elements, not a multiple of 16 bytes"
            )
        device = checks.same_device([("A", A), ("B", B)])
        checks.hopper_device(device)
        out = torch.empty((m, n), dtype=dtype, device=device)
    else:
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} conflicts with out.dtype={out.dtype}")
        check_output(out, m, n)
        device = checks.same_device([("A", A), ("B", B), ("out", out)])
        checks.hopper_device(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if config == "autotune":
        from .runtime.autotune import best_config

        cfg = best_config(m, n, k, A.dtype, out.dtype, device)
    elif config is None:
        cfg = choose_config(m, n, k, num_sms)
    elif isinstance(config, GemmConfig):
        cfg = config
    else:
        raise TypeError(f"config must be a GemmConfig, None or 'autotune', got {config!r}")
    key = gemm_kernels.GemmKernelKey(cfg, A.dtype, AccStore(out.dtype), num_sms=num_sms)
    gemm_kernels.launch(key, A, B, (out,))
    return out
