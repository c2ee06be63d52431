"""Kernel-family registry.

A family is a small module ``qmoe_rtc/kernels/<name>.py`` defining a
:class:`~qmoe_rtc.jit.family.KernelFamily` subclass decorated with :func:`register`. Built-in
families are listed in :data:`BUILTIN_FAMILIES` and imported lazily on first lookup (nothing is
imported or compiled at package import). To add one: write the module, add its name here.
"""

from __future__ import annotations

import importlib
import threading

from ..errors import QMoEUnsupportedError

__all__ = ["BUILTIN_FAMILIES", "register", "unregister", "get_family", "family_names"]

#: Built-in families in a stable order: dequant (tests, fallback) and the executor's five.
BUILTIN_FAMILIES: tuple[str, ...] = ("dequant", "route", "group", "gemv", "gemm", "mma")

_lock = threading.RLock()
_registry: dict = {}
_extra: list[str] = []  # families registered from outside the built-in list, in order


def register(cls):
    """Class decorator: register one instance of a KernelFamily subclass under ``cls.name``."""
    with _lock:
        if not cls.name or not cls.header:
            raise QMoEUnsupportedError(f"kernel family {cls.__name__} must set 'name' and 'header'")
        prev = _registry.get(cls.name)
        if prev is not None and type(prev) is not cls and type(prev).__qualname__ != cls.__qualname__:
            raise QMoEUnsupportedError(f"kernel family name {cls.name!r} already registered by {type(prev).__name__}")
        _registry[cls.name] = cls()
        if cls.name not in BUILTIN_FAMILIES and cls.name not in _extra:
            _extra.append(cls.name)
    return cls


def unregister(name: str) -> None:
    """Remove a non-built-in family (tests that register throw-away families)."""
    with _lock:
        if name in BUILTIN_FAMILIES:
            raise QMoEUnsupportedError(f"built-in kernel family {name!r} cannot be unregistered")
        _registry.pop(name, None)
        if name in _extra:
            _extra.remove(name)


def get_family(name: str):
    """The registered family ``name`` (importing ``qmoe_rtc.kernels.<name>`` on first use)."""
    with _lock:
        fam = _registry.get(name)
        if fam is None and name in BUILTIN_FAMILIES:
            importlib.import_module(f"{__name__}.{name}")
            fam = _registry.get(name)
        if fam is None:
            raise QMoEUnsupportedError(f"unknown kernel family {name!r} (known: {list(family_names())})")
        return fam


def family_names() -> tuple[str, ...]:
    with _lock:
        return BUILTIN_FAMILIES + tuple(_extra)
