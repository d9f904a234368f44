"""Optional small autotune for the PingPong GEMM: time a few configs, keep the fastest.

``coda.gemm(A, B, config="autotune")`` calls :func:`best_config`; results are cached in
memory per (M, N, K, dtypes, SM count), so only the first call of a shape pays (one
compile per candidate config, then a few timed launches each).
"""

from __future__ import annotations

import torch

from ..mainloop.config import GemmConfig

CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(tile_n=192, cluster_m=2),
    GemmConfig(tile_n=192, cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=128, cluster_m=2),
    GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=160, cluster_m=2),
)

_best: dict[tuple, GemmConfig] = {}


def time_config(config: GemmConfig, a, b, out, reps: int = 10) -> float:
    """Mean milliseconds of one launch with ``config`` (after one warm-up launch)."""
    from ..matmul import gemm

    gemm(a, b, out=out, config=config)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        gemm(a, b, out=out, config=config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def best_config(
    m: int,
    n: int,
    k: int,
    ab_dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: torch.device,
    candidates: tuple[GemmConfig, ...] = CANDIDATES,
) -> GemmConfig:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    key = (m, n, k, ab_dtype, out_dtype, sms, candidates)
    if key not in _best:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(m, k, device=device, generator=g).to(ab_dtype)
        b = torch.randn(n, k, device=device, generator=g).to(ab_dtype)
        out = torch.empty(m, n, device=device, dtype=out_dtype)
        times = {cfg: time_config(cfg, a, b, out) for cfg in candidates}
        _best[key] = min(times, key=times.get)
    return _best[key]
