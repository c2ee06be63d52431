"""Failures written down as they happen (``QMOE_RTC_FAIL_LOG=path``): a GPU run on a lent machine is cut at its time
limit, and pytest prints which tests failed only at the end of a session, so a cut run says "F" and nothing more. With
the variable set, each failed test's id, phase and traceback (its last 4000 characters) are appended to ``path`` the
moment it fails (by the xdist controller only, where xdist runs the tests in workers). ``tests/conftest.py`` calls
:func:`record` from its ``pytest_runtest_logreport`` hook; ``tools/device_check.sh`` sets the variable."""

from __future__ import annotations

import os

ENV = "QMOE_RTC_FAIL_LOG"
MAX_CHARS = 4000


def record(report) -> bool:
    """Append ``report`` (a pytest TestReport) to the log if it failed and a log is set; whether it was written."""
    path = os.environ.get(ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    text = str(report.longrepr or "")[-MAX_CHARS:]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"FAILED {report.nodeid} ({report.when})\n{text}\n\n")
    return True
