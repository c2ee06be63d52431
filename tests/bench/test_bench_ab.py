"""``python -m qmoe_rtc bench ab`` on the CPU: its settings (knob names or environment variables, typed like
the environment), its grids and its --help; the A/B itself runs on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_rtc.bench import ab

REPO = Path(__file__).resolve().parents[2]


def test_settings_take_knob_names_and_variables_typed():
    parse = ab.parse_setting
    assert parse("base") == {}
    assert parse("mma_expert_flow=0") == {"mma_expert_flow": False}
    assert parse("mma_target_warps=6336,mma_deep_split=off,QMOE_RTC_PDL=0") == {"mma_target_warps": 6336,
                                                                                "mma_deep_split": False, "pdl": False}
    assert parse("decode_max_routes=0") == {"decode_max_routes": 0}


@pytest.mark.parametrize("bad", ["mma_expert_flow", "no_such_knob=1", "QMOE_RTC_NOPE=1", "QMOE_RTC_MMA_TARGET_WARPS=1"])
def test_a_setting_that_names_no_knob_is_refused(bad):
    with pytest.raises(SystemExit, match="not name=value with a knob"):
        ab.parse_setting(bad)


def test_a_bad_value_is_the_knobs_own_error():
    from qmoe_rtc.errors import KnobError

    with pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[mma_target_warps\]"):
        ab.parse_setting("mma_target_warps=-1")


def test_grids_give_one_setting_per_combination():
    assert ab.grid_settings([]) == []
    assert ab.grid_settings(["decode_max_routes=0", "mma_expert_flow=0,1"]) == [
        "decode_max_routes=0,mma_expert_flow=0", "decode_max_routes=0,mma_expert_flow=1"]
    got = [ab.parse_setting(t) for t in ab.grid_settings(["mma_expert_flow=0,1", "mma_deep_split=on,off"])]
    assert len(got) == 4 and got[0] == {"mma_expert_flow": False, "mma_deep_split": True}
    with pytest.raises(SystemExit, match="expected NAME=V1"):
        ab.grid_settings(["mma_expert_flow"])


def test_no_setting_at_all_is_refused_before_the_gpu_is_asked():
    with pytest.raises(SystemExit, match="expected at least one setting"):
        ab.main([])


def test_help_works_without_a_gpu():
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "bench", "ab", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert r.returncode == 0 and "Interleaved A/B" in r.stdout and "--grid" in r.stdout, r.stderr


def test_presets_and_tokens_are_checked_before_the_gpu_is_asked(capsys):
    from qmoe_rtc.bench import crossover

    a = ab.build_parser().parse_args(["base", "--preset", "mixtral-8x7b,gpt-oss-120b", "--tokens", "1,8"])
    assert a.preset == ["mixtral-8x7b", "gpt-oss-120b"] and a.tokens == [1, 8]
    assert crossover.build_parser().parse_args([]).tokens == [1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512]
    for parser, argv, says in ((ab.build_parser(), ["base", "--preset", "nope"], "unknown bench shape nope"),
                               (crossover.build_parser(), ["--tokens", "0"], "--tokens")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_crossover_rows_and_the_literal_engine_choice_holds():
    """bench crossover's point row (engines that did not run are None; the default's time over the fastest) and the
    sweep printed as kernels/engine_choice.MEASURED's literal, which reads back as the same data."""
    import ast

    from qmoe_rtc.bench import crossover

    row, best, ratio = crossover.point_row({"decode": None, "batched": 41.2, "wgmma": 45.4}, "batched")
    assert row == (None, 41.2, 45.4) and best == "batched" and ratio == 1.0
    assert crossover.point_row({"decode": 44.0, "batched": 41.2, "wgmma": None}, "decode")[2] == pytest.approx(44.0 / 41.2)
    assert crossover.point_row({"decode": 44.0, "batched": 41.2, "wgmma": None}, "prefill-mma")[2] == 0.0
    sweep = {"ort-2048": {1: (24.1, 27.5, 41.2), 512: (None, 273.6, 108.4)}}
    assert ast.literal_eval(crossover.measured_literal(sweep)) == sweep
