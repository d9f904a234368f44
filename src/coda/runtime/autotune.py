"""Optional small autotune for the PingPong GEMM: time a few configs, keep the fastest.

``coda.gemm(A, B, config="autotune")`` calls :func:`best_config`; results are cached in
memory per (M, N, K, dtypes, operand layout, SM count), so only the first call of a shape
pays (one compile per candidate config, then a few timed launches each). Sits in
``coda.runtime`` and launches through :mod:`coda.runtime.gemm_kernels` directly.
"""

from __future__ import annotations

import torch

from ..mainloop.config import GemmConfig
from ..mainloop.visitor import AccStore
from . import gemm_kernels

CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(tile_n=192, cluster_m=2),
    GemmConfig(tile_n=192, cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=128, cluster_m=2),
    GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=160, cluster_m=2),
)

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
    if major_is_k:
        return torch.randn(rows, k, device=device, generator=g).to(dtype)
    return torch.randn(k, rows, device=device, generator=g).to(dtype).t()


def best_config(
    m: int,
    n: int,
    k: int,
    ab_dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: torch.device,
    candidates: tuple[GemmConfig, ...] = CANDIDATES,
    layout: tuple[str, str] = ("k", "k"),
) -> GemmConfig:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    key = (m, n, k, ab_dtype, out_dtype, sms, candidates, layout)
    if key not in _best:
        g = torch.Generator(device=device).manual_seed(0)
        a = _operand(m, k, layout[0] == "k", ab_dtype, device, g)
        b = _operand(n, k, layout[1] == "k", ab_dtype, device, g)
        out = torch.empty(m, n, device=device, dtype=out_dtype)
        times = {
            cfg: time_config(
                gemm_kernels.kernel_key(cfg, ab_dtype, AccStore(out_dtype), sms, *layout), a, b, out
            )
            for cfg in candidates
        }
        _best[key] = min(times, key=times.get)
    return _best[key]
