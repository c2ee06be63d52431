"""A fake CUDA driver for the tests that check what happens before (or instead of) the GPU: :class:`FakeDriver`
answers the few driver calls the probe makes for one imagined machine (the ``machine`` fixture of tests/conftest.py
installs one)."""

from __future__ import annotations

from types import SimpleNamespace


class FakeDriver:
    """The few cuda.bindings driver calls :func:`qmoe_rtc.jit.driver.probe` makes, for one imagined machine."""

    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
                                         CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor")

    def __init__(self, version=13000, init_err=0, count=1, cc=(9, 0), lib=True):
        self.version, self.init_err, self.count, self.cc, self.lib = version, init_err, count, cc, lib

    def cuDriverGetVersion(self):
        if not self.lib:
            raise OSError("libcuda.so.1: cannot open shared object file")
        return (0, self.version)

    def cuInit(self, flags):
        return (self.init_err,)

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_NO_DEVICE" if int(err) == 100 else b"CUDA_ERROR_UNKNOWN")

    def cuDeviceGetCount(self):
        return (0, self.count)

    def cuDeviceGet(self, i):
        return (0, i)

    def cuDeviceGetAttribute(self, attr, dev):
        return (0, self.cc[0] if attr == "major" else self.cc[1])
