"""Composed epilogues fused into the GEMM on the GPU (marker ``gpu``; needs Hopper).

Each composition runs through ``coda.testing.fuzz.check_example``: outputs pre-filled
with NaN, compared against a float64-accumulator reference and against eager PyTorch
(bf16 GEMM output, then the epilogue): err(coda) <= 2 * err(eager) + 1e-3.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an NVIDIA Hopper GPU", allow_module_level=True)

from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.fuzz import check_example  # noqa: E402
from coda.testing.strategies import make_inputs  # noqa: E402

bf16 = torch.bfloat16
SHAPES = [(128, 128, 64), (300, 520, 264), (1000, 776, 136), (7, 8, 8), (4096, 1024, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_fused_matches_reference(name, shape):
    epi = EPILOGUES[name]
    m, n, k = shape
    A, B, tensors = make_inputs(epi, m, n, k, bf16, seed=m + n + k)
    tensors = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in tensors.items()}
    record = check_example(epi, A.cuda(), B.cuda(), tensors)
    assert not record["failed"], record
