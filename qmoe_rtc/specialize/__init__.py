"""Specialization: the frozen values that decide which kernel modules exist.

:func:`modules_for` is THE function that decides which (family, params) modules a layer needs; the
executor and the warm tool both call it, so a warmed cache holds exactly what runtime asks for.
"""

from __future__ import annotations

from typing import Iterable

from .layout import (
    ACTIVATIONS,
    BITS,
    DTYPES,
    GATED_ACTIVATIONS,
    ZP_MODES,
    Layout,
    ModelConfig,
    ModuleSpec,
    dtype_abbrev,
)

__all__ = [
    "ACTIVATIONS",
    "BITS",
    "DTYPES",
    "GATED_ACTIVATIONS",
    "ZP_MODES",
    "VARIANTS",
    "Layout",
    "ModelConfig",
    "ModuleSpec",
    "dtype_abbrev",
    "modules_for",
]

#: Execution variants a plan can need: "decode" (few rows: GEMV path), "prefill" (grouped GEMM).
VARIANTS = ("decode", "prefill")


def modules_for(config: "ModelConfig | Layout", variants: Iterable[str] = VARIANTS,
                families: Iterable[str] | None = None) -> list[ModuleSpec]:
    """Unique modules (in a stable order) that running ``config`` in ``variants`` needs.

    Asks every registered kernel family (or only ``families``) for its specs; a family whose
    ``variants`` does not intersect the requested ones contributes nothing.
    """
    from ..errors import QMoEAttributeError
    from ..kernels import get_family, family_names

    variants = tuple(variants)
    for v in variants:
        if v not in VARIANTS:
            raise QMoEAttributeError("variants", f"items of {list(VARIANTS)}", repr(v))
    seen: dict[ModuleSpec, None] = {}
    for fam_name in (family_names() if families is None else tuple(families)):
        fam = get_family(fam_name)
        if fam.variants is not None and not set(fam.variants) & set(variants):
            continue
        for spec in fam.specs(config, variants):
            seen.setdefault(spec, None)
    return list(seen)
