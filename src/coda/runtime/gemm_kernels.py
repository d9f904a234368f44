"""Compile and cache PingPong GEMM kernels; launch them on torch tensors.

Sits between :mod:`coda.mainloop` (the kernel) and the public ops (:mod:`coda.gemm`).
A kernel is compiled once per :class:`GemmKernelKey` -- config, dtypes, visitor, operand
majors, SM count and CuTeDSL version -- against *symbolic* shapes and strides (M, N, K
and every leading stride are runtime values), so new problem sizes and padded views never
recompile. The key is a frozen attrs value: every compile-time input is in it, so a cache
hit can never be the wrong kernel.

Kernels are compiled with CuTeDSL's TVM-FFI calling convention: the compiled function
takes torch tensors directly (DLPack through C, no per-argument Python adaptation), reads
the current torch stream itself, and checks every tensor's dtype, rank, strides and
alignment against the compile-time description in C before launching.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ..mainloop import dtypes
from ..mainloop.config import GemmConfig
from ..mainloop.cute_env import dsl_version, ensure_arch
from ..mainloop.visitor import AccStore
from . import disk_cache, elf, occupancy


@attrs.frozen
class GemmKernelKey:
    """Everything a compiled kernel depends on. The visitor declares the M x N outputs and
    operands it stores/loads (``store_dtypes`` / ``load_dtypes``) and, through
    ``fake_extras()``, the extra tensors and scalars it takes."""

    config: GemmConfig
    ab_dtype: torch.dtype
    visitor: Any = AccStore()
    num_sms: int = 132
    #: which dimension of A (M, K) is contiguous: "k" (row-major) or "m" (a transposed view)
    a_major: str = attrs.field(default="k", validator=attrs.validators.in_(("k", "m")))
    #: which dimension of B (N, K) is contiguous: "k" (an nn.Linear weight) or "n"
    b_major: str = attrs.field(default="k", validator=attrs.validators.in_(("k", "n")))
    dsl: str = attrs.field(factory=dsl_version)


_keys: dict[tuple, GemmKernelKey] = {}


def kernel_key(
    config: GemmConfig,
    ab_dtype: torch.dtype,
    visitor: Any,
    num_sms: int,
    a_major: str = "k",
    b_major: str = "k",
) -> GemmKernelKey:
    """The :class:`GemmKernelKey` of these inputs, built once and then looked up (the hot
    path of every call: no attrs construction or validation per launch)."""
    parts = (config, ab_dtype, visitor, num_sms, a_major, b_major)
    key = _keys.get(parts)
    if key is None:
        key = _keys[parts] = GemmKernelKey(config, ab_dtype, visitor, num_sms, a_major, b_major)
    return key


def device_key(
    config: GemmConfig,
    ab_dtype: torch.dtype,
    visitor: Any,
    device: torch.device,
    a_major: str = "k",
    b_major: str = "k",
) -> GemmKernelKey:
    """:func:`kernel_key` for a launch on ``device``: the grid sized by the clusters of
    ``config`` that fit it at once (:func:`coda.runtime.occupancy.grid_sms`)."""
    sms = occupancy.grid_sms(device, config.cluster_m * config.cluster_n)
    return kernel_key(config, ab_dtype, visitor, sms, a_major, b_major)


_cache: dict[GemmKernelKey, Any] = {}
_local_bytes: dict[GemmKernelKey, int] = {}  # per-thread local memory (spills) of each
_lock = threading.Lock()


def _fake_args(key: GemmKernelKey):
    """Compile-time stand-ins for the launch arguments: symbolic M, N, K shared by every
    tensor, and a symbolic leading stride per tensor (a multiple of 16 bytes, TMA's rule),
    so padded and transposed views run without copies."""
    ensure_arch()
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    m = cute.sym_int32()
    n = cute.sym_int32(divisibility=8)
    k = cute.sym_int32()

    def matrix(dtype, rows, cols, contiguous: str):
        """A (rows, cols) tensor whose ``contiguous`` dim ("row": the last) has stride 1."""
        elem = torch.empty(0, dtype=dtype).element_size()
        lead = cute.sym_int32(divisibility=16 // elem)
        stride = (lead, 1) if contiguous == "row" else (1, lead)
        return make_fake_tensor(dtypes.to_cutlass(dtype), (rows, cols), stride, assumed_align=16)

    def tiles(kind):
        dts = getattr(key.visitor, f"{kind}_dtypes")
        widths = getattr(key.visitor, f"{kind}_widths", (1,) * len(dts))
        # N * width columns (width != 1): a symbol of its own (N*w is not affine in N)
        return tuple(
            matrix(d, m, n if w == 1 else cute.sym_int32(), "row")
            for d, w in zip(dts, widths, strict=True)
        )

    extras = key.visitor.fake_extras(m, n) if hasattr(key.visitor, "fake_extras") else ()
    return (
        matrix(key.ab_dtype, m, k, "row" if key.a_major == "k" else "col"),
        matrix(key.ab_dtype, n, k, "row" if key.b_major == "k" else "col"),
        tiles("store"),
        tiles("load"),
        extras,
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def _kernel_object(key: GemmKernelKey):
    ensure_arch()
    from ..mainloop.kernel import PingPongGemm

    return PingPongGemm(
        key.config,
        dtypes.to_cutlass(key.ab_dtype),
        visitor=key.visitor,
        num_sms=key.num_sms,
    )


#: every kernel is compiled for the TVM-FFI calling convention (see the module doc)
TVM_FFI = "--enable-tvm-ffi"


def compile_kernel(key: GemmKernelKey, options: str | None = None):
    """Compile (uncached) for sm_90a. Works on a GPU-less machine."""
    ensure_arch()
    import cutlass.cute as cute

    args = _fake_args(key)
    kernel = _kernel_object(key)
    with warnings.catch_warnings():
        # tuples of tensors (stores, loads, extras) are flattened by CuTeDSL into dynamic
        # arguments; it still warns that a tuple is "not a JitArgument".
        warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
        return cute.compile(kernel, *args, options=f"{TVM_FFI} {options or ''}".strip())


def get_kernel(key: GemmKernelKey):
    """The compiled kernel for ``key``: from memory, else from the disk cache, else compiled.

    The disk cache (:mod:`coda.runtime.disk_cache`, ``$CODA_CACHE_DIR``) lets a new process
    skip the compile; it is bypassed when ``key`` has no stable identity (a lambda in the
    visitor, say).
    """
    return get_compiled("gemm", key, compile_kernel)


def get_compiled(kind: str, key: Any, compile_fn: Callable[[Any], Any]):
    """Memory cache, then disk cache, then ``compile_fn(key)``, for any kernel ``key`` (a
    frozen value) of family ``kind`` ("gemm", "finalize")."""
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn, _local_bytes[key] = _load_or_compile(kind, key, compile_fn)
                _cache[key] = fn
    return fn


def launcher(key: GemmKernelKey):
    """The compiled kernel's bare TVM-FFI function (no Python wrapper layers): call it as
    ``launcher(A, B, stores, loads, extras)``."""
    fn = get_kernel(key)
    return getattr(fn, "_tvm_ffi_function", None) or fn


def local_memory_bytes(key: GemmKernelKey) -> int:
    """Per-thread local memory of the kernel for ``key`` (compiled or loaded if needed):
    0 unless registers spill (or code keeps arrays in local memory)."""
    get_kernel(key)
    return _local_bytes[key]


def _load_or_compile(kind: str, key: Any, compile_fn) -> tuple[Any, int]:
    canonical = None
    if disk_cache.enabled():
        ensure_arch()
        canonical = disk_cache.canonical_key(kind, key)
        if canonical is None:
            disk_cache.stats["bypass"] += 1
        else:
            hit = disk_cache.load(canonical)
            if hit is not None:
                return hit.fn, elf.local_memory_bytes(hit.code)
    fn = compile_fn(key)
    if canonical is not None:
        disk_cache.store(canonical, fn)
    # the host object embeds the cubin (in memory: no files written)
    return fn, elf.local_memory_bytes(disk_cache.object_bytes(fn, "coda_probe"))


def compile_artifacts(key: GemmKernelKey, dump_dir: str) -> tuple[str, bytes]:
    """(PTX text, cubin bytes) of the kernel for ``key``; for inspection and CPU tests."""
    os.makedirs(dump_dir, exist_ok=True)
    fn = compile_kernel(
        key, options=f"--keep-ptx --keep-cubin --gpu-arch sm_90a --dump-dir {dump_dir}"
    )
    return fn.__ptx__, fn.__cubin__


def launch(
    key: GemmKernelKey,
    a: torch.Tensor,
    b: torch.Tensor,
    stores: tuple[torch.Tensor, ...],
    loads: tuple[torch.Tensor, ...] = (),
    extras: tuple = (),
) -> None:
    """Run the kernel for ``key`` on the current torch stream. ``extras`` are torch
    tensors and Python floats, in the visitor's ``fake_extras`` order."""
    launcher(key)(a, b, stores, loads, extras)
