"""``bench ab --power`` (qmoe_rtc/bench/power.py): the summary of a setting's turns, a turn's energy and polls over a
fake NVML, the refusal where NVML cannot be loaded (CPU); real readings on a GPU."""

from __future__ import annotations

import math

import pytest

from qmoe_rtc.bench import ab
from qmoe_rtc.bench.power import SW_POWER_CAP, PowerMeter, Turn, summarize
from qmoe_rtc.errors import DeviceError


def test_summary_is_energy_over_time_and_the_median_clock():
    capped = [SW_POWER_CAP, 0, SW_POWER_CAP]
    turns = [Turn(energy_mj=700e3, seconds=1.0, mhz=[1600, 1700, 1650], watts=[690.0] * 3, reasons=capped),
             Turn(energy_mj=1400e3, seconds=2.0, mhz=[1800], watts=[700.0], reasons=[SW_POWER_CAP])]
    s = summarize(turns, median_us=5000.0)
    assert s["watts"] == pytest.approx(700.0)  # 2100 J over 3 s
    assert s["sm_mhz"] == 1675  # median of the four polls
    assert s["capped"] == pytest.approx(0.75)
    assert s["mj_per_call"] == pytest.approx(3500.0)  # 700 W x 5 ms


def test_summary_of_no_polls_is_not_a_number():
    s = summarize([Turn()], median_us=1.0)
    assert all(math.isnan(s[k]) for k in ("watts", "sm_mhz", "capped", "mj_per_call"))


class FakeNvml:
    def __init__(self, fail_after=None):
        self.energy, self.polls, self.fail_after = 1000, 0, fail_after

    def energy_mj(self):
        self.energy += 250
        return self.energy

    def poll(self):
        self.polls += 1
        if self.fail_after is not None and self.polls > self.fail_after:
            raise DeviceError("NVML nvmlDeviceGetPowerUsage failed (999): fake")
        return 1700 + self.polls, 650.0, SW_POWER_CAP


def test_a_turn_counts_the_energy_between_its_ends_and_polls_meanwhile():
    meter = PowerMeter(FakeNvml(), period_s=0.001)
    with meter.turn() as t:
        import time

        time.sleep(0.02)
    assert t.energy_mj == 250.0 and t.seconds >= 0.02
    assert len(t.mhz) >= 2 and len(t.mhz) == len(t.watts) == len(t.reasons)
    assert t.mhz[0] == 1701 and set(t.reasons) == {SW_POWER_CAP}


def test_a_failed_poll_is_raised_when_the_turn_ends():
    meter = PowerMeter(FakeNvml(fail_after=1), period_s=0.001)
    with pytest.raises(DeviceError, match="nvmlDeviceGetPowerUsage"):
        with meter.turn():
            import time

            time.sleep(0.02)


def test_no_nvml_library_is_a_clear_device_error():
    with pytest.raises(DeviceError, match="power readings need NVML"):
        PowerMeter.open(0, lib_name="libnvidia-ml-no-such.so.1")


def test_the_flag_is_parsed_and_documented():
    p = ab.build_parser()
    assert p.parse_args(["base", "--power"]).power and not p.parse_args(["base"]).power
    assert "power" in p.format_help() and "--power" in ab.__doc__


@pytest.mark.gpu
def test_readings_on_the_gpu():
    cp = pytest.importorskip("cupy")
    meter = PowerMeter.open(cp.cuda.Device().id)
    a = cp.ones((4096, 4096), dtype=cp.float32)
    with meter.turn() as t:
        for _ in range(50):
            a = a @ a * (1.0 / 4096)
        cp.cuda.get_current_stream().synchronize()
    s = summarize([t], median_us=1.0)
    assert t.mhz and 100 < s["sm_mhz"] < 5000, t.mhz
    assert 10 < s["watts"] < 2000, s
