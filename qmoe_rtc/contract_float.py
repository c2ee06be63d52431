"""The contract's projections with float codes: FP8 (ONNX Runtime's ``quant_type="fp8"``) and FP4
(``quant_type="mxfp4"`` / ``"nvfp4"`` [ext]). :func:`qmoe_rtc.contract.describe_layer` calls these for
each projection of such a layer; every refusal names the input, the expected and the actual value.
"""

from __future__ import annotations

from ._arrays import dtype_name, shape_str
from .errors import QMoEInputError
from .projection import ProjectionSpec, require
from .specialize.vocab import DTYPES as FLOAT_DTYPES

__all__ = ["fp4_projection", "fp8_projection"]


def fp8_projection(w, attrs, p, E, N, K) -> ProjectionSpec:
    """One FP8 projection: codes ``[E, N, K]``, the global scale ``[E]`` float32 (block_size 0) or square
    block scales ``[E, ceil(N/bs), ceil(K/bs)]`` in float32 or T, no zero points."""
    from .fp8 import fp8_scale_shape

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
                          zp_mode="fp8", has_bias=w[bn] is not None,
                          bias_dtype=dtype_name(w[bn]) if w[bn] is not None else None, quant="fp8")


def fp4_projection(w, attrs, p, E, N, K) -> ProjectionSpec:
    """One FP4 projection [ext] (:mod:`qmoe_rtc.fp4`): e2m1 codes ``[E, N, K/2]``, block scales
    ``[E, N, K/bs]`` (MXFP4: e8m0 bytes, bs 32; NVFP4: e4m3fn, bs 16, with the float32 global scale
    ``[E]`` or ``[E, N]``), no zero points. The engines hold float32 scales (:func:`qmoe_rtc.fp4.engine_scales`)."""
    qt, bs = attrs.quant_type, attrs.block_size
    wn, sn, bn, zn = f"{p}_experts_weights", f"{p}_scales", f"{p}_experts_bias", f"{p}_zero_points"
    if K % bs:
        raise QMoEInputError(wn, f"K a multiple of {bs} ({qt} scale blocks of {bs} codes along K)", f"{p}'s K = {K}")
    require(wn, w[wn], shape=(E, N, K // 2), dtypes=("uint8",),
             where=f"[E, N, K/2] e2m1 codes, two per byte, with N={N}, K={K}")
    if w[zn] is not None:
        raise QMoEInputError(zn, f"absent with quant_type='{qt}' (e2m1 has no zero point)", "an array")
    sdt = ("uint8", "float8_e8m0fnu") if qt == "mxfp4" else ("uint8", "float8_e4m3fn")
    require(sn, w[sn], shape=(E, N, K // bs), dtypes=sdt,
             where=f"{qt} block scales [E, N, K/{bs}] ({'e8m0' if qt == 'mxfp4' else 'e4m3fn'} bytes)")
    if qt == "nvfp4":
        gn = f"{p}_global_scale"
        require(gn, w[gn], rank=(1, 2), dtypes=("float32",), where="the NVFP4 global scale, float32")
        if tuple(w[gn].shape) not in ((E,), (E, N)):
            raise QMoEInputError(gn, f"shape {shape_str((E,))} (per expert) or {shape_str((E, N))} (per row)",
                                 f"shape {shape_str(w[gn].shape)}")
    if w[bn] is not None:
        require(bn, w[bn], shape=(E, N), dtypes=FLOAT_DTYPES)
    return ProjectionSpec(name=p, bits=4, N=N, K=K, block_size=bs, row_bytes=K // 2, scale_dtype="float32",
                          zp_mode="fp4", has_bias=w[bn] is not None,
                          bias_dtype=dtype_name(w[bn]) if w[bn] is not None else None, quant=qt)
