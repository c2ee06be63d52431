"""Packed b-bit codes (1/2/3/4/8 bits): the contract's row layout, packed and unpacked.

One expert is a row-major matrix ``[N, K]`` of ``b``-bit codes packed **least-significant bits first along K**
(docs/contract.md, "Packed weights"): element ``k`` sits in byte ``k·b // 8`` at bit offset ``k·b % 8``; a 3-bit row
is one continuous bitstream; a row takes ``ceil(K·b/8)`` bytes. The same packing holds zero points (along the block
axis, or along N for row-wise ones) and FP4 (e2m1) codes.

Every function accepts NumPy arrays, and CuPy arrays too (returning CuPy). :mod:`qmoe_rtc.quantize` re-exports them.
"""

from __future__ import annotations

import numpy as np

from ._arrays import array_module, shape_str
from .errors import QMoEInputError
from .specialize.vocab import BITS

__all__ = ["check_bits", "pack_codes", "packed_row_bytes", "unpack_codes", "unpack_zero_points"]


def check_bits(bits, name="bits") -> int:
    """``bits`` as an int when it is a code width of the contract (1, 2, 3, 4, 8), else a QMoEInputError naming ``name``."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BITS:
        raise QMoEInputError(name, f"one of {BITS}", repr(bits))
    return int(bits)


def packed_row_bytes(K: int, bits: int) -> int:
    """Bytes of one packed row of ``K`` codes: ``ceil(K·b/8)``."""
    return (int(K) * int(bits) + 7) // 8


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group: 8 codes in b bytes for 3-bit, 8/b codes in 1 byte else."""
    return (8, 3) if bits == 3 else (8 // bits, 1)


def pack_codes(codes, bits: int):
    """Pack integer codes ``[..., K]`` (each < 2^bits) into uint8 ``[..., ceil(K·b/8)]``, LSB first."""
    bits = check_bits(bits)
    xp = array_module(codes)
    codes = xp.asarray(codes)
    K = codes.shape[-1]
    if codes.size and int(codes.max()) >= (1 << bits):
        raise QMoEInputError("codes", f"values below 2^{bits} = {1 << bits}", f"max {int(codes.max())}")
    lead = codes.shape[:-1]
    if bits == 8:
        return xp.ascontiguousarray(codes.astype(xp.uint8))
    G, B = _group(bits)
    pad = (-K) % G
    c = codes.astype(xp.uint32)
    if pad:
        c = xp.concatenate([c, xp.zeros((*lead, pad), dtype=xp.uint32)], axis=-1)
    c = c.reshape(*lead, -1, G)
    acc = c[..., 0].copy()
    for j in range(1, G):
        acc |= c[..., j] << (bits * j)
    out = xp.stack([(acc >> (8 * i)) & 0xFF for i in range(B)], axis=-1).astype(xp.uint8)
    out = out.reshape(*lead, -1)[..., : packed_row_bytes(K, bits)]
    return xp.ascontiguousarray(out)


def unpack_codes(packed, bits: int, K: int):
    """Unpack uint8 ``[..., ceil(K·b/8)]`` into codes uint8 ``[..., K]`` (the inverse of :func:`pack_codes`)."""
    bits = check_bits(bits)
    xp = array_module(packed)
    packed = xp.asarray(packed)
    K = int(K)
    need = packed_row_bytes(K, bits)
    if packed.shape[-1] != need:
        raise QMoEInputError(
            "packed", f"last dim ceil(K·b/8) = {need} for K={K}, b={bits}", f"shape {shape_str(packed.shape)}"
        )
    if bits == 8:
        return packed.astype(xp.uint8)
    lead = packed.shape[:-1]
    G, B = _group(bits)
    p = packed.astype(xp.uint32)
    pad = (-need) % B
    if pad:
        p = xp.concatenate([p, xp.zeros((*lead, pad), dtype=xp.uint32)], axis=-1)
    p = p.reshape(*lead, -1, B)
    acc = p[..., 0].copy()
    for i in range(1, B):
        acc |= p[..., i] << (8 * i)
    mask = (1 << bits) - 1
    out = xp.stack([(acc >> (bits * j)) & mask for j in range(G)], axis=-1).astype(xp.uint8)
    return xp.ascontiguousarray(out.reshape(*lead, -1)[..., :K])


def unpack_zero_points(zero_points, bits: int, N: int, n_blocks: int, block_wise: bool):
    """Zero-point codes as uint8 ``[E, N, nb]`` (block-wise) or ``[E, N, 1]`` (row-wise).

    Block-wise zero points are packed along the block axis ``[E, N, ceil(nb·b/8)]``; row-wise ones
    along N ``[E, ceil(N·b/8)]``.
    """
    if block_wise:
        return unpack_codes(zero_points, bits, n_blocks)
    return unpack_codes(zero_points, bits, N)[..., None]
