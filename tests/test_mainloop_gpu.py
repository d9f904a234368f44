"""GPU numerics of the PingPong GEMM (marker ``gpu``; skipped without a Hopper GPU).

Error is measured against a float64 reference; coda passes when its error is at most
twice eager PyTorch's own error for the same output dtype, plus a tiny atol.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not hopper:
    pytest.skip("needs an NVIDIA Hopper GPU", allow_module_level=True)

from coda.mainloop.config import GemmConfig  # noqa: E402
from coda.matmul import gemm  # noqa: E402

# (M, N, K): aligned, ragged in every dimension, tiny, tall, wide.
SHAPES = [
    (128, 192, 64),
    (256, 384, 128),
    (1024, 1024, 1024),
    (4096, 4096, 512),
    (1, 8, 8),
    (7, 8, 16),
    (100, 200, 64),
    (129, 200, 72),
    (255, 136, 520),
    (1000, 1000, 1000),
    (1023, 1032, 1016),
    (333, 4104, 264),
    (4097, 264, 4104),
    (2048, 8, 2048),
    (8, 2048, 2048),
    (3000, 5000, 200),
    (517, 1231 + 1, 952),
    (64, 64, 4096),
    (16384, 24, 128),
    (24, 16384, 128),
    (1536, 1544, 8),
]


def _errors(a, b, out, out_dtype):
    ref = a.double() @ b.double().t()
    eager = (a @ b.t()) if out_dtype == a.dtype else (a.float() @ b.float().t()).to(out_dtype)
    scale = ref.abs().max().item() + 1e-30
    err = (out.double() - ref).abs().max().item() / scale
    base = (eager.double() - ref).abs().max().item() / scale
    return err, base


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_gemm_matches_float64_reference(shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 13 + k)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poison
    gemm(a, b, out=out)
    assert not out.isnan().any(), "unwritten output elements"
    err, base = _errors(a, b, out, torch.bfloat16)
    assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("ab_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemm_dtypes(ab_dtype, out_dtype):
    m, n, k = 777, 1000, 520
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(m, k, device="cuda", generator=g).to(ab_dtype)
    b = torch.randn(n, k, device="cuda", generator=g).to(ab_dtype)
    out = gemm(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    err, base = _errors(a, b, out, out_dtype)
    assert err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(tile_n=128, cluster_m=1),
        GemmConfig(tile_n=192, cluster_m=2),
        GemmConfig(tile_n=128, cluster_m=1, cluster_n=2),
        GemmConfig(tile_n=160, cluster_m=2, group_m=1),
    ],
    ids=str,
)
def test_gemm_configs_ragged(config):
    m, n, k = 1111, 1320, 1048
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(a, b, out=out, config=config)
    err, base = _errors(a, b, out, torch.bfloat16)
    assert not out.isnan().any()
    assert err <= 2 * base + 1e-6, (err, base)


def test_gemm_strided_views():
    """Row strides larger than the width (a column slice of a wider buffer) are supported."""
    g = torch.Generator(device="cuda").manual_seed(4)
    big_a = torch.randn(300, 256, device="cuda", generator=g).to(torch.bfloat16)
    big_b = torch.randn(200, 256, device="cuda", generator=g).to(torch.bfloat16)
    a, b = big_a[:, :128], big_b[:, :128]
    out_buf = torch.zeros(300, 256, device="cuda", dtype=torch.bfloat16)
    out = out_buf[:, :200]
    gemm(a, b, out=out)
    err, base = _errors(a, b, out, torch.bfloat16)
    assert err <= 2 * base + 1e-6
    assert (out_buf[:, 200:] == 0).all(), "wrote outside the output view"
