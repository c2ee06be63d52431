"""The tiled weight layout the tensor-core engines read, made once from the contract layout, and back.

The contract (ONNX Runtime's) layout stores each expert's rows one after the other, ``w [E, N, K·b/8]``.
A tensor-core lane reads 32 consecutive codes of a row per 128-code chunk (a *segment*, 4·b bytes), and
the 32 lanes of a warp read rows ``8q + g`` (g = 0..7) at segments ``4c + t`` (t = 0..3): in the
contract layout those are 8 pieces of 16·b bytes, one per row, a row apart. The tiled layout puts
them next to each other::

    tiled [E, N8, NCH, 8, 4, 4·b] u8    N8 = ceil(N / 8) row groups, NCH = ceil(K / 128) chunks
          [e, q, c, g, t, :] = segment 4c + t of tile row 8q + g of expert e (zero past N or K)

so a warp's copy of a row group's chunk is one contiguous run of 128·b bytes, and a row group's whole K
is one contiguous run. Inside a segment the codes are in *pair order* (:func:`pair_order`): the
positions the device's shifts and masks take a pair from hold natural codes 2i and 2i + 1, so the pair's
activations are one 32-bit word of the input, with no byte permute. Tile rows are the rows themselves,
except FC1 with gate and linear rows (``fusion``, :func:`tile_rows`): the 8 gate rows of outputs 8p ..
8p + 7 become tile rows 16p .. 16p + 7 and their linear rows 16p + 8 .. 16p + 15, the two lane rows of a
gated warp tile. That holds for both contract orders, gate row 2o and linear row 2o + 1
(``swiglu_fusion=1``) and halves, o and I + o (``swiglu_fusion=2``), so tiled FC1 codes of either are the
same bytes and the engines read them as ``swiglu_fusion=1``'s; the FC1 bias then moves to that order too
(:func:`fusion1_order`). FP8 codes of ``swiglu_fusion=2`` keep their rows (:func:`fc1_fusion`: their scale
blocks span 128 rows of the contract order). The device mirror of :func:`tiled_offset` is ``CodeRows``
(``cuda_src/core/codes.cuh``); a CPU test checks the two and that :func:`untile` inverts :func:`tile`.

Scales and zero points of integer codes go with them into *meta records* (:func:`pack_meta`), in the same
tile rows::

    meta [E, ceil(N/16), nb, 8, R] u8    nb scale blocks per row (1 row-wise), R = meta_record_bytes
         [e, q, j, g, :] = block j of tile rows 16q + g and 16q + 8 + g: their two scales (the scale
         dtype's bytes), then with zero points their two zero points (one byte each, unpacked), zeros

A tensor-core lane owns exactly those two rows of a 16-row tile, so one copy of R bytes brings both rows'
coefficients of a block (the contract layout takes a 4-byte word per row, and a second for the zero
point). The device side is ``QuantParams::meta_record`` / ``LaneMeta`` (``cuda_src/core/dequant.cuh``,
``core/lane_meta.cuh``); FP8 scales keep their contract layout.

:func:`pack` / :func:`unpack` do both steps (what the layer uploads); :func:`tile` / :func:`untile` move
whole segments and work on any dtype (the tests tile index arrays). Every function takes the array
module (``numpy`` or ``cupy``) so the same reshapes run on the host (tests, offline packing) and on the
GPU (at upload).

The tiled layout is qmoe_rtc's own, not ONNX Runtime's: :data:`LAYOUT_VERSION` names it, and changes
whenever a byte of it moves. :func:`qmoe_rtc.tiled.given.tiled_weights` makes a whole layer's tiled codes
(what ``QMoE(prepack='given')`` takes back); store the version beside them.
"""

from __future__ import annotations

import math

from ..errors import QMoEInputError

__all__ = ["CHUNK", "GROUP", "LAYOUT_VERSION", "META_ROWS", "fc1_fusion", "fusion1_order", "meta_record_bytes", "meta_shape",
           "pack", "pack_meta", "pair_order", "segment_order", "tile", "tile_rows", "tiled_offset", "tiled_shape", "unpack",
           "unpack_meta", "untile"]

#: Version of the tiled layout (tile shape, tile-row order, pair order): tiled codes stored with another
#: version must be made again from the contract codes. 2: FC1 codes of ``swiglu_fusion=2`` in interleaved tile
#: rows (version 1 kept their rows).
LAYOUT_VERSION = 2
GROUP = 8  #: rows per row group (the lanes g of a warp)
CHUNK = 128  #: codes per chunk (the 4 lanes t of a row, 32 codes each)
#: Codes bytes :func:`pair_order` reorders at once in :func:`pack` / :func:`unpack` (its temporaries are
#: about 16× that: one byte per bit, twice), so an upload's extra memory stays bounded by the layer.
ORDER_BYTES = 1 << 22


def tiled_shape(E: int, N: int, K: int, bits: int) -> tuple[int, ...]:
    """``(E, N8, NCH, 8, 4, 4·bits)``: the tiled array of a projection with N rows of K codes."""
    return (E, -(-N // GROUP), -(-K // CHUNK), GROUP, 4, 4 * bits)


def fc1_fusion(swiglu_fusion: int, square_scales: bool) -> int:
    """The ``fusion`` FC1's codes are tiled with (:func:`tile_rows`): the layer's ``swiglu_fusion``, except
    codes with square scale blocks (FP8: ``ScaleRule.square`` of its format) of ``swiglu_fusion=2``, which keep
    their rows (0): a square scale block spans 128 contract rows, which interleaving would split. The device
    side: ``kernels/_expert.py`` ``gate_of``."""
    return 0 if square_scales and swiglu_fusion == 2 else swiglu_fusion


def tile_rows(N: int, fusion: int = 0) -> list[int]:
    """Contract row of each tile row of a projection with N rows. ``fusion``: FC1's gate / linear rows,
    1 gate row 2o and linear row 2o + 1, 2 gate row o and linear row N/2 + o; both give interleaved tile
    rows (module docstring); 0: the rows themselves."""
    if not fusion:
        return list(range(N))
    if fusion not in (1, 2) or N % 16:
        raise QMoEInputError("FC1 rows", "fusion 1 or 2 with N a multiple of 16 (8 outputs a tile)",
                             f"fusion {fusion!r}, N={N}")
    out, half = [], N // 2
    for p in range(N // 16):  # 8 outputs: their gate rows, then their linear rows
        outs = range(8 * p, 8 * p + GROUP)
        out += [2 * o for o in outs] + [2 * o + 1 for o in outs] if fusion == 1 else list(outs) + [half + o for o in outs]
    return out


def fusion1_order(xp, b):
    """FC1 biases ``b`` [E, 2I] of ``swiglu_fusion=2`` (gate halves, then linear) in ``swiglu_fusion=1``'s
    order (gate 2o, linear 2o + 1): what the engines read beside tiled codes of fusion 2."""
    E, N = b.shape
    return xp.ascontiguousarray(b.reshape(E, 2, N // 2).transpose(0, 2, 1).reshape(E, N))


def tiled_offset(e: int, N: int, m: int, K: int, bits: int, s: int) -> int:
    """Byte offset of segment ``s`` of tile row ``m`` of expert ``e`` (the device's ``CodeRows``)."""
    n8, nch = -(-N // GROUP), -(-K // CHUNK)
    return ((e * n8 + m // GROUP) * nch + s // 4) * CHUNK * bits + ((m % GROUP) * 4 + s % 4) * 4 * bits


def _check(w, K: int, bits: int, name: str) -> tuple[int, int]:
    if bits not in (1, 2, 3, 4, 8):
        raise QMoEInputError(f"{name} bits", "1, 2, 3, 4 or 8", repr(bits))
    if K % 32:
        raise QMoEInputError(f"{name} K", "a multiple of 32 (whole 32-code segments)", repr(K))
    if len(w.shape) != 3 or w.shape[2] != K * bits // 8:
        raise QMoEInputError(name, f"shape [E, N, {K * bits // 8}] (K={K}, {bits}-bit)", f"shape {tuple(w.shape)}")
    if N_odd := w.shape[1] % GROUP:
        raise QMoEInputError(name, f"N a multiple of {GROUP}", f"N={w.shape[1]} ({N_odd} over)")
    return w.shape[0], w.shape[1]


def tile(xp, w, K: int, bits: int, fusion: int = 0, name: str = "weights"):
    """The tiled layout of contract codes ``w`` [E, N, K·bits/8] (uint8, or any dtype of the same
    shape: the tests tile index arrays), made expert by expert (temporaries of one expert); ``fusion``:
    FC1's gate / linear rows (:func:`tile_rows`)."""
    E, N = _check(w, K, bits, name)
    shape = tiled_shape(E, N, K, bits)
    nch, seg = shape[2], 4 * bits
    rows = xp.asarray(tile_rows(N, fusion)) if fusion else None
    out = xp.zeros(shape, dtype=w.dtype)
    for e in range(E):
        we = w[e] if rows is None else w[e][rows]  # [N, Kb] in tile-row order
        padded = xp.zeros((N, nch * 4 * seg), dtype=w.dtype)  # K padded to whole chunks
        padded[:, : we.shape[1]] = we
        # [N8, 8, NCH, 4, seg] -> [N8, NCH, 8, 4, seg]
        out[e] = padded.reshape(N // GROUP, GROUP, nch, 4, seg).transpose(0, 2, 1, 3, 4)
    return out


def untile(xp, t, N: int, K: int, bits: int, fusion: int = 0):
    """The contract codes [E, N, K·bits/8] of a tiled array (the inverse of :func:`tile`)."""
    E = t.shape[0]
    if tuple(t.shape) != tiled_shape(E, N, K, bits):
        raise QMoEInputError("tiled weights", f"shape {tiled_shape(E, N, K, bits)}", f"shape {tuple(t.shape)}")
    nch, seg = t.shape[2], 4 * bits
    flat = xp.ascontiguousarray(t.transpose(0, 1, 3, 2, 4, 5)).reshape(E, N, nch * 4 * seg)[:, :, : K * bits // 8]
    if not fusion:
        return xp.ascontiguousarray(flat)
    out = xp.empty_like(flat)
    out[:, xp.asarray(tile_rows(N, fusion))] = flat
    return out


def segment_order(bits: int) -> list[int]:
    """Natural code (0..31) stored at each position of a tiled segment: the device dequantizes pair i from
    positions ``first_code(i)`` and ``first_code(i) + P`` (``core/mma_pair.cuh``; 3-bit codes pair as
    4-bit ones), which hold natural codes 2i and 2i + 1."""
    order = 4 if bits == 3 else bits
    P, C = 16 // order, 32 // order
    out = [0] * 32
    for i in range(16):
        first = (i // P) * C + i % P
        out[first], out[first + P] = 2 * i, 2 * i + 1
    return out


def pair_order(xp, t, bits: int, inverse: bool = False):
    """Tiled uint8 codes ``t`` (any shape ending in whole segments) with each segment's codes put in pair
    order (``inverse``: back to natural order). Codes are a little-endian bit string per segment."""
    perm = segment_order(bits)
    if inverse:
        inv = [0] * 32
        for pos, nat in enumerate(perm):
            inv[nat] = pos
        perm = inv
    bits_flat = xp.unpackbits(xp.ascontiguousarray(t).reshape(-1), bitorder="little")  # [segments·32·b]
    codes = bits_flat.reshape(-1, 32, bits)[:, xp.asarray(perm), :]
    return xp.packbits(codes.reshape(-1), bitorder="little").reshape(t.shape)


def _row_groups(t, order_bytes: int):
    """Slices of ``t``'s row groups (axis 1) of about ``order_bytes`` bytes each, expert by expert."""
    per_group = max(1, math.prod(t.shape[2:]) * t.dtype.itemsize)
    step = max(1, order_bytes // per_group)
    for e in range(t.shape[0]):
        for q in range(0, t.shape[1], step):
            yield e, slice(q, q + step)


def pack(xp, w, K: int, bits: int, fusion: int = 0, name: str = "weights", order_bytes: int = ORDER_BYTES):
    """The layer's upload: contract codes ``w`` [E, N, K·bits/8] u8 → the tiled layout in pair order,
    [E, N8, NCH, 8, 4, 4·bits] u8. Besides the result, temporaries of about 3× one expert's codes (the
    padded copy, :func:`tile`) and 16× ``order_bytes`` (the unpacked bits, :func:`pair_order`)."""
    t = tile(xp, w, K, bits, fusion, name)
    for e, rows in _row_groups(t, order_bytes):
        t[e, rows] = pair_order(xp, t[e, rows], bits)
    return t


def unpack(xp, t, N: int, K: int, bits: int, fusion: int = 0, order_bytes: int = ORDER_BYTES):
    """The contract codes [E, N, K·bits/8] of :func:`pack`'s output (its inverse)."""
    natural = xp.empty_like(t)
    for e, rows in _row_groups(t, order_bytes):
        natural[e, rows] = pair_order(xp, t[e, rows], bits, inverse=True)
    return untile(xp, natural, N, K, bits, fusion)


META_ROWS = 16  #: tile rows a meta record row group covers (a tensor-core lane's rows g and g + 8)


def meta_record_bytes(scale_bytes: int, zero_points: bool) -> int:
    """Bytes of one meta record: two scales, then two zero-point bytes when the projection has zero points,
    padded to a cp.async size (4, 8 or 16); the device's ``QuantParams::kMetaBytes``."""
    if scale_bytes not in (2, 4):
        raise QMoEInputError("scales", "float16, bfloat16 or float32 (2 or 4 bytes)", f"{scale_bytes} bytes")
    return (16 if scale_bytes == 4 else 8) if zero_points else 2 * scale_bytes


def meta_shape(E: int, N: int, blocks: int, scale_bytes: int, zero_points: bool) -> tuple[int, ...]:
    """``(E, ceil(N/16), blocks, 8, R)``: the meta records of a projection with N rows and ``blocks`` scale
    blocks per row."""
    return (E, -(-N // META_ROWS), blocks, GROUP, meta_record_bytes(scale_bytes, zero_points))


def _unpack_zero_points(xp, zp, E: int, N: int, blocks: int, bits: int, row_wise: bool):
    """Packed zero points (contract: [E, N, ceil(nb·b/8)], row-wise [E, ceil(N·b/8)]) as u8 [E, N, nb]."""
    per = N if row_wise else blocks
    flat = xp.ascontiguousarray(zp).reshape(E * (1 if row_wise else N), -1)  # [rows, bytes]
    bits_all = xp.unpackbits(flat.reshape(-1), bitorder="little").reshape(flat.shape[0], -1)  # CuPy: no axis=
    bits_all = bits_all[:, : per * bits].reshape(-1, per, bits)
    weights = xp.asarray([1 << i for i in range(bits)], dtype=xp.uint8)
    vals = (bits_all * weights).sum(axis=2, dtype=xp.uint8)
    return vals.reshape(E, N, blocks)


def pack_meta(xp, scales, zp, N: int, bits: int, fusion: int = 0, name: str = "scales", row_wise: bool | None = None):
    """Meta records [E, ceil(N/16), nb, 8, R] u8 (module docstring) of one projection: ``scales`` [E, N, nb]
    or row-wise [E, N] (float16, float32, or bfloat16 stored as uint16), ``zp`` the packed zero points or
    None; tile rows as the codes' (``fusion``: FC1's gate / linear rows, :func:`tile_rows`). ``row_wise``
    is the layer's ``block_size == 0`` (its zero points then packed along N, [E, ceil(N·b/8)], also where
    the scales come as [E, N, 1]); None: row-wise exactly when the scales are [E, N]."""
    if len(scales.shape) not in (2, 3) or scales.shape[1] != N:
        raise QMoEInputError(name, f"shape [E, {N}] or [E, {N}, nb]", f"shape {tuple(scales.shape)}")
    E = scales.shape[0]
    row_wise = len(scales.shape) == 2 if row_wise is None else row_wise
    if row_wise and len(scales.shape) == 3 and scales.shape[2] != 1:
        raise QMoEInputError(name, f"row-wise [E, {N}] or [E, {N}, 1]", f"shape {tuple(scales.shape)}")
    nb = 1 if row_wise else scales.shape[2]  # [E, N, 1] row-wise: one block
    sb = scales.dtype.itemsize
    rec = meta_record_bytes(sb, zp is not None)
    n16 = -(-N // META_ROWS)
    rows = xp.asarray(tile_rows(N, fusion)) if fusion else None
    s = xp.ascontiguousarray(scales).reshape(E, N, nb)
    s = s if rows is None else s[:, rows]
    body = xp.zeros((E, n16 * META_ROWS, nb, rec), dtype=xp.uint8)  # [E, tile row, block, record bytes]
    body[:, :N, :, :sb] = s.reshape(E, N, nb, 1).view(xp.uint8).reshape(E, N, nb, sb)
    if zp is not None:
        z = _unpack_zero_points(xp, zp, E, N, nb, bits, row_wise)
        body[:, :N, :, 2 * sb] = z if rows is None else z[:, rows]
    # tile row 16q + 8h + g -> record [q, j, g], half h
    t = body.reshape(E, n16, 2, GROUP, nb, rec).transpose(0, 1, 4, 3, 2, 5)  # [E, q, j, g, h, rec]
    out = xp.zeros((E, n16, nb, GROUP, rec), dtype=xp.uint8)
    out[..., :sb] = t[..., 0, :sb]
    out[..., sb: 2 * sb] = t[..., 1, :sb]
    if zp is not None:
        out[..., 2 * sb] = t[..., 0, 2 * sb]
        out[..., 2 * sb + 1] = t[..., 1, 2 * sb]
    return out


def unpack_meta(xp, meta, N: int, scale_dtype, fusion: int = 0, row_wise: bool = False):
    """(scales [E, N, nb] (row-wise: [E, N]) of ``scale_dtype``, zero points u8 [E, N, nb] unpacked or None)
    of :func:`pack_meta`'s records (its inverse, up to the zero points' packing)."""
    E, n16, nb, _, rec = meta.shape
    sb = xp.dtype(scale_dtype).itemsize
    zero_points = rec == meta_record_bytes(sb, True)
    halves = xp.stack([meta[..., :sb], meta[..., sb: 2 * sb]], axis=3)  # [E, q, j, h, g, sb]
    rows_sb = xp.ascontiguousarray(halves.transpose(0, 1, 3, 4, 2, 5)).reshape(E, n16 * META_ROWS, nb, sb)[:, :N]
    s = rows_sb.copy().view(scale_dtype).reshape(E, N, nb)
    z = None
    if zero_points:
        zh = xp.stack([meta[..., 2 * sb], meta[..., 2 * sb + 1]], axis=3)  # [E, q, j, h, g]
        z = xp.ascontiguousarray(zh.transpose(0, 1, 3, 4, 2)).reshape(E, n16 * META_ROWS, nb)[:, :N]
    if fusion:
        order = xp.asarray(tile_rows(N, fusion))
        s2, z2 = xp.empty_like(s), None if z is None else xp.empty_like(z)
        s2[:, order] = s
        if z is not None:
            z2[:, order] = z
        s, z = s2, z2
    return (s.reshape(E, N) if row_wise else s), z
