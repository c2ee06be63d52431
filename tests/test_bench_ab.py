"""tools/knob_ab.py on the CPU: its settings (knob names or environment variables, typed like the
environment) and its --help; the A/B itself runs on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_soak_tool import load_tool

TOOL = Path(__file__).resolve().parent.parent / "tools" / "knob_ab.py"


def _load():
    return load_tool(TOOL, "knob_ab_tool")


def test_settings_take_knob_names_and_variables_typed():
    parse = _load().parse_setting
    assert parse("base") == {}
    assert parse("mma_expert_flow=0") == {"mma_expert_flow": False}
    assert parse("QMOE_RTC_MMA_TARGET_WARPS=6336,mma_deep_split=off") == {"mma_target_warps": 6336,
                                                                          "mma_deep_split": False}


@pytest.mark.parametrize("bad", ["mma_expert_flow", "no_such_knob=1", "QMOE_RTC_NOPE=1"])
def test_a_setting_that_names_no_knob_is_refused(bad):
    with pytest.raises(SystemExit, match="not name=value with a knob"):
        _load().parse_setting(bad)


def test_a_bad_value_is_the_knobs_own_error():
    from qmoe_rtc.errors import KnobError

    with pytest.raises(KnobError, match="QMOE_RTC_MMA_TARGET_WARPS"):
        _load().parse_setting("mma_target_warps=-1")


def test_help_works_without_a_gpu():
    r = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=120,
                       cwd=TOOL.parent.parent, env={"PYTHONPATH": str(TOOL.parent.parent), "PATH": ""})
    assert r.returncode == 0 and "Interleaved A/B" in r.stdout, r.stderr
