"""Two-tier kernel cache: in-memory (compiled bytes per process, loaded modules per device) and
on-disk (raw ``.cubin`` + JSON metadata), both keyed by the compile unit's key (:func:`unit_key`).

On-disk entry, in ``<cache_dir>/v<SCHEMA>/<arch>/``::

    <module-name>-<key16>.json                 metadata, written LAST: the commit marker
    <module-name>-<key16>-<sha12>.cubin        raw SASS (``cuobjdump -sass`` works on it)

The JSON names its cubin and carries the cubin's sha256 and size; a reader that finds a missing,
short or altered cubin, or unreadable JSON, or a key mismatch, treats the entry as a miss and
rebuilds it (never loads it). The cubin file name contains its own checksum, so two processes
writing the same entry never overwrite each other's cubin with different bytes; the JSON replace
is atomic, so a reader sees one writer's complete pair. Every file is written temp -> fsync ->
``os.replace``; temp files older than an hour are swept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from .. import knobs
from ..errors import CacheCorruptError, CacheMissError, DeviceError
from . import compiler, driver
from .compiler import CompiledModule
from .launch import Kernel
from .unit import SCHEMA_VERSION, CompileUnit, unit_key

__all__ = ["LoadedModule", "clear_memory", "disk_entry_dir", "entry_stem", "get_cubin", "load_module"]

log = logging.getLogger("qmoe_rtc")

_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0

_lock = threading.RLock()
_compiled: dict[str, CompiledModule] = {}  # unit key -> module (process memory tier)
_loaded: dict[tuple[int, str], LoadedModule] = {}  # (device id, unit key) -> loaded module


# ---------------------------------------------------------------------------------------------
# disk tier

def disk_entry_dir(arch: str) -> Path:
    return knobs.cache_dir() / f"v{SCHEMA_VERSION}" / arch


def entry_stem(name: str, key: str) -> str:
    return f"{name}-{key[:16]}"


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _sweep_tmp(d: Path) -> None:
    now = time.time()
    for p in d.glob(_TMP_PREFIX + "*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                p.unlink()
        except OSError:
            pass


def _read_entry(d: Path, stem: str, key: str) -> CompiledModule | None:
    """The committed entry, or None on a miss; raises CacheCorruptError for a damaged entry."""
    meta_path = d / f"{stem}.json"
    try:
        raw = meta_path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        meta = json.loads(raw)
        if meta.get("schema") != SCHEMA_VERSION or meta.get("key") != key:
            raise CacheCorruptError(f"{meta_path}: schema/key mismatch")
        cubin_path = d / meta["cubin_file"]
        if Path(meta["cubin_file"]).name != meta["cubin_file"]:
            raise CacheCorruptError(f"{meta_path}: bad cubin file name {meta['cubin_file']!r}")
        want_sha, want_size = meta["cubin_sha256"], int(meta["cubin_size"])
        lowered = dict(meta["lowered"])
    except CacheCorruptError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CacheCorruptError(f"{meta_path}: unreadable metadata ({exc})") from None
    try:
        cubin = cubin_path.read_bytes()
    except FileNotFoundError:
        raise CacheCorruptError(f"{meta_path}: cubin {cubin_path.name} missing") from None
    if len(cubin) != want_size or hashlib.sha256(cubin).hexdigest() != want_sha:
        raise CacheCorruptError(f"{cubin_path}: checksum mismatch (size {len(cubin)}, expected {want_size})")
    return CompiledModule(name=meta["name"], family=meta["family"], key=key, arch=meta["arch"], cubin=cubin,
                          lowered=lowered, options=tuple(meta.get("options", ())),
                          nvrtc=tuple(meta.get("nvrtc", ())), origin="disk")


def _write_entry(d: Path, stem: str, mod: CompiledModule, unit: CompileUnit) -> None:
    d.mkdir(parents=True, exist_ok=True)
    _sweep_tmp(d)
    sha = hashlib.sha256(mod.cubin).hexdigest()
    cubin_file = f"{stem}-{sha[:12]}.cubin"
    _atomic_write(d / cubin_file, mod.cubin)
    meta = {
        "schema": SCHEMA_VERSION,
        "key": mod.key,
        "name": mod.name,
        "family": mod.family,
        "params": dict(unit.meta),
        "arch": mod.arch,
        "nvrtc": list(mod.nvrtc),
        "options": list(compiler.key_options(mod.options)),
        "lowered": mod.lowered,
        "cubin_file": cubin_file,
        "cubin_sha256": sha,
        "cubin_size": len(mod.cubin),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_write(d / f"{stem}.json", json.dumps(meta, indent=1, sort_keys=True).encode())  # commit
    _fsync_dir(d)


def _dump(d: Path, stem: str, unit: CompileUnit, arch: str, options, nvrtc_log: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    _atomic_write(d / f"{stem}.cu", unit.source.encode())
    _atomic_write(d / f"{stem}.log", (" ".join(compiler.key_options(options)) + "\n" + nvrtc_log).encode())
    ptx = compiler.compile_ptx_listing(unit.name, unit.source, unit.name_exprs(), arch, options)
    _atomic_write(d / f"{stem}.ptx", ptx.encode())


# ---------------------------------------------------------------------------------------------
# public API

def get_cubin(unit: CompileUnit, arch: str | None = None) -> CompiledModule:
    """Compiled module for ``unit`` on ``arch`` (default: the current device's, needs a GPU).

    Looks in process memory, then on disk (normal/strict modes), else compiles (not in strict
    mode: :class:`CacheMissError`) and stores the entry. No GPU needed with an explicit arch.
    """
    arch = compiler.check_arch(arch) if arch is not None else compiler.default_arch()
    t0 = time.perf_counter()
    key = unit_key(unit, arch)
    with _lock:
        hit = _compiled.get(key)
    if hit is not None:
        return replace(hit, origin="memory", ms=(time.perf_counter() - t0) * 1e3)

    mode = knobs.cache_mode()
    use_disk = not knobs.get("no_disk_cache")
    d = disk_entry_dir(arch)
    stem = entry_stem(unit.name, key)
    if use_disk:
        try:
            mod = _read_entry(d, stem, key)
        except CacheCorruptError as exc:
            log.warning("qmoe_rtc cache: corrupt entry treated as a miss and rebuilt: %s", exc)
            mod = None
        if mod is not None:
            mod = replace(mod, ms=(time.perf_counter() - t0) * 1e3)
            with _lock:
                _compiled.setdefault(key, mod)
            log.debug("qmoe_rtc cache: disk hit %s (%s) %.1f ms", unit.name, arch, mod.ms)
            return mod
    if mode == "strict":
        where = d / f"{stem}.json" if use_disk else "memory (disk cache disabled)"
        raise CacheMissError(f"strict cache mode: module {unit.name} for {arch} is not cached (looked for {where}); "
                             f"warm the cache with `python -m qmoe_rtc warm ...`")

    options = compiler.base_options(arch, unit.defines)
    level = logging.INFO if knobs.get("debug") else logging.DEBUG
    log.log(level, "qmoe_rtc compile %s for %s\noptions: %s\n%s", unit.name, arch, " ".join(options), unit.source)
    cubin, lowered, nvrtc_log = compiler.compile_unit(unit.name, unit.source, unit.name_exprs(), arch, options)
    ms = (time.perf_counter() - t0) * 1e3
    if nvrtc_log.strip():
        log.log(level, "qmoe_rtc NVRTC log for %s:\n%s", unit.name, nvrtc_log)
    family = dict(unit.meta).get("family", "")
    mod = CompiledModule(name=unit.name, family=str(family), key=key, arch=arch, cubin=cubin, lowered=lowered,
                         options=options, nvrtc=compiler.nvrtc_version(), origin="compiled", ms=ms)
    if use_disk:
        try:
            _write_entry(d, stem, mod, unit)
            if knobs.get("dump"):
                _dump(d, stem, unit, arch, options, nvrtc_log)
        except OSError as exc:  # read-only or full disk: keep working from memory
            log.warning("qmoe_rtc cache: cannot write %s: %s", d, exc)
    with _lock:
        _compiled.setdefault(key, mod)
    log.debug("qmoe_rtc compiled %s (%s) in %.1f ms", unit.name, arch, ms)
    return mod


class LoadedModule:
    """A cubin loaded on one device, with its kernels as :class:`~qmoe_rtc.jit.launch.Kernel`."""

    def __init__(self, unit: CompileUnit, compiled: CompiledModule, module, device_id: int, kernels: dict):
        self.unit = unit
        self.compiled = compiled
        self.module = module  # keep the CUmodule alive
        self.device_id = device_id
        self.kernels = kernels

    def __getitem__(self, key: str) -> Kernel:
        try:
            return self.kernels[key]
        except KeyError:
            raise KeyError(f"module {self.compiled.name} has no kernel {key!r} (has {sorted(self.kernels)})") from None

    def __repr__(self) -> str:
        return f"LoadedModule({self.compiled.name}, device={self.device_id}, kernels={sorted(self.kernels)})"


def _current_device() -> int:
    try:
        import cupy

        return int(cupy.cuda.Device().id)
    except Exception as exc:
        raise DeviceError(f"no usable CUDA device: {exc}") from exc


def load_module(unit: CompileUnit, device: int | None = None) -> LoadedModule:
    """Compile (or fetch) ``unit`` for the device's arch and load it there (needs a GPU).
    Memoised per (device, unit key): a unit that differs in anything is another module."""
    device_id = int(device) if device is not None else _current_device()
    arch = compiler.default_arch(device_id)
    key = unit_key(unit, arch)
    with _lock:
        lm = _loaded.get((device_id, key))
    if lm is not None:
        return lm
    compiled = get_cubin(unit, arch)
    try:
        module = driver.load_cubin(compiled.cubin, device_id)
        kernels = {k.key: Kernel(k, driver.get_function(module, compiled.lowered[k.key]), device_id, compiled.name)
                   for k in unit.kernels}
    except DeviceError:
        raise
    except Exception as exc:
        raise DeviceError(f"loading {compiled.name} ({arch}) on device {device_id} failed: {exc}") from exc
    lm = LoadedModule(unit, compiled, module, device_id, kernels)
    with _lock:
        return _loaded.setdefault((device_id, key), lm)


def clear_memory() -> None:
    """Forget both in-memory tiers (tests; disk entries stay)."""
    with _lock:
        _compiled.clear()
        _loaded.clear()
