"""FP8 (float8 e4m3fn) experts: the NumPy decoder against ml_dtypes code by code, quantization into
both scale forms and back, the reference on FP8 layers, and every refusal (CPU only)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qmoe_rtc import errors
from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import activate, qmoe, route
from qmoe_rtc.formats.fp8 import E4M3_MAX, decode_e4m3fn, dequantize_fp8, encode_e4m3fn
from qmoe_rtc.formats.quantize import quantize

E, H, I = 4, 64, 48
ALL = np.arange(256, dtype=np.uint8)


# ---- the decoder ------------------------------------------------------------------------------------

def test_decoder_matches_ml_dtypes_bit_for_bit_on_all_256_codes():
    ours = decode_e4m3fn(ALL)
    theirs = ALL.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert ours.dtype == np.float32
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF]  # the only NaN codes; no infinities
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))  # signed zeros included
    assert not np.isinf(ours).any()


@pytest.mark.parametrize("code, value", [(0x00, 0.0), (0x01, 2.0**-9), (0x07, 7 * 2.0**-9), (0x08, 2.0**-6),
                                         (0x38, 1.0), (0x39, 1.125), (0x7E, 448.0), (0xB8, -1.0), (0xFE, -448.0)])
def test_decoder_hand_values(code, value):
    assert decode_e4m3fn(np.array([code], np.uint8))[0] == value


def test_decoder_reads_float8_arrays_as_their_codes():
    assert np.array_equal(decode_e4m3fn(ALL.view(ml_dtypes.float8_e4m3fn)), decode_e4m3fn(ALL), equal_nan=True)


def test_encoder_inverts_the_decoder_and_refuses_what_has_no_code():
    finite = ALL[(ALL & 0x7F) != 0x7F]
    assert np.array_equal(encode_e4m3fn(decode_e4m3fn(finite)), finite)
    for bad in (np.nan, np.inf, 449.0, -500.0):
        with pytest.raises(errors.QMoEInputError, match="values"):
            encode_e4m3fn(np.array([1.0, bad], np.float32))


# ---- quantize(format="fp8_e4m3") --------------------------------------------------------------------

def _bound(w, s):
    """Round-to-nearest error bound: half a mantissa step (2^-4 relative) or half the subnormal step."""
    return np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * s) * (1 + 1e-6)


def test_global_scale_round_trip(rng):
    w = rng.standard_normal((3, 40, 72)).astype(np.float32)
    w[1] *= 1e-3  # experts of very different ranges get their own scale
    q = quantize(w, format="fp8_e4m3")
    assert (q.packed.dtype, q.packed.shape, q.scales.dtype, q.scales.shape, q.zero_points) == \
        (np.uint8, (3, 40, 72), np.float32, (3,), None)
    d = dequantize_fp8(q.packed, q.scales, 0)
    assert np.all(np.abs(d - w) <= _bound(w, q.scales[:, None, None]))
    assert np.allclose(np.abs(decode_e4m3fn(q.packed)).max(axis=(1, 2)), E4M3_MAX)  # amax maps to ±448
    assert np.array_equal(d, decode_e4m3fn(q.packed) * q.scales[:, None, None])  # the scale multiplies


@pytest.mark.parametrize("bs, N, K, sdt", [(128, 300, 260, np.float32), (16, 40, 72, np.float16),
                                           (32, 32, 64, ml_dtypes.bfloat16)])
def test_block_scales_round_trip(rng, bs, N, K, sdt):
    w = rng.standard_normal((2, N, K)).astype(np.float32)
    q = quantize(w, 8, bs, scale_dtype=sdt, format="fp8_e4m3")
    nbn, nbk = -(-N // bs), -(-K // bs)
    assert q.scales.shape == (2, nbn, nbk) and q.scales.dtype == np.dtype(sdt) and q.packed.shape == (2, N, K)
    s = q.scales.astype(np.float32)
    full = np.repeat(np.repeat(s, bs, 1), bs, 2)[:, :N, :K]  # [E, N, K]: block (n // bs, k // bs)
    d = dequantize_fp8(q.packed, q.scales, bs)
    assert np.array_equal(d, decode_e4m3fn(q.packed) * full)
    assert np.all(np.abs(d - w) <= _bound(w, full) + 2.0**-8 * np.abs(w))  # a scale rounded to T moves values a little
    for i in range(nbn):  # each block's largest magnitude lands at (or, with a rounded scale, next to) 448
        for j in range(nbk):
            blk = np.abs(decode_e4m3fn(q.packed[:, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs]))
            assert np.all(blk.max(axis=(1, 2)) >= 416)


def test_all_zero_blocks_get_scale_one(rng):
    w = np.zeros((1, 32, 32), np.float32)
    w[0, :16, :16] = 1.0
    q = quantize(w, block_size=16, format="fp8_e4m3")
    assert q.scales[0].tolist() == [[np.float32(1.0) / np.float32(448.0), 1.0], [1.0, 1.0]]
    assert np.array_equal(dequantize_fp8(q.packed, q.scales, 16), w)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("bs", [0, 16])
def test_fp8_quantize_refuses_non_finite(value, bs):
    w = np.ones((2, 16, 32), np.float32)
    w[1, 3, 7] = value
    with pytest.raises(errors.QMoEInputError, match=r"weights.*index \[1, 3, 7\]"):
        quantize(w, block_size=bs, format="fp8_e4m3")


@pytest.mark.parametrize("kw, name", [(dict(bits=4), "bits"), (dict(block_size=8), "block_size"),
                                      (dict(block_size=48), "block_size"), (dict(block_size=-1), "block_size"),
                                      (dict(symmetric=False), "symmetric"), (dict(scale_dtype=np.float16), "scale_dtype"),
                                      (dict(block_size=16, scale_dtype=np.int8), "scale_dtype"),
                                      (dict(format="fp4"), "format")])
def test_fp8_quantize_refuses_bad_arguments(kw, name):
    kw = {"format": "fp8_e4m3", **kw}
    with pytest.raises(errors.QMoEInputError) as ei:
        quantize(np.ones((1, 16, 32), np.float32), **kw)
    assert ei.value.name == name


# ---- the reference on FP8 layers --------------------------------------------------------------------

def _dense(x, w, a, layer_kw):
    """The layer from the decoded FP8 weights: plain float64 algebra written out here."""
    bs = a["block_size"]

    def deq(p):
        codes = w[f"{p}_experts_weights"]
        s = (w[f"{p}_scales"] if bs else w[f"{p}_global_scale"]).astype(np.float32)
        if not bs:
            return decode_e4m3fn(codes).astype(np.float64) * s[:, None, None].astype(np.float64)
        N, K = codes.shape[1:]
        full = np.repeat(np.repeat(s, bs, 1), bs, 2)[:, :N, :K]
        return (decode_e4m3fn(codes) * full).astype(np.float64)

    from qmoe_rtc.contract import QMoEAttributes

    attrs = QMoEAttributes.from_kwargs(**a)
    x64 = x.astype(np.float64)
    W1, W2 = deq("fc1"), deq("fc2")
    experts, rw = route(layer_kw["logits"], attrs)
    out = np.zeros_like(x64)
    for r in range(x.shape[0]):
        for j, e in enumerate(experts[r]):
            h = x64[r : r + 1] @ W1[e].T
            out[r] += rw[r, j] * (activate(h, attrs, 2 if attrs.swiglu_fusion else 1) @ W2[e].T)[0]
    return out


@pytest.mark.parametrize("bs", [0, 16])
@pytest.mark.parametrize("act", ["swiglu", "silu"])
def test_reference_fp8_equals_dense_decoded_computation(rng, bs, act):
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, block_size=bs, activation_type=act, dtype="float32",
                        format="fp8_e4m3")
    assert a["quant_type"] == "fp8" and a["expert_weight_bits"] == 8
    x, lg, _ = random_inputs(rng, 5, H, E, "float32")
    got = qmoe(x, lg, **w, **a)
    want = _dense(x, w, a, {"logits": lg})
    assert np.allclose(got, want, rtol=1e-6, atol=1e-7)
    as_fp8 = {n: v.view(ml_dtypes.float8_e4m3fn) if n.endswith("_weights") else v for n, v in w.items()}
    assert np.array_equal(qmoe(x, lg, **as_fp8, **a), got)  # float8e4m3fn arrays read as their codes


def test_reference_fp8_global_scales_are_inputs_15_and_16(rng):
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float16", format="fp8_e4m3")
    x, lg, _ = random_inputs(rng, 3, H, E)
    pos = qmoe(x, lg, w["fc1_experts_weights"], None, None, w["fc2_experts_weights"], None, None,
               None, None, None, None, None, None, None, w["fc1_global_scale"], w["fc2_global_scale"], **a)
    assert np.array_equal(pos, qmoe(x, lg, **w, **a))
    doubled = qmoe(x, lg, **{**w, "fc2_global_scale": w["fc2_global_scale"] * 2}, **a)
    assert np.allclose(doubled.astype(np.float32), 2 * pos.astype(np.float32), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("bs", [-1, -128])
def test_fp8_block_size_at_or_below_zero_means_global_scales(rng, bs):
    """ONNX Runtime reads FP8 block_size <= 0 as per-expert global scales: a negative value is the same
    layer as 0 (an integer layer still refuses it)."""
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float16", format="fp8_e4m3")
    assert a["block_size"] == 0
    x, lg, _ = random_inputs(rng, 3, H, E)
    assert QMoEAttributes.from_kwargs(**{**a, "block_size": bs}).block_size == 0
    assert np.array_equal(qmoe(x, lg, **w, **{**a, "block_size": bs}), qmoe(x, lg, **w, **a))
    wi, ai = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float16")
    with pytest.raises(errors.QMoEAttributeError, match="block_size"):
        qmoe(x, lg, **wi, **{**ai, "block_size": bs})


def test_nan_codes_propagate_and_are_refused_by_content_checks(rng):
    w, a = random_layer(rng, E=E, H=H, I=I, k=1, activation_type="relu", dtype="float32", format="fp8_e4m3")
    w["fc2_experts_weights"] = w["fc2_experts_weights"].copy()
    w["fc2_experts_weights"][2, 5, 0] = 0xFF
    w["fc2_experts_weights"][2, 5, 1:] = 0x00  # so the NaN is all that row 5 of expert 2 holds
    x, lg, _ = random_inputs(rng, 6, H, E, "float32")
    lg[:3, 2] = 100.0  # rows 0-2 go to expert 2
    lg[3:, 2] = -100.0
    y = qmoe(x, lg, **w, **a)
    assert np.isnan(y[:3, 5]).all() and not np.isnan(y[3:]).any() and not np.isnan(np.delete(y[:3], 5, 1)).any()
    with pytest.raises(errors.QMoEInputError, match=r"fc2_experts_weights.*0xff at index \[2, 5, 0\]"):
        qmoe(x, lg, **w, **a, validate_content=True)


# ---- validation: one test per refusal ---------------------------------------------------------------

def _fp8(rng, bs=0, **kw):
    return random_layer(rng, E=E, H=H, I=I, k=2, block_size=bs, dtype="float16", format="fp8_e4m3", **kw)


def _with(d, **changes):
    out = {**d, **changes}
    return {n: v for n, v in out.items() if v is not None}


FP8_REFUSALS = {  # what: (block_size, change weights, change attributes, refused name, error class)
    "bits 4": (0, {}, dict(expert_weight_bits=4), "expert_weight_bits", errors.QMoEAttributeError),
    "fc2 bits 4": (0, {}, dict(fc2_expert_weight_bits=4), "fc2_expert_weight_bits", errors.QMoEAttributeError),
    "zero_point_offset": (0, {}, dict(zero_point_offset=8.0), "zero_point_offset", errors.QMoEAttributeError),
    "weights dtype": (0, dict(fc1_experts_weights=lambda w: w["fc1_experts_weights"].view(np.int8)),
                      {}, "fc1_experts_weights", errors.QMoEInputError),
    "weights packed like int4": (0, dict(fc2_experts_weights=lambda w: np.ascontiguousarray(
        w["fc2_experts_weights"][:, :, : I // 2])), {}, "fc2_experts_weights", errors.QMoEInputError),
    "global scale missing": (0, dict(fc1_global_scale=lambda w: None), {}, "fc1_global_scale", errors.QMoEInputError),
    "global scale shape": (0, dict(fc2_global_scale=lambda w: np.ones(E + 1, np.float32)), {}, "fc2_global_scale",
                           errors.QMoEInputError),
    "global scale dtype": (0, dict(fc1_global_scale=lambda w: w["fc1_global_scale"].astype(np.float16)), {},
                           "fc1_global_scale", errors.QMoEInputError),
    "row scales with global form": (0, dict(fc1_scales=lambda w: np.ones((E, 2 * I), np.float16)), {}, "fc1_scales",
                                    errors.QMoEInputError),
    "block scales shape": (16, dict(fc1_scales=lambda w: np.ascontiguousarray(w["fc1_scales"][:, :, :-1])), {},
                           "fc1_scales", errors.QMoEInputError),
    "block scales missing": (16, dict(fc2_scales=lambda w: None), {}, "fc2_scales", errors.QMoEInputError),
    "global scale with block form": (16, dict(fc1_global_scale=lambda w: np.ones(E, np.float32)), {},
                                     "fc1_global_scale", errors.QMoEInputError),
    "zero points": (0, dict(fc1_zero_points=lambda w: np.zeros((E, I), np.uint8)), {}, "fc1_zero_points",
                    errors.QMoEInputError),
    "fc3": (0, dict(fc3_experts_weights=lambda w: np.zeros((E, I, H), np.uint8)), dict(swiglu_fusion=0),
            "fc3_experts_weights", errors.QMoEInputError),
}


@pytest.mark.parametrize("what", sorted(FP8_REFUSALS))
def test_fp8_layer_refusals(rng, what):
    bs, wch, ach, name, cls = FP8_REFUSALS[what]
    w, a = _fp8(rng, bs)
    w = _with(w, **{n: f(w) for n, f in wch.items()})
    x, lg, _ = random_inputs(rng, 2, H, E)
    with pytest.raises(cls) as ei:
        qmoe(x, lg, **w, **{**a, **ach})
    assert type(ei.value) is cls and ei.value.name == name and f"'{name}'" in str(ei.value)


def test_global_scales_are_refused_for_integer_layers(rng):
    w, a = random_layer(rng, E=E, H=H, I=I, dtype="float16")
    x, lg, _ = random_inputs(rng, 2, H, E)
    with pytest.raises(errors.QMoEInputError, match="fc2_global_scale.*quant_type='int'"):
        qmoe(x, lg, **w, **a, fc2_global_scale=np.ones(E, np.float32))


def test_fp8_content_check_refuses_negative_global_scales(rng):
    w, a = _fp8(rng)
    w["fc1_global_scale"] = w["fc1_global_scale"].copy()
    w["fc1_global_scale"][3] = -1.0
    x, lg, _ = random_inputs(rng, 2, H, E)
    with pytest.raises(errors.QMoEInputError, match=r"fc1_global_scale.*index \[3\]"):
        qmoe(x, lg, **w, **a, validate_content=True)
