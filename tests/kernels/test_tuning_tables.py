"""Per-arch tuning tables (kernels/tuning/, CPU only): which table a device reads, the default table's fallback and
its one-time warning, and that the plans read the thresholds through the call's device."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from qmoe_rtc.kernels import Problem, get_family, tuning
from qmoe_rtc.kernels.arch import ArchSpec
from qmoe_rtc.kernels.tuning import DEFAULT_TABLE, Tuning, table, table_name
from qmoe_rtc.specialize.presets import PRESETS


def test_each_device_reads_its_arch_table():
    """sm_90 and sm_90a read sm_90's table; an unknown device and an arch without a table read the default one,
    whose values are sm_90's (measured there) under its own name."""
    assert table_name(ArchSpec("sm_90")) == table_name(ArchSpec("sm_90a")) == "sm_90"
    assert table_name(ArchSpec()) == table_name(ArchSpec("sm_86")) == table_name(ArchSpec("sm_120")) == DEFAULT_TABLE
    sm90, default = table(ArchSpec("sm_90a")), table(ArchSpec())
    assert sm90.name == "sm_90" and default.name == DEFAULT_TABLE and "sm_90" in default.measured_on
    assert dataclasses.replace(default, name="sm_90") == sm90
    assert ArchSpec("sm_90a").tuning is sm90
    assert all(f.name in ("name", "measured_on", "knobs") or getattr(sm90, f.name) for f in dataclasses.fields(Tuning))


def test_an_arch_without_a_table_warns_once(caplog):
    """The default table stands in for an arch that has none, with one WARNING per arch naming it and where the
    values were measured; an unknown device (warm tool, CPU) takes it silently."""
    tuning._for_family.cache_clear()
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        for _ in range(3):
            assert table(ArchSpec("sm_89")).name == DEFAULT_TABLE
            assert table(ArchSpec()).name == DEFAULT_TABLE
            assert table(ArchSpec("sm_90a")).name == "sm_90"
    said = [r.getMessage() for r in caplog.records if "tuning table" in r.getMessage()]
    assert len(said) == 1 and "sm_89" in said[0] and "measured on sm_90" in said[0], said


def test_plans_read_the_thresholds_of_the_calls_device(monkeypatch):
    """A threshold read at plan time comes from the call's device's table: the wgmma route tile of
    gpt-oss-120b at 512 tokens (16 routes an expert) follows sm_90's wgmma_narrow_routes."""
    cfg = PRESETS["gpt-oss-120b"].config(dtype="bfloat16")
    fam = get_family("wgmma_prefill")
    spec = fam.spec(cfg)
    p = Problem(rows=512, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype="bfloat16", arch="sm_90a", sms=132)
    assert fam.configure(spec, p).br == 32
    narrow = dataclasses.replace(table(ArchSpec("sm_90a")), wgmma_narrow_routes=8)
    monkeypatch.setattr(ArchSpec, "tuning", property(lambda self: narrow))
    assert fam.configure(spec, p).br == 64


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_90a", ""])
def test_every_arch_resolves_a_complete_table(target):
    t = ArchSpec(target).tuning
    assert set(t.batched_max_routes) == set(t.batched_max_routes_many) == {1, 2}
    assert t.wgmma_narrow_routes < t.wgmma_tile64_routes < t.wgmma_tile128_routes


def test_knob_defaults_come_from_the_arch_table_and_tune_overrides(monkeypatch):
    """An arch knob (kernels/tuning ARCH_KNOBS) unset reads its arch table's measured default, QMOE_RTC_TUNE and a
    scope override it; a table must give each arch knob a value the knob takes."""
    from qmoe_rtc.errors import KnobError, QMoEUnsupportedError
    from qmoe_rtc.kernels.tuning import ARCH_KNOBS, knob
    from qmoe_rtc.settings import knobs

    sm90 = ArchSpec("sm_90a")
    assert set(table(sm90).knobs) == set(ARCH_KNOBS) and knob("mma_one_wave", sm90) is True
    off = dataclasses.replace(table(sm90), knobs={**table(sm90).knobs, "mma_one_wave": False})
    monkeypatch.setattr(tuning, "table", lambda device: off)
    assert knob("mma_one_wave", sm90) is False
    monkeypatch.setenv("QMOE_RTC_TUNE", "mma_one_wave=1")
    assert knob("mma_one_wave", sm90) is True
    with knobs.scope(mma_one_wave=False):
        assert knob("mma_one_wave", sm90) is False
    with pytest.raises(QMoEUnsupportedError, match="missing"):
        dataclasses.replace(off, knobs={})
    with pytest.raises(KnobError):
        dataclasses.replace(off, knobs={**off.knobs, "prefill_wg_overlap": "sometimes"})


def _ab_rows():
    """Fake `bench ab` rows: two shapes at two token counts, settings base / one_wave off / overlap off."""
    us = {("mixtral-8x7b", 1): (100.0, 97.0, 101.0), ("mixtral-8x7b", 8): (300.0, 310.0, 299.0),
          ("qwen3-30b-a3b", 1): (30.0, 29.5, 30.2), ("qwen3-30b-a3b", 8): (80.0, 81.0, 80.5)}
    settings = ({}, {"mma_one_wave": False}, {"prefill_wg_overlap": False, "mma_target_warps": 3000})
    return [dict(shape=s, T=t, setting=st, median_us=m[i], engine="x") for (s, t), m in us.items()
            for i, st in enumerate(settings)]


def test_bench_ab_writes_a_tuning_table(tmp_path):
    """`bench ab --write-table`'s writer (a fake timing result, no GPU): the fastest value of each varied knob per
    (shape, tokens) in MEASURED, the table's knobs the values fastest at the most points, a module that loads as a
    table of the arch."""
    import importlib.util

    from qmoe_rtc.bench.tune_table import fastest, table_source
    from qmoe_rtc.errors import QMoEInputError

    defaults = {"mma_one_wave": True, "prefill_wg_overlap": True, "mma_target_warps": 0}
    got = fastest(_ab_rows(), defaults)
    assert got["mma_one_wave"] == {("mixtral-8x7b", 1): (False, 97.0), ("mixtral-8x7b", 8): (True, 299.0),
                                   ("qwen3-30b-a3b", 1): (False, 29.5), ("qwen3-30b-a3b", 8): (True, 80.0)}
    assert got["mma_target_warps"][("mixtral-8x7b", 8)] == (3000, 299.0)
    path = tmp_path / "sm_89.py"
    path.write_text(table_source(_ab_rows(), defaults, "sm_89", "NVIDIA L4"))
    spec = importlib.util.spec_from_file_location("qmoe_rtc.kernels.tuning.sm_89_written", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = mod.TABLE
    assert isinstance(t, Tuning) and t.name == "sm_89" and "NVIDIA L4" in t.measured_on
    # one_wave: off fastest at 2 points (126.5 us), on at 2 (380.0): off; overlap: off fastest at 1, on at 3: on
    assert t.knobs == {"mma_one_wave": False, "mma_deep_split": True, "prefill_wg_overlap": True}
    assert mod.MEASURED["mma_target_warps"][("mixtral-8x7b", 8)] == (3000, 299.0)
    base = table(ArchSpec())  # the thresholds it does not measure: the default table's
    assert all(getattr(t, f.name) == getattr(base, f.name) for f in dataclasses.fields(Tuning)
               if f.name not in ("name", "measured_on", "knobs"))
    with pytest.raises(QMoEInputError, match="varied"):
        table_source([r for r in _ab_rows() if not r["setting"]], defaults, "sm_89", "NVIDIA L4")
    with pytest.raises(QMoEInputError, match="family"):
        table_source(_ab_rows(), defaults, "ampere", "NVIDIA L4")
