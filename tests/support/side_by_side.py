"""Compile-only tests' helper: NVRTC releases the GIL, so a test's modules compile side by side in
threads (one per CPU), which halves the compile tier's time on CI's two cores."""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

A = TypeVar("A")
R = TypeVar("R")


def in_threads(fn: Callable[[A], R], items: Iterable[A]) -> list[R]:
    """``[fn(item) for item in items]``, computed in a thread per CPU (the first error is raised)."""
    items = list(items)
    if len(items) < 2:
        return [fn(item) for item in items]
    with cf.ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 2)) as pool:
        return list(pool.map(fn, items))


#: unit key -> compiled module, for the whole session: a unit that another compile-only test (or parametrization)
#: already built is not compiled again (CI time). The key hashes everything NVRTC is given (source, defines,
#: knob-driven options, arch, toolchain), so a reused module is the one a fresh compile would give.
_COMPILED: dict = {}


@dataclass(frozen=True)
class Built:
    """A module as the executor loads it: its pieces' cubins (one per part) and every kernel's lowered name."""

    cubins: tuple[bytes, ...]
    lowered: dict


def compile_specs(pairs: Iterable[tuple]) -> list[Built]:
    """The compiled modules of ``(spec, arch)`` pairs (the kernel cache's get_cubins), side by side; a unit
    this session compiled before through here is taken from :data:`_COMPILED`."""
    from qmoe_rtc.jit import get_cubins, unit_key
    from qmoe_rtc.kernels import spec_unit

    def one(pair):
        unit = spec_unit(pair[0])
        key = unit_key(unit, pair[1])
        if key not in _COMPILED:
            mods = get_cubins(unit, pair[1])
            _COMPILED[key] = Built(tuple(m.cubin for m in mods), {k: v for m in mods for k, v in m.lowered.items()})
        return _COMPILED[key]

    return in_threads(one, pairs)
