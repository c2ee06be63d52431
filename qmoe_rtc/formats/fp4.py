"""The ``mxfp4`` and ``nvfp4`` weight formats [ext]: e2m1 codes with MXFP4 (e8m0 scale per 32) or NVFP4 (e4m3
scale per 16 and a float32 global scale) scales. The code decoder and encoder, quantization into both formats, the
float32 dequantization the reference uses, the per-block float32 scales the GPU engines hold, and the contract
projection checks.

A code is a nibble ``s e e m``: sign bit 3, a 2-bit exponent (bias 1) and a 1-bit mantissa. Exponent
0 is subnormal (``m/2``), the others normal (``(1 + m/2) · 2^(e−1)``), so the eight magnitudes are
0, 0.5, 1, 1.5, 2, 3, 4 and 6; every code is a number (no NaN, no infinity). Codes are packed two per
byte along K, the even element in the low nibble, exactly like 4-bit integer codes
(docs/contract.md, "FP4 experts [ext]"):

- ``mxfp4`` (OCP microscaling): ``w = e2m1(q) · 2^(s − 127)`` with one e8m0 byte ``s``
  per block of 32 codes along K, scales uint8 ``[E, N, K/32]``; ``s = 255`` is NaN and refused.
- ``nvfp4``: ``w = e2m1(q) · e4m3(s) · g[e]`` with one e4m3fn byte per block of 16
  codes, scales ``[E, N, K/16]`` (uint8 or float8_e4m3fn) and the float32 global scale
  ``fc*_global_scale`` ``[E]`` (one per expert) or ``[E, N]`` (one per row).

The contract's ``quant_type`` has the same names. On the GPU the engines read one float32 scale per block
(:func:`engine_scales`): MXFP4's are the exact powers of two, NVFP4's the float32 product ``e4m3(s) · g`` (rounded
once, at most half a float32 unit in the last place). Functions taking ``fmt`` accept the format's name or its
:class:`~qmoe_rtc.formats.axis.WeightFormat`. Nothing here runs at import time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._arrays import array_module, dtype_name, is_cupy, shape_str
from ..errors import QMoEInputError
from .axis import MXFP4, NVFP4, QuantizedWeights, WeightFormat, weight_format
from .fp8 import e4m3_table, encode_e4m3fn
from .int_codes import FLOAT_DTYPES, pack_codes, unpack_codes
from .projection import ProjectionSpec, require

__all__ = ["E2M1_MAX", "NVFP4Weights", "check_content", "check_fp4_scales", "check_layer", "decode_e2m1",
           "decode_e8m0", "dequantize_fp4", "device_scales", "encode_e2m1", "engine_scales", "fp4_format",
           "fp4_scale_shape", "projection", "quantize", "quantize_fp4", "reference_weights"]

#: The largest e2m1 magnitude (codes 0x7 / 0xF).
E2M1_MAX = 6.0


class NVFP4Weights(NamedTuple):
    """One NVFP4 projection of all experts (``quantize(format="nvfp4")``)."""

    packed: object  #: uint8 ``[E, N, K/2]`` e2m1 codes
    scales: object  #: uint8 ``[E, N, K/16]`` e4m3fn block scales (``fc*_scales``)
    global_scale: object  #: float32 ``[E]`` (``fc*_global_scale``)

    @property
    def zero_points(self) -> None:
        """None: e2m1 has no zero point."""
        return None


def fp4_format(fmt, name: str = "format") -> WeightFormat:
    """The FP4 format ``fmt`` names ('mxfp4' / 'nvfp4', or its WeightFormat); any other is a QMoEInputError."""
    f = weight_format(fmt, name)
    if f not in (MXFP4, NVFP4):
        raise QMoEInputError(name, "'mxfp4' or 'nvfp4' (an FP4 format)", repr(fmt))
    return f


#: The eight e2m1 magnitudes, by the code's low three bits.
_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: Halfway points between neighbouring magnitudes (rounding boundaries).
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2


def _table() -> np.ndarray:
    """float32 ``[16]``: the value of every code (from sign, exponent and mantissa)."""
    c = np.arange(16)
    e, m = (c >> 1) & 3, (c & 1).astype(np.float64)
    mag = np.where(e == 0, m / 2.0, (1.0 + m / 2.0) * np.exp2(e - 1.0))
    return (np.where(c >> 3, -1.0, 1.0) * mag).astype(np.float32)


def decode_e2m1(codes):
    """float32 values of e2m1 codes (uint8 ``[...]``, one code per element in bits 0–3)."""
    xp = array_module(codes)
    return xp.asarray(_table())[xp.asarray(codes) & 0xF]


def encode_e2m1(values):
    """uint8 codes ``[...]`` of float values (NumPy or CuPy, as given), rounded to the nearest e2m1 value
    (ties to an even mantissa), magnitudes above 6 saturating to ±6. NaN is refused (:class:`QMoEInputError`)."""
    xp = array_module(values)
    v = xp.asarray(values, dtype=xp.float32)
    if bool(xp.isnan(v).any()):
        idx = [int(i) for i in xp.argwhere(xp.isnan(v))[0]]
        raise QMoEInputError("values", "numbers (no NaN)", f"NaN at index {idx}")
    mag, mid = xp.abs(v), xp.asarray(_MIDPOINTS)
    lo = xp.searchsorted(mid, mag, side="left")
    hi = xp.searchsorted(mid, mag, side="right")
    idx = xp.where(lo != hi, lo + (lo & 1), lo)  # on a midpoint: the neighbour with the even mantissa
    return (idx | xp.where(xp.signbit(v), 8, 0)).astype(xp.uint8)


def decode_e8m0(scales):
    """float32 ``2^(s − 127)`` of e8m0 bytes (uint8, or ml_dtypes float8_e8m0fnu viewed as bytes); 255 is NaN."""
    xp = array_module(scales)
    s = xp.asarray(scales).view(xp.uint8).astype(xp.uint32)
    bits = xp.where(s == 0, xp.uint32(0x00400000), s << 23)  # 2^-127 is a float32 subnormal
    bits = xp.where(s == 255, xp.uint32(0x7FC00000), bits)
    return bits.view(xp.float32)


def _e4m3(scales):
    xp = array_module(scales)
    return xp.asarray(e4m3_table())[xp.asarray(scales).view(xp.uint8)]


def fp4_scale_shape(E: int, N: int, K: int, fmt) -> tuple:
    """``(E, N, K / block)`` of ``fmt`` ('mxfp4': blocks of 32, 'nvfp4': 16)."""
    return (E, N, K // fp4_format(fmt).scale.block)


def engine_scales(fmt, scales, global_scale=None):
    """float32 ``[E, N, K/block]``: the scale of each block as the GPU engines read it (NumPy or CuPy,
    as given). MXFP4: ``2^(s − 127)``, exact. NVFP4: ``e4m3(s) · g`` in float32 (rounded once)."""
    if fp4_format(fmt) is MXFP4:
        return decode_e8m0(scales)
    xp = array_module(scales)
    g = xp.asarray(global_scale).astype(xp.float32)
    g = g[:, None, None] if g.ndim == 1 else g[..., None]
    return (_e4m3(scales) * g).astype(xp.float32)


def check_fp4_scales(fmt, scales, global_scale=None, name: str = "scales") -> None:
    """:class:`QMoEInputError` for scales with no finite value: e8m0 255 (NaN), e4m3 NaN codes, global
    scales that are not finite and positive. Reads the arrays (host copies of CuPy arrays)."""
    def host(a):
        return a.get() if is_cupy(a) else np.asarray(a)

    mx = fp4_format(fmt) is MXFP4
    s = host(scales).view(np.uint8)
    bad = s == 255 if mx else (s & 0x7F) == 0x7F
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        what = "e8m0 scales other than 255 (NaN)" if mx else "e4m3fn scales without NaN codes (0x7F, 0xFF)"
        raise QMoEInputError(name, what, f"code {int(s[tuple(idx)]):#04x} at index {idx}")
    if not mx and global_scale is not None:
        g = host(global_scale).astype(np.float32)
        bad = ~np.isfinite(g) | (g <= 0)
        if bad.any():
            idx = [int(i) for i in np.argwhere(bad)[0]]
            raise QMoEInputError(name.replace("_scales", "_global_scale"), "finite, positive global scales",
                                 f"{float(g[tuple(idx)])} at index {idx}")


def dequantize_fp4(fmt, packed, scales, global_scale=None) -> np.ndarray:
    """float32 ``[E, N, K]`` of FP4 experts: codes uint8 ``[E, N, K/2]``, scales ``[E, N, K/block]``
    (and NVFP4's global scale ``[E]`` or ``[E, N]``), by the formulas of the module docstring."""
    f = fp4_format(fmt, "quant")
    q = np.asarray(packed)
    if q.ndim != 3 or q.dtype != np.uint8:
        raise QMoEInputError("packed", "uint8 [E, N, K/2] e2m1 codes", f"{dtype_name(q)} {shape_str(q.shape)}")
    E, N, K = int(q.shape[0]), int(q.shape[1]), 2 * int(q.shape[2])
    want = fp4_scale_shape(E, N, K, f)
    if tuple(int(d) for d in np.shape(scales)) != want:
        raise QMoEInputError("scales", f"shape {shape_str(want)} ({f.name})", f"shape {shape_str(np.shape(scales))}")
    s = engine_scales(f, np.asarray(scales), global_scale)
    v = decode_e2m1(unpack_codes(q, 4, K)).reshape(E, N, -1, f.scale.block)
    return (v * s[..., None]).reshape(E, N, K).astype(np.float32)


def quantize_fp4(weights, fmt):
    """Quantize float experts ``[E, N, K]`` (K a multiple of the block; NumPy, or CuPy computed on the
    device): ``(codes uint8 [E, N, K/2], scales, global scale or None)``, in the input's array module.

    MXFP4: each block's scale is the smallest power of two ``X`` with ``amax/X <= 6``, so no code
    saturates. NVFP4: the global scale is ``amax(expert) / (6 · 448)`` (1 for an all-zero expert), each
    block's e4m3 scale the nearest code to ``amax(block) / (6 · g)``; codes divide by the product as
    stored. Non-finite weights are refused.
    """
    f = fp4_format(fmt)
    xp = array_module(weights)
    w = xp.asarray(weights).astype(xp.float32)
    finite = xp.isfinite(w)
    if not bool(finite.all()):
        idx = [int(i) for i in xp.argwhere(~finite)[0]]
        raise QMoEInputError("weights", "finite values (no NaN or inf)", f"{float(w[tuple(idx)])} at index {idx}")
    E, N, K = (int(d) for d in w.shape)
    bs = f.scale.block
    if K % bs:
        raise QMoEInputError("weights", f"K a multiple of {bs} ({f.name} blocks of {bs} codes)", f"K = {K}")
    blocks = w.reshape(E, N, K // bs, bs)
    amax = xp.abs(blocks).max(axis=-1)  # [E, N, nb]
    if f is MXFP4:
        with np.errstate(divide="ignore"):
            exp = xp.ceil(xp.log2(xp.where(amax > 0, amax, E2M1_MAX) / E2M1_MAX))
        scales = (xp.clip(exp, -127, 127) + 127).astype(xp.uint8)
        g = None
    else:
        gmax = amax.reshape(E, -1).max(axis=1)
        g = xp.where(gmax > 0, gmax / (E2M1_MAX * 448.0), 1.0).astype(xp.float32)  # [E]
        want = xp.minimum(amax / (E2M1_MAX * g[:, None, None]), 448.0)
        scales = xp.asarray(encode_e4m3fn(want.get() if xp is not np else want))  # small: on the host
    s = engine_scales(f, scales, g)
    safe = xp.where(s > 0, s, 1.0)[..., None]
    scaled = xp.where(s[..., None] > 0, blocks / safe, 0.0)
    codes = encode_e2m1(scaled).reshape(E, N, K)
    return xp.ascontiguousarray(pack_codes(codes, 4)), xp.ascontiguousarray(scales), g


def quantize(fmt, xp, w, bits, block_size: int, symmetric: bool, scale_dtype):
    """:func:`qmoe_rtc.formats.quantize.quantize` with ``format="mxfp4"`` / ``"nvfp4"`` (NumPy, or CuPy on the device):
    :class:`~qmoe_rtc.formats.axis.QuantizedWeights` (MXFP4) or :class:`NVFP4Weights`."""
    bs = fmt.scale.block
    if block_size not in (0, bs):
        raise QMoEInputError("block_size", f"0 or {bs} with format={fmt.name!r} (its scale block)", str(block_size))
    if symmetric is not True:
        raise QMoEInputError("symmetric", f"True with format={fmt.name!r} (e2m1 has no zero point)", repr(symmetric))
    if int(w.shape[2]) % bs:
        raise QMoEInputError("weights", f"K a multiple of {bs} ({fmt.name} blocks)", f"shape {shape_str(w.shape)}")
    codes, scales, g = quantize_fp4(w, fmt)
    return NVFP4Weights(codes, scales, g) if fmt is NVFP4 else QuantizedWeights(codes, scales, None)


# -- the contract ------------------------------------------------------------------------------------

def check_layer(fmt, w: dict, attrs, has_fc3: bool) -> None:
    """NVFP4: no FC3 (there is no FC3 global scale input); MXFP4: no global scales."""
    qt = attrs.quant_type
    if fmt is NVFP4 and has_fc3:
        raise QMoEInputError("fc3_experts_weights", "absent with quant_type='nvfp4' (there is no FC3 global scale "
                             "input; use swiglu_fusion 1 or 2)", "an array")
    for n in ("fc1_global_scale", "fc2_global_scale"):
        if w.get(n) is not None and fmt is not NVFP4:
            raise QMoEInputError(n, f"absent with quant_type='{qt}' (FP8 and NVFP4 experts only)", "an array")


def projection(fmt, w: dict, attrs, p: str, E: int, N: int, K: int) -> ProjectionSpec:
    """One FP4 projection: e2m1 codes ``[E, N, K/2]``, block scales ``[E, N, K/bs]`` (MXFP4: e8m0 bytes, bs 32;
    NVFP4: e4m3fn, bs 16, with the float32 global scale ``[E]`` or ``[E, N]``), no zero points. The engines
    hold float32 scales (:func:`engine_scales`)."""
    qt, bs = attrs.quant_type, attrs.block_size
    wn, sn, bn, zn = f"{p}_experts_weights", f"{p}_scales", f"{p}_experts_bias", f"{p}_zero_points"
    if K % bs:
        raise QMoEInputError(wn, f"K a multiple of {bs} ({qt} scale blocks of {bs} codes along K)", f"{p}'s K = {K}")
    require(wn, w[wn], shape=(E, N, K // 2), dtypes=("uint8",),
            where=f"[E, N, K/2] e2m1 codes, two per byte, with N={N}, K={K}")
    if w[zn] is not None:
        raise QMoEInputError(zn, f"absent with quant_type='{qt}' (e2m1 has no zero point)", "an array")
    stored = fmt.scale.stored  # e8m0 (MXFP4) or e4m3 (NVFP4) bytes, or an ml_dtypes array of them
    sdt = ("uint8", "float8_e8m0fnu") if stored == "e8m0" else ("uint8", "float8_e4m3fn")
    require(sn, w[sn], shape=(E, N, K // bs), dtypes=sdt,
            where=f"{qt} block scales [E, N, K/{bs}] ({'e8m0' if stored == 'e8m0' else 'e4m3fn'} bytes)")
    if fmt.scale.global_scale == "always":
        gn = f"{p}_global_scale"
        require(gn, w[gn], rank=(1, 2), dtypes=("float32",), where="the NVFP4 global scale, float32")
        if tuple(w[gn].shape) not in ((E,), (E, N)):
            raise QMoEInputError(gn, f"shape {shape_str((E,))} (per expert) or {shape_str((E, N))} (per row)",
                                 f"shape {shape_str(w[gn].shape)}")
    if w[bn] is not None:
        require(bn, w[bn], shape=(E, N), dtypes=FLOAT_DTYPES)
    return ProjectionSpec(name=p, bits=4, N=N, K=K, block_size=bs, row_bytes=K // 2, scale_dtype="float32",
                          zp_mode="none", has_bias=w[bn] is not None,
                          bias_dtype=dtype_name(w[bn]) if w[bn] is not None else None, format=fmt.name)


def check_content(fmt, weights: dict, p: ProjectionSpec, host) -> None:
    """Scales with a value: no e8m0 255, no e4m3 NaN codes, finite positive global scales."""
    g = weights.get(f"{p.name}_global_scale") if fmt is NVFP4 else None
    check_fp4_scales(fmt, host(weights[p.scale_input]), None if g is None else host(g), p.scale_input)


def reference_weights(fmt, weights: dict, p: ProjectionSpec, e: int, zero_point_offset=None) -> np.ndarray:
    """Expert ``e`` of projection ``p`` in float32 ``[N, K]`` by the formulas of the module docstring."""
    g = weights.get(f"{p.name}_global_scale")
    return dequantize_fp4(fmt, weights[f"{p.name}_experts_weights"][e : e + 1], weights[p.scale_input][e : e + 1],
                          None if g is None else g[e : e + 1])[0]


def device_scales(fmt, scales, global_scale=None):
    """float32 per block (:func:`engine_scales`)."""
    return engine_scales(fmt, scales, global_scale)
