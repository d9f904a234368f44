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


#: The FP32 arithmetic that shares the SM sub-partitions with the other warpgroup's
#: WGMMAs: beside a running mainloop each costs about a mainloop cycle
#: (docs/fused-epilogues.md, "Not the register file: the FP32 pipe")
FP32_PIPE = ("FFMA", "FMUL", "FADD")

_ADD_OF_ZERO = re.compile(r"FADD(?:\.\w+)* R\d+, (?:-?RZ, R\d+|R\d+, -?RZ)\b")


def fp32_pipe_count(counts: Counter) -> int:
    """FFMA + FMUL + FADD instructions (every modifier) in ``opcode_counts``' result."""
    return sum(count_prefix(counts, op) for op in FP32_PIPE)


def adds_of_zero(sass: str) -> int:
    """FADDs with the zero register as an operand: a sum started at 0.0, which the
    compiler must keep (-0 + 0 is +0) where starting at the first term would not."""
    return len(_ADD_OF_ZERO.findall(sass))


def instruction_profile(sass: str) -> dict[str, int]:
    """The counts a kernel engineer compares between versions of an epilogue: every
    instruction, the FP32 pipe's, MUFU, SHFL, IMAD (address arithmetic), LDL + STL
    (spills) and the adds of zero."""
    counts = opcode_counts(sass)
    return {
        "instructions": sum(counts.values()),
        "fp32": fp32_pipe_count(counts),
        "mufu": count_prefix(counts, "MUFU"),
        "shfl": count_prefix(counts, "SHFL"),
        "imad": count_prefix(counts, "IMAD"),
        "spills": count_prefix(counts, "LDL") + count_prefix(counts, "STL"),
        "adds_of_zero": adds_of_zero(sass),
    }
