"""Kernel families: one module per family (argument specs, launch geometry, limits, the compile
unit), the registry, and the pipelines that chain them (:mod:`.pipelines`).

Built-in families are imported lazily on first lookup (nothing is imported or compiled at package
import). To add an engine: write ``qmoe_rtc/kernels/<name>.py`` with a :class:`KernelFamily`
subclass decorated with :func:`register`, add its name to :data:`BUILTIN_FAMILIES` and its
pipeline to :data:`~qmoe_rtc.kernels.pipelines.PIPELINES`.
"""

from __future__ import annotations

from .base import (
    BUILTIN_FAMILIES,
    KernelFamily,
    Problem,
    Slot,
    family_names,
    get_family,
    register,
    spec_unit,
    unregister,
)
from .pipelines import PIPELINES, Choice, Pipeline, Step, choose, decode_limit, modules_for

__all__ = [
    "BUILTIN_FAMILIES",
    "PIPELINES",
    "Choice",
    "KernelFamily",
    "Pipeline",
    "Problem",
    "Slot",
    "Step",
    "choose",
    "decode_limit",
    "family_names",
    "get_family",
    "modules_for",
    "register",
    "spec_unit",
    "unregister",
]
