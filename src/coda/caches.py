"""coda.caches: the bounded memo dictionaries of the host path.

Sits at the bottom of coda (imports nothing of it), used by ``coda.runtime`` and
``coda.matmul``. Their caches are keyed by call signatures and problem sizes, which a
long-running process with ever-new shapes (a dynamic sequence length) could grow without
end; each is a plain ``dict`` for look-ups (a hit costs one ``dict.get``) whose ``put``
drops everything once the bound is passed, then stores. Dropping all is cheap and
correct: every entry is recomputed on the next miss.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["BoundedCache"]


class BoundedCache(dict[K, V]):
    """A dict with at most ``limit + 1`` entries: ``put`` clears it when it holds more than
    ``limit`` before storing."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__()
        if limit < 1:
            raise ValueError(f"BoundedCache limit must be positive; got {limit}")
        self.limit = limit

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` (clearing first when over the limit); return it."""
        if len(self) > self.limit:
            self.clear()
        self[key] = value
        return value
