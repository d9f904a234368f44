"""coda.testing.profiles: hypothesis settings profiles shared by coda's suite and users.

* ``ci``: derandomized (the seed is derived from each test, so a red CI run replays
  identically), no example database, fixed example counts, no deadline (CPU timing varies),
  ``print_blob=True`` (a failure prints a ``@reproduce_failure`` blob).
* ``dev``: random seeds, the local example database, ``DEV_SCALE`` times more examples;
  for local and device runs (``HYPOTHESIS_PROFILE=dev``).

Tests state their example count through ``examples(n)``, which multiplies ``n`` by the
active profile's scale, so ``HYPOTHESIS_PROFILE=dev`` raises every count at once while the
CI counts stay fixed and visible in the test files.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["PROFILES", "active_profile", "examples", "load_profile", "register_profiles"]

DEV_SCALE = 5
#: profile name -> example-count scale
PROFILES: dict[str, int] = {"ci": 1, "dev": DEV_SCALE}
_active = "ci"


def register_profiles() -> None:
    """Register the ``ci`` and ``dev`` profiles with hypothesis (idempotent)."""
    common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", derandomize=True, database=None, max_examples=100, **common)
    settings.register_profile("dev", max_examples=100 * DEV_SCALE, **common)


def load_profile(name: str | None = None) -> str:
    """Register and load profile ``name`` (default: $HYPOTHESIS_PROFILE, else ``ci``)."""
    global _active
    register_profiles()
    name = name or os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    if name not in PROFILES:
        raise ValueError(f"unknown hypothesis profile {name!r}; known: {', '.join(PROFILES)}")
    settings.load_profile(name)
    _active = name
    return name


def active_profile() -> str:
    """The profile last loaded through ``load_profile``."""
    return _active


def examples(n: int) -> int:
    """``n`` examples scaled by the active profile (ci: n, dev: 5 n)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"examples: n must be a positive int; got {n!r}")
    return n * PROFILES[_active]
