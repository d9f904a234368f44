"""Input validation shared by every coda op that launches a kernel.

Each check raises a specific, readable error *before* anything is launched. Checks run
in an order that reports the most basic problem first: type, rank, dtype, shape,
layout/alignment, then device and GPU architecture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from . import dtypes


def tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def rank(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise InputError(f"{name} must be {ndim}-D {what}, got shape {tuple(t.shape)}")


def dtype_in(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(dtypes.name(d) for d in allowed)
        raise TypeError(f"{name} has dtype {dtypes.name(t.dtype)}; supported: {names}")


def row_major_tma(name: str, t: torch.Tensor) -> None:
    """Last dim contiguous, row stride and base pointer 16-byte aligned (TMA's contract)."""
    if t.numel() == 0:
        raise InputError(f"{name} is empty (shape {tuple(t.shape)}); coda needs M, N, K >= 1")
    if t.stride(-1) != 1:
        raise InputError(
            f"{name} must be contiguous in its last dimension (stride {t.stride()}); "
            f"call .contiguous() first"
        )
    elem = t.element_size()
    if (t.stride(0) * elem) % 16:
        raise InputError(
            f"{name} row stride is {t.stride(0)} elements ({t.stride(0) * elem} bytes); TMA "
            f"needs a multiple of 16 bytes, i.e. the last dimension padded to a multiple of "
            f"{16 // elem} elements"
        )
    if t.data_ptr() % 16:
        raise InputError(
            f"{name} data pointer is not 16-byte aligned (offset {t.data_ptr() % 16}); "
            f"slice views with an unaligned start are not supported, clone the tensor"
        )


def same_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    (first_name, first), *rest = named
    for name, t in rest:
        if t.device != first.device:
            raise InputError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                f"all tensors must be on the same CUDA device"
            )
    return first.device


def hopper_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise InputError(
            f"coda kernels run on CUDA tensors; got tensors on {device}. "
            f"(On a CPU machine use Epilogue.reference or coda.simulate.)"
        )
    if not torch.cuda.is_available():
        raise InputError("CUDA is not available in this process")
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        raise InputError(
            f"coda kernels need an NVIDIA Hopper GPU (sm_90); {torch.cuda.get_device_name(device)} "
            f"is sm_{cap[0]}{cap[1]}"
        )
