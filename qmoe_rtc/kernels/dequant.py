"""Kernel family ``dequant``: packed expert weights -> dense [E, N, K] in T.

Template: ``cuda_src/engines/dequant_expert.cuh``, ``qmoe::dequant_expert<T, ScaleT, BITS, BLOCK, ZP>``.
One module per distinct projection quantization (bits, block size and decode trait: the projection's
weight format and zero-point mode folded into one, the ``ZP`` template argument) of a layer; used by tests
and as a fallback path.
"""

from __future__ import annotations

from typing import Any

from .._arrays import dtype_name
from ..errors import QMoEAttributeError, QMoEInputError
from ..formats.axis import INT, weight_format
from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import BITS, CPP_TYPES, CPP_ZP, DECODE_TRAITS, Layout, ModuleSpec
from .base import KernelFamily, register

__all__ = ["DequantFamily", "dequant_spec", "dequantize_experts"]

_MAX_GRID = 2**31 - 1
THREADS = 256


def dequant_spec(dtype: str, bits: int, block_size: int = 0, zp: str = "none", scale_dtype: str = "",
                 threads: int = THREADS, format: str = "int") -> ModuleSpec:
    """The spec of one dequant module of ``format`` codes with zero-point mode ``zp`` (validated through
    Layout's rules); its ``zp`` parameter is their decode trait (``Layout.decode_trait``)."""
    lay = Layout(dtype=dtype, scale_dtype=scale_dtype, fc1_bits=bits, fc1_zp=zp, fc1_format=format,
                 block_size=block_size)
    if not (type(threads) is int and 32 <= threads <= 1024 and threads % 32 == 0):
        raise QMoEAttributeError("threads", "a multiple of 32 in [32, 1024]", repr(threads))
    return ModuleSpec.make("dequant", dtype=lay.dtype, scale_dtype=lay.scale_dtype, bits=bits,
                           block_size=lay.block_size, zp=lay.decode_trait("fc1"), threads=threads)


@register
class DequantFamily(KernelFamily):
    name = "dequant"
    header = "engines/dequant_expert.cuh"
    depends_on = ("dtype", "scale_dtype", "fc1_bits", "fc2_bits", "fc3_bits", "fc1_zp", "fc2_zp", "fc3_zp",
                  "fc1_format", "fc2_format", "fc3_format", "has_fc3", "block_size")

    def specs(self, config: Any) -> list[ModuleSpec]:
        layout = getattr(config, "layout", config)
        out: dict[ModuleSpec, None] = {}
        for p in layout.projections:
            out.setdefault(dequant_spec(layout.dtype, layout.bits(p), layout.block_size, layout.zp(p),
                                        layout.scale_dtype, format=layout.format(p).name), None)
        return list(out)

    def spec(self, config: Any) -> ModuleSpec:
        return self.specs(config)[0]

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        if spec["bits"] not in BITS or spec["zp"] not in DECODE_TRAITS:
            raise QMoEAttributeError("dequant spec", f"bits in {BITS}, zp in {DECODE_TRAITS}", f"{spec.params}")
        t, s = CPP_TYPES[spec["dtype"]], CPP_TYPES[spec["scale_dtype"]]
        expr = f"qmoe::dequant_expert<{t}, {s}, {spec['bits']}, {spec['block_size']}, {CPP_ZP[spec['zp']]}>"
        args = (
            Ptr("w", "uint8"),                       # [E, N, ceil(K*b/8)]
            Ptr("scales", spec["scale_dtype"]),      # [E, N] or [E, N, K/bs]
            Ptr("zp", "uint8", nullable=True),       # packed zero points (zp == 'packed')
            Scalar("zp_offset", "float32"),          # zp == 'offset'
            Ptr("out", spec["dtype"]),               # [E, N, K]
            Scalar("E", "int32"),
            Scalar("N", "int32"),
            Scalar("K", "int32"),
        )
        return (KernelDef("dequant_expert", expr, args),)

    def geometry(self, spec: ModuleSpec, *, E: int, N: int, K: int) -> Launch:
        threads = spec["threads"]
        groups = E * N * ((K + 7) // 8)
        blocks = max(1, min(_MAX_GRID, (groups + threads - 1) // threads))
        return Launch((blocks, 1, 1), (threads, 1, 1), 0)


def dequantize_experts(w, scales, bits: int, *, zero_points=None, zero_point_offset: float | None = None,
                       block_size: int = 0, K: int | None = None, dtype: str = "float16", out=None,
                       stream=None, threads: int = 256, format: str = "int"):
    """Dequantize ``w`` [E, N, ceil(K*b/8)] uint8 (CuPy) to ``out`` [E, N, K] in ``dtype``.

    zero-point mode: 'packed' with ``zero_points``, 'offset' with ``zero_point_offset``, else 'none'.
    ``K`` defaults to the largest K the packed row length allows (exact for K*b % 8 == 0).
    A bfloat16 ``out`` may be a uint16 CuPy array (bit pattern).
    ``format`` (:mod:`qmoe_rtc.formats`): 'fp8_e4m3': ``w`` holds float8 e4m3fn codes [E, N, K] (bits 8, no zero
    points) and ``scales`` is the per-expert scale [E] (block_size 0) or square blocks [E, ceil(N/bs), ceil(K/bs)]
    (:mod:`qmoe_rtc.formats.fp8`). 'mxfp4' / 'nvfp4': ``w`` holds e2m1 codes [E, N, K/2] (bits 4, no zero points)
    and ``scales`` the float32 block scales [E, N, K/bs] the engines read (:func:`qmoe_rtc.formats.fp4.engine_scales`).
    """
    fmt = weight_format(format)
    if fmt is not INT:
        fmt.check_bits(bits, "bits")
        if zero_points is not None or zero_point_offset is not None:
            raise QMoEInputError("zero_points", f"none with format={fmt.name!r} ({fmt.summary}: no zero point)", "given")
        if fmt.scale.square:
            return _dequantize_square(fmt, w, scales, block_size, dtype, out, stream, threads)
        if not block_size:
            raise QMoEInputError("block_size", f"{fmt.scale.block} with format={fmt.name!r} (its scale block)", "0")
    if w.ndim != 3:
        raise QMoEInputError("w", "[E, N, ceil(K*b/8)] uint8", f"rank {w.ndim}")
    E, N, row_bytes = (int(d) for d in w.shape)
    if K is None:
        K = row_bytes * 8 // bits
    if (K * bits + 7) // 8 != row_bytes:
        raise QMoEInputError("w", f"row length ceil({K}*{bits}/8) = {(K * bits + 7) // 8} bytes", f"{row_bytes}")
    if zero_points is not None and zero_point_offset is not None:
        raise QMoEInputError("zero_points", "either zero points or zero_point_offset", "both")
    zp = "packed" if zero_points is not None else ("offset" if zero_point_offset is not None else "none")
    sdt = dtype_name(scales)
    spec = dequant_spec(dtype, bits, block_size, zp, "float32" if sdt == "float32" else dtype, threads, fmt.name)
    nb = K // block_size if block_size else 1
    if block_size and K % block_size:
        raise QMoEInputError("w", f"K divisible by block_size {block_size}", f"K={K}")
    want = (E, N, nb) if block_size else (E, N)
    if tuple(scales.shape) not in (want, (E, N, 1) if not block_size else want):
        raise QMoEInputError("scales", f"shape {list(want)}", f"{list(scales.shape)}")
    if zero_points is not None:
        zwant = (E, N, (nb * bits + 7) // 8) if block_size else (E, (N * bits + 7) // 8)
        if tuple(zero_points.shape) != zwant:
            raise QMoEInputError("zero_points", f"shape {list(zwant)}", f"{list(zero_points.shape)}")
    return _launch(spec, w, scales, zero_points, float(zero_point_offset or 0.0), dtype, out, stream, (E, N, K))


def _dequantize_square(fmt, w, scales, block_size: int, dtype: str, out, stream, threads: int):
    """:func:`dequantize_experts` for codes with square scale blocks (float8 e4m3fn, ``format='fp8_e4m3'``)."""
    from ..formats.fp8 import fp8_scale_shape

    if w.ndim != 3 or dtype_name(w) not in fmt.code_dtypes:
        raise QMoEInputError("w", "[E, N, K] uint8 (float8 e4m3fn codes)", f"rank {w.ndim}, dtype {dtype_name(w)}")
    E, N, K = (int(d) for d in w.shape)
    want = fp8_scale_shape(E, N, K, block_size)
    if tuple(int(d) for d in scales.shape) != want:
        raise QMoEInputError("scales", f"shape {list(want)} (block_size={block_size})", f"{list(scales.shape)}")
    sdt = dtype_name(scales)
    spec = dequant_spec(dtype, fmt.bits[0], block_size, "none", "float32" if sdt == "float32" else dtype, threads,
                        fmt.name)
    return _launch(spec, w.view("uint8"), scales, None, 0.0, dtype, out, stream, (E, N, K))


def _launch(spec: ModuleSpec, w, scales, zero_points, zp_offset: float, dtype: str, out, stream, shape):
    import cupy

    from ..jit import load_module

    E, N, K = shape
    if out is None:
        from .._arrays import np_dtype

        out = cupy.empty((E, N, K), dtype=np_dtype(dtype) if dtype != "bfloat16" else cupy.uint16)
    if tuple(out.shape) != (E, N, K):
        raise QMoEInputError("out", f"shape {[E, N, K]}", f"{list(out.shape)}")
    fam = DequantFamily()
    mod = load_module(fam.unit(spec), w.device.id)
    geo = fam.geometry(spec, E=E, N=N, K=K)
    mod["dequant_expert"](geo.grid, geo.block, (w, scales, zero_points, zp_offset, out, E, N, K),
                          shared_mem=geo.shared_mem, stream=stream)
    return out
