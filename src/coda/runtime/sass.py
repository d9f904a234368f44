"""Disassemble compiled kernels and summarize their SASS (for tests and kernel engineers).

Uses ``nvdisasm`` from the ``nvidia-cuda-nvdisasm`` wheel (coda's ``test`` extra), or
one on PATH. Works on a GPU-less machine.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter


def find_nvdisasm() -> str | None:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if hits:
            return hits[-1]
    return None


def disassemble(cubin: bytes) -> str:
    exe = find_nvdisasm()
    if exe is None:
        raise RuntimeError("nvdisasm not found: pip install 'nvidia-cuda-nvdisasm>=13.4.0rc1,<14'")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [exe, "-c", f.name], check=True, capture_output=True, text=True
        ).stdout


_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", re.M)


def opcode_counts(sass: str) -> Counter:
    """Count instructions by full opcode (e.g. ``HGMMA.64x192x16.F32.BF16``)."""
    return Counter(_OPCODE.findall(sass))


def count_prefix(counts: Counter, prefix: str) -> int:
    """Instructions whose opcode is ``prefix`` or starts with ``prefix.``."""
    return sum(n for op, n in counts.items() if op == prefix or op.startswith(prefix + "."))
