"""The GPU's power and SM clock while a benchmark runs (NVML, read through ctypes: no extra package).

Where a layer runs the GPU at its power limit (mixtral-8x7b at 4096 tokens on an H200, 700 W), the clock
the GPU holds depends on the work's power, so a kernel that is faster per cycle can draw the clock down
and gain less than its cycles say (docs/performance-log.md). :class:`PowerMeter` measures a
turn of samples: the energy counter over the turn (mean watts), and a thread polling the SM clock, the
power and the throttle reasons every ``period_s`` (median MHz, the share of polls at the power cap).

    meter = PowerMeter.open(cupy_device_index)      # DeviceError where NVML cannot be read
    with meter.turn() as t:                        # t: a Turn, filled when the block ends
        ...the timed work, synchronised...
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import DeviceError

__all__ = ["PowerMeter", "Turn", "summarize"]

NVML_CLOCK_SM = 1
#: nvmlClocksThrottleReasons: the software power cap, and the hardware slowdowns (power brake, thermal).
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8 | 0x40 | 0x80


@dataclass
class Turn:
    """One timed turn: energy over it (mJ), its wall seconds, and the polls (MHz, W, throttle reasons)."""

    energy_mj: float = 0.0
    seconds: float = 0.0
    mhz: list = field(default_factory=list)
    watts: list = field(default_factory=list)
    reasons: list = field(default_factory=list)


def summarize(turns: list[Turn], median_us: float) -> dict:
    """A setting's turns → mean watts (energy counter over wall time), median SM MHz, the share of polls at
    the power cap (software cap or a hardware slowdown), and mJ per call (mean watts × the median time)."""
    seconds = sum(t.seconds for t in turns)
    watts = sum(t.energy_mj for t in turns) / 1e3 / seconds if seconds > 0 else float("nan")
    mhz = [m for t in turns for m in t.mhz]
    reasons = [r for t in turns for r in t.reasons]
    capped = sum(1 for r in reasons if r & (SW_POWER_CAP | HW_SLOWDOWN)) / len(reasons) if reasons else float("nan")
    return dict(watts=watts, sm_mhz=statistics.median(mhz) if mhz else float("nan"), capped=capped,
                mj_per_call=watts * median_us / 1e3)


class _Nvml:
    """The few NVML entry points used here, on one device handle."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def _call(self, name: str, *args) -> None:
        ret = getattr(self.lib, name)(*args)
        if ret != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            raise DeviceError(f"NVML {name} failed ({ret}): {self.lib.nvmlErrorString(ret).decode(errors='replace')}")

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self._call("nvmlDeviceGetTotalEnergyConsumption", self.handle, ctypes.byref(v))
        return v.value

    def poll(self) -> tuple[int, float, int]:
        """(SM MHz, watts, throttle reasons) now."""
        mhz, mw, why = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        self._call("nvmlDeviceGetClockInfo", self.handle, NVML_CLOCK_SM, ctypes.byref(mhz))
        self._call("nvmlDeviceGetPowerUsage", self.handle, ctypes.byref(mw))
        self._call("nvmlDeviceGetCurrentClocksThrottleReasons", self.handle, ctypes.byref(why))
        return mhz.value, mw.value / 1e3, why.value


class PowerMeter:
    """Power, energy and SM clock of one GPU over timed turns (see the module docstring)."""

    def __init__(self, nvml: _Nvml, period_s: float = 0.01):
        self.nvml, self.period_s = nvml, period_s

    @classmethod
    def open(cls, device_index: int, period_s: float = 0.01, lib_name: str = "libnvidia-ml.so.1") -> PowerMeter:
        """The meter of CUDA device ``device_index`` (found in NVML by its PCI bus id); DeviceError where
        NVML cannot be loaded or does not know the device."""
        try:
            lib = ctypes.CDLL(lib_name)
        except OSError as e:
            raise DeviceError(f"power readings need NVML ({lib_name}), which could not be loaded: {e}") from None
        nv = _Nvml(lib, None)
        nv._call("nvmlInit_v2")
        import cupy as cp

        bus = cp.cuda.Device(device_index).pci_bus_id  # 'dddd:bb:dd.f'
        handle = ctypes.c_void_p()
        dom, _, rest = bus.partition(":")
        tries = [bus, f"{int(dom, 16):08x}:{rest}"]
        for b in tries:
            if lib.nvmlDeviceGetHandleByPciBusId_v2(b.encode(), ctypes.byref(handle)) == 0:
                nv.handle = handle
                return cls(nv, period_s)
        raise DeviceError(f"NVML knows no GPU at PCI bus id {bus!r} (CUDA device {device_index}; tried {tries})")

    @contextmanager
    def turn(self):
        """Measure the block's work: yields a :class:`Turn` filled in when the block ends (the caller
        synchronises the GPU inside the block, so the energy counter covers its work)."""
        t = Turn()
        stop = threading.Event()
        failed: list = []

        def polling():
            try:
                while not stop.is_set():
                    m, w, r = self.nvml.poll()
                    t.mhz.append(m)
                    t.watts.append(w)
                    t.reasons.append(r)
                    stop.wait(self.period_s)
            except DeviceError as e:  # raised in the caller's thread when the turn ends
                failed.append(e)

        e0, t0 = self.nvml.energy_mj(), time.perf_counter()
        th = threading.Thread(target=polling, name="qmoe-power", daemon=True)
        th.start()
        try:
            yield t
        finally:
            stop.set()
            th.join()
            t.seconds = time.perf_counter() - t0
            t.energy_mj = float(self.nvml.energy_mj() - e0)
        if failed:
            raise failed[0]
