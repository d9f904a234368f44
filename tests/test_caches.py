"""``coda.caches.BoundedCache``: the host path's memo dictionaries stay bounded."""

from __future__ import annotations

import pytest

from coda import matmul
from coda.caches import BoundedCache
from coda.runtime import epilogue_kernels, operands


def test_put_stores_returns_and_clears_past_the_limit():
    c: BoundedCache[int, str] = BoundedCache(3)
    for i in range(4):  # up to limit + 1 entries
        assert c.put(i, str(i)) == str(i)
    assert dict(c) == {0: "0", 1: "1", 2: "2", 3: "3"}
    assert c.put(9, "nine") == "nine"  # over the limit: cleared, then stored
    assert dict(c) == {9: "nine"} and c.get(0) is None
    assert isinstance(c, dict) and c.limit == 3


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        BoundedCache(0)


@pytest.mark.parametrize(
    "cache",
    [
        epilogue_kernels._plans,
        epilogue_kernels._calls,
        epilogue_kernels._signature_fns,
        operands._problems,
        matmul._configs,
        matmul._validated,
    ],
)
def test_the_host_path_caches_are_bounded(cache):
    assert isinstance(cache, BoundedCache) and cache.limit == 4096
