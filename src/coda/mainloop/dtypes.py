"""Mapping between torch dtypes and CuTeDSL numeric types, with coda's supported sets."""

from __future__ import annotations

import torch

#: GEMM operand dtypes (A and B must match).
OPERAND_DTYPES = (torch.bfloat16, torch.float16)
#: GEMM output dtypes.
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def to_cutlass(dtype: torch.dtype):
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
    }
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"coda has no CuTeDSL type for {dtype}") from None


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
