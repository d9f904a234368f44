"""CuTeDSL environment for coda: import ``cutlass`` through here, never directly at module top.

coda targets Hopper only. On a GPU-less machine CuTeDSL falls back to sm_100a, where
Hopper code fails at trace time, so ``CUTE_DSL_ARCH`` defaults to ``sm_90a`` before
``cutlass`` is first imported (an explicit user setting wins).
"""

from __future__ import annotations

import os

TARGET_ARCH = "sm_90a"


def ensure_arch() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", TARGET_ARCH)


def dsl_version() -> str:
    ensure_arch()
    import cutlass

    return str(cutlass.__version__)
