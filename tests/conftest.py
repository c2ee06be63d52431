"""Shared test fixtures. Tests marked ``gpu`` are skipped cleanly when no NVIDIA GPU/driver is found; with
QMOE_RTC_FAIL_LOG set, failures are written down as they happen (support/fail_log.py)."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_available() -> tuple[bool, str]:
    """(usable, why not): the driver probe a layer runs (no driver, driver too old, no GPU, GPU too old:
    the same words ``QMoE()`` and ``python -m qmoe_rtc info`` use), then CuPy."""
    from qmoe_rtc.errors import DeviceError
    from qmoe_rtc.jit.driver import probe

    try:
        probe(0)
    except DeviceError as exc:
        return False, f"no usable GPU: {exc}"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy broken although the driver answers
        return False, f"no usable GPU: CuPy cannot reach it ({type(exc).__name__}: {exc})"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With QMOE_RTC_FAIL_LOG set, each failure written to that file at once (support/fail_log.py)."""
    from support.fail_log import record

    record(report)


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache_of_the_session(tmp_path_factory):
    """No test writes into the user's own kernel cache: unless QMOE_RTC_CACHE_DIR names one (as the GPU
    machine's scripts do, to share a precompiled cache), the session compiles into a temporary
    directory (set as QMOE_RTC_CACHE_DIR, so processes the tests start inherit it too)."""
    import os

    if os.environ.get("QMOE_RTC_CACHE_DIR"):
        yield
        return
    path = tmp_path_factory.mktemp("kernel-cache")
    path.chmod(0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QMOE_RTC_CACHE_DIR", str(path))
        yield


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test id: fresh data per case, reproducible per case."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cache(tmp_path):
    """A fresh on-disk kernel cache in tmp_path (normal mode, no dumps), memory tier cleared around it."""
    from qmoe_rtc.jit import clear_memory
    from qmoe_rtc.settings import knobs

    clear_memory()
    tmp_path.chmod(0o700)  # a cache directory others can write is not trusted (whatever the umask made it)
    with knobs.scope(cache_dir=tmp_path, no_disk_cache=False, strict=False, dump=False):
        yield tmp_path
    clear_memory()


@pytest.fixture
def machine(monkeypatch):
    """``machine(**FakeDriver kwargs)`` installs that fake driver for the probe; returns the probe calls."""
    from qmoe_rtc.jit import driver

    from support.fake_driver import FakeDriver

    calls = []

    def install(**kw):
        fake = FakeDriver(**kw)
        monkeypatch.setattr(driver, "_drv", lambda: fake)
        real = driver.probe

        def probe(device_id=None):
            calls.append(device_id)
            return real(device_id)

        monkeypatch.setattr("qmoe_rtc.executor.probe", probe)
        return calls

    return install
