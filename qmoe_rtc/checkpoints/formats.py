"""Quantized linear weights as public checkpoint formats store them, decoded to one common form: the
codes ``q`` uint8 [N, K] of a projection with N outputs and K inputs, its scales [N, nb] (the stored
dtype) and its zero points uint8 [N, nb] (or None: 2^(b−1), the contract's default), with
``w[n, k] = (q[n, k] − zero[n, g]) · scale[n, g]``, g = k // group (group 0: one group per row).
That is the contract's own formula, so :mod:`qmoe_rtc.checkpoints.layer` only stacks and packs.

GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``)::

    qweight [K·b/32, N] int32   32/b codes along K per word, code i at bits b·i
    qzeros  [nb, N·b/32] int32  zero points packed along N the same way; checkpoint_format 'gptq_v2'
                                stores the zero points themselves, 'gptq' (v1, GPTQModel's default) the
                                words of v2 less one in every code, as whole 32-bit words: v2 = v1 +
                                0x11111111 (4-bit; 0x01010101 8-bit, 0x55555555 2-bit) modulo 2^32, carries
                                and all -- GPTQModel's own v1 <-> v2 conversion, exact for every zero point,
                                a zero point of 0 (stored as 0xF with a borrow from its neighbour) included
    scales  [nb, N] float16     nb = K / group_size (1 with group_size −1); bfloat16 and float32 read too
    g_idx   [K] int32           group of each input; must be k // group_size (act-order is refused:
                                its groups are not contiguous blocks of K)

AWQ (AutoAWQ GEMM, ``quant_method: awq``, ``version: gemm``), 4-bit::

    qweight [K, N/8] int32      8 codes along N per word, in the order 0, 2, 4, 6, 1, 3, 5, 7
    qzeros  [nb, N/8] int32     zero points packed the same way (no offset)
    scales  [nb, N] float16

compressed-tensors ``pack-quantized`` (llm-compressor, ``quant_method: compressed-tensors``), int 1-8 bit::

    weight_packed     [N, ceil(K·b/32)] int32   codes along K as one little-endian bit string, code i at bit
                                                b·i (32/b per word for b = 1, 2, 4, 8; 3-bit codes cross
                                                words, written so from compressed-tensors 0.19 on), each the
                                                signed value + 2^(b−1)
    weight_scale      [N, nb] float             nb = K / group_size (1 for the channel strategy); float32,
                                                float16 or bfloat16 (a bfloat16 model's scales)
    weight_zero_point [ceil(N·b/32), nb] int32  asymmetric only: packed along N, signed + 2^(b−1); with
                                                ``symmetric: true`` it must hold 2^(b−1) everywhere (refused
                                                otherwise: the config and the tensor disagree)
    weight_shape      [2] int                   [N, K]
    weight_g_idx      [K] int32                 act-order, refused as for GPTQ

FP8 with square block scales (DeepSeek-V3, Qwen3 FP8: ``quant_method: fp8``, ``weight_block_size [b, b]``)::

    weight            [N, K] float8_e4m3fn
    weight_scale_inv  [ceil(N/b), ceil(K/b)] float32   w = e4m3(weight) · weight_scale_inv (the contract's
                                                       FP8 block scales, so the bytes carry over as they are);
                                                       bfloat16 / float16 widened exactly, float8_e8m0fnu
                                                       (``scale_fmt: ue8m0``) as 2^(s − 127)

NVFP4 (NVIDIA ModelOpt, ``quant_method: modelopt``, ``quant_algo: NVFP4``, group_size 16)::

    weight          [N, K/2] uint8             two e2m1 codes per byte along K, the even element in the low nibble
    weight_scale    [N, K/16] float8_e4m3fn    one e4m3 scale per block of 16 codes
    weight_scale_2  [] or [1] float32          the global scale: w = e2m1(q) · e4m3(weight_scale) · weight_scale_2
    input_scale     [] float32                 the activation scale of W4A4 inference: not read (the layer is
                                               weight-only, its activations stay 16/32-bit)

the contract's NVFP4 experts (:mod:`qmoe_rtc.formats.fp4`): the codes and scale bytes carry over as they are,
the global scale into ``fc*_global_scale`` (``Quantized.global_scale``, one per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import dtype_name
from ..errors import QMoEInputError, QMoEUnsupportedError
from ..formats.quantize import packed_row_bytes, unpack_codes
from ..specialize.vocab import DTYPES as FLOAT_DTYPES

__all__ = ["AWQ_ORDER", "Quantized", "awq", "compressed", "fp8_blocks", "gptq", "nvfp4"]

#: Which of 8 consecutive outputs AWQ's GEMM packing puts in nibble i of a word.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Quantized:
    """One projection's weights in the contract's terms (module docstring)."""

    q: np.ndarray  # [N, K] uint8
    scales: np.ndarray  # [N, nb]
    zeros: np.ndarray | None  # [N, nb] uint8, None: 2^(bits-1) everywhere
    bits: int
    group: int  # block size along K, 0: one scale per row
    square: bool = False  # FP8: scales [ceil(N/group), ceil(K/group)], square blocks (q holds e4m3 bytes)
    global_scale: np.ndarray | None = None  # NVFP4: float32 [N], each row's global scale (q: e2m1 codes)


def _words(a, name: str, shape: tuple) -> np.ndarray:
    if a.dtype not in (np.int32, np.uint32) or tuple(a.shape) != shape:
        raise QMoEInputError(name, f"int32 {list(shape)}", f"{a.dtype} {list(a.shape)}")
    return np.ascontiguousarray(a).view(np.uint32)


def _unpack(words: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Codes of ``words`` (uint32) unpacked along ``axis``: 32/bits codes per word, code i at bits·i -- a
    little-endian bit string, the contract's own packing (:func:`qmoe_rtc.formats.quantize.unpack_codes`) -- placed
    at position order[i] of its word's run (natural order without ``order``)."""
    w = np.ascontiguousarray(np.moveaxis(words, axis, -1)).astype("<u4")  # [..., n]
    codes = unpack_codes(w.view(np.uint8), bits, w.shape[-1] * 32 // bits)  # [..., n·32/b]
    if order is not None:  # position p of a word's run holds the code of nibble order.index(p)
        codes = codes.reshape(*w.shape, -1)[..., np.argsort(order)].reshape(codes.shape)
    return np.ascontiguousarray(np.moveaxis(codes, -1, axis))


def _is_float(a) -> bool:
    """float32, float16 or bfloat16 (ml_dtypes' bfloat16 is no NumPy float kind)."""
    return dtype_name(a) in FLOAT_DTYPES


def _scales(a, name: str, shape: tuple) -> np.ndarray:
    if not _is_float(a) or tuple(a.shape) != shape:
        raise QMoEInputError(name, f"float32, float16 or bfloat16 {list(shape)}", f"{a.dtype} {list(a.shape)}")
    return np.ascontiguousarray(a.T)  # [N, nb]


#: GPTQ v1 -> v2 zero-point words: one added to every code of a 32-bit word (module docstring)
V1_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def _group_count(K: int, group: int, name: str) -> int:
    if group <= 0:
        return 1
    if K % group:
        raise QMoEInputError(name, f"K = {K} a multiple of group_size {group}", f"K = {K}")
    return K // group


def gptq(get, prefix: str, bits: int, group: int, K: int, N: int, version: int = 1) -> Quantized:
    """The GPTQ tensors ``prefix.qweight`` … of a [N, K] projection (``get(name)`` reads one)."""
    if bits not in (2, 4, 8):
        raise QMoEUnsupportedError(f"{prefix}.qweight: GPTQ with {bits}-bit codes (2, 4 and 8 are read: 3-bit "
                                   "GPTQ words split codes across word boundaries)")
    nb = _group_count(K, group, f"{prefix}.qweight")
    per = 32 // bits
    q = _unpack(_words(get(f"{prefix}.qweight"), f"{prefix}.qweight", (K // per, N)), bits, 0).T  # [N, K]
    zw = _words(get(f"{prefix}.qzeros"), f"{prefix}.qzeros", (nb, N // per))  # [nb, N·b/32] u32
    if version == 1:  # whole-word arithmetic modulo 2^32, as GPTQModel converts v1 to v2
        zw = (zw.astype(np.uint64) + V1_OFFSET[bits]).astype(np.uint32)
    z = _unpack(zw, bits, 1)  # [nb, N]
    s = _scales(get(f"{prefix}.scales"), f"{prefix}.scales", (nb, N))
    g_idx = get.optional(f"{prefix}.g_idx")
    if g_idx is not None and group > 0 and not np.array_equal(np.asarray(g_idx), np.arange(K) // group):
        raise QMoEUnsupportedError(f"{prefix}.g_idx: act-order GPTQ (desc_act) puts inputs of a group apart; the "
                                   "contract's blocks are contiguous runs of K, so it cannot be loaded losslessly")
    return Quantized(np.ascontiguousarray(q), s, _zeros_or_none(z.T, bits), bits, max(group, 0))


def awq(get, prefix: str, bits: int, group: int, K: int, N: int) -> Quantized:
    """The AWQ (GEMM) tensors ``prefix.qweight`` … of a [N, K] projection."""
    if bits != 4:
        raise QMoEUnsupportedError(f"{prefix}.qweight: AWQ with {bits}-bit codes (AWQ's GEMM packing is 4-bit)")
    nb = _group_count(K, group, f"{prefix}.qweight")
    q = _unpack(_words(get(f"{prefix}.qweight"), f"{prefix}.qweight", (K, N // 8)), 4, 1, AWQ_ORDER).T  # [N, K]
    z = _unpack(_words(get(f"{prefix}.qzeros"), f"{prefix}.qzeros", (nb, N // 8)), 4, 1, AWQ_ORDER)  # [nb, N]
    s = _scales(get(f"{prefix}.scales"), f"{prefix}.scales", (nb, N))
    return Quantized(np.ascontiguousarray(q), s, _zeros_or_none(z.T, 4), 4, max(group, 0))


def compressed(get, prefix: str, bits: int, group: int, K: int, N: int, symmetric: bool,
               dense: bool = True) -> Quantized:
    """The compressed-tensors ``pack-quantized`` tensors ``prefix.weight_packed`` … of a [N, K] projection;
    ``dense``: 3-bit codes form one bit string across words (compressed-tensors 0.19 and newer)."""
    if bits not in (1, 2, 3, 4, 8):
        raise QMoEUnsupportedError(f"{prefix}.weight_packed: {bits}-bit codes (the contract's widths are 1, 2, 3, "
                                   "4 and 8)")
    if bits == 3 and not dense:
        raise QMoEUnsupportedError(f"{prefix}.weight_packed: 3-bit codes written by a compressed-tensors older than "
                                   "0.19 (config.json quantization_config.version), whose packing is not read")
    shape = get(f"{prefix}.weight_shape")
    if [int(v) for v in np.asarray(shape).reshape(-1)] != [N, K]:
        raise QMoEInputError(f"{prefix}.weight_shape", f"[{N}, {K}]", str(np.asarray(shape).tolist()))
    nb = _group_count(K, group, f"{prefix}.weight_packed")
    q = _bit_string(_words(get(f"{prefix}.weight_packed"), f"{prefix}.weight_packed", (N, -(-K * bits // 32))),
                    bits, K)  # [N, K]
    s = get(f"{prefix}.weight_scale")
    if not _is_float(s) or tuple(s.shape) != (N, nb):
        raise QMoEInputError(f"{prefix}.weight_scale", f"float32, float16 or bfloat16 [{N}, {nb}]",
                             f"{s.dtype} {list(s.shape)}")
    g_idx = get.optional(f"{prefix}.weight_g_idx")
    if g_idx is not None and group > 0 and not np.array_equal(np.asarray(g_idx), np.arange(K) // group):
        raise QMoEUnsupportedError(f"{prefix}.weight_g_idx: act-order puts inputs of a group apart; the contract's "
                                   "blocks are contiguous runs of K, so it cannot be loaded losslessly")
    zn = f"{prefix}.weight_zero_point"
    stored = get.optional(zn) if symmetric else get(zn)
    if stored is None:
        zeros = np.full((N, nb), 1 << (bits - 1))
    else:  # packed along N: [ceil(N·b/32), nb]
        zeros = _bit_string(_words(stored, zn, (-(-N * bits // 32), nb)).T, bits, N).T  # [N, nb]
        if symmetric and np.any(zeros != 1 << (bits - 1)):
            raise QMoEInputError(zn, f"no zero points other than {1 << (bits - 1)} (the config says symmetric: true)",
                                 "asymmetric zero points")
    return Quantized(np.ascontiguousarray(q), np.ascontiguousarray(s), _zeros_or_none(zeros, bits), bits, max(group, 0))


def fp8_blocks(get, prefix: str, block: int, K: int, N: int) -> Quantized:
    """The FP8 tensors ``prefix.weight`` / ``prefix.weight_scale_inv`` of a [N, K] projection."""
    w = get(f"{prefix}.weight")
    if str(w.dtype) != "float8_e4m3fn" or tuple(w.shape) != (N, K):
        raise QMoEInputError(f"{prefix}.weight", f"float8_e4m3fn [{N}, {K}]", f"{w.dtype} {list(w.shape)}")
    q = np.ascontiguousarray(w).view(np.uint8)
    if np.any((q & 0x7F) == 0x7F):
        raise QMoEInputError(f"{prefix}.weight", "no NaN codes (0x7F, 0xFF)", "a NaN code")
    want = (-(-N // block), -(-K // block))
    sn = f"{prefix}.weight_scale_inv"
    s = get(sn)
    if tuple(s.shape) != want or not (_is_float(s) or dtype_name(s) == "float8_e8m0fnu"):
        raise QMoEInputError(sn, f"float32, bfloat16, float16 or float8_e8m0fnu {list(want)}", f"{s.dtype} {list(s.shape)}")
    if dtype_name(s) == "float8_e8m0fnu":  # ue8m0 block scales: 2^(s − 127), exact in float32
        from ..formats.fp4 import check_fp4_scales, decode_e8m0

        b = np.ascontiguousarray(s).view(np.uint8)
        check_fp4_scales("mxfp4", b, name=sn)  # 255 is NaN
        return Quantized(q, decode_e8m0(b).astype(np.float32), None, 8, block, square=True)
    return Quantized(q, np.ascontiguousarray(s.astype(np.float32)), None, 8, block, square=True)


def nvfp4(get, prefix: str, K: int, N: int) -> Quantized:
    """The ModelOpt NVFP4 tensors ``prefix.weight`` / ``weight_scale`` / ``weight_scale_2`` of a [N, K]
    projection (``input_scale`` is not read: module docstring)."""
    from ..formats.fp4 import check_fp4_scales

    name = f"{prefix}.weight"
    if K % 16:
        raise QMoEInputError(name, "K a multiple of 16 (NVFP4 blocks of 16 codes)", f"K = {K}")
    w = get(name)
    if str(w.dtype) != "uint8" or tuple(w.shape) != (N, K // 2):
        raise QMoEInputError(name, f"uint8 [{N}, {K // 2}] (two e2m1 codes per byte)", f"{w.dtype} {list(w.shape)}")
    s = get(f"{prefix}.weight_scale")
    if str(s.dtype) not in ("float8_e4m3fn", "uint8") or tuple(s.shape) != (N, K // 16):
        raise QMoEInputError(f"{prefix}.weight_scale", f"float8_e4m3fn [{N}, {K // 16}]", f"{s.dtype} {list(s.shape)}")
    s = np.ascontiguousarray(s).view(np.uint8)  # the e4m3 bytes, as the contract takes them
    check_fp4_scales("nvfp4", s, name=f"{prefix}.weight_scale")
    gn = f"{prefix}.weight_scale_2"
    g = get(gn)
    if dtype_name(g) not in FLOAT_DTYPES or g.ndim > 1 or g.size != 1:  # float16 / bfloat16: exact in float32
        raise QMoEInputError(gn, "a float32 scalar (shape [] or [1])", f"{g.dtype} {list(g.shape)}")
    g32 = np.asarray(g).astype(np.float32).reshape(())
    if not np.isfinite(g32) or g32 <= 0:
        raise QMoEInputError(gn, "a finite, positive global scale", str(float(g32)))
    q = unpack_codes(np.ascontiguousarray(w), 4, K)  # [N, K] e2m1 codes
    return Quantized(q, s, None, 4, 16, global_scale=np.full(N, g32, dtype=np.float32))


def _bit_string(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The first ``n`` codes of each row of ``words`` (uint32 [..., w]) read as one little-endian bit string,
    code i at bit b·i across word boundaries (compressed-tensors' dense packing; the contract's own)."""
    raw = np.ascontiguousarray(words.astype("<u4")).view(np.uint8)  # [..., 4w]
    return unpack_codes(np.ascontiguousarray(raw[..., : packed_row_bytes(n, bits)]), bits, n)


def _zeros_or_none(zeros: np.ndarray, bits: int):
    """None where every zero point is the contract's default 2^(bits−1) (symmetric codes), else uint8."""
    return None if np.all(zeros == (1 << (bits - 1))) else np.ascontiguousarray(zeros.astype(np.uint8))
