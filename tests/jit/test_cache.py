"""Cache tiers and modes, integrity, atomicity and concurrent writers (CPU only: explicit arch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qmoe_rtc.errors import CacheMissError
from qmoe_rtc.jit import SCHEMA_VERSION, clear_memory, disk_entry_dir, get_cubin, unit_key
from qmoe_rtc.kernels import spec_unit
from qmoe_rtc.kernels.dequant import dequant_spec
from qmoe_rtc.settings import knobs

ARCH = "sm_90"
SPEC = spec_unit(dequant_spec("float16", 4, 128, "packed", "float32"))  # a compile unit
REPO = Path(__file__).resolve().parents[2]


def _entry(spec=SPEC):
    d = disk_entry_dir(ARCH)
    metas = sorted(d.glob(f"{spec.name}-*.json"))
    assert len(metas) == 1, metas
    meta = json.loads(metas[0].read_text())
    return metas[0], d / meta["cubin_file"], meta


def test_miss_then_memory_then_disk_hit(cache):
    first = get_cubin(SPEC, ARCH)
    assert first.origin == "compiled"
    assert get_cubin(SPEC, ARCH).origin == "memory"
    clear_memory()
    again = get_cubin(SPEC, ARCH)
    assert again.origin == "disk" and again.cubin == first.cubin and again.lowered == first.lowered
    meta_path, cubin_path, meta = _entry()
    assert meta["key"] == unit_key(SPEC, ARCH) and meta["lowered"] == first.lowered
    assert cubin_path.read_bytes() == first.cubin  # raw cubin on disk
    assert str(cache) in str(meta_path) and f"v{SCHEMA_VERSION}{os.sep}{ARCH}" in str(meta_path)
    assert not list(meta_path.parent.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate_cubin", "flip_cubin_byte", "delete_cubin", "garbage_json",
                                    "truncate_json", "wrong_key", "edit_kernel_symbol", "edit_options", "edit_name",
                                    "edit_created", "drop_digest", "kernels_of_another_unit"])
def test_corrupt_entry_is_detected_and_rebuilt(cache, damage, caplog):
    good = get_cubin(SPEC, ARCH).cubin
    meta_path, cubin_path, meta = _entry()
    if damage == "truncate_cubin":
        cubin_path.write_bytes(good[: len(good) // 2])
    elif damage == "flip_cubin_byte":
        cubin_path.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    elif damage == "delete_cubin":
        cubin_path.unlink()
    elif damage == "garbage_json":
        meta_path.write_bytes(b"\x00not json")
    elif damage == "truncate_json":
        meta_path.write_bytes(meta_path.read_bytes()[:40])
    elif damage == "wrong_key":
        meta_path.write_text(json.dumps({**meta, "key": "0" * 64}))
    elif damage == "edit_kernel_symbol":  # valid JSON, every other field intact: only the digest can tell
        k = sorted(meta["lowered"])[0]
        meta_path.write_text(json.dumps({**meta, "lowered": {**meta["lowered"], k: meta["lowered"][k] + "x"}}))
    elif damage in ("edit_options", "edit_name", "edit_created"):
        field = damage.removeprefix("edit_")
        value = meta[field] + ["-O0"] if field == "options" else meta[field] + "x"
        meta_path.write_text(json.dumps({**meta, field: value}))
    elif damage == "drop_digest":
        meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "digest"}))
    elif damage == "kernels_of_another_unit":  # a consistent entry (digest recomputed) naming other kernels
        from qmoe_rtc.jit import store

        forged = {**meta, "lowered": {"other": "_Z5otherv"}}
        forged["digest"] = store.digest(forged)
        meta_path.write_text(json.dumps(forged))
    clear_memory()
    with caplog.at_level("WARNING", logger="qmoe_rtc"):
        rebuilt = get_cubin(SPEC, ARCH)
    assert rebuilt.origin == "compiled" and rebuilt.cubin == good
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    clear_memory()
    assert get_cubin(SPEC, ARCH).origin == "disk"  # the rebuilt entry is good again


def test_strict_mode(cache):
    with knobs.scope(strict=True):
        with pytest.raises(CacheMissError, match="strict"):
            get_cubin(SPEC, ARCH)
    assert not disk_entry_dir(ARCH).exists() or not any(disk_entry_dir(ARCH).glob("*.json"))
    get_cubin(SPEC, ARCH)  # warm it
    clear_memory()
    with knobs.scope(strict=True):
        assert get_cubin(SPEC, ARCH).origin == "disk"


def test_memory_only_mode_writes_nothing(cache):
    with knobs.scope(no_disk_cache=True):
        assert get_cubin(SPEC, ARCH).origin == "compiled"
        assert get_cubin(SPEC, ARCH).origin == "memory"
    assert not any(cache.rglob("*"))


def test_stale_temp_files_are_swept(cache):
    d = disk_entry_dir(ARCH)
    d.mkdir(parents=True)
    old, fresh = d / ".tmp-old.cubin.x", d / ".tmp-fresh.cubin.y"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    get_cubin(SPEC, ARCH)
    assert not old.exists() and fresh.exists()


def test_dump_knob_writes_source_log_and_ptx(cache):
    with knobs.scope(dump=True):
        get_cubin(SPEC, ARCH)
    meta_path, _, _ = _entry()
    stem = meta_path.with_suffix("")
    assert "dequant_expert.cuh" in Path(f"{stem}.cu").read_text()
    assert ".entry" in Path(f"{stem}.ptx").read_text()
    assert "-arch=sm_90" in Path(f"{stem}.log").read_text()


_WRITER = r"""
import sys, time
from qmoe_rtc.jit import get_cubin, unit_key
from qmoe_rtc.kernels import spec_unit
from qmoe_rtc.kernels.dequant import dequant_spec
start = float(sys.argv[1])
spec = spec_unit(dequant_spec("float16", 4, 128, "packed", "float32"))
unit_key(spec, "sm_90")  # imports + hashing done before the start line
while time.time() < start:
    time.sleep(0.001)
m = get_cubin(spec, "sm_90")
print(m.origin, len(m.cubin))
"""


def test_two_concurrent_writers_leave_one_good_entry(cache):
    env = {**os.environ, "QMOE_RTC_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("QMOE_RTC_STRICT", None)
    env.pop("QMOE_RTC_NO_DISK_CACHE", None)
    start = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split()[0] in ("compiled", "disk")
    _meta, cubin_path, meta = _entry()
    assert not list(disk_entry_dir(ARCH).glob(".tmp-*"))
    clear_memory()
    hit = get_cubin(SPEC, ARCH)
    assert hit.origin == "disk" and len(hit.cubin) == meta["cubin_size"]


def test_loaded_module_memo_is_keyed_by_the_whole_unit(cache, monkeypatch):
    """load_module memoises per (device, unit key): two units that differ only in a define (what a
    tuning knob changes) are two modules, each loaded from its own cubin (CPU: the driver is faked)."""
    import dataclasses

    from qmoe_rtc.jit import cache as jit_cache
    from qmoe_rtc.jit import compiler, load_module

    loaded = []
    monkeypatch.setattr(compiler, "default_arch", lambda device=None: ARCH)
    monkeypatch.setattr(jit_cache.driver, "load_cubin", lambda cubin, dev: loaded.append(cubin) or len(loaded))
    monkeypatch.setattr(jit_cache.driver, "get_function", lambda module, name: (module, name))
    a = SPEC
    b = dataclasses.replace(SPEC, defines=("-DQMOE_UNUSED_TUNING=4",))
    ma, mb = load_module(a, 0), load_module(b, 0)
    (pa,), (pb,) = ma.parts, mb.parts
    assert ma is not mb and pa.key != pb.key
    assert "-DQMOE_UNUSED_TUNING=4" in pb.options and "-DQMOE_UNUSED_TUNING=4" not in pa.options
    assert load_module(a, 0) is ma and load_module(b, 0) is mb and len(loaded) == 2


def test_unit_options_other_than_defines_are_refused():
    import dataclasses

    from qmoe_rtc.errors import CompileError

    with pytest.raises(CompileError, match="only -D"):
        dataclasses.replace(SPEC, defines=("-I/tmp",))
