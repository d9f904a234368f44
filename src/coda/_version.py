"""coda's version (a leaf module: the runtime's cache keys read it without importing coda)."""

__version__ = "0.1.0"
