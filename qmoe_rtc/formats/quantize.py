"""Quantize float experts into the QMoE raw layout, and unpack / dequantize them again: the public entry point
of every weight format's codec (:mod:`qmoe_rtc.formats`).

Layout (docs/contract.md, "Packed weights"): one expert is a row-major matrix ``[N, K]`` of ``b``-bit
codes packed **least-significant bits first along K** — element ``k`` sits in byte ``k·b // 8`` at bit
offset ``k·b % 8``; a 3-bit row is one continuous bitstream (codes straddle bytes); a row takes
``ceil(K·b/8)`` bytes and unused high bits of its last byte are zero.

Dequantization: ``w = (q − zp) · scale`` in float32, with ``zp`` from a zero-point tensor, else the
``zero_point_offset`` attribute, else ``2^(b−1)``. ``quantize(..., format="fp8_e4m3")`` makes FP8
(float8 e4m3fn) experts instead (:mod:`qmoe_rtc.formats.fp8`), ``format="mxfp4"`` / ``"nvfp4"`` FP4 (e2m1)
experts (:mod:`qmoe_rtc.formats.fp4`).

:func:`quantize` lives here; the integer codec it re-exports (``pack_codes``, ``unpack_codes``,
``packed_row_bytes``, ``unpack_zero_points``, ``dequantize``) lives in :mod:`qmoe_rtc.formats.int_codes`,
``QuantizedWeights`` in :mod:`qmoe_rtc.formats.axis` and ``NVFP4Weights`` in :mod:`qmoe_rtc.formats.fp4`.
Every function accepts NumPy arrays, and CuPy arrays too (returning CuPy).
"""

from __future__ import annotations

import numpy as np

from .._arrays import array_module, dtype_name, shape_str
from ..errors import QMoEInputError
from .axis import INT, QuantizedWeights, weight_format
from .fp4 import NVFP4Weights
from .int_codes import check_bits, dequantize, pack_codes, packed_row_bytes, unpack_codes, unpack_zero_points

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedWeights",
    "NVFP4Weights",
    "packed_row_bytes",
    "pack_codes",
    "unpack_codes",
    "quantize",
    "dequantize",
    "unpack_zero_points",
]

#: Bit widths of the contract's integer codes (the ``int`` format's).
SUPPORTED_BITS = INT.bits


def quantize(weights, bits: int | None = None, block_size: int = 0, symmetric: bool = True, scale_dtype=np.float32,
             format: str = "int"):
    """Quantize float experts ``[E, N, K]`` into the raw QMoE layout.

    Args:
        weights: float array ``[E, N, K]`` (NumPy or CuPy), N output and K input features.
        bits: 1, 2, 3, 4 or 8 (``format="int"``); None or 8 with ``format="fp8_e4m3"``; None or 4 with
            ``"mxfp4"`` / ``"nvfp4"``.
        block_size: 0 for one scale per row, else a power of two ≥ 16 dividing K. FP8: 0 for one
            float32 scale per expert, else a power of two ≥ 16 (need not divide N or K) for square
            ``bs × bs`` block scales. FP4: 0 or the format's block (32 for mxfp4, 16 for nvfp4).
        symmetric: True stores offset-binary codes around the implicit zero point ``2^(b−1)``
            (no zero-point tensor); False picks a per-block (or per-row) min/max range and returns
            packed zero points. FP8 is symmetric only.
        scale_dtype: dtype of the returned scales: float32, float16 or bfloat16 (the activation dtype);
            FP8 global scales are float32 only.
        format: ``"int"`` (b-bit integer codes), ``"fp8_e4m3"`` (float8 e4m3fn codes, ONNX Runtime's
            ``quant_type="fp8"``), ``"mxfp4"`` or ``"nvfp4"`` (e2m1 codes, ``quant_type`` of the same
            name [ext]; ``symmetric`` and ``scale_dtype`` do not apply).

    Returns:
        :class:`QuantizedWeights` ``(packed, scales, zero_points)``. FP8: ``packed`` is uint8 codes
        ``[E, N, K]``, ``scales`` the ``fc*_global_scale`` input ``[E]`` (block_size 0) or the
        ``fc*_scales`` block scales ``[E, ceil(N/bs), ceil(K/bs)]``, ``zero_points`` None. MXFP4:
        ``packed`` uint8 ``[E, N, K/2]``, ``scales`` e8m0 bytes ``[E, N, K/32]``. NVFP4:
        :class:`NVFP4Weights` ``(packed, scales, global_scale)``: e4m3fn scales ``[E, N, K/16]`` and the
        float32 ``fc*_global_scale`` ``[E]``.

    Raises :class:`~qmoe_rtc.errors.QMoEInputError` for bad arguments, weights that are not finite
    (NaN or inf) and scales that do not fit ``scale_dtype`` (e.g. float16 overflow).
    """
    fmt = weight_format(format)
    if fmt is INT:
        bits = check_bits(bits)
    elif bits is not None and (isinstance(bits, bool) or bits not in fmt.bits):  # a float format's width is its own
        raise QMoEInputError("bits", f"None or {fmt.bits[0]} with format={fmt.name!r}", repr(bits))
    xp = array_module(weights)
    w = xp.asarray(weights)
    if w.ndim != 3:
        raise QMoEInputError("weights", "rank 3 [E, N, K]", f"shape {shape_str(w.shape)}")
    if w.dtype.kind not in "fiu" and dtype_name(w) != "bfloat16":
        raise QMoEInputError("weights", "a float (or integer) array", f"dtype {dtype_name(w)}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise QMoEInputError("block_size", "an integer: 0 or a power of two >= 16", repr(block_size))
    return fmt.quantize(xp, w, bits, int(block_size), symmetric, scale_dtype)
