"""The ``fp8_e4m3`` weight format (the contract's ``quant_type="fp8"``): float8 e4m3fn experts. The code decoder,
the encoder, quantization into both scale forms, the contract projection checks and the reference weights.

A code is one byte: sign bit 7, a 4-bit exponent (bits 6–3, bias 7) and a 3-bit mantissa (bits 2–0).
Exponent 0 is subnormal (``m/8 · 2^−6``), every other exponent normal (``(1 + m/8) · 2^(e−7)``); the
two codes ``0x7F`` and ``0xFF`` (exponent 15, mantissa 7) are NaN, and there is no infinity, so the
largest finite magnitude is 448 (``0x7E``). Every code is exact in float32.

A weight is ``decode(q) · scale`` in float32 (docs/contract.md, "FP8 experts"), with either

- one float32 scale per expert (``fc1_global_scale`` / ``fc2_global_scale``, ``[E]``) when
  ``block_size`` is 0, or
- square block scales ``[E, ceil(N/bs), ceil(K/bs)]`` when ``block_size`` = bs > 0: block (i, j)
  covers rows ``[i·bs, (i+1)·bs)`` and columns ``[j·bs, (j+1)·bs)`` (the last ones may be partial).

:func:`decode_e4m3fn` is written from the format above, not from a library, so the tests can check
it against ``ml_dtypes.float8_e4m3fn`` code by code. Nothing here runs at import time.
"""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name, np_dtype, shape_str
from ..errors import QMoEInputError
from .axis import QuantizedWeights
from .int_codes import FLOAT_DTYPES, check_scale_dtype
from .projection import ProjectionSpec, require

__all__ = ["E4M3_MAX", "NAN_CODES", "as_codes", "check_content", "check_fp8_scale_dtype", "check_layer",
           "decode_e4m3fn", "dequantize_fp8", "device_scales", "e4m3_table", "encode_e4m3fn", "fp8_scale_shape",
           "projection", "quantize", "quantize_fp8", "reference_weights"]

#: The largest finite e4m3fn magnitude (code 0x7E).
E4M3_MAX = 448.0
#: The two NaN codes (exponent 15, mantissa 7, either sign).
NAN_CODES = (0x7F, 0xFF)

_TABLE: list = []  # the 256 decoded values, built on first use


def e4m3_table() -> np.ndarray:
    """float32 ``[256]``: the value of every code, from sign, exponent and mantissa."""
    if not _TABLE:
        c = np.arange(256, dtype=np.int64)
        sign = np.where(c >> 7, -1.0, 1.0)
        e = (c >> 3) & 0xF
        m = (c & 0x7).astype(np.float64)
        mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
        vals = sign * mag
        vals[(e == 15) & (c & 0x7 == 7)] = np.nan
        _TABLE.append(vals.astype(np.float32))  # exact: at most 4 significant bits, exponents -9..8
    return _TABLE[0]


def as_codes(a) -> np.ndarray:
    """The uint8 codes of a NumPy array of codes (uint8, or ml_dtypes float8_e4m3fn viewed as bytes)."""
    a = np.asarray(a)
    if dtype_name(a) == "float8_e4m3fn":
        return a.view(np.uint8)
    if a.dtype != np.uint8:
        raise QMoEInputError("codes", "uint8 or float8_e4m3fn codes", f"dtype {dtype_name(a)}")
    return a


def decode_e4m3fn(codes) -> np.ndarray:
    """float32 values of e4m3fn codes ``[...]`` (uint8 or float8_e4m3fn), NaN for 0x7F / 0xFF."""
    return e4m3_table()[as_codes(codes)]


def encode_e4m3fn(values) -> np.ndarray:
    """uint8 codes ``[...]`` of float values, rounded to the nearest code (ties to even mantissa).

    Values must be finite and within ±448 (:func:`quantize_fp8` scales them there); anything else is
    a :class:`QMoEInputError`, never a NaN code.
    """
    import ml_dtypes

    v = np.asarray(values, dtype=np.float32)
    bad = ~np.isfinite(v) | (np.abs(v) > E4M3_MAX)
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        raise QMoEInputError("values", f"finite values within ±{E4M3_MAX:g}", f"{float(v[tuple(idx)])} at index {idx}")
    return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fp8_scale_shape(E: int, N: int, K: int, block_size: int) -> tuple:
    """``(E,)`` (global, block_size 0) or ``(E, ceil(N/bs), ceil(K/bs))`` (square blocks)."""
    if block_size <= 0:
        return (E,)
    return (E, -(-N // block_size), -(-K // block_size))


def _expand(scales: np.ndarray, N: int, K: int, block_size: int) -> np.ndarray:
    """float32 scales ``[E, N, K]`` (or ``[E, 1, 1]`` for global ones) broadcastable against the codes."""
    s = np.asarray(scales).astype(np.float32)
    if block_size <= 0:
        return s.reshape(-1, 1, 1)
    return np.repeat(np.repeat(s, block_size, axis=1), block_size, axis=2)[:, :N, :K]


def dequantize_fp8(codes, scales, block_size: int = 0) -> np.ndarray:
    """float32 ``[E, N, K]`` = ``decode(codes) · scale`` from codes ``[E, N, K]`` and scales
    ``[E]`` (block_size 0) or ``[E, ceil(N/bs), ceil(K/bs)]``."""
    q = as_codes(codes)
    if q.ndim != 3:
        raise QMoEInputError("codes", "[E, N, K] float8e4m3fn codes", f"shape {shape_str(q.shape)}")
    E, N, K = (int(d) for d in q.shape)
    want = fp8_scale_shape(E, N, K, int(block_size))
    if tuple(int(d) for d in np.shape(scales)) != want:
        raise QMoEInputError("scales", f"shape {shape_str(want)} (block_size={block_size})",
                             f"shape {shape_str(np.shape(scales))}")
    return (decode_e4m3fn(q) * _expand(scales, N, K, int(block_size))).astype(np.float32)


def quantize_fp8(weights, block_size: int = 0, scale_dtype="float32"):
    """Quantize float experts ``[E, N, K]`` to e4m3fn codes: ``(codes uint8 [E, N, K], scales)``.

    Each scale is amax/448 of what it covers (1 where that is all zeros), so the largest magnitude maps
    to ±448; a code is the scaled value rounded to the nearest e4m3fn value. ``block_size`` 0 gives the
    float32 per-expert global scale ``[E]``; a power of two ≥ 16 gives block scales
    ``[E, ceil(N/bs), ceil(K/bs)]`` in ``scale_dtype`` (float32, float16 or bfloat16). The weights are
    divided by the scale as stored, so dequantizing with it is consistent. Arguments are checked by
    :func:`qmoe_rtc.formats.quantize.quantize`; non-finite weights are refused here.
    """
    w = np.asarray(weights).astype(np.float32)
    finite = np.isfinite(w)
    if not finite.all():
        idx = [int(i) for i in np.argwhere(~finite)[0]]
        raise QMoEInputError("weights", "finite values (no NaN or inf)", f"{float(w[tuple(idx)])} at index {idx}")
    E, N, K = (int(d) for d in w.shape)
    sdt = dtype_name(np_dtype(scale_dtype))
    if block_size <= 0:
        amax = np.abs(w).reshape(E, -1).max(axis=1, initial=0.0)  # [E]
    else:
        bs = int(block_size)
        nbn, nbk = -(-N // bs), -(-K // bs)
        pad = np.zeros((E, nbn * bs, nbk * bs), dtype=np.float32)
        pad[:, :N, :K] = np.abs(w)
        amax = pad.reshape(E, nbn, bs, nbk, bs).max(axis=(2, 4))  # [E, nbn, nbk]
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    with np.errstate(over="ignore"):
        stored = scale.astype(np_dtype(sdt))
    s32 = stored.astype(np.float32)
    if not np.isfinite(s32).all() or (s32 <= 0).any():
        idx = [int(i) for i in np.argwhere(~np.isfinite(s32) | (s32 <= 0))[0]]
        raise QMoEInputError("weights", f"value ranges whose scales fit {sdt}",
                             f"a scale of {float(scale[tuple(idx)]):.3g} at scale index {idx}")
    scaled = np.clip(w / _expand(s32, N, K, block_size), -E4M3_MAX, E4M3_MAX)  # the stored scale may round down
    return np.ascontiguousarray(encode_e4m3fn(scaled)), np.ascontiguousarray(stored)


def check_fp8_scale_dtype(scale_dtype, block_size: int) -> str:
    """The scale dtype name for an FP8 quantization: float32 for global scales (ONNX Runtime's inputs
    15/16 are float32), any of float32/float16/bfloat16 for block scales."""
    if block_size <= 0:
        return check_scale_dtype(scale_dtype, ("float32",), " (the per-expert global scale is float32)")
    return check_scale_dtype(scale_dtype, FLOAT_DTYPES)


def quantize(fmt, xp, w, bits, block_size: int, symmetric: bool, scale_dtype) -> QuantizedWeights:
    """:func:`qmoe_rtc.formats.quantize.quantize` with ``format="fp8_e4m3"`` (NumPy; CuPy input is quantized on the
    host and returned as CuPy)."""
    if block_size < 0 or (block_size and (block_size < 16 or block_size & (block_size - 1))):
        raise QMoEInputError("block_size", "0 (a global scale per expert) or a power of two >= 16", str(block_size))
    if symmetric is not True:
        raise QMoEInputError("symmetric", "True with format='fp8_e4m3' (e4m3fn has no zero point)", repr(symmetric))
    sdt = check_fp8_scale_dtype(scale_dtype, block_size)
    host = w.get() if xp is not np else w
    codes, scales = quantize_fp8(host, block_size, sdt)
    return QuantizedWeights(xp.asarray(codes), xp.asarray(scales), None)


# -- the contract ------------------------------------------------------------------------------------

def check_layer(fmt, w: dict, attrs, has_fc3: bool) -> None:
    """No FC3 (ONNX Runtime defines no FC3 global scale); the global scales only with block_size 0."""
    if has_fc3:
        raise QMoEInputError("fc3_experts_weights", "absent with quant_type='fp8' (ONNX Runtime defines no FC3 "
                             "global scale; use swiglu_fusion 1 or 2)", "an array")
    for n in ("fc1_global_scale", "fc2_global_scale"):
        if w.get(n) is not None and attrs.block_size > 0:
            raise QMoEInputError(n, "absent unless quant_type='fp8' with block_size 0 (block scales go in "
                                 f"{n[:3]}_scales)", "an array")


def projection(fmt, w: dict, attrs, p: str, E: int, N: int, K: int) -> ProjectionSpec:
    """One FP8 projection: codes ``[E, N, K]``, the global scale ``[E]`` float32 (block_size 0) or square
    block scales ``[E, ceil(N/bs), ceil(K/bs)]`` in float32 or T, no zero points."""
    wn, bn, zn, bs = f"{p}_experts_weights", f"{p}_experts_bias", f"{p}_zero_points", attrs.block_size
    require(wn, w[wn], shape=(E, N, K), dtypes=("uint8", "float8_e4m3fn"),
            where=f"[E, N, K] float8e4m3fn codes with N={N}, K={K}")
    if w[zn] is not None:
        raise QMoEInputError(zn, "absent with quant_type='fp8' (e4m3fn has no zero point)", "an array")
    if bs > 0:
        sn = f"{p}_scales"
        require(sn, w[sn], shape=fp8_scale_shape(E, N, K, bs), dtypes=FLOAT_DTYPES,
                where=f"square FP8 block scales [E, ceil(N/bs), ceil(K/bs)] with block_size={bs}")
    else:
        if w[f"{p}_scales"] is not None:
            raise QMoEInputError(f"{p}_scales", f"absent with quant_type='fp8' and block_size 0 (the scale is "
                                 f"{p}_global_scale)", "an array")
        sn = f"{p}_global_scale"
        require(sn, w[sn], shape=(E,), dtypes=("float32",), where="the per-expert FP8 scale [E], float32")
    if w[bn] is not None:
        require(bn, w[bn], shape=(E, N), dtypes=FLOAT_DTYPES)
    return ProjectionSpec(name=p, bits=8, N=N, K=K, block_size=max(bs, 0), row_bytes=K, scale_dtype=dtype_name(w[sn]),
                          zp_mode="none", has_bias=w[bn] is not None,
                          bias_dtype=dtype_name(w[bn]) if w[bn] is not None else None, format=fmt.name)


def check_content(fmt, weights: dict, p: ProjectionSpec, host) -> None:
    """No NaN codes (0x7F, 0xFF) in the weights."""
    q = host(weights[f"{p.name}_experts_weights"]).view(np.uint8)
    nan = (q & 0x7F) == 0x7F
    if nan.any():
        idx = [int(i) for i in np.argwhere(nan)[0]]
        raise QMoEInputError(f"{p.name}_experts_weights", "no NaN codes (0x7F, 0xFF) in float8e4m3fn weights",
                             f"code {int(q[tuple(idx)]):#04x} at index {idx}")


def reference_weights(fmt, weights: dict, p: ProjectionSpec, e: int, zero_point_offset=None) -> np.ndarray:
    """Expert ``e`` of projection ``p`` in float32 ``[N, K]``: ``e4m3(q) · scale``."""
    return dequantize_fp8(weights[f"{p.name}_experts_weights"][e : e + 1], weights[p.scale_input][e : e + 1],
                          p.block_size)[0]


def device_scales(fmt, scales, global_scale=None):
    """FP8 scales (global or square blocks) go to the device as they are."""
    return scales
