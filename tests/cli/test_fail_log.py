"""The GPU runs' failure log (tests/support/fail_log.py, set by tools/device_check.sh): a failed test is written down the
moment it fails, its id, phase and the end of its traceback; passes, unset logs and xdist workers write nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from support import fail_log


def _report(failed: bool, nodeid="tests/kernels/test_x_gpu.py::test_y[7]", text="E   AssertionError: 3 != 4"):
    return SimpleNamespace(failed=failed, nodeid=nodeid, when="call", longrepr=text)


def test_a_failure_is_appended_at_once(tmp_path, monkeypatch):
    log = tmp_path / "failed.txt"
    monkeypatch.setenv(fail_log.ENV, str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert fail_log.record(_report(True))
    assert not fail_log.record(_report(False, nodeid="tests/a.py::test_ok"))
    assert fail_log.record(_report(True, nodeid="tests/b.py::test_z", text="x" * 5000 + "END"))
    text = log.read_text()
    assert text.startswith("FAILED tests/kernels/test_x_gpu.py::test_y[7] (call)\nE   AssertionError: 3 != 4\n")
    assert "test_ok" not in text and "FAILED tests/b.py::test_z (call)" in text and text.rstrip().endswith("END")
    assert len(text) < 4300  # the long traceback kept to its end


@pytest.mark.parametrize("env", [{}, {"PYTEST_XDIST_WORKER": "gw3"}])
def test_nothing_is_written_without_a_log_or_in_a_worker(tmp_path, monkeypatch, env):
    log = tmp_path / "failed.txt"
    monkeypatch.delenv(fail_log.ENV, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    if env:
        monkeypatch.setenv(fail_log.ENV, str(log))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    assert not fail_log.record(_report(True))
    assert not log.exists()


def test_the_conftest_hook_records(tmp_path, monkeypatch, request):
    """tests/conftest.py's pytest_runtest_logreport, registered as a plugin of this session, hands reports to record."""
    log = tmp_path / "failed.txt"
    monkeypatch.setenv(fail_log.ENV, str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    tests_dir = Path(__file__).resolve().parents[1]
    (conftest,) = [p for p in request.config.pluginmanager.get_plugins()
                   if Path(getattr(p, "__file__", "") or "/").resolve() == tests_dir / "conftest.py"]
    conftest.pytest_runtest_logreport(_report(True, nodeid="tests/c.py::test_hook"))
    assert "FAILED tests/c.py::test_hook (call)" in log.read_text()
