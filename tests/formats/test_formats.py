"""The weight-format axis (qmoe_rtc/formats), on the CPU: the registry and its names, the typed errors, the
contract's quant_type mapping, every format's codec against its reference dequantization, zero points only
where a format has them, and the decode traits the layouts compile to."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qmoe_rtc
from qmoe_rtc import errors
from qmoe_rtc.contract import QMoEAttributes, describe_layer
from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.formats import FORMATS, QUANT_TYPES, format_of_quant_type, weight_format
from qmoe_rtc.formats.fp8 import decode_e4m3fn, encode_e4m3fn
from qmoe_rtc.formats.int_codes import pack_codes, unpack_codes
from qmoe_rtc.formats.quantize import quantize
from qmoe_rtc.specialize import BITS, CPP_ZP, DECODE_TRAITS, ZP_MODES, Layout

NAMES = ("int", "fp8_e4m3", "mxfp4", "nvfp4")


# ---- the registry -------------------------------------------------------------------------------------

def test_the_formats_and_their_one_names():
    assert tuple(FORMATS) == NAMES and all(weight_format(n).name == n for n in NAMES)
    assert all(weight_format(f) is f for f in FORMATS.values())  # a WeightFormat is its own lookup
    assert set().union(*(f.bits for f in FORMATS.values())) == set(BITS)  # the device templates' widths
    assert FORMATS["int"].bits == BITS and FORMATS["fp8_e4m3"].bits == (8,)
    assert FORMATS["mxfp4"].bits == FORMATS["nvfp4"].bits == (4,)
    assert [f.zero_points for f in FORMATS.values()] == [True, False, False, False]
    assert (FORMATS["mxfp4"].scale.block, FORMATS["nvfp4"].scale.block) == (32, 16)
    assert FORMATS["fp8_e4m3"].scale.square and not any(FORMATS[n].scale.square for n in ("int", "mxfp4", "nvfp4"))
    assert qmoe_rtc.formats.FORMATS is FORMATS and qmoe_rtc.fp8 is qmoe_rtc.formats.fp8  # public names still work


@pytest.mark.parametrize("value", ["fp8", "fp4", "FP8_E4M3", "int4", "", None, 8])
def test_an_unknown_format_is_a_typed_error_naming_input_names_and_value(value):
    with pytest.raises(errors.WeightFormatError) as ei:
        weight_format(value, "--format")
    e = ei.value
    assert isinstance(e, errors.QMoEAttributeError) and isinstance(e, errors.QMoEInputError)
    assert e.name == "--format" and e.actual == repr(value) and all(n in e.expected for n in NAMES)
    if value == "fp8":  # the contract's quant_type spelling: the message says what the format is called
        assert "spelled 'fp8_e4m3'" in str(e)


def test_quant_type_maps_to_its_format_in_one_place():
    assert QUANT_TYPES == ("int", "fp8", "mxfp4", "nvfp4")
    assert [format_of_quant_type(q).name for q in QUANT_TYPES] == list(NAMES)
    assert format_of_quant_type(b"fp8") is FORMATS["fp8_e4m3"]  # ONNX attributes may be bytes
    assert format_of_quant_type("int", bits=3) is FORMATS["int"] and format_of_quant_type("nvfp4", 4).name == "nvfp4"
    for qt in ("fp8_e4m3", "fp4", "wfp4afp8", "INT"):
        with pytest.raises(errors.WeightFormatError) as ei:
            format_of_quant_type(qt)
        assert ei.value.name == "quant_type" and ei.value.actual == repr(qt)
    with pytest.raises(errors.QMoEAttributeError) as ei:
        format_of_quant_type("fp8", bits=4)
    assert ei.value.name == "expert_weight_bits"
    for qt, fmt in zip(QUANT_TYPES, NAMES):
        assert QMoEAttributes.from_kwargs(quant_type=qt, expert_weight_bits=FORMATS[fmt].bits[-1]).weight_format.name \
            == fmt


# ---- decode traits and zero points --------------------------------------------------------------------

def test_decode_traits_are_todays_enumerators():
    assert ZP_MODES == ("none", "packed", "offset") and DECODE_TRAITS == tuple(CPP_ZP)
    assert CPP_ZP == {"none": "qmoe::ZP_NONE", "packed": "qmoe::ZP_PACKED", "offset": "qmoe::ZP_OFFSET",
                      "fp8": "qmoe::ZP_FP8", "fp4": "qmoe::ZP_FP4"}
    assert [FORMATS["int"].decode_trait(z) for z in ZP_MODES] == list(ZP_MODES)
    assert [FORMATS[n].decode_trait() for n in NAMES[1:]] == ["fp8", "fp4", "fp4"]


@pytest.mark.parametrize("name", NAMES[1:])
def test_float_formats_refuse_zero_points(rng, name):
    fmt = FORMATS[name]
    for zp in ("packed", "offset"):
        with pytest.raises(errors.QMoEAttributeError) as ei:
            fmt.decode_trait(zp, "fc2_zp")
        assert ei.value.name == "fc2_zp"
    kw = dict(fc1_bits=fmt.bits[0], fc2_bits=fmt.bits[0], fc1_format=name, fc2_format=name, scale_dtype="float32",
              block_size=fmt.scale.block)
    assert Layout(**kw).decode_trait("fc1") == fmt.decode
    assert Layout(**{**kw, "fc1_format": fmt}) == Layout(**kw)  # a WeightFormat is held by its name
    with pytest.raises(errors.QMoEAttributeError, match="fc1_zp"):
        Layout(**kw, fc1_zp="packed")
    with pytest.raises(errors.QMoEInputError) as ei:
        quantize(rng.standard_normal((1, 16, 64)).astype(np.float32), symmetric=False, format=name)
    assert ei.value.name == "symmetric"
    with pytest.raises(errors.QMoEAttributeError, match="zero_point_offset"):
        QMoEAttributes.from_kwargs(quant_type=fmt.quant_type, expert_weight_bits=fmt.bits[0], zero_point_offset=1.0)


# ---- every codec against its reference dequantization ---------------------------------------------------

#: (format, layer keywords, worst |w - dequantized| relative to the expert's largest magnitude)
CASES = [
    ("int", dict(bits=8, block_size=32), 1 / 128), ("int", dict(bits=4, block_size=0, zero_points=True), 1 / 15),
    ("int", dict(bits=3, block_size=16), 1 / 4), ("int", dict(bits=2, block_size=32, zero_points=True), 1 / 3),
    ("fp8_e4m3", dict(block_size=0), 1 / 16), ("fp8_e4m3", dict(block_size=32), 1 / 16),
    ("mxfp4", {}, 0.26), ("nvfp4", {}, 0.26),  # e2m1: half a step is at most a quarter of the value
]


@pytest.mark.parametrize("name, kw, tol", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_codec_round_trip_against_the_reference_dequantization(rng, name, kw, tol):
    """Random float experts quantized by the format's codec, described by its projection checks and
    dequantized by its reference: the codes unpack and pack (decode and encode) unchanged, and the reference
    weights, quantized again by the codec and dequantized again, stay within the format's step of themselves."""
    E, H, I = 3, 64, 32
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, format=name, dtype="float32", activation_type="relu", **kw)
    fmt = FORMATS[name]
    attrs = QMoEAttributes.from_kwargs(**a)
    layer = describe_layer(w, attrs)
    for p in layer.projections():
        assert p.format == name and p.weight_format is fmt and p.decode_trait == fmt.decode_trait(p.zp_mode)
        codes = w[f"{p.name}_experts_weights"]
        if name == "fp8_e4m3":
            assert np.array_equal(encode_e4m3fn(decode_e4m3fn(codes)), codes)  # every code is exact
        else:
            assert np.array_equal(pack_codes(unpack_codes(codes, p.bits, p.K), p.bits), codes)
        ref = np.stack([fmt.reference_weights(w, p, e, attrs.zero_point_offset) for e in range(E)])
        assert ref.dtype == np.float32 and ref.shape == (E, p.N, p.K) and np.isfinite(ref).all()
        again = fmt.quantize(np, ref, fmt.bits[0] if name != "int" else p.bits, p.block_size,
                             p.zp_mode == "none", "float32")
        redo = np.stack([fmt.reference_weights(_renamed(again, p), p, e, None) for e in range(E)])
        # the dequantized weights are on the format's grid: quantizing them again keeps them within one step
        scale = np.abs(ref).reshape(E, -1).max(axis=1)[:, None, None]
        assert (np.abs(redo - ref) <= tol * scale + 1e-7).all(), name


def _renamed(q, p) -> dict:
    """A quantize() result as the contract's inputs of projection ``p``."""
    out = {f"{p.name}_experts_weights": q.packed, p.scale_input: q.scales}
    if q.zero_points is not None:
        out[f"{p.name}_zero_points"] = q.zero_points
    if getattr(q, "global_scale", None) is not None:
        out[f"{p.name}_global_scale"] = q.global_scale
    return out


@pytest.mark.parametrize("name, tol", [("int", 1 / 8), ("fp8_e4m3", 1 / 16), ("mxfp4", 0.26), ("nvfp4", 0.26)])
def test_quantize_then_reference_is_close_to_the_floats(rng, name, tol):
    fmt = FORMATS[name]
    E, N, K = 2, 16, 64
    wf = rng.standard_normal((E, N, K)).astype(np.float32)
    q = quantize(wf, 4 if name == "int" else None, 32 if name != "nvfp4" else 16, format=name)
    spec = _spec(name, N, K, q)
    deq = np.stack([fmt.reference_weights(_renamed(q, spec), spec, e, None) for e in range(E)])
    assert np.abs(deq - wf).max() <= tol * np.abs(wf).max()


def _spec(name, N, K, q):
    from qmoe_rtc.formats import ProjectionSpec

    fmt = FORMATS[name]
    bits = fmt.bits[0] if name != "int" else 4
    bs = fmt.scale.block or 32
    return ProjectionSpec(name="fc1", bits=bits, N=N, K=K, block_size=bs, row_bytes=int(q.packed.shape[-1]),
                          scale_dtype="float32", zp_mode="none", has_bias=False, bias_dtype=None, format=name)


def test_layouts_fold_format_and_zero_points_into_todays_module_specs():
    """A layout's format + zero-point pair becomes the module spec's fcN_zp decode trait, the key every
    generated unit had before the axis existed (the cubins stay the same)."""
    from qmoe_rtc.kernels import get_family
    from qmoe_rtc.specialize import ModelConfig

    lay = Layout(dtype="bfloat16", scale_dtype="float32", fc1_bits=4, fc2_bits=4, fc1_format="mxfp4",
                 fc2_format="mxfp4", block_size=32, activation="swiglu", swiglu_fusion=1)
    spec = get_family("mma_decode").spec(ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=lay))
    params = spec.as_dict()
    assert (params["fc1_zp"], params["fc2_zp"], params["fc3_zp"]) == ("fp4", "fp4", "none")
    assert not any(k.endswith("_format") for k in params) and "fc1-b4-zpE" in spec.name
    int4 = dataclasses.replace(lay, fc1_format="int", fc2_format="int", fc2_zp="packed")
    assert get_family("mma_decode").spec(ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=int4))[
        "fc2_zp"] == "packed"
