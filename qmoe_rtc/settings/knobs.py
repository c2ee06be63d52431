"""Every knob of qmoe_rtc, declared once, typed, and read lazily (never at import).

Two kinds of knob:

- **Operational** knobs, each its own environment variable (``QMOE_RTC_CACHE_DIR``, ``QMOE_RTC_STRICT``,
  ``QMOE_RTC_PDL``, ...): where the cache lives, strictness, logging, launch modes, the prepack default. Ten of them.
- **Tuning** knobs (ring depths, register budgets, forced engines and tiles, compile modes, diagnostics), all
  set through one variable, ``QMOE_RTC_TUNE``, as comma-separated ``name=value`` pairs::

      QMOE_RTC_TUNE="mma_stages=4,prefill_engine=wgmma" python -m qmoe_rtc bench ...

  Their built-in values are the measured choices; a tuning knob is for experiments (``bench ab``) and for
  working around a device the tables were not measured on, never needed to serve.

A knob that changes the generated code or the compiler options reaches the cache key through them (the key
hashes the translation unit and the options), so no knob needs its own invalidation. The variables of knobs
that were retired (the per-knob tuning variables before ``QMOE_RTC_TUNE``, knobs removed because they changed
nothing) are refused when a knob is read, naming what replaces them: a setting that is silently ignored would
be a surprise.

Tests (and the warm tool's worker processes) override knobs with :func:`scope` / :func:`apply`
instead of touching ``os.environ``::

    with knobs.scope(cache_dir=tmp_path, strict=True):
        ...
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import KnobError
from .knob_table import KNOBS, TUNE_ENV, Knob

__all__ = [
    "Knob",
    "KNOBS",
    "RETIRED",
    "TUNE_ENV",
    "get",
    "scope",
    "snapshot",
    "apply",
    "cache_dir",
    "cache_mode",
    "given",
    "label",
]

#: Variables no longer read -> what replaces them. Set, they are refused when any knob is read (a setting silently
#: ignored would be a surprise): the per-knob tuning variables (now ``QMOE_RTC_TUNE``) and knobs removed because
#: they changed nothing (their measurements stay in docs/performance-log.md).
RETIRED: dict[str, str] = {
    **{f"QMOE_RTC_{k.name.upper()}": f"set {TUNE_ENV}={k.name}=<value> instead" for k in KNOBS.values() if k.tuning},
    "QMOE_RTC_MMA_ROLL_COPIES": "the knob was removed (the rolled copy loop measured within noise of the "
                                "unrolled one; the narrow codes that need it roll it always)",
    **{var: "the knob was removed with the wgmma engine's warp-specialised variant (measured 0.98-1.5x the "
            "time of the kernels that remain)" for var in ("QMOE_RTC_PREFILL_WG_VARIANT", "QMOE_RTC_PREFILL_WS_MW")},
}

_lock = threading.Lock()
_overrides: list[dict[str, Any]] = []  # stack of scope() layers, innermost last


def _knob(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        raise KnobError(name, f"one of {sorted(KNOBS)}", repr(name)) from None


def _refuse_retired() -> None:
    for var, instead in RETIRED.items():
        if var in os.environ:
            raise KnobError(var, f"unset: it is no longer read ({instead})", repr(os.environ[var]))


@functools.lru_cache(maxsize=16)
def _tuned(raw: str) -> dict[str, Any]:
    """``QMOE_RTC_TUNE``'s text -> {knob name: value}; a malformed item, a name that is not a tuning knob, a name
    given twice or a value the knob does not take is a :class:`KnobError`."""
    out: dict[str, Any] = {}
    names = sorted(k.name for k in KNOBS.values() if k.tuning)
    for item in raw.split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        knob = KNOBS.get(name)
        if not sep or knob is None:
            raise KnobError(TUNE_ENV, f"name=value pairs, a name among {names}", repr(item))
        if not knob.tuning:
            raise KnobError(TUNE_ENV, f"its own variable {knob.var}", repr(item))
        if name in out:
            raise KnobError(TUNE_ENV, "each name once", repr(item))
        out[name] = knob.parse(value)
    return out


def given() -> dict[str, str]:
    """The knob settings found in the environment, as text: {variable or ``QMOE_RTC_TUNE[name]``: value}."""
    out = {k.var: os.environ[k.var] for k in KNOBS.values() if k.var and k.var in os.environ}
    for item in os.environ.get(TUNE_ENV, "").split(","):
        name, sep, value = item.partition("=")
        if item.strip():
            out[f"{TUNE_ENV}[{name.strip()}]"] = value if sep else "?"
    return out


def label(name: str) -> str:
    """Where knob ``name`` is set, as errors name it (:attr:`Knob.env`)."""
    return _knob(name).env


_DEFAULT = object()


def get(name: str, default: Any = _DEFAULT) -> Any:
    """Current value of a knob: innermost override, else the environment (its variable, or ``QMOE_RTC_TUNE`` for a
    tuning knob), else ``default`` where given (an arch's measured default: kernels/tuning/), else the knob's
    portable default. A retired variable set in the environment is refused first."""
    knob = _knob(name)
    fallback = knob.default if default is _DEFAULT else default
    with _lock:
        for layer in reversed(_overrides):
            if name in layer:
                return layer[name]
    _refuse_retired()
    if knob.tuning:
        return _tuned(os.environ.get(TUNE_ENV, "")).get(name, fallback)
    raw = os.environ.get(knob.var)
    if raw is None:
        return fallback
    return knob.parse(raw)


@contextlib.contextmanager
def scope(**overrides: Any) -> Iterator[None]:
    """Override knobs inside a ``with`` block (process-wide, nested scopes stack)."""
    layer = {name: _knob(name).coerce(value) for name, value in overrides.items()}
    with _lock:
        _overrides.append(layer)
    try:
        yield
    finally:
        with _lock:
            _overrides.remove(layer)


def snapshot() -> dict[str, Any]:
    """Effective value of every knob (to hand to worker processes, see :func:`apply`)."""
    return {name: get(name) for name in KNOBS}


def apply(values: dict[str, Any]) -> None:
    """Install ``values`` as a permanent override layer (worker-process initializer)."""
    layer = {name: _knob(name).coerce(value) for name, value in values.items()}
    with _lock:
        _overrides.insert(0, layer)


def cache_dir() -> Path:
    """The on-disk cache root (not created here)."""
    d = get("cache_dir")
    if d is not None:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "qmoe_rtc"


def cache_mode() -> str:
    """'normal', 'memory' (no disk cache) or 'strict' (disk must already hold every module)."""
    if get("strict"):
        return "strict"
    if get("no_disk_cache"):
        return "memory"
    return "normal"
