"""Test configuration: hypothesis profiles (coda.testing.profiles).

HYPOTHESIS_PROFILE=ci (the default; derandomized, fixed example counts) or dev (random
seeds, 5x the examples). See docs/testing.md.
"""

from coda.testing.profiles import load_profile

load_profile()
