"""Sections of a cubin (ELF64), for tests that compare machine code rather than whole files."""

from __future__ import annotations

import struct


def text_sections(elf: bytes) -> dict[str, bytes]:
    """The ``.text.<kernel>`` sections of an ELF64 cubin: each kernel's machine code."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]

    def name(off: int) -> str:
        return elf[names + off: elf.index(b"\0", names + off)].decode()

    return {name(s[0]): elf[s[4]: s[4] + s[5]] for s in secs if name(s[0]).startswith(".text.")}
