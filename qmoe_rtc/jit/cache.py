"""Two-tier kernel cache: in-memory (compiled bytes per process, loaded modules per device) and
on-disk (raw ``.cubin`` + JSON metadata, :mod:`qmoe_rtc.jit.store`), both keyed by the compile
unit's key (:func:`unit_key`).

A miss in memory reads the disk entry; a miss there (or a damaged entry: logged, treated as a miss,
rebuilt) takes the entry's lock, looks again (another process may have built it meanwhile), and
only then compiles and stores it. A location that cannot store or cannot be trusted degrades to
memory with one WARNING (see :mod:`qmoe_rtc.jit.store` for the rules).

A unit with parts (:meth:`CompileUnit.pieces`) is cached piece by piece, its pieces compiled side by side
in threads (NVRTC releases the GIL) and loaded as one :class:`LoadedModule`: the ``*_cubins`` calls.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..errors import CacheCorruptError, CacheLocationError, CacheMissError, CompileError, DeviceError
from ..settings import knobs
from . import compiler, driver, store
from .compiler import CompiledModule
from .launch import Kernel
from .unit import SCHEMA_VERSION, CompileUnit, unit_key

__all__ = ["LoadedModule", "check_stored", "clear_memory", "disk_entry_dir", "entry_stem", "get_cubin", "get_cubins",
           "load_module", "load_modules", "store_cubin", "store_cubins"]

log = logging.getLogger("qmoe_rtc")

_lock = threading.RLock()
_compiled: dict[str, CompiledModule] = {}  # unit key -> module (process memory tier)
_loaded: dict[tuple[int, str], LoadedModule] = {}  # (device id, unit key) -> loaded module


# ---------------------------------------------------------------------------------------------
# disk tier

def disk_entry_dir(arch: str) -> Path:
    """``<cache_dir>/v<SCHEMA>/<arch>``: where the entries for ``arch`` live (not created here)."""
    return store.arch_dir(knobs.cache_dir(), compiler.check_arch(arch))


def entry_stem(name: str, key: str) -> str:
    return f"{name}-{key[:16]}"


def _kernel_keys(unit: CompileUnit) -> set[str]:
    return {k.key for k in unit.kernels}


def _from_disk(unit: CompileUnit, arch: str, key: str, quiet: bool = False) -> CompiledModule | None:
    """The committed, trusted, intact disk entry of ``unit``, else None (a damaged one is logged)."""
    d = store.location(arch, write=False)
    if d is None:
        return None
    try:
        got = store.read_entry(d, entry_stem(unit.name, key), key, _kernel_keys(unit))
    except store.UntrustedError as exc:
        store.refuse_untrusted(exc)
        return None
    except CacheCorruptError as exc:
        if not quiet:
            log.warning("qmoe_rtc cache: corrupt entry treated as a miss and rebuilt: %s", exc)
        return None
    if got is None:
        return None
    meta, cubin = got
    return CompiledModule(name=meta["name"], family=meta["family"], key=key, arch=meta["arch"], cubin=cubin,
                          lowered=dict(meta["lowered"]), options=tuple(meta.get("options", ())),
                          nvrtc=tuple(meta.get("nvrtc", ())), origin="disk")


def _store(d: Path, mod: CompiledModule, unit: CompileUnit, nvrtc_log: str) -> None:
    """Write ``mod``'s entry (the caller holds its lock); a failure stops storing there (one WARNING)."""
    stem = entry_stem(unit.name, mod.key)
    meta = {"schema": SCHEMA_VERSION, "key": mod.key, "name": mod.name, "family": mod.family, "params": dict(unit.meta),
            "arch": mod.arch, "nvrtc": list(mod.nvrtc), "options": list(compiler.key_options(mod.options)),
            "lowered": mod.lowered, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        extra = None
        if knobs.get("dump"):
            ptx = compiler.compile_ptx_listing(unit.name, unit.source, unit.name_exprs(), mod.arch, mod.options)
            extra = {".cu": unit.source.encode(), ".ptx": ptx.encode(),
                     ".log": (" ".join(compiler.key_options(mod.options)) + "\n" + nvrtc_log).encode()}
        store.write_entry(d, stem, meta, mod.cubin, extra)
    except OSError as exc:  # full disk, read-only file system, ...
        store.unusable(knobs.cache_dir(), f"writing {d / stem}.* failed ({exc.strerror or exc})")


def _compile(unit: CompileUnit, arch: str, key: str, t0: float) -> tuple[CompiledModule, str]:
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
    log.debug("qmoe_rtc compiled %s (%s) in %.1f ms", unit.name, arch, ms)
    return mod, nvrtc_log


# ---------------------------------------------------------------------------------------------
# public API

def get_cubin(unit: CompileUnit, arch: str | None = None) -> CompiledModule:
    """Compiled module for ``unit`` on ``arch`` (default: the current device's, needs a GPU).

    Looks in process memory, then on disk (normal/strict modes), else compiles (not in strict
    mode: :class:`CacheMissError`) and stores the entry, one process per entry at a time. No GPU
    needed with an explicit arch. ``origin`` of the result: 'memory', 'disk' (also when another
    process built it while this one waited) or 'compiled'.
    """
    _one_piece(unit, "get_cubins")
    arch = compiler.check_arch(arch) if arch is not None else compiler.default_arch()
    t0 = time.perf_counter()
    key = unit_key(unit, arch)
    with _lock:
        hit = _compiled.get(key)
    if hit is not None:
        return replace(hit, origin="memory", ms=(time.perf_counter() - t0) * 1e3)

    use_disk = not knobs.get("no_disk_cache")
    mod = _from_disk(unit, arch, key) if use_disk else None
    if mod is None and knobs.cache_mode() == "strict":
        where = disk_entry_dir(arch) / f"{entry_stem(unit.name, key)}.json" if use_disk else "memory (disk cache disabled)"
        raise CacheMissError(f"strict cache mode: module {unit.name} for {arch} is not cached (looked for {where}); "
                             f"warm the cache with `python -m qmoe_rtc warm ...`")
    if mod is None:
        d = store.location(arch, write=True) if use_disk else None
        if d is None:
            mod, _ = _compile(unit, arch, key, t0)
        else:
            with store.entry_lock(d, entry_stem(unit.name, key)) as held:
                mod = _from_disk(unit, arch, key, quiet=True) if held else None  # built while we waited?
                if mod is None:
                    mod, nvrtc_log = _compile(unit, arch, key, t0)
                    if held:
                        _store(d, mod, unit, nvrtc_log)
    mod = replace(mod, ms=(time.perf_counter() - t0) * 1e3)
    if mod.origin == "disk":
        log.debug("qmoe_rtc cache: disk hit %s (%s) %.1f ms", unit.name, arch, mod.ms)
    with _lock:
        _compiled.setdefault(key, mod)
    return mod


def _one_piece(unit: CompileUnit, instead: str) -> None:
    if len(unit.pieces()) > 1:
        raise CompileError(unit.name, f"this module is built in {len(unit.parts)} parts, one cubin each: {instead}(unit) "
                                      "gives them all (or take unit.pieces() one by one)")


def _side_by_side(fn, items: tuple) -> tuple:
    """``tuple(fn(item) for item in items)``, computed in threads (one per CPU at most) when there are several."""
    if len(items) < 2:
        return tuple(fn(item) for item in items)
    with cf.ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1), thread_name_prefix="qmoe_rtc-nvrtc") as pool:
        return tuple(pool.map(fn, items))


def get_cubins(unit: CompileUnit, arch: str | None = None) -> tuple[CompiledModule, ...]:
    """:func:`get_cubin` of each of ``unit``'s pieces (one for a unit without parts), side by side."""
    arch = compiler.check_arch(arch) if arch is not None else compiler.default_arch()
    return _side_by_side(lambda piece: get_cubin(piece, arch), unit.pieces())


def store_cubins(unit: CompileUnit, arch: str) -> tuple[CompiledModule, ...]:
    """:func:`store_cubin` of each of ``unit``'s pieces (one for a unit without parts), side by side."""
    arch = compiler.check_arch(arch)
    return _side_by_side(lambda piece: store_cubin(piece, arch), unit.pieces())


def store_cubin(unit: CompileUnit, arch: str) -> CompiledModule:
    """:func:`get_cubin`, with the entry on disk whichever tier answered: a module this process holds in
    memory (compiled under another cache directory, or while the disk cache was off) is written to the
    current one too, so a warm run inside a process that already built it still stores it. ``origin``
    'stored' when this call wrote the memory copy. One piece: :func:`store_cubins` takes a unit with parts."""
    _one_piece(unit, "store_cubins")
    arch = compiler.check_arch(arch)
    mod = get_cubin(unit, arch)
    if mod.origin != "memory" or knobs.get("no_disk_cache"):
        return mod
    d = store.location(arch, write=True)
    if d is None or _from_disk(unit, arch, mod.key, quiet=True) is not None:
        return mod
    with store.entry_lock(d, entry_stem(unit.name, mod.key)) as held:
        if held and _from_disk(unit, arch, mod.key, quiet=True) is None:
            _store(d, mod, unit, "")  # the NVRTC log is not kept in memory
            return replace(mod, origin="stored")
    return mod


def check_stored(unit: CompileUnit, arch: str) -> None:
    """Raise unless ``unit``'s entry for ``arch`` is on disk, trusted and intact -- what a later
    process will load (the warm tool's final check): :class:`CacheMissError` (absent),
    :class:`CacheCorruptError` (damaged), :class:`CacheLocationError` (location unusable or untrusted).
    A unit with parts: every piece."""
    arch = compiler.check_arch(arch)
    d = store.location(arch, write=False, strict=True)
    if d is None:
        raise CacheMissError(f"{unit.name} ({arch}): no cache directory {disk_entry_dir(arch)}")
    for piece in unit.pieces():
        key = unit_key(piece, arch)
        try:
            got = store.read_entry(d, entry_stem(piece.name, key), key, _kernel_keys(piece))
        except store.UntrustedError as exc:
            raise CacheLocationError(str(exc)) from None
        if got is None:
            raise CacheMissError(f"{piece.name} ({arch}): not on disk ({d / entry_stem(piece.name, key)}.json)")


class LoadedModule:
    """A unit loaded on one device: its kernels as :class:`~qmoe_rtc.jit.launch.Kernel`, one cubin per piece.

    A unit with parts may be loaded piece by piece (:func:`load_modules` with ``kernels``): ``parts`` /
    ``modules`` are the pieces loaded so far (compiled pieces and their CUmodules, kept alive here, in piece
    order) and ``kernels`` their kernels; a kernel of a piece not loaded yet is refused by name."""

    def __init__(self, unit: CompileUnit, device_id: int):
        self.unit = unit
        self.name = unit.name
        self.device_id = device_id
        self.pieces = unit.pieces()
        self.kernels: dict[str, Kernel] = {}
        self._loaded: dict[int, tuple[CompiledModule, object]] = {}  # piece index -> (compiled, CUmodule)

    @property
    def parts(self) -> tuple[CompiledModule, ...]:
        return tuple(self._loaded[i][0] for i in sorted(self._loaded))

    @property
    def modules(self) -> tuple:
        return tuple(self._loaded[i][1] for i in sorted(self._loaded))

    def missing(self, keys=None) -> tuple[int, ...]:
        """Indices of the pieces not loaded yet that hold any of the kernel ``keys`` (None: every kernel)."""
        if keys is None:
            wanted = range(len(self.pieces))
        else:
            keys = set(keys)
            unknown = keys - {k.key for k in self.unit.kernels}
            if unknown:
                raise KeyError(f"module {self.name} has no kernel {sorted(unknown)} (has {[k.key for k in self.unit.kernels]})")
            wanted = [i for i, p in enumerate(self.pieces) if keys & {k.key for k in p.kernels}]
        return tuple(i for i in wanted if i not in self._loaded)

    def _add(self, index: int, compiled: CompiledModule, arch: str) -> None:
        """Load piece ``index`` (compiled as ``compiled``) unless another thread did (the caller holds _lock)."""
        if index in self._loaded:
            return
        piece = self.pieces[index]
        try:
            module = driver.load_cubin(compiled.cubin, self.device_id)
            kernels = {k.key: Kernel(k, driver.get_function(module, compiled.lowered[k.key]), self.device_id,
                                     compiled.name) for k in piece.kernels}
        except DeviceError:
            raise
        except Exception as exc:
            raise DeviceError(f"loading {compiled.name} ({arch}) on device {self.device_id} failed: {exc}") from exc
        self._loaded[index] = (compiled, module)
        self.kernels.update(kernels)

    def __getitem__(self, key: str) -> Kernel:
        try:
            return self.kernels[key]
        except KeyError:
            pass
        if key in {k.key for k in self.unit.kernels}:
            raise KeyError(f"module {self.name}: kernel {key!r} is in a piece not loaded yet (load_modules(..., "
                           f"kernels=...) names the kernels to load; loaded: {sorted(self.kernels)})")
        raise KeyError(f"module {self.name} has no kernel {key!r} (has {[k.key for k in self.unit.kernels]})")

    def __repr__(self) -> str:
        return (f"LoadedModule({self.name}, device={self.device_id}, parts={len(self._loaded)}/{len(self.pieces)}, "
                f"kernels={sorted(self.kernels)})")


def _current_device() -> int:
    try:
        import cupy

        return int(cupy.cuda.Device().id)
    except Exception as exc:
        raise DeviceError(f"no usable CUDA device: {exc}") from exc


def load_module(unit: CompileUnit, device: int | None = None, kernels=None) -> LoadedModule:
    """Compile (or fetch) ``unit`` for the device's arch and load it there (needs a GPU); a unit with parts,
    its pieces side by side (``kernels``: only the pieces holding those). Memoised per (device, unit key): a
    unit that differs in anything is another module."""
    return load_modules((unit,), device, None if kernels is None else (kernels,))[0]


def load_modules(units, device: int | None = None, kernels=None) -> tuple[LoadedModule, ...]:
    """:func:`load_module` of each unit, the pieces not loaded yet compiled (or read) side by side, all units
    together: a plan's modules on first contact take about as long as the slowest piece.

    ``kernels``: one entry per unit, the kernel keys it must hold (None: all of them); a unit with parts then
    loads only the pieces holding those (a plan needs one route tile's GEMMs, not every tile's), and a later
    call adds the others to the same :class:`LoadedModule`. Each unit's key is computed once (a loaded unit
    costs one key and a dictionary lookup)."""
    device_id = int(device) if device is not None else _current_device()
    arch = compiler.default_arch(device_id)
    units = tuple(units)
    wants = (None,) * len(units) if kernels is None else tuple(kernels)
    if len(wants) != len(units):
        raise ValueError(f"load_modules: kernels has {len(wants)} entries for {len(units)} units")
    keys = [unit_key(u, arch) for u in units]
    with _lock:
        mods = tuple(_loaded.get((device_id, k)) or _loaded.setdefault((device_id, k), LoadedModule(u, device_id))
                     for k, u in zip(keys, units))
        todo = list(dict.fromkeys((lm, i) for lm, want in zip(mods, wants) for i in lm.missing(want)))
    compiled = _side_by_side(lambda item: get_cubin(item[0].pieces[item[1]], arch), tuple(todo))
    with _lock:
        for (lm, i), c in zip(todo, compiled):
            lm._add(i, c, arch)
    return mods


def clear_memory() -> None:
    """Forget both in-memory tiers and which disk locations were given up on (tests; disk entries stay)."""
    with _lock:
        _compiled.clear()
        _loaded.clear()
    store.reset()
