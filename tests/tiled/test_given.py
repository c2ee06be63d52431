"""Tiled codes as an input (qmoe_rtc/tiled/given.py) on the CPU: tiled_weights is prepack.pack per
projection (routed and shared) and unpack gives the contract codes back; a layer given tiled codes is
described exactly like the contract one; every refusal of QMoE(prepack='given') (and of tiled codes
without it) is a typed error raised before the driver is asked for a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import qmoe_rtc
from qmoe_rtc import errors
from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.runtime.layer import describe_gpu_layer
from qmoe_rtc.settings import knobs
from qmoe_rtc.tiled.given import CODE_INPUTS, tiled_weights
from qmoe_rtc.tiled.transform import LAYOUT_VERSION, pack, tiled_shape, unpack

# (name, random_layer kwargs): interleaved FC1 with a shared expert, 8-bit row-wise zero points with fused
# halves (2), 3-bit FC3 with blocks of 16, 2-bit plain gelu, FP8 (bytes, tiled like 8-bit codes)
LAYOUTS = [
    ("b4-bs128-swiglu1-S1", dict(bits=4, block_size=128, dtype="bfloat16", activation_type="swiglu", swiglu_fusion=1,
                                 shared=1)),
    ("b8-row-zp-swiglu2", dict(bits=8, block_size=0, zero_points=True, dtype="float16", activation_type="swiglu",
                               swiglu_fusion=2)),
    ("b3-bs16-zp-silu-fc3", dict(bits=3, block_size=16, zero_points=True, dtype="float16", activation_type="silu",
                                 fc3=True)),
    ("b2-bs32-gelu-S2", dict(bits=2, block_size=32, dtype="bfloat16", activation_type="gelu", shared=2)),
    ("fp8-bs128-swiglu1", dict(format="fp8_e4m3", block_size=128, dtype="bfloat16", activation_type="swiglu",
                               swiglu_fusion=1)),
]
E, H, I = 4, 256, 128


def layer(rng, **kw):
    return random_layer(rng, E=E, H=H, I=I, k=2, **kw)


@pytest.fixture
def no_gpu(monkeypatch):
    """The driver probe (QMoE's first GPU step) answers 'no GPU'; returns its calls, so a test can tell
    that a refusal came before it."""
    calls = []

    def probe(device_id=None):
        calls.append(device_id)
        raise errors.DeviceError("no GPU (this test's fake driver)")

    monkeypatch.setattr("qmoe_rtc.executor.probe", probe)
    return calls


@pytest.mark.parametrize("name, kw", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_tiled_weights_is_pack_per_projection_and_unpacks_to_the_contract(rng, name, kw):
    w, a = layer(rng, **kw)
    tw = tiled_weights(w, **a)
    g = describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {})
    groups = [("", g.layer)] + ([("shared_", g.ext.shared)] if g.ext.shared is not None else [])
    done = set()
    for prefix, spec in groups:
        for p in spec.projections():
            n = f"{prefix}{p.name}_experts_weights"
            codes = w[n].view(np.uint8)
            # FC1's gate / linear rows interleave in tile rows, both fusions' (FP8 fusion 2's rows stay)
            interleaved = a["swiglu_fusion"] if p.name == "fc1" else 0
            interleaved = 0 if p.weight_format.scale.square and interleaved == 2 else interleaved
            t = tw[n]
            assert t.dtype == np.uint8 and t.shape == tiled_shape(spec.E, p.N, p.K, p.bits), n
            np.testing.assert_array_equal(t, pack(np, codes, p.K, p.bits, interleaved), err_msg=n)
            np.testing.assert_array_equal(unpack(np, t, p.N, p.K, p.bits, interleaved), codes, err_msg=n)
            done.add(n)
    assert done == {n for n in CODE_INPUTS if w.get(n) is not None}
    assert all(tw[n] is w[n] for n in w if n not in done)  # scales, zero points, biases: the arrays themselves
    # the tiled layer is the contract layer, sizes and all (its codes checked as their contract shapes)
    assert describe_gpu_layer(tw, QMoEAttributes.from_kwargs(**a), {}, given=True) == g


def test_the_layout_is_versioned():
    assert isinstance(LAYOUT_VERSION, int) and LAYOUT_VERSION >= 1
    assert "LAYOUT_VERSION" in qmoe_rtc.tiled.transform.__all__ and qmoe_rtc.tiled.LAYOUT_VERSION == LAYOUT_VERSION


def test_a_good_given_layer_reaches_the_gpu_step(no_gpu, rng):
    for _, kw in LAYOUTS:
        w, a = layer(rng, **kw)
        with pytest.raises(errors.DeviceError, match="fake driver"):
            qmoe_rtc.QMoE(**tiled_weights(w, **a), **a, prepack="given")
    assert len(no_gpu) == len(LAYOUTS)


def test_the_one_shot_form_takes_given_codes_too(no_gpu, rng):
    from qmoe_rtc.contract.random_layer import random_inputs

    w, a = layer(rng, **LAYOUTS[0][1])
    tw = tiled_weights(w, **a)
    x, lg, _ = random_inputs(rng, 2, H, E, "bfloat16")
    with pytest.raises(errors.QMoEInputError, match="prepack='given'") as ei:
        qmoe_rtc.qmoe(x, lg, **tw, **a)
    assert ei.value.name == "fc1_experts_weights" and no_gpu == []
    with pytest.raises(errors.DeviceError, match="fake driver"):
        qmoe_rtc.qmoe(x, lg, **tw, **a, prepack="given")
    assert len(no_gpu) == 1


def _refused(exc_type, w, a, **kw):
    with pytest.raises(exc_type) as ei:
        qmoe_rtc.QMoE(**w, **a, **kw)
    return ei.value


def test_contract_codes_with_given_and_tiled_codes_without_it_are_refused(no_gpu, rng):
    w, a = layer(rng, **LAYOUTS[0][1])
    tw = tiled_weights(w, **a)
    e = _refused(errors.QMoEInputError, w, a, prepack="given")
    assert e.name == "fc1_experts_weights" and "tiled codes [E, N/8, ceil(K/128), 8, 4, 16]" in e.expected
    assert e.actual == "shape [4, 256, 128]" and "leave prepack='given' out" in e.hint
    for setting in (None, "auto", "on", "off", True):
        e = _refused(errors.QMoEInputError, tw, a, prepack=setting)
        assert e.name == "fc1_experts_weights" and "prepack='given'" in e.expected, setting
        assert e.actual == "shape [4, 32, 2, 8, 4, 16]"
    mixed = {**tw, "fc2_experts_weights": w["fc2_experts_weights"]}  # one projection left in the contract layout
    assert _refused(errors.QMoEInputError, mixed, a, prepack="given").name == "fc2_experts_weights"
    shared = {**tw, "shared_fc1_experts_weights": w["shared_fc1_experts_weights"]}
    assert _refused(errors.QMoEInputError, shared, a, prepack="given").name == "shared_fc1_experts_weights"
    assert no_gpu == []


def _cut(a, axis, n):
    """``a`` with ``n`` entries of ``axis`` (a contiguous copy)."""
    return np.ascontiguousarray(np.take(a, np.arange(n), axis=axis))


def test_bad_tiled_shapes_name_the_input_and_both_shapes(no_gpu, rng):
    """Each tiled shape is the one its projection's sizes give (K from the other projection: FC1's and
    FC3's K = H = 8·FC2's dim 1, FC2's K = I): refused with the expected and the actual tiled shape."""
    w, a = layer(rng, **LAYOUTS[2][1])  # 3-bit, FC3: tiled [E, N/8, ceil(K/128), 8, 4, 12]
    tw = tiled_weights(w, **a)
    f1, f2, f3 = (tw[f"fc{i}_experts_weights"] for i in (1, 2, 3))
    assert f1.shape == (4, 16, 2, 8, 4, 12) and f2.shape == (4, 32, 1, 8, 4, 12) and f3.shape == f1.shape
    cases = [  # (what, input, bad array, expected shape)
        ("segment bytes", "fc1_experts_weights", _cut(f1, 5, 8), "[E, N/8, ceil(K/128), 8, 4, 12]"),
        ("chunks", "fc1_experts_weights", _cut(f1, 2, 1), "shape [4, 16, 2, 8, 4, 12]"),
        ("rank", "fc2_experts_weights", f2.reshape(4, 32, 8, 4, 12), "[E, N/8, ceil(K/128), 8, 4, 12]"),
        ("experts", "fc2_experts_weights", _cut(f2, 0, 3), "shape [4, 32, 1, 8, 4, 12]"),
        ("fc3 rows", "fc3_experts_weights", _cut(f3, 1, 15), "shape [4, 16, 2, 8, 4, 12]"),
        ("tile rows", "fc3_experts_weights", _cut(f3, 3, 4), "[E, N/8, ceil(K/128), 8, 4, 12]"),
    ]
    for what, name, bad, expected in cases:
        e = _refused(errors.QMoEInputError, {**tw, name: bad}, a, prepack="given")
        assert e.name == name and expected in e.expected, (what, str(e))
        assert e.actual == "shape [" + ", ".join(map(str, bad.shape)) + "]", what
    # FC2's rows give H, so fewer of them are a wrong K for FC1 and FC3 (here: fewer chunks than fc1 has)
    e = _refused(errors.QMoEInputError, {**tw, "fc2_experts_weights": _cut(f2, 1, 16)}, a, prepack="given")
    assert e.name == "fc1_experts_weights" and "K=H=128" in e.expected
    assert no_gpu == []


def test_what_the_contract_checks_of_tiled_codes_says(no_gpu, rng):
    """dtype, contiguity, a missing projection: the contract's own checks, naming the input, and saying that
    tiled codes are checked as their contract shape."""
    w, a = layer(rng, **LAYOUTS[0][1])
    tw = tiled_weights(w, **a)
    f1 = tw["fc1_experts_weights"]
    e = _refused(errors.QMoEInputError, {**tw, "fc1_experts_weights": f1.view(np.int8)}, a, prepack="given")
    assert e.name == "fc1_experts_weights" and "dtype int8" in e.actual and "contract shape" in e.hint
    strided = np.zeros((*f1.shape[:-1], 32), np.uint8)[..., :16]
    e = _refused(errors.QMoEInputError, {**tw, "fc1_experts_weights": strided}, a, prepack="given")
    assert e.name == "fc1_experts_weights" and "non-contiguous" in e.actual
    e = _refused(errors.QMoEInputError, {**tw, "fc2_experts_weights": None}, a, prepack="given")
    assert e.name == "fc2_experts_weights" and e.actual == "None" and "fc1_experts_weights, H," in e.expected
    e = _refused(errors.QMoEInputError, {**tw, "shared_fc2_experts_weights": None}, a, prepack="given")
    assert e.name == "shared_fc2_experts_weights"
    bits8 = {**a, "expert_weight_bits": 8}  # the attributes say 8-bit: the tiled segments are 4-bit ones
    e = _refused(errors.QMoEInputError, tw, bits8, prepack="given")
    assert e.name == "fc1_experts_weights" and "8, 4, 32]" in e.expected
    assert no_gpu == []


def test_fp8_codes_may_be_given_as_float8(no_gpu, rng):
    """FP8 codes are bytes tiled like 8-bit codes; a float8_e4m3fn view of them is taken as well."""
    import ml_dtypes

    w, a = layer(rng, **LAYOUTS[4][1])
    tw = tiled_weights(w, **a)
    assert tw["fc1_experts_weights"].shape[-1] == 32
    f8 = {n: tw[n].view(ml_dtypes.float8_e4m3fn) if n in CODE_INPUTS and tw.get(n) is not None else tw[n] for n in tw}
    _refused(errors.DeviceError, f8, a, prepack="given")
    assert len(no_gpu) == 1


def test_layers_the_engines_cannot_read_tiled_are_refused_with_the_reason(no_gpu, rng):
    w, a = layer(rng, bits=2, block_size=32, dtype="float16", activation_type="swiglu", swiglu_fusion=1)
    tw = tiled_weights(w, **a)
    offset = {**a, "zero_point_offset": 1.5}  # only the SIMT engines take a zero-point offset
    with pytest.raises(errors.QMoEUnsupportedError, match="prepack='given' needs tensor-core engines.*zero_point_offset"):
        qmoe_rtc.QMoE(**tw, **offset, prepack="given")
    with pytest.raises(errors.QMoEUnsupportedError, match="cannot be tiled.*zero_point_offset"):
        tiled_weights(w, **offset)
    with pytest.raises(errors.KnobError, match="QMOE_RTC_PREPACK.*'auto', 'on', 'off'.*'given'"), \
            knobs.scope(prepack="given"):
        qmoe_rtc.QMoE(**w, **a)  # 'given' says what one layer's arrays are, not a process-wide default
    assert no_gpu == []


def test_tiled_weights_refuses_what_it_cannot_tile(rng):
    w, a = layer(rng, **LAYOUTS[0][1])
    tw = tiled_weights(w, **a)
    with pytest.raises(errors.QMoEInputError, match="prepack='given'") as ei:
        tiled_weights(tw, **a)  # already tiled
    assert ei.value.name == "fc1_experts_weights"
    with pytest.raises(errors.QMoEInputError) as ei:
        tiled_weights({**w, "fc2_scales": None}, **a)  # the layer is validated as a whole
    assert ei.value.name == "fc2_scales"
    with pytest.raises(errors.QMoEAttributeError):
        tiled_weights(w, **{**a, "swiglu_fusion": 3})
