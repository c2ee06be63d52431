"""The weight-format axis: one frozen :class:`WeightFormat` per way expert weights are coded, the registry
:data:`FORMATS`, and the lookups :func:`weight_format` (a format by its one name) and :func:`format_of_quant_type`
(the contract's ``quant_type`` attribute to its format: the only place that mapping is made).

A format is separate from zero points: it says what a code means (``int``: b-bit integers, ``w = (q − zp)·s``;
``fp8_e4m3``: float8 e4m3fn bytes; ``mxfp4`` / ``nvfp4``: e2m1 nibbles), its code widths, whether zero points
(a zero-point tensor, or the ``zero_point_offset`` attribute) are allowed, its scale rule, and the device decode
trait its codes compile to (the key of ``qmoe_rtc.specialize.vocab.CPP_ZP``: integer codes decode by their
zero-point mode, 'none' / 'packed' / 'offset'; a float format has a trait of its own). Each format's codec
(pack / unpack / quantize), its contract projection checks, its reference dequantization and what the device
upload does to its scales live in one module of this package (:attr:`WeightFormat.codec`), reached through the
methods here. This module imports nothing of the package but its errors: the layouts validate against it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from ..errors import QMoEAttributeError, WeightFormatError

__all__ = ["FORMATS", "FP8_E4M3", "INT", "MXFP4", "NVFP4", "QUANT_TYPES", "ZERO_POINT_MODES", "QuantizedWeights",
           "ScaleRule", "WeightFormat", "format_of_quant_type", "weight_format"]

#: Zero-point modes of a projection of integer codes: implicit 2^(b−1), a packed uint8 tensor, the float
#: ``zero_point_offset`` attribute [ext]. Float formats take 'none' only.
ZERO_POINT_MODES = ("none", "packed", "offset")


class QuantizedWeights(NamedTuple):
    """One projection of all experts in the contract's layout (what :func:`qmoe_rtc.formats.quantize.quantize` returns)."""

    packed: object  #: uint8 ``[E, N, ceil(K·b/8)]`` (FP8: ``[E, N, K]``; FP4: ``[E, N, K/2]``)
    scales: object  #: ``[E, N]`` (row-wise) or ``[E, N, K/bs]`` (block-wise); FP8: ``[E]`` or square blocks
    zero_points: object | None  #: None (symmetric) or uint8 ``[E, N, ceil(nb·b/8)]`` / ``[E, ceil(N·b/8)]``


@dataclass(frozen=True)
class ScaleRule:
    """How a format's codes are scaled.

    ``block``: the format's own block of codes along K per scale (MXFP4 32, NVFP4 16; 0: the layer's
    ``block_size``, 0 meaning one scale per row). ``square``: scales cover square ``bs × bs`` blocks of the
    ``[N, K]`` matrix, the last ones possibly partial, and ``block_size`` 0 means one scale per expert (FP8).
    ``stored``: the scale tensor's elements, 'float' (float32 or the activation dtype), 'e8m0' or 'e4m3'
    bytes. ``global_scale``: the float32 ``fc*_global_scale`` input, '' never, 'per-expert' in place of the
    scales when ``block_size`` is 0 (FP8), 'always' beside them (NVFP4: ``[E]`` or ``[E, N]``).
    ``device``: the dtype the engines hold the scales in, '' as given, 'float32' (FP4: one per block).
    """

    block: int = 0
    square: bool = False
    stored: str = "float"
    global_scale: str = ""
    device: str = ""


@dataclass(frozen=True)
class WeightFormat:
    """One weight format: its one name, its code widths, zero points, scale rule and decode trait.

    ``name``: the spelling everywhere the package chooses one (``quantize(format=)``, presets, the bench and
    warm ``--format``, random layers, checkpoint loaders). ``quant_type``: the contract's attribute value
    for it (docs/contract.md). ``bits``: the code widths it allows (fixed for a float format).
    ``zero_points``: whether a projection may have them. ``decode``: the device decode trait of its codes
    ('' : the projection's zero-point mode). ``codec``: the module of :mod:`qmoe_rtc.formats` with its codec,
    projection checks, reference dequantization and device scales. ``summary``: what a weight is, in words.
    ``code_dtypes``: the dtypes the contract takes its code tensors in.
    """

    name: str
    quant_type: str
    bits: tuple[int, ...]
    zero_points: bool
    scale: ScaleRule
    decode: str
    codec: str
    summary: str
    code_dtypes: tuple[str, ...] = ("uint8",)

    # -- rules ---------------------------------------------------------------------------------
    def check_bits(self, bits: Any, name: str = "bits") -> int:
        """``bits`` as an int when it is one of this format's code widths, else a :class:`QMoEAttributeError`."""
        if isinstance(bits, bool) or not hasattr(bits, "__index__") or int(bits) not in self.bits:
            why = f" ({self.name} codes are {self.bits[0]}-bit)" if len(self.bits) == 1 else ""
            raise QMoEAttributeError(name, f"one of {self.bits}{why}", repr(bits))
        return int(bits)

    def decode_trait(self, zero_points: str = "none", name: str = "zero points") -> str:
        """The device decode trait (a key of ``CPP_ZP``) of this format's codes with zero-point mode
        ``zero_points``: the mode itself for integer codes, the format's own trait for float codes (which
        refuse zero points)."""
        if zero_points not in ZERO_POINT_MODES:
            raise QMoEAttributeError(name, f"one of {list(ZERO_POINT_MODES)}", repr(zero_points))
        if zero_points != "none" and not self.zero_points:
            raise QMoEAttributeError(name, f"'none' with format {self.name!r} ({self.summary}: no zero point)",
                                     repr(zero_points))
        return self.decode or zero_points

    def check_block_size(self, block_size: Any, name: str = "block_size") -> int:
        """``block_size`` as an int when this format's scales can have it (a layout's value: 0 or a power of
        two >= 16; a format with its own block takes exactly that), else a :class:`QMoEAttributeError`."""
        bs = block_size
        if isinstance(bs, bool) or not hasattr(bs, "__index__") or not (bs == 0 or (bs >= 16 and bs & (bs - 1) == 0)):
            raise QMoEAttributeError(name, "0 (row-wise) or a power of two >= 16", repr(bs))
        if self.scale.block and bs != self.scale.block:
            raise QMoEAttributeError(name, f"{self.scale.block} with format {self.name!r} (its scale block)", repr(bs))
        return int(bs)

    def attribute_block_size(self, value: int, name: str = "block_size") -> int:
        """The ``block_size`` attribute as the contract reads it for this format: the format's own block when
        it has one (0 meaning that block); for square scales any value <= 0 is 0 (one scale per expert, as
        ONNX Runtime reads it); else 0 (row-wise) or a power of two >= 16."""
        if self.scale.block:
            if value not in (0, self.scale.block):
                raise QMoEAttributeError(name, f"{self.scale.block} (or 0, meaning {self.scale.block}): the "
                                         "format's scale block", str(value))
            return self.scale.block
        if self.scale.square and value < 0:
            return 0
        if value != 0 and (value < 16 or value & (value - 1)):
            raise QMoEAttributeError(name, "0 (row-wise) or a power of two >= 16"
                                     + (" (or <= 0 for global scales)" if self.scale.square else ""), str(value))
        return value

    # -- the codec module ----------------------------------------------------------------------
    def module(self) -> ModuleType:
        """The module of :mod:`qmoe_rtc.formats` that codes this format (imported on first use)."""
        return importlib.import_module(f"{__package__}.{self.codec}")

    def quantize(self, xp, weights, bits, block_size: int, symmetric: bool, scale_dtype):
        """Quantize float experts ``[E, N, K]`` (checked by :func:`qmoe_rtc.formats.quantize.quantize`) into this format."""
        return self.module().quantize(self, xp, weights, bits, block_size, symmetric, scale_dtype)

    def check_layer(self, w: dict, attrs, has_fc3: bool) -> None:
        """The contract's layer-wide checks of this format (which FC3 and global-scale inputs it takes)."""
        self.module().check_layer(self, w, attrs, has_fc3)

    def projection(self, w: dict, attrs, p: str, E: int, N: int, K: int):
        """Check one projection's inputs (``w`` by input name) and describe it: a
        :class:`~qmoe_rtc.formats.projection.ProjectionSpec`."""
        return self.module().projection(self, w, attrs, p, E, N, K)

    def check_content(self, weights: dict, p, host) -> None:
        """The contract's opt-in content checks of one projection's arrays (``host`` copies an array to NumPy)."""
        self.module().check_content(self, weights, p, host)

    def reference_weights(self, weights: dict, p, e: int, zero_point_offset=None):
        """Expert ``e`` of projection ``p`` dequantized in float32 ``[N, K]``: the reference's weights."""
        return self.module().reference_weights(self, weights, p, e, zero_point_offset)

    def device_scales(self, scales, global_scale=None):
        """The scales as the engines hold them (NumPy or CuPy, as given)."""
        return self.module().device_scales(self, scales, global_scale)


INT = WeightFormat("int", "int", (1, 2, 3, 4, 8), True, ScaleRule(), "", "int_codes",
                   "b-bit integer codes, w = (q − zp)·s")
FP8_E4M3 = WeightFormat("fp8_e4m3", "fp8", (8,), False, ScaleRule(square=True, global_scale="per-expert"), "fp8",
                        "fp8", "float8 e4m3fn codes, w = e4m3(q)·s", ("uint8", "float8_e4m3fn"))
MXFP4 = WeightFormat("mxfp4", "mxfp4", (4,), False, ScaleRule(block=32, stored="e8m0", device="float32"), "fp4",
                     "fp4", "e2m1 codes with an e8m0 scale per 32, w = e2m1(q)·2^(s−127)")
NVFP4 = WeightFormat("nvfp4", "nvfp4", (4,), False,
                     ScaleRule(block=16, stored="e4m3", global_scale="always", device="float32"), "fp4", "fp4",
                     "e2m1 codes with an e4m3 scale per 16 and a float32 global scale, w = e2m1(q)·e4m3(s)·g")

#: Every weight format by its name.
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (INT, FP8_E4M3, MXFP4, NVFP4)}
#: The contract's ``quant_type`` values (ONNX Runtime's 'int' and 'fp8', and 'mxfp4' / 'nvfp4' [ext]).
QUANT_TYPES = tuple(f.quant_type for f in FORMATS.values())


def weight_format(value: Any, name: str = "format") -> WeightFormat:
    """The format named ``value`` (a :class:`WeightFormat` is returned as it is); anything else raises
    :class:`~qmoe_rtc.errors.WeightFormatError` naming the input ``name``, the format names and the value
    (and the format a contract ``quant_type`` spelling stands for, when it is one)."""
    if isinstance(value, WeightFormat):
        return value
    fmt = FORMATS.get(value) if isinstance(value, str) else None
    if fmt is None:
        alias = next((f for f in FORMATS.values() if isinstance(value, str) and value == f.quant_type), None)
        hint = f"the format of quant_type {value!r} is spelled {alias.name!r}" if alias else None
        raise WeightFormatError(name, f"one of {list(FORMATS)}", repr(value), hint)
    return fmt


def format_of_quant_type(quant_type: Any, bits: Any = None, name: str = "quant_type") -> WeightFormat:
    """The format of the contract's ``quant_type`` attribute (bytes are decoded), with ``bits`` (when given)
    checked against its code widths under the name ``expert_weight_bits``: the one place the contract's
    spelling meets the package's."""
    if isinstance(quant_type, bytes):
        quant_type = quant_type.decode()
    fmt = next((f for f in FORMATS.values() if f.quant_type == quant_type), None)
    if fmt is None:
        raise WeightFormatError(name, f"one of {QUANT_TYPES} (the quantizations this build implements)",
                                repr(quant_type))
    if bits is not None:
        fmt.check_bits(bits, "expert_weight_bits")
    return fmt
