"""Contract extensions [ext] in the reference: shared experts (with and without the sigmoid gate), the
router GEMM, every refusal of their inputs, and the GPU layer refusing them before the GPU (CPU only)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import qmoe_rtc
from qmoe_rtc import errors
from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.extensions import SHARED_INPUTS
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import activate, qmoe
from qmoe_rtc.formats.quantize import dequantize

E, H, I, IS = 6, 64, 32, 48  # IS: the shared experts' own intermediate size


def shared(rng, S=2, I_s=IS, **kw):
    """Random shared experts: ``(shared_* tensors, the attributes they were made with)``."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("activation_type", "swiglu")
    w, a = random_layer(rng, E=S, H=H, I=I_s, **kw)
    return {f"shared_{n}": v for n, v in w.items()}, a


def routed(rng, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("activation_type", "swiglu")
    return random_layer(rng, E=E, H=H, I=I, k=2, **kw)


def dense_shared(x, sw, attrs: QMoEAttributes, bits=4, bs=0, gate=None):
    """Σ_s shared_s(x) in float64 from the dequantized shared weights, written out here."""
    x64 = x.astype(np.float64)
    S = sw["shared_fc1_experts_weights"].shape[0]
    I_s = sw["shared_fc2_experts_weights"].shape[2] * 8 // bits
    W1 = dequantize(sw["shared_fc1_experts_weights"], sw["shared_fc1_scales"], bits, bs, K=H).astype(np.float64)
    W2 = dequantize(sw["shared_fc2_experts_weights"], sw["shared_fc2_scales"], bits, bs, K=I_s).astype(np.float64)
    b1, b2 = sw.get("shared_fc1_experts_bias"), sw.get("shared_fc2_experts_bias")
    total = np.zeros_like(x64)
    for s in range(S):
        h = x64 @ W1[s].T + (0.0 if b1 is None else b1[s].astype(np.float64))
        total += activate(h, attrs, 2) @ W2[s].T + (0.0 if b2 is None else b2[s].astype(np.float64))
    if gate is not None:
        total *= (1.0 / (1.0 + np.exp(-(x64 @ gate.astype(np.float64)))))[:, None]
    return total


# ---- shared experts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("S", [1, 3])
def test_shared_part_equals_dense_computation(rng, gated, S):
    w, a = routed(rng, bias=True, swiglu_limit=7.0, activation_alpha=1.702, activation_beta=1.0)
    sw, _ = shared(rng, S=S, bias=True)
    gate = rng.standard_normal(H).astype(np.float32) / 8 if gated else None
    x, lg, _ = random_inputs(rng, 5, H, E, "float32")
    extra = dict(sw, shared_gate_weight=gate) if gated else sw
    got = qmoe(x, lg, **w, **a, **extra).astype(np.float64)
    base = qmoe(x, lg, **w, **a).astype(np.float64)
    want = dense_shared(x, sw, QMoEAttributes.from_kwargs(**a), gate=gate)
    assert np.allclose(got - base, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0.1  # the shared part is not negligible


def test_shared_experts_keep_their_own_bits_and_block_size(rng):
    w, a = routed(rng, bits=4, block_size=32)
    sw, _ = shared(rng, S=1, bits=8, block_size=16)
    x, lg, _ = random_inputs(rng, 3, H, E, "float32")
    got = qmoe(x, lg, **w, **a, **sw, shared_expert_weight_bits=8, shared_block_size=16).astype(np.float64)
    base = qmoe(x, lg, **w, **a).astype(np.float64)
    want = dense_shared(x, sw, QMoEAttributes.from_kwargs(**a), bits=8, bs=16)
    assert np.allclose(got - base, want, rtol=1e-5, atol=1e-5)


def test_shared_experts_in_float16_round_once(rng):
    w, a = routed(rng, dtype="float16")
    sw, _ = shared(rng, dtype="float16")
    gate = (rng.standard_normal(H) / 8).astype(np.float16)
    x, lg, _ = random_inputs(rng, 4, H, E)
    y = qmoe(x, lg, **w, **a, **sw, shared_gate_weight=gate)
    assert y.dtype == np.float16 and y.shape == x.shape and np.isfinite(y).all()


# ---- the router GEMM --------------------------------------------------------------------------------

@pytest.mark.parametrize("wdt, bias", [("float32", True), ("float16", False), ("float16", True)])
def test_router_gemm_equals_logits_computed_outside(rng, wdt, bias):
    w, a = routed(rng, dtype="float16")
    x, _, _ = random_inputs(rng, 7, H, E)
    rwt = (rng.standard_normal((E, H)) / 4).astype(wdt)
    rb = (rng.standard_normal(E)).astype(wdt) if bias else None
    logits = x.astype(np.float64) @ rwt.astype(np.float64).T + (0.0 if rb is None else rb.astype(np.float64))
    outside = qmoe(x, logits.astype(np.float32), **w, **a)
    inside = qmoe(x, None, **w, **a, router_weight=rwt, router_bias=rb)
    assert np.array_equal(inside, outside)


def test_router_gemm_with_router_weights_and_shared_experts(rng):
    w, a = routed(rng)
    sw, _ = shared(rng)
    x, _, mix = random_inputs(rng, 3, H, E, "float32", router_weights=True)
    rwt = rng.standard_normal((E, H)).astype(np.float32)
    logits = (x.astype(np.float64) @ rwt.astype(np.float64).T).astype(np.float32)
    outside = qmoe(x, logits, **w, **a, **sw, router_weights=mix)
    inside = qmoe(x, None, **w, **a, **sw, router_weight=rwt, router_weights=mix)
    assert np.array_equal(inside, outside)


# ---- validation: one test per refusal ---------------------------------------------------------------

def _drop(name):
    return lambda t: {**t, name: None}


def _set(name, f):
    return lambda t: {**t, name: f(t)}


REFUSALS = {  # what: (change the extension tensors, change attributes, call changes, name, class)
    "shared weights missing": (_drop("shared_fc1_experts_weights"), {}, {}, "shared_fc1_experts_weights",
                               errors.QMoEInputError),
    "shared scales missing": (_drop("shared_fc2_scales"), {}, {}, "shared_fc2_scales", errors.QMoEInputError),
    "shared scales shape": (_set("shared_fc1_scales", lambda t: np.ascontiguousarray(t["shared_fc1_scales"][:, :-1])),
                            {}, {}, "shared_fc1_scales", errors.QMoEInputError),
    "shared S disagree": (_set("shared_fc2_experts_weights", lambda t: t["shared_fc2_experts_weights"][:1]), {}, {},
                          "shared_fc2_experts_weights", errors.QMoEInputError),
    "shared inter size disagree": (_set("shared_fc2_experts_weights",
                                        lambda t: np.zeros((2, H, IS // 2 - 4), np.uint8)), {}, {},
                                   "shared_fc2_experts_weights", errors.QMoEInputError),
    "shared hidden size": (_set("shared_fc2_experts_weights", lambda t: np.zeros((2, H + 32, IS // 2), np.uint8)),
                           {}, {}, "shared_fc2_experts_weights", errors.QMoEInputError),
    "shared weights dtype": (_set("shared_fc1_experts_weights", lambda t: t["shared_fc1_experts_weights"].view(np.int8)),
                             {}, {}, "shared_fc1_experts_weights", errors.QMoEInputError),
    "shared bias shape": (_set("shared_fc2_experts_bias", lambda t: np.zeros((2, H - 1), np.float32)), {}, {},
                          "shared_fc2_experts_bias", errors.QMoEInputError),
    "shared zero points shape": (_set("shared_fc1_zero_points", lambda t: np.zeros((2, 3), np.uint8)), {}, {},
                                 "shared_fc1_zero_points", errors.QMoEInputError),
    "shared scales dtype mix": (_set("shared_fc1_scales", lambda t: t["shared_fc1_scales"].astype(ml_dtypes.bfloat16)),
                                {}, {}, "shared_fc1_scales", errors.QMoEInputError),
    "shared bits": ({}, dict(shared_expert_weight_bits=5), {}, "shared_expert_weight_bits", errors.QMoEAttributeError),
    "shared bits disagree with packing": ({}, dict(shared_expert_weight_bits=8), {}, "shared_fc1_experts_weights",
                                          errors.QMoEInputError),
    "shared block size": ({}, dict(shared_block_size=24), {}, "shared_block_size", errors.QMoEAttributeError),
    "shared block size vs scales": ({}, dict(shared_block_size=16), {}, "shared_fc1_scales", errors.QMoEInputError),
    "gate shape": (_set("shared_gate_weight", lambda t: np.zeros(H + 1, np.float32)), {}, {}, "shared_gate_weight",
                   errors.QMoEInputError),
    "gate dtype": (_set("shared_gate_weight", lambda t: np.zeros(H, np.float64)), {}, {}, "shared_gate_weight",
                   errors.QMoEInputError),
    "gate without shared experts": (lambda t: {"shared_gate_weight": np.zeros(H, np.float32)}, {}, {},
                                    "shared_gate_weight", errors.QMoEInputError),
    "shared attributes without shared experts": (lambda t: {}, dict(shared_block_size=16), {}, "shared_block_size",
                                                 errors.QMoEAttributeError),
    "shared experts need fused GLU": ({}, {}, {}, "swiglu_fusion", errors.QMoEAttributeError),
    "router weight shape": (_set("router_weight", lambda t: np.zeros((E, H - 1), np.float32)), {}, {}, "router_weight",
                            errors.QMoEInputError),
    "router weight dtype": (_set("router_weight", lambda t: np.zeros((E, H), np.int8)), {}, {}, "router_weight",
                            errors.QMoEInputError),
    "router bias shape": (_set("router_bias", lambda t: np.zeros(E + 1, np.float32)), {}, {}, "router_bias",
                          errors.QMoEInputError),
    "router bias without weight": (lambda t: {**t, "router_weight": None, "router_bias": np.zeros(E, np.float32)}, {},
                                   {}, "router_bias", errors.QMoEInputError),
    "router_probs with router weight": ({}, {}, dict(logits=True), "router_probs", errors.QMoEInputError),
    "no logits and no router weight": (lambda t: {**t, "router_weight": None, "router_bias": None}, {},
                                       dict(logits=False), "router_probs",
                                       errors.QMoEInputError),
    "input dtype vs extension dtype": (_set("shared_gate_weight", lambda t: np.zeros(H, np.float16)), {}, {}, "input",
                                       errors.QMoEInputError),
    "unknown extension input": (lambda t: {**t, "shared_fc3_experts_weights": np.zeros(1, np.uint8)}, {}, {},
                                "shared_fc3_experts_weights", errors.QMoEAttributeError),
}


ROUTED_KW = {"shared experts need fused GLU": dict(fc3=True), "shared scales dtype mix": dict(dtype="float16")}


def _case(rng, what):
    change, attrs, call, name, cls = REFUSALS[what]
    w, a = routed(rng, **{"dtype": "float32", **ROUTED_KW.get(what, {})})
    if "zero points" in what:
        sw, _ = shared(rng, zero_points=True)
    else:
        sw, _ = shared(rng)
    ext = dict(sw, shared_gate_weight=np.zeros(H, np.float32), router_weight=np.zeros((E, H), np.float32),
               router_bias=np.zeros(E, np.float32))
    ext = change(ext) if callable(change) else ext
    ext = {n: v for n, v in ext.items() if v is not None}
    x, lg, _ = random_inputs(rng, 2, H, E, "float32")
    logits = lg if call.get("logits", "router_weight" not in ext) else None
    return w, {**a, **attrs}, ext, x, logits, name, cls


@pytest.mark.parametrize("what", sorted(REFUSALS))
def test_extension_refusals(rng, what):
    w, a, ext, x, logits, name, cls = _case(rng, what)
    with pytest.raises(cls) as ei:
        qmoe(x, logits, **w, **a, **ext)
    assert type(ei.value) is cls and ei.value.name == name, str(ei.value)
    assert f"'{name}'" in str(ei.value)


@pytest.mark.parametrize("bs", [0, 16])
def test_fp8_shared_part_equals_dense_computation(rng, bs):
    """FP8 layers have FP8 shared experts (global scales [S] with block size 0, square blocks else)."""
    from qmoe_rtc.formats.fp8 import dequantize_fp8

    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float32", block_size=bs, format="fp8_e4m3",
                        activation_type="swiglu")
    sw, _ = shared(rng, S=2, block_size=bs, format="fp8_e4m3")
    scale = "global_scale" if bs == 0 else "scales"
    assert f"shared_fc1_{scale}" in sw and f"shared_fc2_{scale}" in sw
    x, lg, _ = random_inputs(rng, 4, H, E, "float32")
    got = qmoe(x, lg, **w, **a, **sw).astype(np.float64)
    base = qmoe(x, lg, **w, **a).astype(np.float64)
    attrs = QMoEAttributes.from_kwargs(**a)
    W1 = dequantize_fp8(sw["shared_fc1_experts_weights"], sw[f"shared_fc1_{scale}"], bs).astype(np.float64)
    W2 = dequantize_fp8(sw["shared_fc2_experts_weights"], sw[f"shared_fc2_{scale}"], bs).astype(np.float64)
    want = sum(activate(x.astype(np.float64) @ W1[s].T, attrs, 2) @ W2[s].T for s in range(2))
    assert np.allclose(got - base, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0.1


def test_fp8_shared_experts_refuse_other_bits_and_missing_scales(rng):
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float32", format="fp8_e4m3")
    sw, _ = shared(rng, format="fp8_e4m3")
    x, lg, _ = random_inputs(rng, 2, H, E, "float32")
    with pytest.raises(errors.QMoEAttributeError) as ei:
        qmoe(x, lg, **w, **a, **sw, shared_expert_weight_bits=4)
    assert ei.value.name == "shared_expert_weight_bits"
    with pytest.raises(errors.QMoEInputError) as ei:
        qmoe(x, lg, **w, **a, **{**sw, "shared_fc2_global_scale": None})
    assert ei.value.name == "shared_fc2_global_scale"


def test_shared_input_names():
    assert SHARED_INPUTS == ("shared_fc1_experts_weights", "shared_fc1_scales", "shared_fc1_zero_points",
                             "shared_fc1_experts_bias", "shared_fc2_experts_weights", "shared_fc2_scales",
                             "shared_fc2_zero_points", "shared_fc2_experts_bias", "shared_fc1_global_scale",
                             "shared_fc2_global_scale")


# ---- the GPU layer: validated before the GPU; what it cannot run refused there -----------------------

GPU_REFUSED = {
    "shared of another size": lambda rng: (routed(rng), shared(rng, I_s=2 * I)[0]),
    "shared of other bits": lambda rng: (routed(rng), dict(shared(rng, I_s=I, bits=8)[0], shared_expert_weight_bits=8)),
    "shared beside fc3": lambda rng: (routed(rng, activation_type="silu", fc3=True),
                                      shared(rng, I_s=I, activation_type="silu")[0]),
    "fp8 shared of another block size": lambda rng: (routed(rng, format="fp8_e4m3", block_size=16),
                                                     dict(shared(rng, I_s=I, format="fp8_e4m3", block_size=32)[0],
                                                          shared_block_size=32)),
}
GPU_ACCEPTED = {
    "fp8 global": lambda rng: (random_layer(rng, E=E, H=H, I=I, dtype="float16", format="fp8_e4m3"), {}),
    "fp8 block": lambda rng: (random_layer(rng, E=E, H=H, I=I, dtype="float16", block_size=16, format="fp8_e4m3"), {}),
    "fp8 partial blocks": lambda rng: (random_layer(rng, E=E, H=H, I=I, dtype="bfloat16", block_size=64,
                                                    format="fp8_e4m3"), {}),
    "shared": lambda rng: (routed(rng), shared(rng, I_s=I)[0]),
    "shared gated": lambda rng: (routed(rng), dict(shared(rng, I_s=I)[0], shared_gate_weight=np.zeros(H, np.float32))),
    "router gemm": lambda rng: (routed(rng), dict(router_weight=np.zeros((E, H), np.float32))),
    "fp8 shared": lambda rng: (routed(rng, format="fp8_e4m3"), shared(rng, I_s=I, format="fp8_e4m3")[0]),
    "fp8 shared blocks": lambda rng: (routed(rng, format="fp8_e4m3", block_size=16),
                                      shared(rng, I_s=I, format="fp8_e4m3", block_size=16)[0]),
}


@pytest.mark.parametrize("what", sorted(GPU_REFUSED))
def test_gpu_layer_refuses_what_it_cannot_run_before_the_gpu(machine, rng, what):
    calls = machine(lib=False)  # no driver at all: any GPU access would be a DeviceError, not this
    (w, a), ext = GPU_REFUSED[what](rng)
    with pytest.raises(errors.QMoEUnsupportedError, match="GPU engines of this build do not") as ei:
        qmoe_rtc.QMoE(**w, **a, **ext)
    assert "reference" in str(ei.value) and calls == []


@pytest.mark.parametrize("what", sorted(GPU_ACCEPTED))
def test_gpu_layer_accepts_fp8_shared_experts_and_the_router_gemm(machine, rng, what):
    machine(lib=False)  # validation passes; the next thing is the driver, which is missing here
    (w, a), ext = GPU_ACCEPTED[what](rng)
    with pytest.raises(errors.DeviceError):
        qmoe_rtc.QMoE(**w, **a, **ext)


def test_gpu_layer_validates_extension_inputs_first(machine, rng):
    calls = machine(lib=False)
    w, a = routed(rng)
    sw, _ = shared(rng)
    sw["shared_fc1_scales"] = np.ascontiguousarray(sw["shared_fc1_scales"][:, :-1])
    with pytest.raises(errors.QMoEInputError) as ei:
        qmoe_rtc.QMoE(**w, **a, **sw)
    assert ei.value.name == "shared_fc1_scales" and calls == []
    w8, a8 = random_layer(rng, E=E, H=H, I=I, dtype="float16", format="fp8_e4m3")
    with pytest.raises(errors.QMoEInputError) as ei:
        qmoe_rtc.QMoE(**{**w8, "fc1_global_scale": None}, **a8)
    assert ei.value.name == "fc1_global_scale" and calls == []
