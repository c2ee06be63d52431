"""CPU: expert weights as e4m3 codes (qmoe_rtc/formats/e4m3_weights.py) equal the formats' unscaled weights exactly,
and what e4m3 cannot hold exactly is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.errors import QMoEInputError
from qmoe_rtc.formats.e4m3_weights import E4M3_INT_BITS, e2m1_as_e4m3, int_codes_as_e4m3
from qmoe_rtc.formats.fp4 import decode_e2m1
from qmoe_rtc.formats.fp8 import decode_e4m3fn
from qmoe_rtc.formats.int_codes import pack_codes


@pytest.mark.parametrize("bits", E4M3_INT_BITS)
@pytest.mark.parametrize("zero", ["default", "offset", "block", "row"])
def test_int_codes_minus_zero_point_are_exact(bits, zero):
    rng = np.random.default_rng(bits * 7 + len(zero))
    E, N, K, bs = 2, 5, 96, 32
    q = rng.integers(0, 1 << bits, size=(E, N, K))
    q[0, 0, : 1 << bits] = np.arange(1 << bits)  # every code at least once
    kwargs, zp = {}, np.full((E, N, 1), 1 << (bits - 1))
    if zero == "offset":
        kwargs["zero_point_offset"] = zp_val = (1 << bits) - 1
        zp = np.full((E, N, 1), zp_val)
    elif zero == "block":
        zb = rng.integers(0, 1 << bits, size=(E, N, K // bs))
        kwargs.update(zero_points=pack_codes(zb, bits), block_size=bs)
        zp = np.repeat(zb, bs, axis=-1)
    elif zero == "row":
        zr = rng.integers(0, 1 << bits, size=(E, N))
        kwargs["zero_points"] = pack_codes(zr, bits)
        zp = zr[..., None]
    codes = int_codes_as_e4m3(pack_codes(q, bits), bits, K, **kwargs)
    assert codes.dtype == np.uint8 and codes.shape == (E, N, K)
    np.testing.assert_array_equal(decode_e4m3fn(codes), (q - zp).astype(np.float32))


def test_every_e2m1_code_is_the_same_e4m3_value():
    c = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(decode_e4m3fn(e2m1_as_e4m3(c)), decode_e2m1(c))
    high = np.array([[0x21, 0xF7]], dtype=np.uint8)  # bits above the code are ignored, as decode_e2m1 does
    np.testing.assert_array_equal(decode_e4m3fn(e2m1_as_e4m3(high)), decode_e2m1(high))


@pytest.mark.parametrize("bits, kwargs, name", [
    (8, {}, "bits"),
    (4, {"zero_point_offset": 7.5}, "zero_point_offset"),
    (4, {"zero_point_offset": 16}, "zero_point_offset"),
    (4, {"zero_point_offset": True}, "zero_point_offset"),
])
def test_what_e4m3_cannot_hold_exactly_is_refused(bits, kwargs, name):
    packed = np.zeros((1, 2, 16 * bits // 8), dtype=np.uint8)
    with pytest.raises(QMoEInputError, match=name):
        int_codes_as_e4m3(packed, bits, 16, **kwargs)


def test_packed_codes_of_the_wrong_type_are_refused():
    with pytest.raises(QMoEInputError, match="packed"):
        int_codes_as_e4m3(np.zeros((2, 8), dtype=np.uint8), 4, 16)
