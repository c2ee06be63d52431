"""FP4 experts [ext] on the CPU: the e2m1 / e8m0 codecs against ml_dtypes, quantization into MXFP4 and
NVFP4, the contract's checks of both formats, the float64 reference, the layer's config and the float32
block scales the upload binds. Compiles: tests/formats/test_fp4_engines.py; the GPU: tests/formats/test_fp4_gpu.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_fp8_engines import _Dev, _fake_cupy

from qmoe_rtc import errors
from qmoe_rtc.contract import QMoEAttributes, check_content, describe_layer
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.formats.fp4 import decode_e2m1, decode_e8m0, dequantize_fp4, encode_e2m1, engine_scales, quantize_fp4
from qmoe_rtc.formats.quantize import NVFP4Weights, QuantizedWeights, quantize
from qmoe_rtc.runtime.layer import layer_config
from qmoe_rtc.runtime.tensors import layer_scale_dtype, upload_projections

FORMATS = ("mxfp4", "nvfp4")


# ---- the codecs -----------------------------------------------------------------------------------------

def test_e2m1_decode_is_ml_dtypes_code_by_code():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(decode_e2m1(codes), want)
    assert sorted(set(np.abs(want).tolist())) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_encode_rounds_to_nearest_even_like_ml_dtypes():
    v = np.concatenate([np.linspace(-8, 8, 4001), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 1e9, -1e9]])
    v = v.astype(np.float32)
    got = decode_e2m1(encode_e2m1(v))
    np.testing.assert_array_equal(got, v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    with pytest.raises(errors.QMoEInputError, match="NaN"):
        encode_e2m1(np.array([1.0, np.nan], np.float32))


def test_e8m0_decode_is_ml_dtypes_with_255_nan():
    s = np.arange(256, dtype=np.uint8)
    got = decode_e8m0(s)
    want = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(got[:255], want[:255])
    assert np.isnan(got[255]) and got[0] == np.float32(2.0**-127) and got[127] == 1.0


# ---- quantization ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip_is_within_half_a_code_step(rng, fmt):
    E, N, K = 3, 24, 128
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    w[1, 3] = 0.0  # an all-zero row: scales stay finite, codes zero
    q = quantize(w, format=fmt)
    bs = 32 if fmt == "mxfp4" else 16
    assert q.packed.shape == (E, N, K // 2) and q.packed.dtype == np.uint8 and q.zero_points is None
    assert q.scales.shape == (E, N, K // bs) and q.scales.dtype == np.uint8
    if fmt == "nvfp4":
        assert isinstance(q, NVFP4Weights) and q.global_scale.shape == (E,) and q.global_scale.dtype == np.float32
    else:
        assert isinstance(q, QuantizedWeights)
    d = dequantize_fp4(fmt, q.packed, q.scales, getattr(q, "global_scale", None))
    s = engine_scales(fmt, q.scales, getattr(q, "global_scale", None))  # [E, N, nb] float32
    step = np.repeat(s, bs, axis=2)  # the spacing of e2m1 at its top is 2 scales
    assert np.all(np.abs(d - w) <= step + 1e-7), float(np.max(np.abs(d - w) / step))
    assert np.all(d[1, 3] == 0.0)
    codes = np.stack([q.packed & 0xF, q.packed >> 4], -1).reshape(E, N, K)
    assert (codes & 7).max() == 7  # the range is used


def test_mxfp4_scales_are_the_smallest_power_of_two_that_fits():
    w = np.zeros((1, 1, 32), np.float32)
    w[0, 0, 5] = 6.0 * 2.0**-3  # amax / 6 = 2^-3 exactly
    codes, s, _ = quantize_fp4(w, "mxfp4")
    assert s[0, 0, 0] == 127 - 3 and decode_e2m1(codes[0, 0, 2] >> 4) == 6.0  # element 5: the high nibble


@pytest.mark.parametrize("fmt, bad, match", [
    ("mxfp4", dict(block_size=16), "block_size"), ("nvfp4", dict(block_size=32), "block_size"),
    ("mxfp4", dict(bits=8), "bits"), ("nvfp4", dict(symmetric=False), "symmetric"),
])
def test_quantize_refuses_what_the_formats_do_not_have(rng, fmt, bad, match):
    w = rng.standard_normal((1, 4, 64)).astype(np.float32)
    with pytest.raises(errors.QMoEInputError, match=match):
        quantize(w, format=fmt, **bad)
    with pytest.raises(errors.QMoEInputError, match="K a multiple"):
        quantize(rng.standard_normal((1, 4, 40)).astype(np.float32), format=fmt)


# ---- the contract ------------------------------------------------------------------------------------

def _layer(rng, fmt, **kw):
    kw = {**dict(E=4, H=128, I=64, k=2, dtype="bfloat16", activation_type="swiglu", bias=True), **kw}
    return random_layer(rng, format=fmt, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_describe_an_fp4_layer(rng, fmt):
    w, a = _layer(rng, fmt)
    assert a["quant_type"] == fmt and a["block_size"] == (32 if fmt == "mxfp4" else 16)
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    for p in layer.projections():
        assert (p.bits, p.zp_mode, p.format, p.scale_dtype, p.row_bytes) == (4, "none", fmt, "float32", p.K // 2)
        assert p.decode_trait == "fp4"
    assert layer.dtype == "bfloat16"  # from the biases
    lay = layer_config(layer, "bfloat16", layer_scale_dtype(layer)).layout
    assert (lay.fc1_format, lay.fc2_format, lay.fc1_zp, lay.fc1_bits, lay.scale_dtype) == (fmt, fmt, "none", 4, "float32")
    assert "zpE" in lay.name and lay.block_size == a["block_size"]
    check_content(w, layer)


def test_block_size_zero_means_the_formats_block():
    assert QMoEAttributes.from_kwargs(quant_type="mxfp4").block_size == 32
    assert QMoEAttributes.from_kwargs(quant_type="nvfp4", block_size=16).block_size == 16
    for qt, bs in (("mxfp4", 16), ("nvfp4", 32), ("mxfp4", 64)):
        with pytest.raises(errors.QMoEAttributeError, match="block_size"):
            QMoEAttributes.from_kwargs(quant_type=qt, block_size=bs)
    with pytest.raises(errors.QMoEAttributeError, match="fc2_expert_weight_bits"):
        QMoEAttributes.from_kwargs(quant_type="mxfp4", fc2_expert_weight_bits=8)
    with pytest.raises(errors.QMoEAttributeError, match="zero_point_offset"):
        QMoEAttributes.from_kwargs(quant_type="nvfp4", zero_point_offset=1.0)
    with pytest.raises(errors.QMoEAttributeError, match="quant_type"):
        QMoEAttributes.from_kwargs(quant_type="fp4")


@pytest.mark.parametrize("fmt, change, name", [
    ("mxfp4", lambda w: w.update(fc1_scales=w["fc1_scales"].astype(np.float32)), "fc1_scales"),
    ("mxfp4", lambda w: w.update(fc2_scales=w["fc2_scales"][:, :, :1].copy()), "fc2_scales"),
    ("mxfp4", lambda w: w.update(fc1_global_scale=np.ones(4, np.float32)), "fc1_global_scale"),
    ("mxfp4", lambda w: w.update(fc2_zero_points=np.zeros((4, 128, 1), np.uint8)), "fc2_zero_points"),
    ("nvfp4", lambda w: w.pop("fc2_global_scale"), "fc2_global_scale"),
    ("nvfp4", lambda w: w.update(fc1_global_scale=np.ones((4, 3), np.float32)), "fc1_global_scale"),
    ("nvfp4", lambda w: w.update(fc1_experts_weights=w["fc1_experts_weights"][:, :, :32].copy()),
     "fc1_experts_weights"),
])
def test_the_contract_names_a_malformed_fp4_input(rng, fmt, change, name):
    w, a = _layer(rng, fmt)
    change(w)
    with pytest.raises(errors.QMoEInputError) as ei:
        describe_layer(w, QMoEAttributes.from_kwargs(**a))
    assert ei.value.name == name, str(ei.value)


def test_nvfp4_has_no_fc3_and_check_content_finds_nan_scales(rng):
    w, a = _layer(rng, "nvfp4", activation_type="silu", fc3=True, swiglu_fusion=0)
    with pytest.raises(errors.QMoEInputError, match="fc3_experts_weights"):
        describe_layer(w, QMoEAttributes.from_kwargs(**a))
    for fmt, nan in (("mxfp4", 255), ("nvfp4", 0x7F)):
        w, a = _layer(rng, fmt)
        layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
        w["fc2_scales"] = w["fc2_scales"].copy()
        w["fc2_scales"][1, 2, 0] = nan
        with pytest.raises(errors.QMoEInputError, match="fc2_scales"):
            check_content(w, layer)
    w, a = _layer(rng, "nvfp4")
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    w["fc1_global_scale"] = np.array([1, 0, 1, 1], np.float32)
    with pytest.raises(errors.QMoEInputError, match="fc1_global_scale"):
        check_content(w, layer)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_computes_the_dequantized_layer(rng, fmt):
    """The reference's FP4 layer equals the same layer written as float32 weights with 8-bit codes that
    represent every dequantized value exactly (an independent path through the int dequantization)."""
    w, a = _layer(rng, fmt, activation_type="silu", bias=False, dtype="float32")
    x, lg, _ = random_inputs(rng, 5, 128, 4, "float32")
    got = reference(x, lg, **w, **a)
    dense = {p: dequantize_fp4(fmt, w[f"{p}_experts_weights"], w[f"{p}_scales"], w.get(f"{p}_global_scale"))
             for p in ("fc1", "fc2")}
    # FP4 values · 2 are integers in [-12, 12]: 8-bit codes around 128 with scale/2 per block are exact
    bs = a["block_size"]
    iw = {}
    for p, d in dense.items():
        s = engine_scales(fmt, w[f"{p}_scales"], w.get(f"{p}_global_scale"))
        q = np.rint(d / np.repeat(s / 2, bs, axis=2)) + 128
        iw[f"{p}_experts_weights"] = q.astype(np.uint8)
        iw[f"{p}_scales"] = (s / 2).astype(np.float32)
    ia = {**a, "quant_type": "int", "expert_weight_bits": 8}
    want = reference(x, lg, **iw, **ia)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_upload_binds_float32_block_scales(rng, fmt):
    w, a = _layer(rng, fmt)
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    dev = {n: np.ascontiguousarray(v).view(_Dev) for n, v in w.items()}
    sdt, proj = upload_projections(_fake_cupy(), dev, layer, 0)
    assert sdt == "float32"
    for p in ("fc1", "fc2"):
        codes, scales, zp, _ = proj[p]
        want = engine_scales(fmt, w[f"{p}_scales"], w.get(f"{p}_global_scale"))
        assert zp is None and codes.shape == w[f"{p}_experts_weights"].shape
        np.testing.assert_array_equal(np.asarray(scales), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_layers_are_tiled_by_default_and_warm_plans_the_same(rng, fmt):
    """Without biases nothing fixes the activation dtype, yet an FP4 layer is tiled ('auto'), and the
    config warm / precompile build from (executor_config) is tiled too: no request waits for a compile."""
    from qmoe_rtc.runtime.layer import executor_config, prepack_choice

    w, a = _layer(rng, fmt, bias=False)
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    assert layer.dtype is None and prepack_choice(None, layer, None, 0) is True
    assert prepack_choice("off", layer, None, 0) is False
    assert executor_config(layer_config(layer, "bfloat16", layer_scale_dtype(layer))).layout.tiled
