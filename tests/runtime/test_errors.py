"""The error hierarchy, the driver probe, and validation before the GPU (CPU only: the driver is faked
where a test needs a particular machine, so these run the same with or without a GPU)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import qmoe_rtc
from qmoe_rtc import errors
from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.formats.quantize import quantize
from qmoe_rtc.jit import driver

E, H, I = 4, 32, 16


def layer(rng, **kw):
    kw.setdefault("activation_type", "silu")
    return random_layer(rng, E=E, H=H, I=I, **kw)


# ---- the hierarchy -----------------------------------------------------------------------------------

def test_every_error_is_a_qmoe_error_and_attributes_are_input_errors():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.QMoEError), name
        assert getattr(qmoe_rtc, name) is cls  # every one is reachable from the package
    assert issubclass(errors.QMoEAttributeError, errors.QMoEInputError)
    for cls in (errors.CacheMissError, errors.CacheCorruptError, errors.CacheLocationError):
        assert issubclass(cls, errors.CacheError)


def test_readme_promise_bad_attribute_is_caught_as_input_error(rng):
    """README: "Bad input ... raises qmoe_rtc.QMoEInputError" -- attributes such as k=0 included."""
    w, a = layer(rng)
    x, lg, _ = random_inputs(rng, 2, H, E)
    for bad in (dict(k=0), dict(activation_type="tanh"), dict(activation_alpha=math.inf)):
        with pytest.raises(qmoe_rtc.QMoEInputError):
            reference(x, lg, **w, **{**a, **bad})
        with pytest.raises(qmoe_rtc.QMoEInputError):
            qmoe_rtc.QMoE(**w, **{**a, **bad})


# ---- the driver probe: which thing is missing --------------------------------------------------------

@pytest.mark.parametrize("kw, says", [
    (dict(lib=False), "no NVIDIA driver found"),
    (dict(version=12040), "too old: it supports CUDA 12.4"),
    (dict(init_err=100), "no GPU is visible"),
    (dict(count=0), "no GPU is visible"),
    (dict(cc=(7, 5)), "compute capability 7.5"),
])
def test_probe_says_what_is_missing(machine, kw, says):
    machine(**kw)
    with pytest.raises(errors.DeviceError, match=says):
        driver.probe(0)


def test_probe_passes_a_good_machine_and_checks_the_index(machine):
    machine(version=13010, count=2)
    assert driver.probe(1) == (13010, 2)
    with pytest.raises(errors.DeviceError, match="has 2 GPU"):
        driver.probe(2)


@pytest.mark.parametrize("kw, says", [(dict(lib=False), "no NVIDIA driver"), (dict(version=12080), "too old")])
def test_good_layer_without_a_usable_gpu_is_a_device_error(machine, rng, kw, says):
    machine(**kw)
    w, a = layer(rng)
    with pytest.raises(errors.DeviceError, match=says):
        qmoe_rtc.QMoE(**w, **a)
    with pytest.raises(errors.DeviceError, match=says):
        qmoe_rtc.QMoE(**w, **a, device="cuda:0")


def test_default_arch_without_gpu_names_the_reason_and_the_hint(machine):
    from qmoe_rtc.jit import compiler

    machine(version=12000)
    with pytest.raises(errors.DeviceError, match="too old.*arch='sm_90'"):
        compiler.default_arch(7)


# ---- validation before the GPU ------------------------------------------------------------------------

def _bad_layers(rng):
    """(what, weights, attrs, bad input name): malformed layers the contract refuses."""
    out = []

    def case(what, name, fix_w=None, fix_a=None, **kw):
        w, a = layer(rng, **kw)
        if fix_w:
            fix_w(w)
        if fix_a:
            fix_a(a)
        out.append((what, w, a, name))

    case("weights dtype", "fc1_experts_weights", lambda w: w.update(fc1_experts_weights=w["fc1_experts_weights"].view(np.int8)))
    case("weights rank", "fc2_experts_weights", lambda w: w.update(fc2_experts_weights=w["fc2_experts_weights"][0]))
    case("packed width", "fc1_experts_weights", fix_a=lambda a: a.update(expert_weight_bits=8))
    case("expert count", "fc2_experts_weights", lambda w: w.update(fc2_experts_weights=w["fc2_experts_weights"][:-1]))
    case("non-contiguous", "fc1_experts_weights",
         lambda w: w.update(fc1_experts_weights=np.repeat(w["fc1_experts_weights"], 2, axis=1)[:, ::2]))
    case("scales dtype", "fc1_scales", lambda w: w.update(fc1_scales=w["fc1_scales"].astype(np.float64)))
    case("scales shape", "fc2_scales", lambda w: w.update(fc2_scales=np.ascontiguousarray(w["fc2_scales"][:, :-1])))
    case("mixed dtypes", "fc2_scales", lambda w: w.update(fc2_scales=w["fc2_scales"].astype(ml_dtypes.bfloat16)))
    case("bias shape", "fc2_experts_bias", lambda w: w.update(fc2_experts_bias=w["fc2_experts_bias"][:, :-1]), bias=True)
    case("zero points", "fc1_zero_points", lambda w: w.update(fc1_zero_points=np.zeros((E, I, 3), np.uint8)),
         block_size=16, zero_points=True)
    case("fc3 unused", "fc3_experts_weights", lambda w: w.update(fc3_experts_weights=w["fc1_experts_weights"]),
         activation_type="relu")
    case("k > E", "k", fix_a=lambda a: a.update(k=E + 1))
    case("block size", "block_size", fix_a=lambda a: a.update(block_size=64))
    return out


def test_bad_layers_are_refused_before_the_gpu_like_the_reference(machine, rng):
    """The same error (type and input name) from QMoE(...) as from the reference, and the GPU is never
    asked about (on a machine with no GPU at all, no CUDA error can come first)."""
    calls = machine(lib=False)
    x, lg, _ = random_inputs(rng, 2, H, E)
    for what, w, a, name in _bad_layers(rng):
        with pytest.raises(errors.QMoEInputError) as ref:
            reference(x, lg, **w, **a)
        with pytest.raises(errors.QMoEInputError) as got:
            qmoe_rtc.QMoE(**w, **a)
        assert (type(got.value), got.value.name) == (type(ref.value), ref.value.name) == (type(got.value), name), what
        assert str(got.value) == str(ref.value), what
    assert calls == []


def test_one_shot_qmoe_checks_the_call_before_the_gpu(machine, rng):
    """qmoe_rtc.qmoe(...) refuses a bad per-call input the way the reference does, without asking the
    driver (no GPU at all: the input error, not a DeviceError, comes first)."""
    calls = machine(lib=False)
    w, a = layer(rng)
    x, lg, rw = random_inputs(rng, 3, H, E, router_weights=True)
    for what, args, kw in (("H", (np.ascontiguousarray(x[:, :-1]), lg), {}), ("logits shape", (x, lg[:2]), {}),
                           ("input dtype", (x.astype(np.float32), lg), {}),
                           ("router_weights", (x, lg), dict(router_weights=rw[:, :-1]))):
        with pytest.raises(errors.QMoEInputError) as ref:
            reference(*args, **w, **a, **kw)
        with pytest.raises(errors.QMoEInputError) as got:
            qmoe_rtc.qmoe(*args, **w, **a, **kw)
        assert (got.value.name, str(got.value)) == (ref.value.name, str(ref.value)), what
    assert calls == []
    with pytest.raises(errors.DeviceError, match="no NVIDIA driver"):  # a good call reaches the driver probe
        qmoe_rtc.qmoe(x, lg, **w, **a)


def test_objects_that_are_no_arrays_are_input_errors(machine, rng):
    calls = machine(lib=False)
    w, a = layer(rng)
    for bad in ([[1.0]], "scales", object()):
        with pytest.raises(errors.QMoEInputError, match="fc1_scales"):
            qmoe_rtc.QMoE(**{**w, "fc1_scales": bad}, **a)
    assert calls == []


def test_content_is_checked_before_the_gpu_and_by_the_reference(machine, rng):
    calls = machine(lib=False)
    w, a = layer(rng)
    w["fc1_scales"] = w["fc1_scales"].copy()
    w["fc1_scales"][1, 2] = -1.0
    x, lg, _ = random_inputs(rng, 2, H, E)
    reference(x, lg, **w, **a)  # content is not looked at unless asked
    with pytest.raises(errors.QMoEInputError, match="fc1_scales") as ref:
        reference(x, lg, **w, **a, validate_content=True)
    with pytest.raises(errors.QMoEInputError, match="fc1_scales") as got:
        qmoe_rtc.QMoE(**w, **a, validate_content=True)
    assert str(got.value) == str(ref.value) and calls == []
    with pytest.raises(errors.DeviceError):
        qmoe_rtc.QMoE(**w, **a)  # without the flag: the layer would be uploaded


@pytest.mark.parametrize("kw, name", [(dict(device="gpu0"), "device"), (dict(device="cuda:x"), "device"),
                                      (dict(device=-1), "device"), (dict(device=1.0), "device"),
                                      (dict(decode_max_routes="many"), "decode_max_routes"),
                                      (dict(decode_max_routes=-1), "decode_max_routes")])
def test_bad_parameters_are_typed(machine, rng, kw, name):
    machine(lib=False)
    w, a = layer(rng)
    with pytest.raises(errors.QMoEInputError) as ei:
        qmoe_rtc.QMoE(**w, **a, **kw)
    assert ei.value.name == name


@pytest.mark.parametrize("device, want", [("cuda:1", 1), ("cuda", None), (3, 3), (None, None)])
def test_device_strings(device, want):
    from qmoe_rtc.runtime.interop import parse_device

    assert parse_device(device) == want


# ---- limits of this build ---------------------------------------------------------------------------

@pytest.mark.parametrize("E_, k, limit", [(513, 2, "at most 512"), (40, 33, "at most 32")])
def test_limits_are_unsupported_errors_naming_the_limit(machine, rng, E_, k, limit):
    calls = machine(lib=False)
    w, a = random_layer(rng, E=E_, H=16, I=16, k=k, activation_type="relu", dtype="float32")
    with pytest.raises(errors.QMoEUnsupportedError, match=limit):
        qmoe_rtc.QMoE(**w, **a)
    assert calls == []
    x, lg, _ = random_inputs(rng, 2, 16, E_, "float32")
    assert reference(x, lg, **w, **a).shape == (2, 16)  # the contract has no such limit


def test_k_above_ten_is_served(machine, rng):
    machine(lib=False)
    w, a = random_layer(rng, E=40, H=16, I=16, k=32, activation_type="relu", dtype="float32")
    with pytest.raises(errors.DeviceError):  # validation passed; only the GPU is missing
        qmoe_rtc.QMoE(**w, **a)


# ---- attributes and quantize() ----------------------------------------------------------------------

@pytest.mark.parametrize("attrs, name", [(dict(activation_alpha=math.inf), "activation_alpha"),
                                         (dict(activation_beta=-math.inf), "activation_beta"),
                                         (dict(activation_alpha=math.nan), "activation_alpha")])
def test_non_finite_activation_parameters_are_refused(attrs, name):
    with pytest.raises(errors.QMoEAttributeError) as ei:
        QMoEAttributes.from_kwargs(activation_type="swiglu", swiglu_fusion=1, **attrs)
    assert ei.value.name == name


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_quantize_refuses_non_finite_weights(rng, value):
    w = rng.standard_normal((600, 8, 32)).astype(np.float32)  # more experts than one chunk: index is global
    w[555, 3, 7] = value
    for symmetric in (True, False):
        with pytest.raises(errors.QMoEInputError, match=r"weights.*index \[555, 3, 7\]"):
            quantize(w, 4, 16, symmetric=symmetric)


@pytest.mark.parametrize("sdt", ["int8", np.int8, "float64", None, "bogus"])
def test_quantize_refuses_unsupported_scale_dtypes(rng, sdt):
    with pytest.raises(errors.QMoEInputError, match="scale_dtype"):
        quantize(rng.standard_normal((2, 4, 32)), 4, 16, scale_dtype=sdt)


def test_quantize_refuses_scales_that_overflow_and_bad_argument_types(rng):
    w = rng.standard_normal((2, 4, 32)).astype(np.float32)
    with pytest.raises(errors.QMoEInputError, match="fit float16"):
        quantize(w * np.float32(1e7), 4, 16, scale_dtype=np.float16)
    for bits, bs in ((None, 0), ("4", 0), (4, "16"), (4, 16.0)):
        with pytest.raises(errors.QMoEInputError):
            quantize(w, bits, bs)


def test_readme_example_without_a_gpu_stops_at_qmoe_with_a_device_error(machine):
    """The README's ten lines on a machine without a driver: the package's DeviceError, from QMoE(...)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("## API in ten lines", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    calls = machine(lib=False)
    with pytest.raises(errors.DeviceError, match="no NVIDIA driver") as ei:
        exec(compile(code, "README.md", "exec"), {})
    assert calls and any(str(e.path).endswith("executor.py") for e in ei.traceback)  # raised inside QMoE(...)


def test_dequantize_refuses_shapes_it_cannot_read(rng):
    from qmoe_rtc.formats.quantize import dequantize

    q = quantize(rng.standard_normal((2, 4, 64)).astype(np.float32), 4, 32)
    for args, name in (((q.packed, q.scales[:, :3], 4, 32), "scales"), ((q.packed, q.scales, 4, 0), "scales"),
                       ((q.packed[0], q.scales, 4, 32), "packed"), ((q.packed, q.scales, 4, "32"), "block_size")):
        with pytest.raises(errors.QMoEInputError) as ei:
            dequantize(*args)
        assert ei.value.name == name
