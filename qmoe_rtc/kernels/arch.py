"""The device as the kernel families see it: one :class:`ArchSpec`, parsed once from the compile target ('sm_90a'),
with the device's multiprocessors and opt-in shared memory where a GPU is known (the executor reads both from it),
else this module's tables.

Every question the host asks about an arch is answered here, never by parsing the target where it is asked: the
compute capability, which features the engines may use there (programmatic dependent launch, warpgroup MMA, the FP8
conversion), the shared memory a block may take, the SMs the launch-geometry rules size grids for, and the name its
measured tables are filed under (``family``: 'sm_90' for sm_90 and sm_90a; ``tuning``: its table of thresholds). A
new GPU is a row of :data:`SMEM_OPTIN` here (and, once measured, its tables: ``kernels/tuning/<family>.py``, its rows
in ``kernels/engine_choice.py``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_SMEM", "DEFAULT_SMS", "FP8_MIN_CC", "SMEM_OPTIN", "ArchSpec"]

#: Multiprocessors assumed when the device is unknown (an H200's 132, where the geometry rules were measured);
#: never used for a launch on a GPU, whose own count the executor reads.
DEFAULT_SMS = 132

#: Dynamic shared memory one block may opt in to (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), by compute
#: capability, from the CUDA C++ Programming Guide's compute-capability tables: 8.0 / 8.7 (A100, Orin) 163 KiB,
#: 8.6 / 8.9 (A10, A40, L4, L40, RTX 30 / 40) 99 KiB, 9.0 / 10.x (H100, H200, B200) 227 KiB, 12.x (RTX 50) 99 KiB.
#: Planning takes the device's own value (the executor reads the attribute); this table serves compiles without
#: a GPU (``--arch``, the warm tool, CPU tests).
SMEM_OPTIN = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024,
              103: 227 * 1024, 120: 99 * 1024, 121: 99 * 1024}
#: The budget of a device that is unknown (target ''): an H200's, where the geometry rules were measured.
DEFAULT_SMEM = SMEM_OPTIN[90]
#: The budget of a target the table does not list: the smallest listed (a launch that fits it fits them all).
_SMALLEST_SMEM = min(SMEM_OPTIN.values())

#: The first compute capability with the e4m3 -> f16 conversion the tensor-core engines decode FP8 with.
FP8_MIN_CC = 89
#: The first with programmatic dependent launch (griddepcontrol).
PDL_MIN_CC = 90
#: The one with the warpgroup MMA the wgmma prefill engine is written for (built as the arch-specific sm_90a).
WGMMA_CC = 90

_TARGET = re.compile(r"sm_(\d+)[a-z]?")


@functools.lru_cache(maxsize=64)
def _cc(target: str) -> int | None:
    m = _TARGET.fullmatch(target)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ArchSpec:
    """A device: its compile ``target`` ('sm_90a' ...; '' when unknown: the warm tool, CPU tests), its ``sms`` and
    opt-in dynamic shared memory per block ``smem`` in bytes (0 when unknown). A feature an unknown device may have is
    assumed present where that only lists more modules (FP8 MMA, warpgroup MMA), absent where it changes launches
    (programmatic dependent launch)."""

    target: str = ""
    sms: int = 0
    smem: int = 0

    @property
    def cc(self) -> int | None:
        """The compute capability (90 for 'sm_90' and 'sm_90a'), None when the target is unknown."""
        return _cc(self.target)

    @property
    def family(self) -> str:
        """The name the per-arch tables file it under: 'sm_90' for sm_90 and sm_90a ('' when unknown)."""
        return f"sm_{self.cc}" if self.cc is not None else ""

    @property
    def sm_count(self) -> int:
        """Multiprocessors the launch-geometry rules size grids for: the device's, else :data:`DEFAULT_SMS`."""
        return self.sms or DEFAULT_SMS

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory a block may ask for: the device's opt-in limit, else the table's for the target
        (:data:`SMEM_OPTIN`; unknown target: :data:`DEFAULT_SMEM`; a target the table lacks: its smallest value)."""
        if self.smem:
            return self.smem
        if not self.target:
            return DEFAULT_SMEM
        return SMEM_OPTIN.get(self.cc, _SMALLEST_SMEM) if self.cc is not None else _SMALLEST_SMEM

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (sm_90+; unknown: no)."""
        return self.cc is not None and self.cc >= PDL_MIN_CC

    @property
    def warpgroup_mma(self) -> bool:
        """The wgmma prefill engine's warpgroup MMA (sm_90a; unknown: assumed, so module listings include it)."""
        return self.cc is None or self.cc == WGMMA_CC

    @property
    def tuning(self):
        """The arch's table of measured thresholds (:mod:`qmoe_rtc.kernels.tuning`; an arch without one: the default
        table, with one WARNING)."""
        from .tuning import table

        return table(self)

    @property
    def fp8_mma(self) -> bool:
        """The e4m3 conversion the tensor-core engines decode FP8 weights with (sm_89+; unknown: assumed)."""
        return self.cc is None or self.cc >= FP8_MIN_CC
