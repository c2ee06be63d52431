"""Specialization values: the vocabulary (:mod:`.vocab`), the frozen values that decide which kernel
modules exist (:mod:`.layout`) and the layer shapes of well-known models (:mod:`.presets`, imported from there).
Plain values only: nothing here compiles, loads or walks a registry (which modules a layer needs is
:func:`qmoe_rtc.kernels.modules_for`).
"""

from __future__ import annotations

from .layout import Layout, ModelConfig, ModuleSpec
from .vocab import (
    ACTIVATIONS,
    BITS,
    CPP_ACT,
    CPP_GATE,
    CPP_TYPES,
    CPP_ZP,
    DECODE_TRAITS,
    DTYPES,
    GATEABLE_ACTIVATIONS,
    GATES,
    GLU_ACTIVATIONS,
    ZP_MODES,
    dtype_abbrev,
    gate_source,
)

__all__ = [
    "ACTIVATIONS",
    "BITS",
    "CPP_ACT",
    "CPP_GATE",
    "CPP_TYPES",
    "CPP_ZP",
    "DECODE_TRAITS",
    "DTYPES",
    "GATEABLE_ACTIVATIONS",
    "GATES",
    "GLU_ACTIVATIONS",
    "ZP_MODES",
    "Layout",
    "ModelConfig",
    "ModuleSpec",
    "dtype_abbrev",
    "gate_source",
]
