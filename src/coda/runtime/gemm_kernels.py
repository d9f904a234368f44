"""Compile and cache PingPong GEMM kernels; launch them on torch tensors.

Sits between :mod:`coda.mainloop` (the kernel) and the public ops (:mod:`coda.gemm`).
A kernel is compiled once per :class:`GemmKernelKey` -- config, dtypes, visitor, SM count
and CuTeDSL version -- against *symbolic* shapes (M, N, K are runtime values, N and K
divisible by 8), so new problem sizes never recompile. The key is a frozen attrs value:
every compile-time input is in it, so a cache hit can never be the wrong kernel.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import attrs
import torch

from ..mainloop.config import GemmConfig
from ..mainloop.visitor import AccStore
from . import disk_cache, dtypes, elf
from .cute_env import dsl_version, ensure_arch


@attrs.frozen
class GemmKernelKey:
    """Everything a compiled kernel depends on. The visitor declares the M x N outputs and
    operands it stores/loads (``store_dtypes`` / ``load_dtypes``) and, through
    ``fake_extras()``, the extra tensors and scalars it takes."""

    config: GemmConfig
    ab_dtype: torch.dtype
    visitor: Any = AccStore()
    num_sms: int = 132
    dsl: str = attrs.field(factory=dsl_version)


_cache: dict[GemmKernelKey, Any] = {}
_local_bytes: dict[GemmKernelKey, int] = {}  # per-thread local memory (spills) of each
_lock = threading.Lock()


def _fake_args(key: GemmKernelKey):
    ensure_arch()
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    ab = dtypes.to_cutlass(key.ab_dtype)
    m = cute.sym_int32()
    n = cute.sym_int32(divisibility=8)
    k = cute.sym_int32(divisibility=8)
    row_major = {"stride_order": (1, 0), "assumed_align": 16}

    def tile(dtype, width=1):
        cols = n
        if width != 1:  # N * width columns: a symbol of its own, rows of 16-byte multiples
            elem = torch.empty(0, dtype=dtype).element_size()
            cols = cute.sym_int32(divisibility=16 // elem)
        return make_fake_compact_tensor(dtypes.to_cutlass(dtype), (m, cols), **row_major)

    def tiles(kind):
        dts = getattr(key.visitor, f"{kind}_dtypes")
        widths = getattr(key.visitor, f"{kind}_widths", (1,) * len(dts))
        return tuple(tile(d, w) for d, w in zip(dts, widths, strict=True))

    extras = key.visitor.fake_extras(m, n) if hasattr(key.visitor, "fake_extras") else ()
    return (
        make_fake_compact_tensor(ab, (m, k), **row_major),
        make_fake_compact_tensor(ab, (n, k), **row_major),
        tiles("store"),
        tiles("load"),
        extras,
        make_fake_stream(),
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
        if options:
            return cute.compile(kernel, *args, options=options)
        return cute.compile(kernel, *args)


def get_kernel(key: GemmKernelKey):
    """The compiled kernel for ``key``: from memory, else from the disk cache, else compiled.

    The disk cache (:mod:`coda.runtime.disk_cache`, ``$CODA_CACHE_DIR``) lets a new process
    skip the compile; it is bypassed when ``key`` has no stable identity (a lambda in the
    visitor, say).
    """
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn, _local_bytes[key] = _load_or_compile(key)
                _cache[key] = fn
    return fn


def local_memory_bytes(key: GemmKernelKey) -> int:
    """Per-thread local memory of the kernel for ``key`` (compiled or loaded if needed):
    0 unless registers spill (or code keeps arrays in local memory)."""
    get_kernel(key)
    return _local_bytes[key]


def _load_or_compile(key: GemmKernelKey) -> tuple[Any, int]:
    canonical = None
    if disk_cache.enabled():
        ensure_arch()
        canonical = disk_cache.canonical_key("gemm", key)
        if canonical is None:
            disk_cache.stats["bypass"] += 1
        else:
            hit = disk_cache.load(canonical)
            if hit is not None:
                return hit.fn, elf.local_memory_bytes(hit.code)
    fn = compile_kernel(key)
    if canonical is not None:
        disk_cache.store(canonical, fn)
    # the host object embeds the cubin (in memory: no files written)
    return fn, elf.local_memory_bytes(fn.dump_to_object("coda_probe"))


def compile_artifacts(key: GemmKernelKey, dump_dir: str) -> tuple[str, bytes]:
    """(PTX text, cubin bytes) of the kernel for ``key``; for inspection and CPU tests."""
    os.makedirs(dump_dir, exist_ok=True)
    fn = compile_kernel(
        key, options=f"--keep-ptx --keep-cubin --gpu-arch sm_90a --dump-dir {dump_dir}"
    )
    return fn.__ptx__, fn.__cubin__


def as_cute_tensor(t: torch.Tensor):
    """Zero-copy CuTeDSL view of a row-major 2-D torch tensor with dynamic shape."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=1)


def current_stream(device: torch.device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def launch(
    key: GemmKernelKey,
    a: torch.Tensor,
    b: torch.Tensor,
    stores: tuple[torch.Tensor, ...],
    loads: tuple[torch.Tensor, ...] = (),
    extras: tuple = (),
) -> None:
    """Run the kernel for ``key``; ``extras`` are already CuTeDSL values (see the visitor)."""
    fn = get_kernel(key)
    fn(
        as_cute_tensor(a),
        as_cute_tensor(b),
        tuple(as_cute_tensor(t) for t in stores),
        tuple(as_cute_tensor(t) for t in loads),
        extras,
        current_stream(a.device),
    )
