"""Tiled codes given as inputs (``QMoE(prepack='given')``, :mod:`qmoe_rtc.tiled.given`): their shapes checked and
replaced by the metadata of their contract shapes, so the contract's checks run on them as on any layer.

A tiled array ``[E, N8, NCH, 8, 4, 4·b]`` holds N = 8·N8 rows and NCH = ceil(K/128) chunks, so K comes from the other
projection: FC1's and FC3's K is H = FC2's N, FC2's K is I = FC1's N / F (F = 2 with fused gate and linear rows).
"""

from __future__ import annotations

from dataclasses import replace

from .._arrays import ArrayMeta, device_of, dtype_name, is_c_contiguous, shape_str
from ..contract.attributes import QMoEAttributes
from ..errors import QMoEInputError
from ..formats.int_codes import packed_row_bytes
from ..tiled.transform import CHUNK, GROUP, tiled_shape

__all__ = ["CODE_INPUTS", "contract_metas", "given_hint"]

#: The code tensors a tiled layer holds tiled: the routed projections' and the [ext] shared experts'.
CODE_INPUTS = ("fc1_experts_weights", "fc2_experts_weights", "fc3_experts_weights", "shared_fc1_experts_weights",
               "shared_fc2_experts_weights")
#: The projection each projection's K comes from, and which of its sizes that is.
_K_FROM = {"fc1": ("fc2", "H"), "fc3": ("fc2", "H"), "fc2": ("fc1", "I")}


def _shape(a) -> tuple:
    return tuple(int(d) for d in getattr(a, "shape", ()))


def _meta(a, shape: tuple) -> ArrayMeta:
    """``a``'s metadata (dtype, contiguity, device) with the contract ``shape`` in place of its own."""
    if isinstance(a, ArrayMeta):
        return replace(a, shape=shape)
    return ArrayMeta(shape, dtype_name(a), is_c_contiguous(a), device_of(a))


def _group(arrays: dict, attrs: QMoEAttributes, prefix: str) -> dict:
    """Contract metadata of one group's tiled codes (routed experts: ``prefix`` '', shared: 'shared_')."""
    names = {p: f"{prefix}{p}_experts_weights" for p in ("fc1", "fc2", "fc3")}
    tiled = {p: arrays[n] for p, n in names.items() if arrays.get(n) is not None}
    if not tiled:
        return {}
    bits = {p: attrs.bits(p) for p in tiled}  # a float format's own width (attributes hold it)
    for p, a in tiled.items():
        shape, b = _shape(a), bits[p]
        if len(shape) != 6 or shape[3:] != (GROUP, 4, 4 * b):
            raise QMoEInputError(names[p], f"tiled codes [E, N/8, ceil(K/128), 8, 4, {4 * b}] ({b}-bit) with "
                                 "prepack='given'", f"shape {shape_str(shape)}",
                                 "contract-layout codes: leave prepack='given' out, or tile them with "
                                 "qmoe_rtc.tiled.given.tiled_weights" if len(shape) == 3 else None)
    E = _shape(tiled.get("fc1", next(iter(tiled.values()))))[0]
    F = 2 if attrs.swiglu_fusion else 1  # swiglu_fusion 1 or 2: FC1 holds gate and linear rows
    N = {p: GROUP * _shape(a)[1] for p, a in tiled.items()}
    size = {"H": N.get("fc2"), "I": N["fc1"] // F if "fc1" in N else None}
    if "fc3" in N and size["I"] is not None and not attrs.swiglu_fusion:
        N["fc3"] = size["I"]  # the linear rows: I of them (checked against the tiled shape below)
    out = {}
    for p, a in tiled.items():
        src, what = _K_FROM[p]
        K = size[what]
        if K is None:
            raise QMoEInputError(names[src], f"tiled codes as well (with prepack='given' the K of {names[p]}, "
                                 f"{what}, comes from the rows of {names[src]})", "None")
        want = tiled_shape(E, N[p], K, bits[p])
        if _shape(a) != want:
            raise QMoEInputError(names[p], f"shape {shape_str(want)} (tiled: E={E}, N={N[p]}, K={what}={K}, "
                                 f"{bits[p]}-bit; ceil(K/{CHUNK}) chunks)", f"shape {shape_str(_shape(a))}")
        out[names[p]] = _meta(a, (E, N[p], packed_row_bytes(K, bits[p])))  # FP8: K bytes, FP4: K/2
    return out


def contract_metas(arrays: dict, attrs: QMoEAttributes, given: bool) -> dict:
    """``arrays`` (a layer's tensors or their :class:`~qmoe_rtc._arrays.ArrayMeta`, by input name) as the
    contract sees them. ``given`` (``QMoE(prepack='given')``): every code tensor must be tiled, and is
    checked and replaced by the metadata of its contract shape; otherwise a tiled (6-D) one is refused,
    saying to pass ``prepack='given'``. Raises :class:`~qmoe_rtc.errors.QMoEInputError` naming the input."""
    if not given:
        for n in CODE_INPUTS:
            if len(_shape(arrays.get(n))) == 6:
                raise QMoEInputError(n, "contract-layout codes [E, N, ceil(K·b/8)] (codes already tiled, "
                                     "[E, N/8, ceil(K/128), 8, 4, 4·b], need QMoE(prepack='given'))",
                                     f"shape {shape_str(_shape(arrays[n]))}")
        return arrays
    out = {**arrays, **_group(arrays, attrs, "")}
    if any(arrays.get(n) is not None for n in CODE_INPUTS[3:]):
        out.update(_group(arrays, attrs.shared_attrs(), "shared_"))
    return out


def given_hint(exc: QMoEInputError) -> QMoEInputError:
    """``exc`` from the contract's checks of tiled codes' stand-ins, saying which shape was checked."""
    if exc.name not in CODE_INPUTS:
        return exc
    note = "prepack='given': tiled codes are checked as their contract shape [E, N, ceil(K·b/8)], N = 8·dim 1"
    return type(exc)(exc.name, exc.expected, exc.actual, f"{exc.hint}; {note}" if exc.hint else note)
