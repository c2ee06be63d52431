"""Quantize float experts into the QMoE raw layout, and unpack / dequantize them again.

Layout (docs/contract.md, "Packed weights"): one expert is a row-major matrix ``[N, K]`` of ``b``-bit
codes packed **least-significant bits first along K** — element ``k`` sits in byte ``k·b // 8`` at bit
offset ``k·b % 8``; a 3-bit row is one continuous bitstream (codes straddle bytes); a row takes
``ceil(K·b/8)`` bytes and unused high bits of its last byte are zero.

Dequantization: ``w = (q − zp) · scale`` in float32, with ``zp`` from a zero-point tensor, else the
``zero_point_offset`` attribute, else ``2^(b−1)``. ``quantize(..., format="fp8_e4m3")`` makes FP8
(float8 e4m3fn) experts instead (:mod:`qmoe_rtc.fp8`), ``format="mxfp4"`` / ``"nvfp4"`` FP4 (e2m1)
experts (:mod:`qmoe_rtc.fp4`).

Every function accepts NumPy arrays, and CuPy arrays too (returning CuPy).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._arrays import array_module, dtype_name, np_dtype, shape_str
from .bit_codes import check_bits, pack_codes, packed_row_bytes, unpack_codes, unpack_zero_points
from .errors import QMoEInputError
from .specialize.vocab import BITS
from .specialize.vocab import DTYPES as FLOAT_DTYPES

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

#: Bit widths of the contract.
SUPPORTED_BITS = BITS


class QuantizedWeights(NamedTuple):
    """One projection of all experts in the raw QMoE layout."""

    packed: object  #: uint8 ``[E, N, ceil(K·b/8)]``
    scales: object  #: ``[E, N]`` (row-wise) or ``[E, N, K/bs]`` (block-wise)
    zero_points: object | None  #: None (symmetric) or uint8 ``[E, N, ceil(nb·b/8)]`` / ``[E, ceil(N·b/8)]``


class NVFP4Weights(NamedTuple):
    """One NVFP4 projection of all experts (``quantize(format="nvfp4")``)."""

    packed: object  #: uint8 ``[E, N, K/2]`` e2m1 codes
    scales: object  #: uint8 ``[E, N, K/16]`` e4m3fn block scales (``fc*_scales``)
    global_scale: object  #: float32 ``[E]`` (``fc*_global_scale``)

    @property
    def zero_points(self) -> None:
        """None: e2m1 has no zero point."""
        return None


def _check_scale_dtype(scale_dtype) -> str:
    """The canonical name of a scale dtype: float32, float16 or bfloat16 (anything else is refused)."""
    try:
        name = dtype_name(scale_dtype)
    except Exception:  # e.g. an object NumPy cannot read as a dtype
        name = None
    if name not in FLOAT_DTYPES:
        raise QMoEInputError("scale_dtype", f"one of {FLOAT_DTYPES}", repr(scale_dtype))
    return name


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
    from .fp4 import FP4_BLOCK

    if format not in ("int", "fp8_e4m3", *FP4_BLOCK):
        raise QMoEInputError("format", f"one of {('int', 'fp8_e4m3', *FP4_BLOCK)}", repr(format))
    if format == "int":
        bits = check_bits(bits)
    elif bits is not None and (isinstance(bits, bool) or bits != (8 if format == "fp8_e4m3" else 4)):
        raise QMoEInputError("bits", f"None or {8 if format == 'fp8_e4m3' else 4} with format={format!r}", repr(bits))
    xp = array_module(weights)
    w = xp.asarray(weights)
    if w.ndim != 3:
        raise QMoEInputError("weights", "rank 3 [E, N, K]", f"shape {shape_str(w.shape)}")
    if w.dtype.kind not in "fiu" and dtype_name(w) != "bfloat16":
        raise QMoEInputError("weights", "a float (or integer) array", f"dtype {dtype_name(w)}")
    E, N, K = (int(d) for d in w.shape)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise QMoEInputError("block_size", "an integer: 0 or a power of two >= 16", repr(block_size))
    block_size = int(block_size)
    if format == "fp8_e4m3":
        return _quantize_fp8(xp, w, block_size, symmetric, scale_dtype)
    if format in FP4_BLOCK:
        return _quantize_fp4(xp, w, block_size, symmetric, format)
    sdt = _check_scale_dtype(scale_dtype)
    if block_size < 0 or (block_size and (block_size < 16 or block_size & (block_size - 1) or K % block_size)):
        raise QMoEInputError("block_size", f"0 or a power of two >= 16 dividing K={K}", str(block_size))
    chunk = max(1, (1 << 24) // max(1, N * K))  # bound the float32 temporaries to ~64 MiB each
    parts = [_quantize_chunk(xp, w[e0 : e0 + chunk], e0, bits, block_size, symmetric, sdt) for e0 in range(0, E, chunk)]
    if len(parts) == 1:
        return parts[0]
    return QuantizedWeights(
        xp.concatenate([p.packed for p in parts]),
        xp.concatenate([p.scales for p in parts]),
        None if symmetric else xp.concatenate([p.zero_points for p in parts]),
    )


def _quantize_fp8(xp, w, block_size: int, symmetric: bool, scale_dtype) -> QuantizedWeights:
    """:func:`quantize` with ``format="fp8_e4m3"`` (NumPy; CuPy input is quantized on the host and returned as CuPy)."""
    from .fp8 import check_fp8_scale_dtype, quantize_fp8

    if block_size < 0 or (block_size and (block_size < 16 or block_size & (block_size - 1))):
        raise QMoEInputError("block_size", "0 (a global scale per expert) or a power of two >= 16", str(block_size))
    if symmetric is not True:
        raise QMoEInputError("symmetric", "True with format='fp8_e4m3' (e4m3fn has no zero point)", repr(symmetric))
    sdt = check_fp8_scale_dtype(scale_dtype, block_size)
    host = w.get() if xp is not np else w
    codes, scales = quantize_fp8(host, block_size, sdt)
    return QuantizedWeights(xp.asarray(codes), xp.asarray(scales), None)


def _quantize_fp4(xp, w, block_size: int, symmetric: bool, quant: str):
    """:func:`quantize` with ``format="mxfp4"`` / ``"nvfp4"`` (NumPy, or CuPy on the device)."""
    from .fp4 import FP4_BLOCK, quantize_fp4

    bs = FP4_BLOCK[quant]
    if block_size not in (0, bs):
        raise QMoEInputError("block_size", f"0 or {bs} with format={quant!r} (its scale block)", str(block_size))
    if symmetric is not True:
        raise QMoEInputError("symmetric", f"True with format={quant!r} (e2m1 has no zero point)", repr(symmetric))
    if int(w.shape[2]) % bs:
        raise QMoEInputError("weights", f"K a multiple of {bs} ({quant} blocks)", f"shape {shape_str(w.shape)}")
    codes, scales, g = quantize_fp4(w, quant)
    if quant == "nvfp4":
        return NVFP4Weights(codes, scales, g)
    return QuantizedWeights(codes, scales, None)


def _quantize_chunk(xp, w, e0: int, bits: int, block_size: int, symmetric: bool, sdt: str) -> QuantizedWeights:
    """:func:`quantize` of experts ``e0 .. e0 + len(w)`` (arguments already checked)."""
    E, N, K = (int(d) for d in w.shape)
    bs = block_size or K
    nb = K // bs
    g = w.astype(xp.float32).reshape(E, N, nb, bs)
    finite = xp.isfinite(g)
    if not bool(finite.all()):
        idx = [int(i) for i in xp.argwhere(~finite.reshape(E, N, K))[0]]
        raise QMoEInputError("weights", "finite values (no NaN or inf)",
                             f"{float(w[tuple(idx)])} at index {[idx[0] + e0, *idx[1:]]}")
    qmax = (1 << bits) - 1
    if symmetric:
        zp = float(1 << (bits - 1))
        amax = xp.abs(g).max(axis=-1)
        scale = amax / zp
        scale = xp.where(scale > 0, scale, 1.0)
        scale_s = _cast_scales(xp, scale, sdt, e0)
        s = scale_s.astype(xp.float32)[..., None]
        q = xp.clip(xp.rint(g / s) + zp, 0, qmax)
        zero_points = None
    else:
        lo = g.min(axis=-1)
        hi = g.max(axis=-1)
        scale = (hi - lo) / qmax
        scale = xp.where(scale > 0, scale, 1.0)
        scale_s = _cast_scales(xp, scale, sdt, e0)
        s = scale_s.astype(xp.float32)
        zpc = xp.clip(xp.rint(-lo / s), 0, qmax)
        q = xp.clip(xp.rint(g / s[..., None]) + zpc[..., None], 0, qmax)
        zpc = zpc.astype(xp.uint8)
        if block_size:
            zero_points = pack_codes(zpc, bits)  # [E, N, ceil(nb·b/8)]
        else:
            zero_points = pack_codes(zpc[..., 0], bits)  # [E, ceil(N·b/8)]
    packed = pack_codes(q.astype(xp.uint8).reshape(E, N, K), bits)
    scales = scale_s if block_size else scale_s[..., 0]
    return QuantizedWeights(packed, xp.ascontiguousarray(scales), zero_points)


def _cast_scales(xp, scale, sdt: str, e0: int):
    """float32 scales ``[E, N, nb]`` in ``sdt``, refusing any that overflow it (a weight range too wide for float16)."""
    with np.errstate(over="ignore"):
        out = scale.astype(np_dtype(sdt))
    bad = ~xp.isfinite(out.astype(xp.float32))
    if bool(bad.any()):
        idx = [int(i) for i in xp.argwhere(bad)[0]]
        raise QMoEInputError("weights", f"value ranges whose scales fit {sdt}",
                             f"a scale of {float(scale[tuple(idx)]):.3g} for expert {idx[0] + e0}, row {idx[1]}, "
                             f"block {idx[2]}")
    return out


def dequantize(packed, scales, bits: int, block_size: int = 0, zero_points=None, zero_point_offset=None, K=None):
    """Dequantize raw-layout codes to float32 ``[E, N, K]``: ``w = (q − zp) · scale``.

    ``K`` defaults to ``nb·block_size`` for block-wise scales and to ``bytes·8 // b`` for row-wise
    ones; pass it when a row-wise row has padding bits (e.g. 3-bit with K not a multiple of 8).
    ``zero_points`` (packed uint8) wins over ``zero_point_offset``; with neither, zp = 2^(b−1).
    """
    bits = check_bits(bits)
    xp = array_module(packed)
    packed = xp.asarray(packed)
    scales = xp.asarray(scales)
    if packed.ndim != 3 or dtype_name(packed) != "uint8":
        raise QMoEInputError("packed", "uint8 [E, N, ceil(K·b/8)]", f"{dtype_name(packed)} {shape_str(packed.shape)}")
    E, N = int(packed.shape[0]), int(packed.shape[1])
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 0:
        raise QMoEInputError("block_size", "0 or a power of two >= 16", repr(block_size))
    block_size = int(block_size)
    if K is None:
        K = scales.shape[-1] * block_size if block_size and scales.ndim == 3 else packed.shape[-1] * 8 // bits
    K = int(K)
    nb = K // block_size if block_size else 1
    want = ((E, N, nb),) if block_size else ((E, N), (E, N, 1))
    if tuple(int(d) for d in scales.shape) not in want or (block_size and K % block_size):
        raise QMoEInputError("scales", " or ".join(shape_str(w) for w in want) + f" (K={K}, block_size={block_size})",
                             f"shape {shape_str(scales.shape)}")
    q = unpack_codes(packed, bits, K).astype(xp.float32)  # [E, N, K]
    s = scales.astype(xp.float32).reshape(E, N, nb)
    if zero_points is not None:
        zp = unpack_zero_points(xp.asarray(zero_points), bits, N, nb, bool(block_size)).astype(xp.float32)
    elif zero_point_offset is not None:
        zp = xp.full((E, N, 1), float(zero_point_offset), dtype=xp.float32)
    else:
        zp = xp.full((E, N, 1), float(1 << (bits - 1)), dtype=xp.float32)
    bs = block_size or K
    w = (q.reshape(E, N, nb, bs) - zp.reshape(E, N, -1, 1)) * s[..., None]
    return w.reshape(E, N, K).astype(xp.float32)
