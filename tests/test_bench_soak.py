"""tools/soak.py on the CPU: its --help, import safety and its verdict (the soak itself runs on a GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOAK = REPO / "tools" / "soak.py"


def load_tool(path: Path, name: str):
    """A script under tools/ loaded as a module (tools/ is not a package); also used by other tool tests."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load():
    return load_tool(SOAK, "soak_tool")


def test_help_works_without_a_gpu_and_imports_nothing_heavy():
    r = subprocess.run([sys.executable, str(SOAK), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for opt in ("--replays", "--eager", "--every", "--max-batch", "--tol-device-mib", "--json"):
        assert opt in r.stdout
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('s', {str(SOAK)!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print([k for k in sys.modules if k.startswith(('cupy', 'qmoe_rtc', 'numpy'))])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def _samples(phase, n, slope=0.0, metric="device_mib"):
    base = dict(device_mib=1000.0, pool_used_mib=300.0, pool_held_mib=400.0, rss_mib=900.0, objects=50_000)
    return [dict(base, phase=phase, iter=i, **{metric: base[metric] + slope * i}) for i in range(n)]


def test_verdict_flat_and_growing():
    soak = _load()
    flat = {"graph": soak.growth(_samples("graph", 40)), "eager": soak.growth(_samples("eager", 40, 0.01))}
    assert soak.verdict(flat, 8, 16, 2000) == (True, [])
    grow = {"graph": soak.growth(_samples("graph", 40, 1.0, "rss_mib"))}
    ok, over = soak.verdict(grow, 8, 16, 2000)
    assert not ok and len(over) == 1 and "rss_mib" in over[0]


def test_without_a_gpu_it_says_so(request):
    from conftest import gpu_available

    if gpu_available()[0]:
        pytest.skip("a GPU is present: the soak would run")
    assert _load().main(["--replays", "1", "--eager", "1"]) == 2
