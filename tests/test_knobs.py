"""Every QMOE_RTC_* knob refuses a value it does not accept when it is read (CPU): a typed
:class:`~qmoe_rtc.errors.KnobError` (a ``QMoEInputError``) whose one-line message names the variable,
the values it accepts and the value given; every default and every accepted value is taken, from the
environment and from ``knobs.scope``; the knobs' accepted sets agree with what their consumers accept;
the command line refuses a bad knob in one line before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_rtc import knobs
from qmoe_rtc.errors import KnobError, QMoEInputError
from qmoe_rtc.knobs import KNOBS

REPO = Path(__file__).resolve().parent.parent
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


def test_every_int_and_str_knob_but_the_counts_declares_its_values():
    counts = {"jobs", "mma_target_warps", "mma_prefetch_chunks", "prefill_group"}  # any count >= 0
    assert {k.name for k in KNOBS.values() if k.kind in ("int", "str") and k.allowed is None} == counts
    for k in KNOBS.values():
        if k.allowed is not None:
            assert k.default in k.allowed, k.name


@pytest.mark.parametrize("knob", CHECKED, ids=lambda k: k.env)
def test_a_bad_value_in_the_environment_is_refused_naming_the_variable(monkeypatch, knob):
    for raw in _bad_values(knob):
        monkeypatch.setenv(knob.env, raw)
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
    with pytest.raises(KnobError, match=knob.env if knob.kind != "bool" else knob.name):
        with knobs.scope(**{knob.name: bad}):
            pass
    if knob.allowed is not None and knob.kind == "int":
        with pytest.raises(KnobError, match=knob.env):
            with knobs.scope(**{knob.name: max(knob.allowed) + 1}):
                pass


@pytest.mark.parametrize("knob", list(KNOBS.values()), ids=lambda k: k.env)
def test_the_default_and_every_accepted_value_are_taken(monkeypatch, tmp_path, knob):
    monkeypatch.delenv(knob.env, raising=False)
    assert knobs.get(knob.name) == knob.default
    if knob.kind == "path":
        monkeypatch.setenv(knob.env, str(tmp_path))
        assert knobs.get(knob.name) == tmp_path
        return
    values = {"bool": (False, True), "int": (0, 1, 64)}.get(knob.kind, ()) if knob.allowed is None else knob.allowed
    for v in {knob.default, *values}:
        monkeypatch.setenv(knob.env, _env_text(knob, v))
        assert knobs.get(knob.name) == v
        with knobs.scope(**{knob.name: v}):
            assert knobs.get(knob.name) == v
    monkeypatch.setenv(knob.env, _env_text(knob, knob.default))
    assert knobs.snapshot()[knob.name] == knob.default


def test_the_accepted_sets_are_the_consumers():
    """The sets in knobs.py are written there (knobs import nothing below them): they must be the
    values the code reading each knob takes."""
    from qmoe_rtc.jit.compiler import SPLIT_COMPILE_OPTIONS
    from qmoe_rtc.kernels import mma_decode, mma_prefill, wgmma_geometry
    from qmoe_rtc.runtime.layer import PREPACK_SETTINGS

    a = {k.name: k.allowed for k in KNOBS.values()}
    assert set(a["split_compile"]) == set(SPLIT_COMPILE_OPTIONS)
    assert set(a["prefill_wg_variant"]) == {"auto", *wgmma_geometry.VARIANTS}
    assert set(a["prepack"]) == set(PREPACK_SETTINGS) - {"given"}  # 'given' is QMoE(prepack=...)'s alone
    assert a["mma_min_blocks"] == (0, *mma_decode.MIN_BLOCKS_ALLOWED)
    assert a["batched_route_tile"] == (0, *mma_decode.TILE_ROUTES)
    assert a["prefill_route_tile"] == (0, *sorted({*mma_prefill.TILE_ROUTES, *wgmma_geometry.TILE_ROUTES}))


TUNED = {  # family -> the knobs its spec() reads, with a layer of tiled codes (the tensor-core engines)
    "mma_decode": ("mma_stages", "mma_min_blocks"),
    "mma_batched": ("mma_stages", "mma_min_blocks", "batched_row_tiles"),
    "mma_prefill": ("prefill_stages", "prefill_warps", "prefill_min_blocks"),
    "wgmma_prefill": ("prefill_wg_groups", "prefill_wg_stages", "prefill_wg_fc1_blocks", "prefill_wg_inflight",
                      "prefill_wg_ring", "prefill_wg_shrink", "prefill_ws_mw", "prefill_wg_variant"),
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
            with knobs.scope(**{name: v}, **({"prefill_wg_variant": "ws"} if name == "prefill_ws_mw" else {})):
                fam.spec(cfg)


def test_a_value_the_engine_cannot_use_is_refused_by_the_engine_naming_the_variable():
    """Accepted by the knob, refused where the layer or engine decides: a route tile mma.sync lacks, two row
    tiles for contract-layout codes."""
    from qmoe_rtc.kernels import mma_batched, mma_prefill

    with knobs.scope(prefill_route_tile=128), pytest.raises(KnobError, match="QMOE_RTC_PREFILL_ROUTE_TILE.*128"):
        mma_prefill.tile_routes(4096, 8)
    with knobs.scope(batched_row_tiles=2), pytest.raises(KnobError, match="QMOE_RTC_BATCHED_ROW_TILES"):
        mma_batched.row_tiles(False, 128)
    with knobs.scope(batched_row_tiles=2):
        assert mma_batched.row_tiles(True, 128) == 2


@pytest.mark.parametrize("var, value", [("QMOE_RTC_PREFILL_ENGINE", "fast"), ("QMOE_RTC_PREFILL_STAGES", "9"),
                                        ("QMOE_RTC_PREPACK", "given")])
def test_the_command_line_refuses_a_bad_knob_in_one_line(tmp_path, var, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QMOE_RTC_")}
    env.update(PYTHONPATH=str(REPO), QMOE_RTC_CACHE_DIR=str(tmp_path), **{var: value})
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "demo", "--tokens", "1"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert var in lines[0] and repr(value) in lines[0] and KNOBS_BY_ENV[var].accepts() in lines[0], lines[0]
    assert r.stdout == ""  # refused before any work
    info = subprocess.run([sys.executable, "-m", "qmoe_rtc", "info"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)
    assert info.returncode == 0 and f"BAD: knob '{var}'" in info.stdout  # the diagnostic says so, and runs


KNOBS_BY_ENV = {k.env: k for k in KNOBS.values()}
