"""Shared test fixtures. Tests marked ``gpu`` are skipped cleanly when no NVIDIA GPU/driver is found."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_available() -> tuple[bool, str]:
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy, no driver, no device
        return False, f"no usable GPU ({type(exc).__name__}: {exc})"
    if n < 1:
        return False, "no GPU device found"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test id: fresh data per case, reproducible per case."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cache(tmp_path):
    """A fresh on-disk kernel cache in tmp_path (normal mode, no dumps), memory tier cleared around it."""
    from qmoe_rtc import knobs
    from qmoe_rtc.jit import clear_memory

    clear_memory()
    tmp_path.chmod(0o700)  # a cache directory others can write is not trusted (whatever the umask made it)
    with knobs.scope(cache_dir=tmp_path, no_disk_cache=False, strict=False, dump=False):
        yield tmp_path
    clear_memory()
