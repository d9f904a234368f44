"""Facts read from compiled CUDA code objects (cubins, or host objects embedding them).

Sits in ``coda.runtime`` under the kernel cache: after a compile (or a disk-cache load)
the cache asks :func:`local_memory_bytes` whether the kernel uses local memory, i.e.
spilled registers (LDL/STL in SASS), without a disassembler. The answer is the largest
``EIATTR_FRAME_SIZE`` of the code object's functions, from the ``.nv.info`` section of
every CUDA ELF (``e_machine`` 190) found in the bytes.
"""

from __future__ import annotations

import struct

_ELF_MAGIC = b"\x7fELF"
_EM_CUDA = 190
_EIFMT_SVAL = 0x04  # attribute with a sized value
_EIFMT_HVAL = 0x03  # attribute with a 2-byte value in the size field
_EIATTR_FRAME_SIZE = 0x11  # value: (function symbol index u32, frame bytes u32)


def _sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF image."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        start = names_at + name_off
        name = elf[start : elf.index(b"\0", start)].decode()
        out[name] = elf[offset : offset + size]
    return out


def _frame_sizes(info: bytes) -> list[int]:
    sizes, i = [], 0
    while i + 4 <= len(info):
        fmt, attr, size = info[i], info[i + 1], struct.unpack_from("<H", info, i + 2)[0]
        if fmt == _EIFMT_SVAL:
            if attr == _EIATTR_FRAME_SIZE and size >= 8:
                sizes.append(struct.unpack_from("<I", info, i + 8)[0])
            i += 4 + size
        else:  # no payload after the 4-byte header
            i += 4
    return sizes


def cuda_elfs(blob: bytes) -> list[bytes]:
    """The CUDA ELF images in ``blob`` (a cubin is one; a host object embeds them)."""
    found, at = [], blob.find(_ELF_MAGIC)
    while at >= 0:
        if len(blob) >= at + 0x40 and blob[at + 4] == 2:  # 64-bit
            if struct.unpack_from("<H", blob, at + 18)[0] == _EM_CUDA:
                (shoff,) = struct.unpack_from("<Q", blob, at + 0x28)
                shentsize, shnum = struct.unpack_from("<HH", blob, at + 0x3A)
                found.append(blob[at : at + shoff + shentsize * shnum])
        at = blob.find(_ELF_MAGIC, at + 1)
    return found


def local_memory_bytes(blob: bytes) -> int:
    """Largest per-thread local-memory frame of any function in ``blob`` (0: no spills,
    no local arrays). Raises ValueError when ``blob`` holds no CUDA code object."""
    elfs = cuda_elfs(blob)
    if not elfs:
        raise ValueError("no CUDA ELF code object found")
    frames = [0]
    for elf in elfs:
        info = _sections(elf).get(".nv.info")
        if info:
            frames += _frame_sizes(info)
    return max(frames)
