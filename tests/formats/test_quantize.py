"""Packing layout (docs/contract.md bit order), quantize → dequantize round trips."""

import numpy as np
import pytest

from qmoe_rtc.errors import QMoEInputError
from qmoe_rtc.formats.quantize import (
    SUPPORTED_BITS,
    dequantize,
    pack_codes,
    packed_row_bytes,
    quantize,
    unpack_codes,
    unpack_zero_points,
)


def naive_pack(codes, bits):
    """Independent bit-by-bit packer straight from the contract text: element k at bit k·b of the row."""
    K = codes.shape[-1]
    out = np.zeros((*codes.shape[:-1], packed_row_bytes(K, bits)), dtype=np.uint8)
    for idx in np.ndindex(codes.shape[:-1]):
        for k in range(K):
            for t in range(bits):
                if (int(codes[idx][k]) >> t) & 1:
                    pos = k * bits + t
                    out[idx][pos // 8] |= np.uint8(1 << (pos % 8))
    return out


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("K", [8, 16, 21, 64])
def test_pack_matches_contract_bit_order(rng, bits, K):
    codes = rng.integers(0, 1 << bits, size=(2, 3, K), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    np.testing.assert_array_equal(packed, naive_pack(codes, bits))
    np.testing.assert_array_equal(unpack_codes(packed, bits, K), codes)


def test_known_bytes():
    # 4-bit: element 2j is the low nibble of byte j
    assert pack_codes(np.array([[0x1, 0x2, 0xF, 0x0]], np.uint8), 4).tolist() == [[0x21, 0x0F]]
    # 2-bit: four codes per byte, first in the lowest two bits
    assert pack_codes(np.array([[1, 2, 3, 0]], np.uint8), 2).tolist() == [[0b00111001]]
    # 3-bit: codes straddle bytes; 8 codes → 3 bytes; unused high bits stay zero
    c = np.array([[7, 0, 0, 0, 0, 0, 0, 0]], np.uint8)
    assert pack_codes(c, 3).tolist() == [[7, 0, 0]]
    c = np.array([[0, 0, 7, 0, 0, 0, 0, 0]], np.uint8)  # bits 6..8
    assert pack_codes(c, 3).tolist() == [[0b11000000, 0b1, 0]]
    assert pack_codes(np.array([[7, 7, 7]], np.uint8), 3).tolist() == [[0xFF, 0x01]]
    # 1-bit LSB first
    assert pack_codes(np.array([[1, 0, 0, 0, 0, 0, 0, 1, 1]], np.uint8), 1).tolist() == [[0x81, 0x01]]


def test_pack_rejects_out_of_range_codes():
    with pytest.raises(QMoEInputError, match="codes"):
        pack_codes(np.array([[4]], np.uint8), 2)


def test_unpack_rejects_wrong_row_bytes():
    with pytest.raises(QMoEInputError, match="ceil"):
        unpack_codes(np.zeros((2, 5), np.uint8), 4, 8)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("block_size", [0, 16, 64])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trip(rng, bits, block_size, symmetric):
    E, N, K = 3, 10, 128
    w = rng.standard_normal((E, N, K))
    q = quantize(w, bits, block_size, symmetric=symmetric)
    assert q.packed.dtype == np.uint8 and q.packed.shape == (E, N, packed_row_bytes(K, bits))
    nb = K // block_size if block_size else 1
    assert q.scales.shape == ((E, N, nb) if block_size else (E, N))
    if symmetric:
        assert q.zero_points is None
    else:
        assert q.zero_points.shape == ((E, N, packed_row_bytes(nb, bits)) if block_size else (E, packed_row_bytes(N, bits)))
    d = dequantize(q.packed, q.scales, bits, block_size, q.zero_points, K=K)
    assert d.dtype == np.float32 and d.shape == (E, N, K)
    # every value lies on its block's grid and within half a step of the original (inside the clip range)
    s = np.repeat(q.scales.reshape(E, N, nb).astype(np.float64), K // nb, axis=-1)
    step_err = np.abs(d - w) / s
    inside = (w >= d.min()) & (w <= d.max())
    rel = np.linalg.norm(d - w) / np.linalg.norm(w)
    bound = {1: 1.0, 2: 0.6, 3: 0.3, 4: 0.15, 8: 0.01}[bits]
    assert rel < bound, rel
    if bits >= 2:
        assert np.median(step_err[inside]) <= 0.5 + 1e-6


def test_dequantize_formula_by_hand():
    # one expert, one row, K=4, 4-bit, row-wise, explicit zero point 3, scale 0.5
    codes = np.array([[[0, 3, 5, 15]]], np.uint8)
    packed = pack_codes(codes, 4)
    zp = pack_codes(np.array([[3]], np.uint8), 4)  # row-wise [E, ceil(N·b/8)]
    d = dequantize(packed, np.array([[0.5]], np.float32), 4, 0, zp, K=4)
    np.testing.assert_array_equal(d, [[[-1.5, 0.0, 1.0, 6.0]]])
    # no zero point: 2^(b−1) = 8
    d = dequantize(packed, np.array([[0.5]], np.float32), 4, 0, K=4)
    np.testing.assert_array_equal(d, [[[-4.0, -2.5, -1.5, 3.5]]])
    # fractional zero_point_offset (balanced 2-bit code set)
    p2 = pack_codes(np.array([[[0, 1, 2, 3]]], np.uint8), 2)
    d = dequantize(p2, np.array([[2.0]], np.float32), 2, 0, zero_point_offset=1.5, K=4)
    np.testing.assert_array_equal(d, [[[-3.0, -1.0, 1.0, 3.0]]])


def test_block_zero_points_packed_along_block_axis():
    # 2 blocks of 16, 4-bit: block 0 → low nibble, block 1 → high nibble
    zp = unpack_zero_points(np.array([[[0x52]]], np.uint8), 4, N=1, n_blocks=2, block_wise=True)
    assert zp.tolist() == [[[2, 5]]]
    # row-wise: packed along N
    zp = unpack_zero_points(np.array([[0x52]], np.uint8), 4, N=2, n_blocks=1, block_wise=False)
    assert zp.tolist() == [[[2], [5]]]


def test_scale_dtype_and_bad_args(rng):
    w = rng.standard_normal((2, 4, 32))
    q = quantize(w, 4, 16, scale_dtype=np.float16)
    assert q.scales.dtype == np.float16
    import ml_dtypes

    q = quantize(w, 4, 16, scale_dtype=ml_dtypes.bfloat16)
    assert q.scales.dtype == ml_dtypes.bfloat16
    with pytest.raises(QMoEInputError, match="bits"):
        quantize(w, 5)
    with pytest.raises(QMoEInputError, match="block_size"):
        quantize(w, 4, 24)
    with pytest.raises(QMoEInputError, match="weights"):
        quantize(w[0], 4)
