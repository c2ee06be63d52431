"""``python -m qmoe_rtc bench soak`` on the CPU: its --help, import safety and its verdict (the soak itself
runs on a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_rtc.bench import soak

REPO = Path(__file__).resolve().parents[2]


def test_help_works_without_a_gpu_and_imports_nothing_heavy():
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "bench", "soak", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    for opt in ("--replays", "--eager", "--every", "--max-batch", "--tol-device-mib", "--json"):
        assert opt in r.stdout
    code = ("import sys; import qmoe_rtc.bench.soak; "
            "print([k for k in sys.modules if k.startswith(('cupy', 'numpy')) or "
            "(k.startswith('qmoe_rtc') and k not in ('qmoe_rtc', 'qmoe_rtc._lazy', 'qmoe_rtc.bench', 'qmoe_rtc.bench.soak'))])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def _samples(phase, n, slope=0.0, metric="device_mib"):
    base = dict(device_mib=1000.0, pool_used_mib=300.0, pool_held_mib=400.0, rss_mib=900.0, objects=50_000)
    return [dict(base, phase=phase, iter=i, **{metric: base[metric] + slope * i}) for i in range(n)]


def test_verdict_flat_and_growing():
    flat = {"graph": soak.growth(_samples("graph", 40)), "eager": soak.growth(_samples("eager", 40, 0.01))}
    assert soak.verdict(flat, 8, 16, 2000) == (True, [])
    grow = {"graph": soak.growth(_samples("graph", 40, 1.0, "rss_mib"))}
    ok, over = soak.verdict(grow, 8, 16, 2000)
    assert not ok and len(over) == 1 and "rss_mib" in over[0]


def test_without_a_gpu_it_says_so(request):
    from conftest import gpu_available

    if gpu_available()[0]:
        pytest.skip("a GPU is present: the soak would run")
    assert soak.main(["--replays", "1", "--eager", "1"]) == 2
