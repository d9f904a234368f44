"""Test configuration: hypothesis profiles (coda.testing.profiles).

HYPOTHESIS_PROFILE=ci (the default; derandomized, fixed example counts) or dev (random
seeds, 5x the examples). See docs/testing.md.
"""

import pytest
import torch

from coda.testing.profiles import load_profile

load_profile()


@pytest.fixture
def deterministic_algorithms():
    """A function ``on(warn_only=False)`` that turns on
    ``torch.use_deterministic_algorithms``; the caller's setting is restored after the test."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )

    def on(warn_only: bool = False) -> None:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)

    yield on
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
