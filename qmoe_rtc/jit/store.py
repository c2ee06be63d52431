"""The on-disk tier of the kernel cache: where entries live, when the location is trusted, how one
process builds an entry while the others wait, and how an entry is written and checked.

In ``<cache_dir>/v<SCHEMA>/<arch>/``, per entry (``stem`` = ``<module-name>-<key16>``)::

    <stem>.json                 metadata, written LAST (the commit marker); ``digest`` = sha256 of every other field
    <stem>-<sha12>.cubin        raw SASS (``cuobjdump -sass`` works on it)
    <stem>.lock                 only while the entry is being built (flock: one builder, the others wait)

Rules (docs/runtime-compilation.md, "On disk"):

- **Trust.** The cache root, ``v<SCHEMA>``, ``<arch>`` and every entry file must be owned by this
  user (or root) and not writable by group or others: a cubin is code that runs on the GPU. An
  untrusted location is never read or written: one WARNING, memory only for this process.
  Directories are created 0700, files 0600.
- **Unusable for storing** (not a directory, cannot be created, not writable, a write fails, disk
  full): one WARNING naming the path and the reason, then no more writes there for this process
  (memory only); entries that are already there are still read, so a read-only pre-warmed cache
  serves strict mode. The warm tool raises :class:`~qmoe_rtc.errors.CacheLocationError` instead.
- **One builder per entry.** A process that misses takes ``<stem>.lock`` (``fcntl.flock``), looks
  again, and only then compiles and writes; the others wait on the lock and load what it wrote.
  Every file of an entry is written under its lock (temp file -> fsync -> ``os.replace``), so a temp
  file whose stem's lock is free belongs to a dead writer and is removed; a holder unlinks the lock
  file before releasing it, and a waiter checks it locked the file that is still there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from pathlib import Path

from ..errors import CacheCorruptError, CacheLocationError
from ..settings import knobs
from .unit import SCHEMA_VERSION

__all__ = ["UntrustedError", "arch_dir", "digest", "entry_lock", "location", "read_entry", "refuse_untrusted", "reset",
           "sweep", "unusable", "write_entry"]

log = logging.getLogger("qmoe_rtc")

_TMP = ".tmp-"
_TMP_STEM = re.compile(r"^\.tmp-(.+?-[0-9a-f]{16})[.-]")  # the stem of a temp file's target
_STALE_S = 3600.0  # temp files that name no entry: removed after an hour
LOCK_WAIT_S = 600.0  # a builder that holds an entry longer than this: compile without storing

_state_lock = threading.Lock()
_no_write: dict[Path, str] = {}  # cache root -> why nothing is stored there by this process
_untrusted: dict[Path, str] = {}  # cache root -> why it is neither read nor written


class UntrustedError(CacheLocationError):
    """An entry file or directory that another user could have written (never loaded)."""


def reset() -> None:
    """Forget which locations this process gave up on (tests; :func:`qmoe_rtc.jit.clear_memory`)."""
    with _state_lock:
        _no_write.clear()
        _untrusted.clear()


def _euid() -> int:
    return os.geteuid()


def _trust_problem(st: os.stat_result) -> str | None:
    if st.st_uid not in (_euid(), 0):
        return f"owned by uid {st.st_uid}, not by this user (uid {_euid()}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}; chmod go-w it)"
    return None


def _give_up(table: dict, root: Path, why: str, what: str) -> None:
    with _state_lock:
        if root in table:
            return
        table[root] = why
    log.warning("qmoe_rtc cache: %s: %s; %s for this process", root, why, what)


def unusable(root: Path, why: str) -> None:
    """Stop storing under ``root`` for this process (one WARNING naming it and why)."""
    _give_up(_no_write, root, why, "kernels are kept in memory only (nothing more is stored there)")


def _untrust(root: Path, why: str) -> None:
    _give_up(_untrusted, root, why, "it is not used at all (kernels are kept in memory only)")


def arch_dir(root: Path, arch: str) -> Path:
    """``<root>/v<SCHEMA>/<arch>``: where the entries for ``arch`` live."""
    return root / f"v{SCHEMA_VERSION}" / arch


def location(arch: str, write: bool, strict: bool = False) -> Path | None:
    """The entry directory for ``arch`` when it can be read (``write=False``: it exists and is trusted)
    or written (``write=True``: created 0700 if missing, trusted, writable), else None after one WARNING
    (nothing for a cache that simply does not exist yet). ``strict``: raise
    :class:`CacheLocationError` with the reason instead (the warm tool)."""
    root = knobs.cache_dir()
    d = arch_dir(root, arch)
    with _state_lock:
        why = _untrusted.get(root) or (_no_write.get(root) if write else None)
    if why:
        if strict:
            raise CacheLocationError(f"cache {root}: {why}")
        return None
    for p in (root, root / f"v{SCHEMA_VERSION}", d):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if not write:
                return None
            try:
                if p == root:
                    os.makedirs(p, 0o700, exist_ok=True)  # missing parents too (they get the umask's mode)
                else:
                    with contextlib.suppress(FileExistsError):  # another process made it first
                        os.mkdir(p, 0o700)
                st = os.stat(p)
            except OSError as exc:
                return _refuse(root, f"cannot create {p} ({exc.strerror or exc})", strict)
        except OSError as exc:  # e.g. a parent is a file: NotADirectoryError
            return _refuse(root, f"{p}: {exc.strerror or exc}", strict)
        if not stat.S_ISDIR(st.st_mode):
            return _refuse(root, f"{p} is not a directory", strict)
        problem = _trust_problem(st)
        if problem:
            if strict:
                raise CacheLocationError(f"cache {root}: {p} is {problem}: not trusted")
            _untrust(root, f"{p} is {problem}: not trusted (a cubin is code that runs on the GPU)")
            return None
    if write and not os.access(d, os.W_OK | os.X_OK):
        return _refuse(root, f"{d} is not writable", strict)
    return d


def _refuse(root: Path, why: str, strict: bool) -> None:
    if strict:
        raise CacheLocationError(f"cache {root}: {why}")
    unusable(root, why)
    return None


# ---------------------------------------------------------------------------------------------
# writing

def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=_TMP + path.name + ".", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


def digest(meta: dict) -> str:
    """sha256 of every field of an entry's metadata except ``digest`` itself (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_entry(d: Path, stem: str, meta: dict, cubin: bytes, extra: dict[str, bytes] | None = None) -> None:
    """Write one entry (the caller holds its lock): the cubin, ``extra`` files (``{suffix: bytes}``),
    then the JSON with its digest (the commit), then remove this stem's cubins the JSON no longer names."""
    sha = hashlib.sha256(cubin).hexdigest()
    cubin_file = f"{stem}-{sha[:12]}.cubin"
    _atomic_write(d / cubin_file, cubin)
    for suffix, data in (extra or {}).items():
        _atomic_write(d / f"{stem}{suffix}", data)
    meta = json.loads(json.dumps({**meta, "cubin_file": cubin_file, "cubin_sha256": sha, "cubin_size": len(cubin)}))
    meta["digest"] = digest(meta)
    _atomic_write(d / f"{stem}.json", json.dumps(meta, indent=1, sort_keys=True).encode())  # commit
    _fsync_dir(d)
    for p in d.glob(f"{stem}-*.cubin"):
        if p.name != cubin_file:
            with contextlib.suppress(OSError):
                p.unlink()


# ---------------------------------------------------------------------------------------------
# locking

def _try_lock(path: Path, blocking_s: float) -> int | None:
    """An fd holding ``flock`` on the lock file that is at ``path`` now, or None after ``blocking_s``."""
    deadline = time.monotonic() + blocking_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        os.close(fd)
                        return None
                    time.sleep(0.02)
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            return fd
        os.close(fd)  # the holder before us unlinked it: lock the new one


def _unlock(path: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)  # before releasing: a waiter that then gets the old inode sees it is gone
    os.close(fd)


@contextlib.contextmanager
def entry_lock(d: Path, stem: str, wait_s: float = LOCK_WAIT_S):
    """``with entry_lock(d, stem) as held:`` -- ``held`` is True when this process (thread) is the one
    builder of the entry; False when the lock could not be taken (not writable: then nothing may be
    written; or held longer than ``wait_s`` by another builder)."""
    path = d / f"{stem}.lock"
    try:
        fd = _try_lock(path, wait_s)
    except OSError as exc:
        unusable(d.parent.parent, f"cannot create the lock file {path} ({exc.strerror or exc})")
        yield False
        return
    if fd is None:
        log.warning("qmoe_rtc cache: %s is held by another builder for more than %.0f s; compiling %s without "
                    "storing it", path, wait_s, stem)
        yield False
        return
    try:
        sweep(d, held=stem)
        yield True
    finally:
        _unlock(path, fd)


def sweep(d: Path, held: str | None = None) -> None:
    """Remove what dead writers left in ``d``: temp files of ``held`` (its lock is ours) and of every stem
    whose lock is free, lock files nobody holds, and temp files naming no entry older than an hour."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    temps: dict[str, list[str]] = {}
    for n in names:
        if n.startswith(_TMP):
            m = _TMP_STEM.match(n)
            if m:
                temps.setdefault(m.group(1), []).append(n)
            else:
                with contextlib.suppress(OSError):
                    if time.time() - os.stat(d / n).st_mtime > _STALE_S:
                        os.unlink(d / n)
        elif n.endswith(".lock"):
            temps.setdefault(n[: -len(".lock")], [])
    for stem, files in temps.items():
        fd = None
        if stem != held:
            try:
                fd = _try_lock(d / f"{stem}.lock", 0.0)
            except OSError:
                continue
            if fd is None:
                continue  # a live builder: its temp files are its own
        for n in files:
            with contextlib.suppress(OSError):
                os.unlink(d / n)
        if fd is not None:
            _unlock(d / f"{stem}.lock", fd)


# ---------------------------------------------------------------------------------------------
# reading

def _read_trusted(path: Path) -> bytes:
    """The bytes of an entry file, refusing one another user could have written (:class:`UntrustedError`)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        problem = _trust_problem(os.fstat(f.fileno()))
        if problem:
            raise UntrustedError(f"{path} is {problem}: not trusted")
        return f.read()


def read_entry(d: Path, stem: str, key: str, kernel_keys: set[str]) -> tuple[dict, bytes] | None:
    """``(metadata, cubin)`` of the committed entry, or None when there is none. A damaged one --
    unreadable JSON, a digest, schema or key mismatch, kernels other than ``kernel_keys``, a missing,
    short or altered cubin -- raises :class:`CacheCorruptError`; an untrusted file :class:`UntrustedError`
    (the caller stops using the location)."""
    for attempt in (0, 1):
        meta_path = d / f"{stem}.json"
        try:
            raw = _read_trusted(meta_path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedError(f"{meta_path} is a symbolic link: not trusted") from None
            return None  # unreadable location: a miss (the write side says why, once)
        try:
            meta = json.loads(raw)
            if not isinstance(meta, dict) or meta.get("digest") != digest(meta):
                raise CacheCorruptError(f"{meta_path}: metadata digest mismatch (an edited or damaged entry)")
            if meta.get("schema") != SCHEMA_VERSION or meta.get("key") != key:
                raise CacheCorruptError(f"{meta_path}: schema/key mismatch")
            name = meta["cubin_file"]
            if not isinstance(name, str) or Path(name).name != name or not name.startswith(stem + "-"):
                raise CacheCorruptError(f"{meta_path}: bad cubin file name {name!r}")
            want_sha, want_size = str(meta["cubin_sha256"]), int(meta["cubin_size"])
            lowered = meta["lowered"]
            if not isinstance(lowered, dict) or set(lowered) != set(kernel_keys) or \
                    not all(isinstance(v, str) and v for v in lowered.values()):
                raise CacheCorruptError(f"{meta_path}: kernel names {sorted(lowered)} do not match the unit's")
        except CacheCorruptError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CacheCorruptError(f"{meta_path}: unreadable metadata ({exc})") from None
        try:
            cubin = _read_trusted(d / name)
        except FileNotFoundError:
            if attempt == 0:
                continue  # a builder replaced the entry between our two reads: read the new one
            raise CacheCorruptError(f"{meta_path}: cubin {name} missing") from None
        if len(cubin) != want_size or hashlib.sha256(cubin).hexdigest() != want_sha:
            raise CacheCorruptError(f"{d / name}: checksum mismatch (size {len(cubin)}, expected {want_size})")
        return meta, cubin
    return None  # pragma: no cover - the loop returns or raises


def refuse_untrusted(exc: UntrustedError) -> None:
    """Stop using the location an :class:`UntrustedError` was raised for (one WARNING)."""
    _untrust(knobs.cache_dir(), f"{exc} (a cubin is code that runs on the GPU)")
