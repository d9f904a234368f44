"""Input validation shared by every coda op that launches a kernel.

Each check raises a specific, readable error *before* anything is launched. Checks run
in an order that reports the most basic problem first: type, rank, dtype, shape,
layout/alignment, then device and GPU architecture.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ..errors import InputError
from ..mainloop import dtypes


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


def row_major_tma(name: str, t: torch.Tensor, written: bool = False) -> None:
    """Last dim contiguous, row stride and base pointer 16-byte aligned (TMA's contract).
    ``written``: ``t`` is an output the kernel writes in place (a copy is no remedy)."""
    if t.numel() == 0:
        raise InputError(f"{name} is empty (shape {tuple(t.shape)}); coda needs M, N, K >= 1")
    if t.stride(-1) != 1:
        remedy = (
            "the kernel writes it in place: pass a row-major tensor (e.g. torch.empty of "
            "its shape), not a transposed view"
            if written
            else "call .contiguous() first"
        )
        raise InputError(
            f"{name} must be contiguous in its last dimension (stride {t.stride()}); {remedy}"
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


def tma_major(name: str, t: torch.Tensor, dims: tuple[str, str]) -> str:
    """Which of the two dimensions of a 2-D operand is contiguous (stride 1), named by
    ``dims`` (e.g. ("m", "k") for A): the last one (row-major) or the first one (a
    transposed view, ``x.t()`` of a contiguous tensor). The other stride and the base
    pointer must be 16-byte aligned (TMA's contract). Raises before any launch."""
    if t.numel() == 0:
        raise InputError(f"{name} is empty (shape {tuple(t.shape)}); coda needs M, N, K >= 1")
    rows, cols = t.shape
    if t.stride(1) == 1 or cols == 1 and t.stride(0) != 1:
        major, lead, along = dims[1], t.stride(0), dims[0]
    elif t.stride(0) == 1:
        major, lead, along = dims[0], t.stride(1), dims[1]
    else:
        raise InputError(
            f"{name} {tuple(t.shape)} has strides {t.stride()}: one of its dimensions must be "
            f"contiguous (row-major, or a transposed view such as x.t()); call .contiguous()"
        )
    elem = t.element_size()
    if (lead * elem) % 16:
        raise InputError(
            f"{name} ({dims[0].upper()}, {dims[1].upper()}) = {tuple(t.shape)} is "
            f"{major.upper()}-contiguous with a stride of {lead} elements along "
            f"{along.upper()} ({lead * elem} bytes); TMA needs a multiple of 16 bytes, i.e. "
            f"the contiguous dimension padded to a multiple of {16 // elem} elements "
            f"(e.g. a slice of a wider tensor)"
        )
    if t.data_ptr() % 16:
        raise InputError(
            f"{name} data pointer is not 16-byte aligned (offset {t.data_ptr() % 16}); "
            f"slice views with an unaligned start are not supported, clone the tensor"
        )
    return major


def same_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    (first_name, first), *rest = named
    for name, t in rest:
        if t.device != first.device:
            raise InputError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                f"all tensors must be on the same CUDA device"
            )
    return first.device


_hopper_ok: dict[torch.device, int] = {}
_kernel_devices: dict[torch.device, bool] = {}


def kernels_run_on(device: torch.device) -> bool:
    """True when coda's kernels run on ``device``: a CUDA device that is a Hopper GPU
    (sm_90). The fusions take their reference path (plain torch on the same device)
    elsewhere: on the CPU and on other GPUs. Remembered per device (a dict look-up)."""
    ok = _kernel_devices.get(device)
    if ok is None:
        ok = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        _kernel_devices[device] = ok
    return ok


def hopper_device(device: torch.device) -> int:
    """Check that ``device`` is a Hopper GPU (sm_90); return its multiprocessor count.
    The answer is remembered per device, so the check costs a dict look-up per call."""
    sms = _hopper_ok.get(device)
    if sms is not None:
        return sms
    if device.type != "cuda":
        raise InputError(
            f"coda kernels run on CUDA tensors; got tensors on {device}. "
            f"(On a CPU machine use Epilogue.reference or coda.simulate.)"
        )
    if not torch.cuda.is_available():
        raise InputError("CUDA is not available in this process")
    if not kernels_run_on(device):
        cap = torch.cuda.get_device_capability(device)
        raise InputError(
            f"coda kernels need an NVIDIA Hopper GPU (sm_90); {torch.cuda.get_device_name(device)} "
            f"is sm_{cap[0]}{cap[1]}"
        )
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    _hopper_ok[device] = sms
    return sms


#: Device memory from which a Hopper card counts as HBM3e-class (the H200's 141 GB, 4.8
#: TB/s) rather than HBM3-class (the H100's 80 or 94 GB, 3.35-3.9 TB/s).
HBM3E_MIN_BYTES = 120 * 2**30

_short_groups: dict[torch.device, bool] = {}


def short_swizzle_groups(device: torch.device) -> bool:
    """True on a Hopper card with an H100's memory (less than ``HBM3E_MIN_BYTES``), where
    the GEMM heuristic walks long-K problems in short swizzle groups
    (:data:`coda.mainloop.config.LONG_K`); remembered per device."""
    got = _short_groups.get(device)
    if got is None:
        got = _short_groups[device] = (
            torch.cuda.get_device_properties(device).total_memory < HBM3E_MIN_BYTES
        )
    return got


def alert_not_deterministic(what: str) -> None:
    """PyTorch's rule for an op without a bitwise-reproducible implementation: under
    ``torch.use_deterministic_algorithms(True)`` raise a ``RuntimeError`` (a warning with
    ``warn_only=True``) before anything is launched; otherwise nothing."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    msg = (
        f"{what} does not have a deterministic implementation, but you set "
        f"'torch.use_deterministic_algorithms(True)'. You can turn off determinism just "
        f"for this operation, or you can use the 'warn_only=True' option, if that's "
        f"acceptable for your application."
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(msg, UserWarning, stacklevel=3)
    else:
        raise RuntimeError(msg)
