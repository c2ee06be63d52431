"""The ``int`` weight format: b-bit integer codes (1/2/3/4/8 bits), ``w = (q − zp) · scale``. Its packing (the
contract's row layout, packed and unpacked), its quantizer and dequantizer, its contract projection checks and its
reference weights.

One expert is a row-major matrix ``[N, K]`` of ``b``-bit codes packed **least-significant bits first along K**
(docs/contract.md, "Packed weights"): element ``k`` sits in byte ``k·b // 8`` at bit offset ``k·b % 8``; a 3-bit row
is one continuous bitstream; a row takes ``ceil(K·b/8)`` bytes. The same packing holds zero points (along the block
axis, or along N for row-wise ones) and FP4 (e2m1) codes. ``zp`` comes from a zero-point tensor, else the
``zero_point_offset`` attribute, else ``2^(b−1)``.

Every function accepts NumPy arrays, and CuPy arrays too (returning CuPy). :mod:`qmoe_rtc.formats.quantize` re-exports the
public ones.
"""

from __future__ import annotations

import numpy as np

from .._arrays import array_module, dtype_name, np_dtype, shape_str
from ..errors import QMoEAttributeError, QMoEInputError
from .axis import INT, QuantizedWeights
from .projection import ProjectionSpec, require

__all__ = ["FLOAT_DTYPES", "check_bits", "check_content", "check_layer", "check_scale_dtype", "dequantize", "device_scales",
           "pack_codes", "packed_row_bytes", "projection", "quantize", "reference_weights", "unpack_codes",
           "unpack_zero_points"]

#: Float dtypes of scales, biases and activations (those of qmoe_rtc.specialize.vocab.DTYPES).
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def check_bits(bits, name="bits") -> int:
    """``bits`` as an int when it is a code width of the ``int`` format (1, 2, 3, 4, 8), else a QMoEInputError naming
    ``name``."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in INT.bits:
        raise QMoEInputError(name, f"one of {INT.bits}", repr(bits))
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


# -- quantize / dequantize ---------------------------------------------------------------------------

def check_scale_dtype(scale_dtype, allowed=FLOAT_DTYPES, why: str = "") -> str:
    """The canonical name of a scale dtype in ``allowed`` (anything else is refused, naming ``scale_dtype``)."""
    try:
        name = dtype_name(scale_dtype)
    except Exception:  # e.g. an object NumPy cannot read as a dtype
        name = None
    if name not in allowed:
        raise QMoEInputError("scale_dtype", f"one of {allowed}{why}", repr(scale_dtype))
    return name


def quantize(fmt, xp, w, bits, block_size: int, symmetric: bool, scale_dtype) -> QuantizedWeights:
    """:func:`qmoe_rtc.formats.quantize.quantize` of float experts ``w`` ``[E, N, K]`` into b-bit codes (arguments
    checked there but ``bits``, ``block_size`` and ``scale_dtype``), ~64 MiB of float32 temporaries at a time."""
    bits = check_bits(bits)
    E, N, K = (int(d) for d in w.shape)
    sdt = check_scale_dtype(scale_dtype)
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


# -- the contract ------------------------------------------------------------------------------------

def check_layer(fmt, w: dict, attrs, has_fc3: bool) -> None:
    """Integer codes take every projection and no global scale."""
    for n in ("fc1_global_scale", "fc2_global_scale"):
        if w.get(n) is not None:
            raise QMoEInputError(n, f"absent with quant_type='{attrs.quant_type}' (FP8 and NVFP4 experts only)",
                                 "an array")


def projection(fmt, w: dict, attrs, p: str, E: int, N: int, K: int) -> ProjectionSpec:
    """One projection of b-bit codes: ``[E, N, ceil(K·b/8)]``, scales ``[E, N]`` / ``[E, N, 1]`` (row-wise) or
    ``[E, N, K/block_size]`` in float32 or T, zero points from a packed tensor or the ``zero_point_offset``."""
    bits = attrs.bits(p)
    wn, sn, bn, zn = f"{p}_experts_weights", f"{p}_scales", f"{p}_experts_bias", f"{p}_zero_points"
    rb = packed_row_bytes(K, bits)
    require(wn, w[wn], shape=(E, N, rb), dtypes=("uint8",), where=f"[E, N, ceil(K·b/8)] with N={N}, K={K}, b={bits}")
    bs = attrs.block_size
    if bs and K % bs:
        raise QMoEAttributeError("block_size", f"a divisor of {p}'s K = {K}", str(bs))
    require(sn, w[sn], rank=(2, 3), dtypes=FLOAT_DTYPES)
    s = w[sn]
    if bs:
        require(sn, s, shape=(E, N, K // bs), where=f"block-wise [E, N, K/block_size] with block_size={bs}")
    elif tuple(s.shape) not in ((E, N), (E, N, 1)):
        raise QMoEInputError(sn, f"shape {shape_str((E, N))} (row-wise, block_size=0) or {shape_str((E, N, 1))}",
                             f"shape {shape_str(s.shape)}")
    if w[bn] is not None:
        require(bn, w[bn], shape=(E, N), dtypes=FLOAT_DTYPES)
    zp_mode = "none"
    if w[zn] is not None:
        nb = K // bs if bs else 1
        zshape = (E, N, packed_row_bytes(nb, bits)) if bs else (E, packed_row_bytes(N, bits))
        require(zn, w[zn], shape=zshape, dtypes=("uint8",),
                 where="block-wise [E, N, ceil(nb·b/8)]" if bs else "row-wise [E, ceil(N·b/8)]")
        zp_mode = "packed"
    elif attrs.zero_point_offset is not None:
        zo = attrs.zero_point_offset
        if not 0.0 <= zo <= (1 << bits) - 1:
            raise QMoEAttributeError("zero_point_offset", f"within the {bits}-bit code range [0, {(1 << bits) - 1}]"
                                     f" of {p}", str(zo))
        zp_mode = "offset"
    return ProjectionSpec(name=p, bits=bits, N=N, K=K, block_size=bs, row_bytes=rb, scale_dtype=dtype_name(s),
                          zp_mode=zp_mode, has_bias=w[bn] is not None,
                          bias_dtype=dtype_name(w[bn]) if w[bn] is not None else None, format=fmt.name)


def check_content(fmt, weights: dict, p: ProjectionSpec, host) -> None:
    """Packed zero points whose padding bits past the last code are zero (else they were packed with another width)."""
    if p.zp_mode != "packed":
        return
    z = host(weights[f"{p.name}_zero_points"])
    n = p.n_blocks if p.block_size else p.N
    if packed_row_bytes(n, p.bits) * 8 != n * p.bits and not np.array_equal(pack_codes(unpack_codes(z, p.bits, n),
                                                                                        p.bits), z):
        raise QMoEInputError(f"{p.name}_zero_points", f"zero padding bits after the last {p.bits}-bit code",
                             "non-zero padding bits")


def reference_weights(fmt, weights: dict, p: ProjectionSpec, e: int, zero_point_offset=None) -> np.ndarray:
    """Expert ``e`` of projection ``p`` in float32 ``[N, K]``: ``(q − zp) · scale``."""
    z = weights.get(f"{p.name}_zero_points")
    return dequantize(weights[f"{p.name}_experts_weights"][e : e + 1], weights[f"{p.name}_scales"][e : e + 1], p.bits,
                      p.block_size, zero_points=None if z is None else z[e : e + 1],
                      zero_point_offset=zero_point_offset if p.zp_mode == "offset" else None, K=p.K)[0]


def device_scales(fmt, scales, global_scale=None):
    """Integer codes' scales go to the device as they are."""
    return scales
