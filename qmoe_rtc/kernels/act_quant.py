"""Kernel family ``act_quant``: FP8 activations [ext] on the GPU, a GEMM's input rows -> e4m3fn codes and scales.

Template ``cuda_src/activations/quantize_fp8.cuh``, ``qmoe::quantize_fp8_rows<T>``: the codes and scales of
:func:`qmoe_rtc.formats.activations.quantize_activations`, bit for bit (docs/contract.md, "FP8 activations"). One
module per activation dtype. No pipeline launches it yet: the FP8-activation engine that will read its output does
not exist, and :class:`~qmoe_rtc.executor.QMoE` refuses ``activation_quant`` by name; :func:`quantize_activations_gpu`
runs it on its own (tests, and the engine's building block).
"""

from __future__ import annotations

from typing import Any

from .._arrays import dtype_name, np_dtype
from ..errors import DeviceError, QMoEInputError
from ..formats.activations import group_count
from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import CPP_TYPES, ModuleSpec
from .base import KernelFamily, register

__all__ = ["ActQuantFamily", "MIN_CC", "quantize_activations_gpu"]

THREADS = 256  # kQuantThreads
MIN_CC = 89  # cvt.rn.satfinite.e4m3x2.f32: sm_89+
DTYPES = ("float32", "float16", "bfloat16")
MAX_GRID_Y = 65535


@register
class ActQuantFamily(KernelFamily):
    name = "act_quant"
    header = "activations/quantize_fp8.cuh"
    depends_on = ()  # no layer loads it yet; its one parameter, the rows' dtype, is the caller's

    def specs(self, config: Any) -> list[ModuleSpec]:
        """None for a layer: no pipeline launches it yet (the warm tool compiles nothing of it)."""
        return []

    def spec_for(self, dtype: str) -> ModuleSpec:
        """The module of rows in ``dtype`` (float32, float16 or bfloat16)."""
        if dtype not in DTYPES:
            raise QMoEInputError("dtype", f"one of {DTYPES}", repr(dtype))
        return ModuleSpec.make(self.name, dtype=dtype)

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        args = (Ptr("x", spec["dtype"]),        # [rows, K] T
                Scalar("K", "int32"),
                Scalar("g", "int32"),            # values a scale along K (K: a scale a row)
                Ptr("codes", "uint8"),           # [rows, K] e4m3fn
                Ptr("scales", "float32"))        # [rows, ceil(K / g)]
        return (KernelDef("quantize_fp8_rows", f"qmoe::quantize_fp8_rows<{CPP_TYPES[spec['dtype']]}>", args),)

    def geometry(self, spec: ModuleSpec, *, rows: int, K: int, group: int) -> Launch:
        """Grid (groups a row, rows) of blocks of 256 threads, one block per (group, row)."""
        return Launch((group_count(K, group), rows, 1), (THREADS, 1, 1), 0)


def quantize_activations_gpu(x, group: int = 0, codes=None, scales=None, stream=None):
    """``(codes [rows, K] uint8, scales [rows, G] float32)`` of CuPy rows ``x`` ``[rows, K]`` (float32, float16 or
    bfloat16, C-contiguous) with a scale per ``group`` values along K (0: a scale a row), on ``x``'s device (sm_89+).
    Refused before any launch: another rank, dtype or layout, a negative group, outputs of other shapes or dtypes,
    a device below sm_89."""
    import cupy

    from ..jit import load_module

    dt = dtype_name(x)
    if dt not in DTYPES or x.ndim != 2 or not x.flags.c_contiguous:
        raise QMoEInputError("x", "C-contiguous [rows, K] float32 / float16 / bfloat16",
                             f"rank {x.ndim}, dtype {dt}, contiguous {bool(x.flags.c_contiguous)}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise QMoEInputError("group", "0 (a scale a row) or a positive number of values a scale", repr(group))
    rows, K = (int(d) for d in x.shape)
    G = group_count(K, group)
    for name, arr, want, wdt in (("codes", codes, (rows, K), "uint8"), ("scales", scales, (rows, G), "float32")):
        if arr is not None and (tuple(arr.shape) != want or dtype_name(arr) != wdt or not arr.flags.c_contiguous):
            raise QMoEInputError(name, f"C-contiguous {list(want)} {wdt}", f"{list(arr.shape)} {dtype_name(arr)}")
    dev = x.device.id
    cc = int(cupy.cuda.Device(dev).compute_capability)
    if cc < MIN_CC:
        raise DeviceError(f"FP8 activations need sm_89 or newer (the e4m3 conversion); device {dev} is sm_{cc}")
    with cupy.cuda.Device(dev):
        codes = cupy.empty((rows, K), cupy.uint8) if codes is None else codes
        scales = cupy.empty((rows, G), np_dtype("float32")) if scales is None else scales
        if rows and K:
            fam = ActQuantFamily()
            spec = fam.spec_for(dt)
            kernel = load_module(fam.unit(spec), dev)["quantize_fp8_rows"]
            for r0 in range(0, rows, MAX_GRID_Y):  # grid.y holds at most 65 535 rows a launch
                r1 = min(rows, r0 + MAX_GRID_Y)
                geo = fam.geometry(spec, rows=r1 - r0, K=K, group=group)
                kernel(geo.grid, geo.block, (x[r0:r1], K, group or K, codes[r0:r1], scales[r0:r1]),
                       shared_mem=geo.shared_mem, stream=stream)
    return codes, scales
