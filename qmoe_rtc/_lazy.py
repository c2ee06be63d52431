"""Lazy exports of a package: names and submodules that load their module on first use, so importing the package
does no work. Imports nothing of qmoe_rtc (every layer may use it)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], submodules: Iterable[str],
                 moved: Mapping[str, str] | None = None) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``exports`` (name -> the submodule, relative to the
    package, that defines it) is fetched from its submodule, a name of ``submodules`` is that submodule (at
    ``moved[name]`` where it lives under another path), anything else is an AttributeError as for any module."""
    subs = tuple(submodules)
    moved = dict(moved or {})

    def __getattr__(name: str):
        if name in subs:
            return importlib.import_module(f".{moved.get(name, name)}", package)
        mod = exports.get(name)
        if mod is not None:
            return getattr(importlib.import_module(f".{mod}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        import sys

        return sorted(set(vars(sys.modules[package])) | set(exports) | set(subs))

    return __getattr__, __dir__
