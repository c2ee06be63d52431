"""Every knob refuses a value it does not accept when it is read (CPU): a typed
:class:`~qmoe_rtc.errors.KnobError` (a ``QMoEInputError``) whose one-line message names where it was set (its
``QMOE_RTC_*`` variable, or ``QMOE_RTC_TUNE[name]``), the values it accepts and the value given; every default and
every accepted value is taken, from the environment and from ``knobs.scope``; a malformed ``QMOE_RTC_TUNE`` and a
retired variable are refused, naming what to write instead; the knobs' accepted sets agree with what their
consumers accept; the command line refuses a bad knob in one line before any work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_rtc.errors import KnobError, QMoEInputError
from qmoe_rtc.settings import knobs
from qmoe_rtc.settings.knobs import KNOBS

REPO = Path(__file__).resolve().parents[2]
CHECKED = [k for k in KNOBS.values() if k.kind != "path"]  # a path knob takes any path


def _bad_values(knob) -> list[str]:
    """Texts ``knob`` must refuse: for each kind a wrong type, for a knob with a set of values one
    just past it and one that only differs in case."""
    if knob.kind == "bool":
        return ["maybe", "2"]
    if knob.kind == "int":
        bad = ["two", "-1", "1.5"]
        if knob.allowed is not None:
            bad += [str(max(knob.allowed) + 1), "999"]
        return bad
    return ["fast", knob.default.upper(), f" {knob.default}", ""]


def _env_text(knob, value) -> str:
    return ("1" if value else "0") if knob.kind == "bool" else str(value)


def _setenv(monkeypatch, knob, raw: str) -> None:
    """Set ``knob`` to the text ``raw`` where a user would: its variable, or its item of QMOE_RTC_TUNE."""
    if knob.tuning:
        monkeypatch.setenv(knobs.TUNE_ENV, f"{knob.name}={raw}")
    else:
        monkeypatch.setenv(knob.var, raw)


def test_ten_operational_variables_and_one_for_tuning():
    """The environment a user reads about: ten operational variables, every other knob in QMOE_RTC_TUNE."""
    public = sorted(k.var for k in KNOBS.values() if not k.tuning)
    assert len(public) == 10 and all(v.startswith("QMOE_RTC_") for v in public), public
    assert knobs.TUNE_ENV not in public and all(k.env == f"QMOE_RTC_TUNE[{k.name}]" for k in KNOBS.values() if k.tuning)


def test_every_int_and_str_knob_but_the_counts_declares_its_values():
    counts = {"jobs", "mma_target_warps", "mma_prefetch_chunks", "prefill_group"}  # any count >= 0
    assert {k.name for k in KNOBS.values() if k.kind in ("int", "str") and k.allowed is None} == counts
    for k in KNOBS.values():
        if k.allowed is not None:
            assert k.default in k.allowed, k.name


@pytest.mark.parametrize("knob", CHECKED, ids=lambda k: k.env)
def test_a_bad_value_in_the_environment_is_refused_naming_the_variable(monkeypatch, knob):
    for raw in _bad_values(knob):
        _setenv(monkeypatch, knob, raw)
        with pytest.raises(KnobError) as info:
            knobs.get(knob.name)
        e = info.value
        msg = str(e)
        assert isinstance(e, QMoEInputError) and e.name == knob.env and "\n" not in msg, msg
        assert knob.env in msg and repr(raw) in msg and e.expected == knob.accepts() and e.expected in msg, msg
        if knob.allowed is not None:
            assert all(repr(v) in msg for v in knob.allowed), msg


@pytest.mark.parametrize("knob", CHECKED, ids=lambda k: k.env)
def test_a_bad_override_is_refused_when_the_scope_opens(knob):
    bad = {"bool": 3, "int": -1, "str": "fast"}[knob.kind]
    with pytest.raises(KnobError, match=re.escape(knob.env if knob.kind != "bool" else knob.name)):
        with knobs.scope(**{knob.name: bad}):
            pass
    if knob.allowed is not None and knob.kind == "int":
        with pytest.raises(KnobError, match=re.escape(knob.env)):
            with knobs.scope(**{knob.name: max(knob.allowed) + 1}):
                pass


@pytest.mark.parametrize("knob", list(KNOBS.values()), ids=lambda k: k.env)
def test_the_default_and_every_accepted_value_are_taken(monkeypatch, tmp_path, knob):
    monkeypatch.delenv(knob.var or knobs.TUNE_ENV, raising=False)
    assert knobs.get(knob.name) == knob.default
    if knob.kind == "path":
        monkeypatch.setenv(knob.var, str(tmp_path))
        assert knobs.get(knob.name) == tmp_path
        return
    values = {"bool": (False, True), "int": (0, 1, 64)}.get(knob.kind, ()) if knob.allowed is None else knob.allowed
    for v in {knob.default, *values}:
        _setenv(monkeypatch, knob, _env_text(knob, v))
        assert knobs.get(knob.name) == v
        with knobs.scope(**{knob.name: v}):
            assert knobs.get(knob.name) == v
    _setenv(monkeypatch, knob, _env_text(knob, knob.default))
    assert knobs.snapshot()[knob.name] == knob.default


def test_the_accepted_sets_are_the_consumers():
    """The sets in qmoe_rtc/settings/knob_table.py are written there (knobs import nothing below them): they must be the
    values the code reading each knob takes."""
    from qmoe_rtc.jit.compiler import SPLIT_COMPILE_OPTIONS
    from qmoe_rtc.kernels import mma_batched, mma_decode, mma_prefill, wgmma_geometry
    from qmoe_rtc.runtime.layer import PREPACK_SETTINGS

    a = {k.name: k.allowed for k in KNOBS.values()}
    assert set(a["split_compile"]) == set(SPLIT_COMPILE_OPTIONS)
    assert set(a["prepack"]) == set(PREPACK_SETTINGS) - {"given"}  # 'given' is QMoE(prepack=...)'s alone
    assert a["mma_min_blocks"] == a["batched_min_blocks"] == (0, *mma_decode.MIN_BLOCKS_ALLOWED)
    assert a["batched_stages"] == (0, *mma_batched.STAGES_ALLOWED)
    assert a["batched_route_tile"] == (0, *mma_decode.TILE_ROUTES)
    assert a["prefill_route_tile"] == (0, *sorted({*mma_prefill.TILE_ROUTES, *wgmma_geometry.TILE_ROUTES}))


TUNED = {  # family -> the knobs its spec() reads, with a layer of tiled codes (the tensor-core engines)
    "mma_decode": ("mma_stages", "mma_min_blocks"),
    "mma_batched": ("batched_stages", "batched_min_blocks", "batched_row_tiles"),
    "mma_prefill": ("prefill_stages", "prefill_warps", "prefill_min_blocks"),
    "wgmma_prefill": ("prefill_wg_groups", "prefill_wg_stages", "prefill_wg_fc1_blocks", "prefill_wg_inflight",
                      "prefill_wg_ring", "prefill_wg_shrink"),
}


@pytest.mark.parametrize("family", sorted(TUNED))
def test_every_accepted_value_builds_a_spec(family):
    """What the knob accepts, its consumer takes (a layer the engines run tiled, block 128)."""
    from qmoe_rtc.kernels import get_family
    from qmoe_rtc.specialize import Layout, ModelConfig

    cfg = ModelConfig(hidden=2048, inter=768, experts=128, k=8,
                      layout=Layout(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu",
                                    swiglu_fusion=2, tiled=True))
    fam = get_family(family)
    for name in TUNED[family]:
        for v in KNOBS[name].allowed:
            with knobs.scope(**{name: v}):
                fam.spec(cfg)


def test_a_value_the_engine_cannot_use_is_refused_by_the_engine_naming_the_variable():
    """Accepted by the knob, refused where the layer or engine decides: a route tile mma.sync lacks, two row
    tiles for contract-layout codes."""
    from qmoe_rtc.kernels import mma_batched, mma_prefill
    from qmoe_rtc.kernels.arch import ArchSpec

    with knobs.scope(prefill_route_tile=128), pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[prefill_route_tile\].*128"):
        mma_prefill.tile_routes(4096, 8, ArchSpec().tuning)
    with knobs.scope(batched_row_tiles=2), pytest.raises(KnobError, match=re.escape("QMOE_RTC_TUNE[batched_row_tiles]")):
        mma_batched.row_tiles(False, 128)
    with knobs.scope(batched_row_tiles=2):
        assert mma_batched.row_tiles(True, 128) == 2


@pytest.mark.parametrize("var, value, knob", [("QMOE_RTC_TUNE", "prefill_engine=fast", "prefill_engine"),
                                              ("QMOE_RTC_TUNE", "prefill_stages=9", "prefill_stages"),
                                              ("QMOE_RTC_PREPACK", "given", "prepack")])
def test_the_command_line_refuses_a_bad_knob_in_one_line(tmp_path, var, value, knob):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QMOE_RTC_")}
    env.update(PYTHONPATH=str(REPO), QMOE_RTC_CACHE_DIR=str(tmp_path), **{var: value})
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "demo", "--tokens", "1"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    where, given = KNOBS[knob].env, value.rpartition("=")[2] if var == knobs.TUNE_ENV else value
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert where in lines[0] and repr(given) in lines[0] and KNOBS[knob].accepts() in lines[0], lines[0]
    assert r.stdout == ""  # refused before any work
    info = subprocess.run([sys.executable, "-m", "qmoe_rtc", "info"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)
    assert info.returncode == 0 and f"BAD: knob '{where}'" in info.stdout  # the diagnostic says so, and runs


@pytest.mark.parametrize("text, expected", [
    ("prefill_stages", "name=value pairs"),                # no value
    ("prefill_stagez=4", "name=value pairs"),              # not a knob
    ("pdl=0", "its own variable QMOE_RTC_PDL"),            # an operational knob
    ("mma_stages=4,mma_stages=5", "each name once"),
])
def test_a_malformed_tune_variable_is_refused_naming_the_item(monkeypatch, text, expected):
    monkeypatch.setenv(knobs.TUNE_ENV, text)
    with pytest.raises(KnobError) as info:
        knobs.get("mma_stages")
    e = info.value
    assert e.name == knobs.TUNE_ENV and expected in e.expected and repr(text.split(",")[-1]) == e.actual, str(e)
    if "pairs" in expected:
        assert "prefill_stages" in e.expected and "pdl" not in e.expected  # the tuning knobs' names, listed


def test_tune_items_are_read_with_blanks_around_names_and_empty_items_skipped(monkeypatch):
    monkeypatch.setenv(knobs.TUNE_ENV, " mma_stages=4 ,, prefill_engine=wgmma,")
    assert knobs.get("mma_stages") == 4 and knobs.get("prefill_engine") == "wgmma" and knobs.get("prefill_group") == 0
    tuned = {k: v for k, v in knobs.given().items() if k.startswith("QMOE_RTC_TUNE")}
    assert tuned == {"QMOE_RTC_TUNE[mma_stages]": "4 ", "QMOE_RTC_TUNE[prefill_engine]": "wgmma"}


@pytest.mark.parametrize("var", ["QMOE_RTC_MMA_STAGES", "QMOE_RTC_PREFILL_ENGINE", "QMOE_RTC_MMA_ROLL_COPIES",
                                 "QMOE_RTC_PREFILL_WG_VARIANT"])
def test_a_retired_variable_is_refused_naming_what_replaces_it(monkeypatch, var):
    """The per-knob tuning variables and removed knobs are not silently ignored: reading any knob refuses them."""
    monkeypatch.setenv(var, "1")
    with pytest.raises(KnobError) as info:
        knobs.get("pdl")
    e = info.value
    assert e.name == var and e.actual == "'1'" and knobs.RETIRED[var] in e.expected, str(e)
    if "removed" not in knobs.RETIRED[var]:
        assert f"QMOE_RTC_TUNE={var[len('QMOE_RTC_'):].lower()}=" in e.expected
    with knobs.scope(pdl=False):  # an override is the caller's word: no environment read
        assert knobs.get("pdl") is False


def test_bench_ab_settings_take_knob_names_and_operational_variables():
    from qmoe_rtc.bench.ab import parse_setting

    assert parse_setting("mma_stages=4,QMOE_RTC_PDL=0") == {"mma_stages": 4, "pdl": False}
    with pytest.raises(SystemExit, match="QMOE_RTC_MMA_STAGES"):
        parse_setting("QMOE_RTC_MMA_STAGES=4")
