"""The plain PingPong GEMM on torch tensors, out = A @ B^T (exported as ``coda.gemm``).

Sits on top of :mod:`coda.runtime.gemm_kernels`; this module owns the user-facing
contract (validation before launch, output allocation, config choice). Every operand
layout a training step needs runs without a copy: A (M, K) and B (N, K) may each be
row-major or a transposed view, so the forward ``X @ W.T`` is ``gemm(X, W)``, the dgrad
``dY @ W`` is ``gemm(dY, W.t())`` and the wgrad ``dY.T @ X`` is ``gemm(dY.t(), X.t())``.

The host path is kept thin: after the first call of a (dtypes, layouts, shape) the
kernel key comes from a dict, the checks are a handful of attribute reads, and the
compiled TVM-FFI function takes the tensors directly.
"""

from __future__ import annotations

import torch

from .caches import BoundedCache
from .errors import InputError
from .mainloop.config import GemmConfig, choose_config
from .mainloop.dtypes import OUTPUT_DTYPES
from .mainloop.visitor import AccStore
from .not_differentiable import refuse_out, tied
from .runtime import checks, gemm_kernels
from .runtime.operands import check_gemm_operands, check_output, gemm_problem, operand_majors

__all__ = [
    "LAYOUTS",
    "check_gemm_operands",
    "check_output",
    "gemm",
    "gemm_problem",
    "gemm_unguarded",
    "operand_majors",
]

#: The three GEMMs of an nn.Linear in a training step, as (A major, B major).
LAYOUTS = {"fwd": ("k", "k"), "dgrad": ("k", "n"), "wgrad": ("m", "n")}


#: Let the heuristic split K for fp32 outputs (not under
#: ``torch.use_deterministic_algorithms(True)``): ``choose_config(split_ok=True)`` splits
#: where M x N has too few tiles to fill the GPU and every split keeps its minimum of
#: k-tiles. Measured on an H200 (``benchmarks/split_k.py`` ->
#: ``results/split_k_h200.json``, weight-gradient layout, CUDA-graph replays, 2026-11-29):
#: where it splits (64 and 96 tiles, K = 4096-16384) 1.22-1.87x the unsplit GEMM's speed,
#: writing a fresh output (zeroed first) or accumulating; where it does not (128 tiles
#: and up) 2- and 4-way splits ran 0.94-1.01x. Explicit ``GemmConfig(split_k=...)``
#: configs run it too (the loss's short dh GEMMs: ``coda.fusions.ce_fused._split_config``).
AUTO_SPLIT_K = True

_configs: BoundedCache[tuple[int, int, int, int, bool], GemmConfig] = BoundedCache(4096)

#: Launches already validated once: (dtypes, device, sizes, strides, accumulate) -> the
#: compiled kernel. A hit needs only the per-call pointer-alignment check.
_validated: BoundedCache[tuple, object] = BoundedCache(4096)


def _signature(A, B, out, accumulate, allow_split) -> tuple | None:
    """What decides a launch's validity and kernel, read cheaply (``out`` None: the
    default output, allocated, never split); None if the arguments are not tensors, or
    for ``accumulate`` without ``out`` (refused on the checked path)."""
    try:
        if out is None:
            if accumulate:
                return None
            return (A.dtype, B.dtype, A.device, B.device, A.shape, B.shape, A.stride(), B.stride())
        return (
            A.dtype, B.dtype, out.dtype, accumulate, allow_split, A.device, B.device,
            out.device, A.shape, B.shape, out.shape, A.stride(), B.stride(), out.stride(),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def _heuristic(
    m: int, n: int, k: int, num_sms: int, split_ok: bool, short_groups: bool
) -> GemmConfig:
    key = (m, n, k, num_sms, split_ok, short_groups)
    cfg = _configs.get(key)
    if cfg is None:
        cfg = _configs.put(
            key, choose_config(m, n, k, num_sms, split_ok=split_ok, short_groups=short_groups)
        )
    return cfg


def gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    config: GemmConfig | str | None = None,
    allow_split: bool = True,
) -> torch.Tensor:
    """out = A @ B.T (or out += A @ B.T) on a Hopper GPU with coda's PingPong kernel.

    A: (M, K) bf16/fp16; B: (N, K) of the same dtype (an ``nn.Linear`` weight). Each may
    be row-major or a transposed view (``x.t()`` of a contiguous tensor): no copy is made.
    out: optional row-major (M, N) bf16/fp16/fp32 tensor to write; otherwise allocated
    with ``out_dtype`` (default: A's dtype). ``accumulate=True`` adds the product into
    ``out`` (required then) with TMA reduce-add stores: the kernel never reads ``out``,
    so accumulating costs no extra pass (use an fp32 ``out`` for weight gradients summed
    over micro-batches). fp32 accumulation inside. ``config``: a :class:`GemmConfig`,
    ``None`` for the shape heuristic, or ``"autotune"`` to time a few configs on first use
    of a shape. A config with ``split_k`` > 1 runs several units of work per output tile
    over K ranges, adding through TMA reduce-add (the output is zeroed first unless
    ``accumulate``); the heuristic picks it (``AUTO_SPLIT_K``) for fp32 outputs whose
    M x N has too few tiles to fill the GPU, unless ``allow_split=False``. Split sums are
    not bitwise reproducible: under ``torch.use_deterministic_algorithms(True)`` (or with
    ``allow_split=False``) the heuristic never splits, and under the former an explicit
    split config raises (warns with ``warn_only=True``); every other call is. The
    contiguous dimension of every tensor is padded to 16 bytes (its other stride a
    multiple of 8 elements for 16-bit data); M, N, K need not be multiples of the tile.
    Errors are raised before anything is launched. Not differentiable (``coda.fusions``
    / ``coda.nn`` are the autograd ops): with grad mode on and A or B requiring grad the
    output requires grad through a node whose backward raises, naming this call, and an
    ``out=`` is refused at once (``coda.not_differentiable``); under ``torch.no_grad()``
    the output is a plain tensor.
    """
    try:  # the guard's test, read as cheaply as it can be (non-tensors: the checks say)
        guard = torch.is_grad_enabled() and (A.requires_grad or B.requires_grad)
    except AttributeError:
        guard = False
    if guard:
        if out is not None:
            refuse_out("coda.gemm", "out=")
        product = gemm_unguarded(A, B, None, out_dtype, accumulate, config, allow_split)
        return tied("coda.gemm", product, (A, B))
    return gemm_unguarded(A, B, out, out_dtype, accumulate, config, allow_split)


def gemm_unguarded(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    config: GemmConfig | str | None = None,
    allow_split: bool = True,
) -> torch.Tensor:
    """``coda.gemm`` without its autograd guard (the same arguments, positional too): its
    work, and what ops that run it inside their own backward formulas call
    (``coda.fusions``)."""
    sig = None
    if config is None and out_dtype is None:
        sig = _signature(A, B, out, accumulate, allow_split)
        hit = _validated.get(sig)
        if hit is not None and not (A.data_ptr() | B.data_ptr()) & 15:
            launcher, zero, split = hit
            if split and torch.are_deterministic_algorithms_enabled():
                launcher = None  # a split kernel: the heuristic again, unsplit
            if out is None:
                out = torch.empty((A.shape[0], B.shape[0]), dtype=A.dtype, device=A.device)
            elif out.data_ptr() & 15:
                launcher = None
            if launcher is not None:
                if zero:
                    out.zero_()
                launcher(A, B, (out,), (), ())
                return out
    m, n, k, a_major, b_major = gemm_problem(A, B)
    if out is None:
        if accumulate:
            raise InputError("accumulate=True adds into `out`: pass the tensor to add into")
        dtype = out_dtype or A.dtype
        if dtype not in OUTPUT_DTYPES:
            checks.dtype_in("out_dtype", torch.empty(0, dtype=dtype), OUTPUT_DTYPES)
        if (n * torch.empty(0, dtype=dtype).element_size()) % 16:
            raise InputError(
                f"N={n} gives an output row of {n} {dtype} elements, not a multiple of 16 bytes"
            )
        device = checks.same_device([("A", A), ("B", B)])
        num_sms = checks.hopper_device(device)
        out = torch.empty((m, n), dtype=dtype, device=device)
    else:
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype={out_dtype} conflicts with out.dtype={out.dtype}")
        check_output(out, m, n)
        device = checks.same_device([("A", A), ("B", B), ("out", out)])
        num_sms = checks.hopper_device(device)
    if config is None:
        # split-K sums fp32 partials in the output: only for fp32 outputs, and never under
        # torch.use_deterministic_algorithms(True) (the splits add in finishing order)
        split_ok = (
            AUTO_SPLIT_K
            and allow_split
            and out.dtype == torch.float32
            and not torch.are_deterministic_algorithms_enabled()
        )
        cfg = _heuristic(m, n, k, num_sms, split_ok, checks.short_swizzle_groups(device))
    elif isinstance(config, GemmConfig):
        cfg = config
    elif config == "autotune":
        from .runtime.autotune import best_config

        cfg = best_config(m, n, k, A.dtype, out.dtype, device, layout=(a_major, b_major))
    else:
        raise TypeError(f"config must be a GemmConfig, None or 'autotune', got {config!r}")
    # split-K units add into the output: zero it first unless accumulating anyway
    zero = cfg.split_k > 1 and not accumulate
    if cfg.split_k > 1:
        checks.alert_not_deterministic(
            f"coda.gemm with GemmConfig(split_k={cfg.split_k}) (its splits add into the "
            f"output in whatever order they finish)"
        )
    key = gemm_kernels.device_key(
        cfg, A.dtype, AccStore(out.dtype, accumulate or zero), device, a_major, b_major
    )
    if zero:
        out.zero_()
    gemm_kernels.launch(key, A, B, (out,))
    if sig is not None:  # validated: later calls with the same signature skip to the launch
        _validated.put(sig, (gemm_kernels.launcher(key), zero, cfg.split_k > 1))
    return out
