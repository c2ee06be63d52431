"""Per-arch tuning tables (kernels/tuning/, CPU only): which table a device reads, the default table's fallback and
its one-time warning, and that the plans read the thresholds through the call's device."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from qmoe_rtc.kernels import Problem, get_family, tuning
from qmoe_rtc.kernels.arch import ArchSpec
from qmoe_rtc.kernels.tuning import DEFAULT_TABLE, Tuning, table, table_name
from qmoe_rtc.presets import PRESETS


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
