"""Optional small autotune for the PingPong GEMM: time a few configs, keep the fastest.

``coda.gemm(A, B, config="autotune")`` calls :func:`best_config`; results are cached in
memory per (M, N, K, dtypes, operand layout, SM count), so only the first call of a shape
pays (one compile per candidate config, then a few timed launches each). The candidates
(:func:`candidates`) are the shape heuristic's own config, the same tile with shorter
swizzle groups, and a few fixed tiles. Sits in ``coda.runtime`` and launches through
:mod:`coda.runtime.gemm_kernels` directly.
"""

from __future__ import annotations

import attrs
import torch

from ..mainloop.config import GemmConfig, choose_config
from ..mainloop.visitor import AccStore
from . import checks, gemm_kernels

CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(tile_n=192, cluster_m=2),
    GemmConfig(tile_n=192, cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=128, cluster_m=2),
    GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=160, cluster_m=2),
    # wide tiles in single-row swizzle groups, PingPong and cooperative: on an H100 the
    # long-K GEMMs of a Llama 3 8B block ran at 1.03-1.07x cuBLAS in these, against
    # 0.65-0.93x in the heuristic's 128 x 128 tiles (benchmarks/gemm_raster.py --tiles)
    GemmConfig(tile_n=192, cluster_m=2, group_m=1),
    GemmConfig(tile_m=256, tile_n=192, cluster_m=2),
    GemmConfig(tile_m=256, tile_n=192, cluster_m=2, group_m=1),
)

#: Swizzle-group heights (``GemmConfig.group_m``, in cluster rows) also tried with the
#: heuristic's tile. On an H100 the long-K GEMMs of a Llama 3 8B block (K = 11008-22016,
#: N = 4096 / 11008) ran 15-27% faster at group_m = 1 than at the default 8 (where they
#: reach only 0.52-0.88x cuBLAS's speed; the H200 runs them at 1.04x with 8), while a wide
#: 16384 x 22016 x 4096 GEMM ran 12% slower at 1 (``benchmarks/gemm_raster.py``).
GROUP_M_VARIANTS = (1, 2)


def candidates(
    m: int, n: int, k: int, num_sms: int, short_groups: bool = False
) -> tuple[GemmConfig, ...]:
    """The configs :func:`best_config` times for (m, n, k): the heuristic's config first,
    then its tile with each of ``GROUP_M_VARIANTS``, then ``CANDIDATES`` (no repeats)."""
    base = choose_config(m, n, k, num_sms, short_groups=short_groups)
    variants = (attrs.evolve(base, group_m=g) for g in GROUP_M_VARIANTS)
    return tuple(dict.fromkeys((base, *variants, *CANDIDATES)))


_best: dict[tuple, GemmConfig] = {}


def time_config(key: gemm_kernels.GemmKernelKey, a, b, out, reps: int = 10) -> float:
    """Mean milliseconds of one launch of ``key`` (after one warm-up launch)."""
    gemm_kernels.launch(key, a, b, (out,))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        gemm_kernels.launch(key, a, b, (out,))
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _operand(rows: int, k: int, major_is_k: bool, dtype, device, g) -> torch.Tensor:
    """A (rows, k) operand with the given major whose leading stride is padded to 16 bytes
    (TMA's rule), as a caller's padded operand would be: the contiguous extent (k, or rows
    for a transposed view) need not be a multiple of 8."""
    align = 16 // torch.empty(0, dtype=dtype).element_size()
    if major_is_k:
        padded = -(-k // align) * align
        return torch.randn(rows, padded, device=device, generator=g).to(dtype)[:, :k]
    padded = -(-rows // align) * align
    return torch.randn(k, padded, device=device, generator=g).to(dtype)[:, :rows].t()


def best_config(
    m: int,
    n: int,
    k: int,
    ab_dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: torch.device,
    configs: tuple[GemmConfig, ...] | None = None,
    layout: tuple[str, str] = ("k", "k"),
) -> GemmConfig:
    """The fastest of ``configs`` (default: :func:`candidates`) for this problem, timed
    once on ``device`` and then remembered."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if configs is None:
        configs = candidates(m, n, k, sms, checks.short_swizzle_groups(device))
    key = (m, n, k, ab_dtype, out_dtype, sms, configs, layout)
    if key not in _best:
        g = torch.Generator(device=device).manual_seed(0)
        a = _operand(m, k, layout[0] == "k", ab_dtype, device, g)
        b = _operand(n, k, layout[1] == "k", ab_dtype, device, g)
        out = torch.empty(m, n, device=device, dtype=out_dtype)
        store = AccStore(out_dtype)
        kernels = {
            cfg: gemm_kernels.device_key(cfg, ab_dtype, store, device, *layout) for cfg in configs
        }
        times = {cfg: time_config(kernel, a, b, out) for cfg, kernel in kernels.items()}
        _best[key] = min(times, key=times.get)
    return _best[key]
