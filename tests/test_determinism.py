"""torch.use_deterministic_algorithms(True) and coda's one nondeterministic kernel, split-K
(its splits add into the output in finishing order): the loss's automatic split turns
off, ``coda.gemm`` on an explicit split config alerts the way PyTorch's own ops do (CPU
checks; the GPU side, bitwise-repeated small-batch losses and the alert before a launch,
in tests/test_cross_entropy_gpu.py and tests/test_mainloop_gpu.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from coda.fusions import ce_fused
from coda.runtime import checks


def test_alert_raises_warns_or_passes_as_pytorch_does(deterministic_algorithms):
    checks.alert_not_deterministic("op")  # determinism off: nothing
    deterministic_algorithms()
    with pytest.raises(RuntimeError, match="op does not have a deterministic"):
        checks.alert_not_deterministic("op")
    deterministic_algorithms(warn_only=True)
    with pytest.warns(UserWarning, match="warn_only=True"):
        checks.alert_not_deterministic("op")


@pytest.mark.parametrize("warn_only", [False, True])
def test_the_loss_splits_no_gemm_when_deterministic(deterministic_algorithms, warn_only):
    """The short last row chunk's dh (256 rows, K = V) splits K by default; not under
    deterministic algorithms, where the unsplit GEMM runs, without a warning (the check
    comes before the device is looked at, so a CPU device shows it)."""
    assert ce_fused._split_config_cached(256, 2048, 128256, 132, False).split_k > 1
    deterministic_algorithms(warn_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ce_fused._split_config(256, 2048, 128256, torch.device("cpu")) is None


def test_the_ops_gemms_never_let_the_heuristic_split(monkeypatch):
    """``coda.gemm`` splits K on its own for few-tile fp32 outputs (``AUTO_SPLIT_K``), not
    bitwise reproducible run to run; the fused ops' GEMMs (``_dispatch.matmul``) ask it
    not to (``allow_split=False``), so that they repeat bit for bit, and a launch cached
    for one kind of call is never reused for the other (the fast path's signature holds
    the flag). An explicit config passes through as given."""
    from coda import matmul
    from coda.fusions import _dispatch
    from coda.mainloop.config import GemmConfig

    seen = []
    monkeypatch.setattr(_dispatch, "uses_kernels", lambda t: True)
    monkeypatch.setattr(matmul, "gemm_unguarded", lambda *a, **kw: seen.append(kw))
    A, B = torch.zeros(512, 8192), torch.zeros(2048, 8192)
    out = torch.zeros(512, 2048)
    _dispatch.matmul(A, B, out=out)
    _dispatch.matmul(A, B, out=out, accumulate=True)
    cfg = GemmConfig(split_k=2)
    _dispatch.matmul(A, B, out=out, config=cfg)
    assert [kw["allow_split"] for kw in seen] == [False] * 3
    assert seen[1]["accumulate"] and seen[2]["config"] is cfg
    assert matmul.AUTO_SPLIT_K  # what the ops opt out of
    split, whole = (matmul._signature(A, B, out, False, s) for s in (True, False))
    assert split != whole and None not in (split, whole)
