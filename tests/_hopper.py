"""The guard of the GPU test files (marker ``gpu``): whether an NVIDIA Hopper GPU (sm_90,
where coda's kernels run) is present, and the module-level skip of a file without one."""

from __future__ import annotations

import pytest
import torch

#: an NVIDIA Hopper GPU (compute capability 9.0) is present
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def require_hopper(reason: str = "needs an NVIDIA Hopper GPU") -> None:
    """Skip the calling test module (at import, before its GPU-only imports) unless an
    NVIDIA Hopper GPU is present."""
    if not HOPPER:
        pytest.skip(reason, allow_module_level=True)
