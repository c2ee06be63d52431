"""The disk cache under crowds, kills and bad locations (CPU only: explicit arch, tiny modules).

- N = 4 warm processes on one empty directory compile each entry once and leave no orphan file;
- a warm run killed with SIGKILL (``--jobs 2``) leaves no live worker and no broken entry;
- an untrusted location (group/other-writable, another user's) is neither read nor written;
- one rule for a location that cannot store: one WARNING, memory only; warm refuses it (exit 2).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qmoe_rtc.cli import warm
from qmoe_rtc.jit import check_stored, clear_memory, disk_entry_dir, get_cubin, store
from qmoe_rtc.kernels import spec_unit
from qmoe_rtc.kernels.dequant import dequant_spec
from qmoe_rtc.settings import knobs

ARCH = "sm_80"
REPO = Path(__file__).resolve().parents[2]
UNIT = spec_unit(dequant_spec("float16", 4, 128, "packed", "float32"))
OTHER = spec_unit(dequant_spec("float16", 2, 0, "none", "float32"))
#: A tiny model whose plan is three quick modules (sizes not multiples of 32: route + the SIMT engines), float16.
TINY = ["--hidden", "40", "--inter", "40", "--experts", "4", "--k", "2", "--bits", "3", "--arch", ARCH, "--no-progress"]


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QMOE_RTC_")}
    env.update(PYTHONPATH=str(REPO), QMOE_RTC_CACHE_DIR=str(cache))
    return env


def _files(d: Path) -> dict[str, list[str]]:
    names = sorted(os.listdir(d)) if d.is_dir() else []
    return {"json": [n for n in names if n.endswith(".json")], "cubin": [n for n in names if n.endswith(".cubin")],
            "other": [n for n in names if not n.endswith((".json", ".cubin"))]}


def _planned() -> list:
    return [spec for spec, _ in warm.plan(warm._configs(warm.build_parser().parse_args(TINY)), [ARCH])]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "cache" in r.getMessage()]


# ---- crowds and kills --------------------------------------------------------------------------------

def test_four_concurrent_warm_processes_compile_each_entry_once(tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "qmoe_rtc", "warm", *TINY, "--jobs", "1"]
    procs = [subprocess.Popen(cmd, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    n = len(_planned())
    stored = hits = 0
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        lines = [line for line in out.splitlines() if line.startswith(ARCH + " ")]
        stored += sum(" stored " in line for line in lines)
        hits += sum(" hit " in line for line in lines)
    assert (stored, hits) == (n, 3 * n)  # each entry compiled by exactly one process; the others loaded it
    files = _files(cache / "v3" / ARCH)
    assert len(files["json"]) == len(files["cubin"]) == n and files["other"] == []  # no orphans, no lock files


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its parent's reaping is missing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_warm_run_leaves_no_workers_and_no_broken_entry(tmp_path):
    cache = tmp_path / "cache"
    argv = [*TINY, "--dtype", "float16,bfloat16"]
    proc = subprocess.Popen([sys.executable, "-m", "qmoe_rtc", "warm", *argv, "--jobs", "2"], env=_env(cache),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = proc.stdout.readline()  # one module is done: the workers are running and more is queued
    assert first.startswith(ARCH + " "), first
    workers = _children(proc.pid)
    assert workers, "the warm run has no worker processes"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if _alive(w)], "workers outlived the killed warm run"
    d = cache / "v3" / ARCH
    done = {json.loads((d / n).read_text())["name"] for n in _files(d)["json"]}
    with knobs.scope(cache_dir=cache):
        for spec in _planned() + [s for s, _ in warm.plan(warm._configs(warm.build_parser().parse_args(argv)), [ARCH])]:
            if spec.name in done:
                check_stored(spec_unit(spec), ARCH)  # every committed entry is whole
        assert warm.main([*argv, "--jobs", "1"]) == 0  # a rerun completes it ...
    assert _files(d)["other"] == []  # ... and sweeps what the killed run left


def test_warm_in_a_process_that_built_the_modules_elsewhere_stores_them(tmp_path):
    """A warm run with --jobs 1 runs in this process: modules it already holds in memory (built under another
    cache directory) must still be written to the current one, not reported as hits and left absent."""
    clear_memory()
    with knobs.scope(cache_dir=tmp_path / "first"):
        for spec in _planned():
            get_cubin(spec_unit(spec), ARCH)
    second = tmp_path / "second"
    with knobs.scope(cache_dir=second):
        assert warm.main([*TINY, "--jobs", "1"]) == 0
        for spec in _planned():
            check_stored(spec_unit(spec), ARCH)
        assert len(_files(disk_entry_dir(ARCH))["json"]) == len(_planned())


# ---- trust ------------------------------------------------------------------------------------------

def test_directories_are_created_0700_and_files_0600(cache):
    root = cache / "deep" / "cache"
    with knobs.scope(cache_dir=root):
        get_cubin(UNIT, ARCH)
        d = disk_entry_dir(ARCH)
    for p in (root, root / "v3", d):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    for p in d.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


@pytest.mark.parametrize("where", ["root", "arch_dir", "entry_json", "entry_cubin"])
def test_group_or_other_writable_location_is_not_trusted(cache, caplog, where):
    get_cubin(UNIT, ARCH)
    d = disk_entry_dir(ARCH)
    target = {"root": cache, "arch_dir": d, "entry_json": next(d.glob("*.json")),
              "entry_cubin": next(d.glob("*.cubin"))}[where]
    target.chmod(stat.S_IMODE(target.stat().st_mode) | stat.S_IWGRP | stat.S_IWOTH)
    before = _files(d)
    clear_memory()
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        assert get_cubin(UNIT, ARCH).origin == "compiled"  # never loaded from there
        assert get_cubin(OTHER, ARCH).origin == "compiled"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "writable by group or others" in warned[0] and str(cache) in warned[0], warned
    assert _files(d) == before  # nothing written there either


def test_entry_owned_by_another_user_is_not_trusted(cache, caplog, monkeypatch):
    get_cubin(UNIT, ARCH)
    meta = next(disk_entry_dir(ARCH).glob("*.json"))
    if os.geteuid() == 0:
        os.chown(meta, 12345, -1)
        owner = 12345
    else:  # the files are ours: become someone else for the check (cannot give a file away without root)
        owner = os.geteuid()
        monkeypatch.setattr(store, "_euid", lambda: owner + 1)
    clear_memory()
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        assert get_cubin(UNIT, ARCH).origin == "compiled"
    assert any(f"owned by uid {owner}" in m for m in _warnings(caplog)), _warnings(caplog)


# ---- locations that cannot store ----------------------------------------------------------------------

def test_cache_path_that_is_a_file_warns_once_and_works_from_memory(tmp_path, caplog, capsys):
    clear_memory()
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with knobs.scope(cache_dir=f), caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        assert get_cubin(UNIT, ARCH).origin == "compiled"
        assert get_cubin(OTHER, ARCH).origin == "compiled"
        warned = _warnings(caplog)
        assert len(warned) == 1 and str(f) in warned[0] and "not a directory" in warned[0], warned
        assert warm.main([*TINY, "--jobs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot store" in err[0] and "not a directory" in err[0], err
    clear_memory()


def test_unwritable_directory_warns_once_and_still_serves_what_is_there(cache, caplog, capsys, monkeypatch):
    get_cubin(UNIT, ARCH)  # a pre-warmed entry
    clear_memory()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(cache)) else real(p, mode, **kw))
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        with knobs.scope(strict=True):
            assert get_cubin(UNIT, ARCH).origin == "disk"  # read-only pre-warmed cache: strict mode works
        assert get_cubin(OTHER, ARCH).origin == "compiled"  # not stored: memory only
    warned = _warnings(caplog)
    assert len(warned) == 1 and "not writable" in warned[0], warned
    assert warm.main([*TINY, "--jobs", "1"]) == 2 and "not writable" in capsys.readouterr().err


def test_full_disk_warns_once_leaves_nothing_and_fails_warm(cache, caplog, capsys, monkeypatch):
    calls = []

    def full(path, data):
        calls.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(store, "_atomic_write", full)
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        assert get_cubin(UNIT, ARCH).origin == "compiled"
        assert get_cubin(OTHER, ARCH).origin == "compiled"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "No space left" in warned[0] and len(calls) == 1, warned
    assert _files(disk_entry_dir(ARCH)) == {"json": [], "cubin": [], "other": []}
    clear_memory()
    assert warm.main([*TINY, "--jobs", "1"]) == 1  # compiled, but not stored: warm says so
    out = capsys.readouterr().out
    assert f"0 stored, 0 hits, {len(_planned())} failed" in out and "not stored" in out


def test_warm_refuses_memory_only_mode(cache, capsys):
    with knobs.scope(no_disk_cache=True):
        assert warm.main([*TINY, "--jobs", "1"]) == 2
    assert "QMOE_RTC_NO_DISK_CACHE" in capsys.readouterr().err


# ---- what dead writers leave --------------------------------------------------------------------------

def test_orphans_are_swept_unless_their_writer_holds_the_lock(cache):
    get_cubin(UNIT, ARCH)
    d = disk_entry_dir(ARCH)
    busy, dead = "dequant_busy-" + "a" * 16, "dequant_dead-" + "b" * 16
    for stem in (busy, dead):
        (d / f".tmp-{stem}.json.x1").write_bytes(b"half")
    (d / f"{dead}.lock").write_bytes(b"")
    fd = store._try_lock(d / f"{busy}.lock", 0.0)  # a live writer of `busy`
    try:
        store.sweep(d)
        left = _files(d)["other"]
        assert left == [f".tmp-{busy}.json.x1", f"{busy}.lock"], left
    finally:
        store._unlock(d / f"{busy}.lock", fd)
    store.sweep(d)
    assert _files(d)["other"] == []
    clear_memory()
    assert get_cubin(UNIT, ARCH).origin == "disk"
