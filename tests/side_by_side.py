"""Compile-only tests' helper: NVRTC releases the GIL, so a test's modules compile side by side in
threads (one per CPU), which halves the compile tier's time on CI's two cores."""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Iterable
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


def compile_specs(pairs: Iterable[tuple]) -> list:
    """The compiled modules of ``(spec, arch)`` pairs (the kernel cache's get_cubin), side by side."""
    from qmoe_rtc.jit import get_cubin
    from qmoe_rtc.kernels import spec_unit

    return in_threads(lambda pair: get_cubin(spec_unit(pair[0]), pair[1]), pairs)
