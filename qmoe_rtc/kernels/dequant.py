"""Kernel family ``dequant``: packed expert weights -> dense [E, N, K] in T.

Template: ``cuda_src/dequant_expert.cuh``, ``qmoe::dequant_expert<T, ScaleT, BITS, BLOCK, ZP>``.
One module per distinct projection quantization (bits, zero-point mode) of a layer; used by tests
and as a fallback path.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import QMoEAttributeError, QMoEInputError
from ..jit.family import CPP_TYPES, KernelDef, KernelFamily, Launch, Ptr, Scalar
from ..specialize import BITS, ZP_MODES, ModuleSpec
from . import register

__all__ = ["DequantFamily", "dequant_spec", "dequantize_experts"]

_ZP_ENUM = {"none": "qmoe::ZP_NONE", "packed": "qmoe::ZP_PACKED", "offset": "qmoe::ZP_OFFSET"}
_MAX_GRID = 2**31 - 1


def dequant_spec(dtype: str, bits: int, block_size: int = 0, zp: str = "none", scale_dtype: str = "",
                 threads: int = 256) -> ModuleSpec:
    """The spec of one dequant module (validated through Layout's rules)."""
    from ..specialize import Layout

    lay = Layout(dtype=dtype, scale_dtype=scale_dtype, fc1_bits=bits, fc1_zp=zp, block_size=block_size, threads=threads)
    return ModuleSpec.make("dequant", dtype=lay.dtype, scale_dtype=lay.scale_dtype, bits=bits,
                           block_size=lay.block_size, zp=zp, threads=lay.threads)


@register
class DequantFamily(KernelFamily):
    name = "dequant"
    header = "dequant_expert.cuh"
    depends_on = ("dtype", "scale_dtype", "fc1_bits", "fc2_bits", "fc3_bits", "fc1_zp", "fc2_zp", "fc3_zp",
                  "has_fc3", "block_size", "threads")
    variants = None  # always available (fallback / tests)

    def specs(self, config: Any, variants: Iterable[str]) -> list[ModuleSpec]:
        layout = getattr(config, "layout", config)
        out: dict[ModuleSpec, None] = {}
        for p in layout.projections:
            out.setdefault(dequant_spec(layout.dtype, layout.bits(p), layout.block_size, layout.zp(p),
                                        layout.scale_dtype, layout.threads), None)
        return list(out)

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        if spec["bits"] not in BITS or spec["zp"] not in ZP_MODES:
            raise QMoEAttributeError("dequant spec", f"bits in {BITS}, zp in {ZP_MODES}", f"{spec.params}")
        t, s = CPP_TYPES[spec["dtype"]], CPP_TYPES[spec["scale_dtype"]]
        expr = f"qmoe::dequant_expert<{t}, {s}, {spec['bits']}, {spec['block_size']}, {_ZP_ENUM[spec['zp']]}>"
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

    def launch(self, spec: ModuleSpec, kernel: str = "dequant_expert", *, E: int, N: int, K: int, **_: Any) -> Launch:
        threads = spec["threads"]
        groups = E * N * ((K + 7) // 8)
        blocks = max(1, min(_MAX_GRID, (groups + threads - 1) // threads))
        return Launch((blocks, 1, 1), (threads, 1, 1), 0)


def dequantize_experts(w, scales, bits: int, *, zero_points=None, zero_point_offset: float | None = None,
                       block_size: int = 0, K: int | None = None, dtype: str = "float16", out=None,
                       stream=None, threads: int = 256):
    """Dequantize ``w`` [E, N, ceil(K*b/8)] uint8 (CuPy) to ``out`` [E, N, K] in ``dtype``.

    zero-point mode: 'packed' with ``zero_points``, 'offset' with ``zero_point_offset``, else 'none'.
    ``K`` defaults to the largest K the packed row length allows (exact for K*b % 8 == 0).
    A bfloat16 ``out`` may be a uint16 CuPy array (bit pattern).
    """
    import cupy

    from .._arrays import dtype_name
    from ..jit import load_module

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
    spec = dequant_spec(dtype, bits, block_size, zp, "float32" if sdt == "float32" else dtype, threads)
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
    if out is None:
        from .._arrays import np_dtype

        out = cupy.empty((E, N, K), dtype=np_dtype(dtype) if dtype != "bfloat16" else cupy.uint16)
    if tuple(out.shape) != (E, N, K):
        raise QMoEInputError("out", f"shape {[E, N, K]}", f"{list(out.shape)}")
    mod = load_module(spec, w.device.id)
    fam = DequantFamily()
    geo = fam.launch(spec, E=E, N=N, K=K)
    mod["dequant_expert"].launch(geo, (w, scales, zero_points, float(zero_point_offset or 0.0), out, E, N, K),
                                 stream=stream)
    return out
