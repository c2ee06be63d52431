"""GPU: the FP8 activation quantizer (kernels/act_quant.py) against qmoe_rtc.formats.activations, bit for bit:
codes and scales of fresh random rows (wide magnitude ranges, all-zero rows, values that round to e4m3's
subnormals, a NaN and an infinity in one group each, partial last groups), each dtype, a scale a row and per
group; outputs poisoned before each launch (0xFF is a NaN code the kernel never writes, -7 a scale it never
writes). Skipped without a GPU; sm_89+ (below, the refusal is checked)."""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc import errors
from qmoe_rtc.formats.activations import group_count, quantize_activations

pytestmark = pytest.mark.gpu

DTYPES = {"float32": np.float32, "float16": np.float16}


def _cc() -> int:
    import cupy as cp

    return int(cp.cuda.Device().compute_capability)


def _np_dtype(dtype):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else DTYPES[dtype]


def _rows(rng, rows: int, K: int, dtype: str) -> np.ndarray:
    spread = 6 if dtype == "float16" else 20  # float16 holds 2^±14 or so
    x = rng.standard_normal((rows, K)) * np.exp2(rng.uniform(-spread, spread, (rows, 1)))
    x[0] = 0.0  # an all-zero row: scale 1, codes 0
    if rows > 2:
        x[1, : K // 2] *= 1e-4  # next to larger values: subnormal codes
    if rows > 3:
        x[2, min(3, K - 1)] = np.nan
        x[3, K - 1] = np.inf
    return x.astype(_np_dtype(dtype))


CASES = [(dt, rows, K, g) for dt in ("float32", "float16", "bfloat16")
         for rows, K, g in ((6, 300, 0), (6, 300, 128), (5, 4096, 128), (4, 200, 48), (1, 7, 0), (6, 129, 128))]


@pytest.mark.parametrize("dtype, rows, K, group", CASES)
def test_codes_and_scales_bit_for_bit(rng, dtype, rows, K, group):
    import cupy as cp

    from qmoe_rtc.kernels.act_quant import quantize_activations_gpu

    if _cc() < 89:
        pytest.skip("sm_89+ (see test_older_devices_are_refused)")
    x = _rows(rng, rows, K, dtype)
    codes = cp.full((rows, K), 0xFF, cp.uint8)
    scales = cp.full((rows, group_count(K, group)), -7.0, cp.float32)
    got_c, got_s = quantize_activations_gpu(cp.asarray(x), group, codes=codes, scales=scales)
    want_c, want_s = quantize_activations(x.astype(np.float32), group)
    np.testing.assert_array_equal(cp.asnumpy(got_s), want_s)  # NaN where want is NaN
    np.testing.assert_array_equal(cp.asnumpy(got_c), want_c)
    assert got_c is codes and got_s is scales


def test_more_rows_than_one_grid_holds(rng):
    import cupy as cp

    from qmoe_rtc.kernels.act_quant import quantize_activations_gpu

    if _cc() < 89:
        pytest.skip("sm_89+")
    x = (rng.standard_normal((70000, 32)) * 3).astype(np.float16)
    got_c, got_s = quantize_activations_gpu(cp.asarray(x), 16)
    want_c, want_s = quantize_activations(x.astype(np.float32), 16)
    np.testing.assert_array_equal(cp.asnumpy(got_s), want_s)
    np.testing.assert_array_equal(cp.asnumpy(got_c), want_c)


@pytest.mark.parametrize("what", ["rank", "dtype", "group", "codes", "scales"])
def test_bad_inputs_are_refused_before_any_launch(what):
    import cupy as cp

    from qmoe_rtc.kernels.act_quant import quantize_activations_gpu

    x = cp.zeros((4, 64), cp.float16)
    kw = {"rank": dict(x=x.reshape(2, 2, 64)), "dtype": dict(x=x.astype(cp.float64)), "group": dict(group=-1),
          "codes": dict(codes=cp.zeros((4, 63), cp.uint8)), "scales": dict(scales=cp.zeros((4, 1), cp.float16))}[what]
    args = {"x": x, "group": 0, **kw}
    with pytest.raises(errors.QMoEInputError):
        quantize_activations_gpu(args.pop("x"), **args)


def test_older_devices_are_refused():
    import cupy as cp

    from qmoe_rtc.kernels.act_quant import quantize_activations_gpu

    if _cc() >= 89:
        pytest.skip("this device converts e4m3")
    with pytest.raises(errors.DeviceError, match="sm_89"):
        quantize_activations_gpu(cp.zeros((2, 32), cp.float16))
