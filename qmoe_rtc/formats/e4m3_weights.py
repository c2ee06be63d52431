"""Expert weights as float8 e4m3fn codes, exactly, for FP8 tensor cores: the part of each format that e4m3 holds
without rounding, with its scales kept apart (they multiply outside the MMA).

This is the prepack step of the FP8-activation engine (``activation_quant`` = "fp8_e4m3" [ext], docs/contract.md):
measured on an H100 (docs/performance-log.md, the FP8 probe), warpgroup MMAs fed prepacked e4m3 codes run at
96–100 % of the FP8 rate, while int4 codes converted in registers hold them to 55–81 %. No engine reads these codes
yet; what each format gives:

- ``int`` codes of 1–4 bits: ``q − zp`` with ``q, zp`` in ``[0, 2^b)``, an integer within ±15, which e4m3 (3 mantissa
  bits) holds exactly. 8-bit codes (``q − zp`` up to ±255) do not fit: they are refused, and stay on the 16-bit path.
- ``mxfp4`` / ``nvfp4`` codes (e2m1: 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6): every value is an e4m3 value.
- ``fp8_e4m3`` codes are already e4m3.

Each function returns uint8 codes ``[E, N, K]`` (one byte per weight, row-major along K) whose
:func:`qmoe_rtc.formats.fp8.decode_e4m3fn` equals the format's unscaled weight (``q − zp``, the e2m1 value) exactly.
NumPy or CuPy in, the same out.
"""

from __future__ import annotations

import numpy as np

from .._arrays import array_module, dtype_name, shape_str
from ..errors import QMoEInputError
from .fp4 import decode_e2m1
from .fp8 import encode_e4m3fn
from .int_codes import check_bits, dequantize

__all__ = ["E4M3_INT_BITS", "e2m1_as_e4m3", "int_codes_as_e4m3"]

#: Code widths of the ``int`` format whose ``q − zp`` e4m3 holds exactly.
E4M3_INT_BITS = (1, 2, 3, 4)


def _lookup(table: np.ndarray, index):
    """``table[index]`` on the index's array module (a 256- or 16-entry uint8 table)."""
    xp = array_module(index)
    return xp.asarray(table)[index]


def int_codes_as_e4m3(packed, bits: int, K: int, block_size: int = 0, zero_points=None, zero_point_offset=None):
    """e4m3 codes uint8 ``[E, N, K]`` of ``q − zp`` for packed ``int`` codes ``[E, N, ceil(K·b/8)]``.

    This is :func:`qmoe_rtc.formats.int_codes.dequantize` with unit scales, ``zp`` as it takes it: packed
    ``zero_points`` (block-wise along ``K / block_size`` blocks, or row-wise), else an integer ``zero_point_offset``,
    else ``2^(b−1)``. Refused
    (:class:`QMoEInputError`): 8-bit codes, and an offset that is not an integer in ``[0, 2^b)`` (``q − zp`` would
    not be exact in e4m3).
    """
    bits = check_bits(bits)
    if bits not in E4M3_INT_BITS:
        raise QMoEInputError("bits", f"one of {E4M3_INT_BITS} (q − zp exact in e4m3; 8-bit codes reach ±255)", str(bits))
    if zero_points is None and zero_point_offset is not None:
        off = zero_point_offset
        whole = isinstance(off, (int, float, np.integer, np.floating)) and not isinstance(off, bool) and float(off).is_integer()
        if not whole or not 0 <= int(off) < (1 << bits):
            raise QMoEInputError("zero_point_offset", f"an integer in [0, {1 << bits}) (q − zp exact in e4m3)",
                                 repr(zero_point_offset))
    xp = array_module(packed)
    packed = xp.asarray(packed)
    if packed.ndim != 3 or dtype_name(packed) != "uint8":
        raise QMoEInputError("packed", "uint8 [E, N, ceil(K·b/8)]", f"{dtype_name(packed)} {shape_str(packed.shape)}")
    E, N, K = int(packed.shape[0]), int(packed.shape[1]), int(K)
    if block_size and K % block_size:
        raise QMoEInputError("block_size", f"a divisor of K = {K}", str(block_size))
    ones = xp.ones((E, N, K // block_size) if block_size else (E, N), dtype=xp.float32)  # unit scales: w = q − zp
    diff = dequantize(packed, ones, bits, block_size, zero_points, zero_point_offset, K)  # [E, N, K] integers within ±15
    table = encode_e4m3fn(np.arange(-16, 17, dtype=np.float32))  # e4m3 of −16 .. 16
    return xp.ascontiguousarray(_lookup(table, (diff + 16).astype(xp.int32)))


def e2m1_as_e4m3(codes):
    """e4m3 codes uint8 ``[...]`` of e2m1 codes uint8 ``[...]`` (one code per element in bits 0–3): the same
    values."""
    xp = array_module(codes)
    table = encode_e4m3fn(decode_e2m1(np.arange(16, dtype=np.uint8)))  # [16]
    return _lookup(table, xp.asarray(codes) & 0xF)
