"""GPU: the dequant kernel against an independent NumPy dequantization (bit-exact).

Every bit width x row-wise/block-wise x zero points none/packed/offset x output dtype; fresh random
codes per case; the output is poisoned with NaN before the launch.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
NP_T = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def pack_lsb_first(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., n] codes -> [..., ceil(n*bits/8)] uint8, one continuous LSB-first bitstream per row."""
    *lead, n = codes.shape
    bitplanes = ((codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    stream = bitplanes.reshape(*lead, n * bits)
    nbytes = (n * bits + 7) // 8
    stream = np.concatenate([stream, np.zeros((*lead, nbytes * 8 - n * bits), np.uint8)], axis=-1)
    return np.packbits(stream.reshape(*lead, nbytes, 8), axis=-1, bitorder="little")[..., 0]


def unpack_lsb_first(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., : n * bits]
    planes = stream.reshape(*packed.shape[:-1], n, bits).astype(np.uint32)
    return (planes << np.arange(bits, dtype=np.uint32)).sum(-1).astype(np.uint32)


def test_numpy_packer_roundtrip(rng):
    for bits in (1, 2, 3, 4, 8):
        codes = rng.integers(0, 2**bits, size=(3, 5, 37), dtype=np.uint32)
        packed = pack_lsb_first(codes, bits)
        assert packed.shape == (3, 5, (37 * bits + 7) // 8)
        np.testing.assert_array_equal(unpack_lsb_first(packed, bits, 37), codes)
    # 4-bit: element 2j is the low nibble of byte j; 3-bit straddles: code 2 = bits 6..8
    assert pack_lsb_first(np.array([[1, 2]]), 4)[0, 0] == 0x21
    assert list(pack_lsb_first(np.array([[0, 0, 7]]), 3)[0]) == [0xC0, 0x01]
    try:
        from qmoe_rtc.formats.quantize import unpack_codes
    except ImportError:
        return
    codes = rng.integers(0, 8, size=(2, 4, 29), dtype=np.uint32)
    np.testing.assert_array_equal(np.asarray(unpack_codes(pack_lsb_first(codes, 3), 3, 29)), codes)


CASES = [
    (bits, bs, zp, dtype, scale_f32)
    for bits, bs, zp, dtype, scale_f32 in itertools.product(
        (1, 2, 3, 4, 8), (0, 16, 32), ("none", "packed", "offset"), ("float32", "float16", "bfloat16"), (True, False))
    if not (bs == 32 and dtype != "float16")  # a second block size, not the full cross product
    and not (dtype == "float32" and not scale_f32)  # scales in T == float32: the float32-scale case
]


@pytest.mark.gpu
@pytest.mark.parametrize("bits,bs,zp,dtype,scale_f32", CASES)
def test_dequant_matches_numpy(rng, bits, bs, zp, dtype, scale_f32):
    import cupy

    from qmoe_rtc.kernels.dequant import dequantize_experts

    E, N = 3, 10
    K = 96 if bs else 37  # row-wise: K % 8 != 0 exercises the tail path (and 3-bit straddling)
    nb = K // bs if bs else 1
    codes = rng.integers(0, 2**bits, size=(E, N, K), dtype=np.uint32)
    w = pack_lsb_first(codes, bits)
    sdt = np.dtype(np.float32) if scale_f32 else NP_T[dtype]
    scales = (rng.uniform(0.01, 0.2, size=(E, N, nb) if bs else (E, N))).astype(np.float32).astype(sdt)
    s32 = scales.astype(np.float32).reshape(E, N, nb)
    kwargs = {}
    if zp == "packed":
        zcodes = rng.integers(0, 2**bits, size=(E, N, nb) if bs else (E, N), dtype=np.uint32)
        zpacked = pack_lsb_first(zcodes, bits)  # block-wise: along blocks; row-wise: along N
        kwargs["zero_points"] = cupy.asarray(zpacked)
        z32 = zcodes.astype(np.float32).reshape(E, N, nb)
    elif zp == "offset":
        off = 2 ** (bits - 1) - 0.5
        kwargs["zero_point_offset"] = off
        z32 = np.full((E, N, nb), off, np.float32)
    else:
        z32 = np.full((E, N, nb), 2 ** (bits - 1), np.float32)
    ref32 = (codes.astype(np.float32) - np.repeat(z32, K // nb, axis=-1)) * np.repeat(s32, K // nb, axis=-1)
    ref = ref32.astype(NP_T[dtype])

    out_dev_dtype = cupy.uint16 if dtype == "bfloat16" else NP_T[dtype]
    out = cupy.empty((E, N, K), dtype=out_dev_dtype)
    if dtype == "bfloat16":
        out.fill(0x7FC0)  # bf16 NaN
    else:
        out.fill(np.nan)
    scales_dev = cupy.asarray(scales.view(np.uint16) if sdt == BF16 else scales)
    dequantize_experts(cupy.asarray(w), scales_dev, bits, block_size=bs, K=K,
                       dtype=dtype, out=out, **kwargs)
    got = cupy.asnumpy(out)
    if dtype == "bfloat16":
        got = got.view(BF16)
    assert not np.isnan(got.astype(np.float32)).any(), "unwritten (poisoned) output elements"
    np.testing.assert_array_equal(got.astype(np.float32), ref.astype(np.float32))
