"""Weight formats: what a code of an expert's weights means, as one axis separate from zero points.

:mod:`.axis` holds :class:`WeightFormat` (its one name, code widths, whether zero points are allowed, its scale
rule and the device decode trait it compiles to), the registry :data:`FORMATS` (``int``, ``fp8_e4m3``,
``mxfp4``, ``nvfp4``), :func:`weight_format` and :func:`format_of_quant_type` (the contract's ``quant_type`` to
its format). One module per format family codes it and checks it: :mod:`.int_codes` (b-bit integer codes and
their packing), :mod:`.fp8` (float8 e4m3fn), :mod:`.fp4` (e2m1 with MXFP4 / NVFP4 scales); each has
``quantize``, ``check_layer``, ``projection``, ``check_content``, ``reference_weights`` and ``device_scales``,
which the format's methods call. :mod:`.e4m3_weights` gives each format's codes as exact e4m3 for FP8 tensor cores
(the FP8-activation engine's prepack). :mod:`.projection` holds :class:`ProjectionSpec`, what a projection check
returns. :mod:`.quantize` is the public entry of every format's codec: ``quantize(w, ..., format=...)`` and the
integer codec's ``pack_codes`` / ``unpack_codes`` / ``dequantize``.

Adding a format: its :class:`WeightFormat` in :mod:`.axis` (with a decode trait), its module here, and that
trait in the device templates (docs/runtime-compilation.md, "Adding a weight format").

Importing the package does no work: the names below (and the submodules, by name) load their module on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "FORMATS": "axis",
    "FP8_E4M3": "axis",
    "INT": "axis",
    "MXFP4": "axis",
    "NVFP4": "axis",
    "QUANT_TYPES": "axis",
    "ZERO_POINT_MODES": "axis",
    "QuantizedWeights": "axis",
    "ScaleRule": "axis",
    "WeightFormat": "axis",
    "format_of_quant_type": "axis",
    "weight_format": "axis",
    "ProjectionSpec": "projection",
}

_SUBMODULES = ("axis", "e4m3_weights", "fp4", "fp8", "int_codes", "projection", "quantize")

__all__ = [*_EXPORTS, *_SUBMODULES]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)
