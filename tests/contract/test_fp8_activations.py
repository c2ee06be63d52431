"""FP8 activations [ext] (``activation_quant="fp8_e4m3"``, docs/contract.md "FP8 activations"): the attribute, the
rounding of a GEMM's input rows (checked against a transcription that searches every e4m3fn code), the float64
reference's use of it in both GEMMs, and the GPU side's refusal before any device work (no engine runs it yet)."""

from __future__ import annotations

import numpy as np
import pytest

import qmoe_rtc
from qmoe_rtc import errors
from qmoe_rtc.contract import QMoEAttributes, reference
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.formats.activations import fake_quantize, group_count, quantize_activations
from qmoe_rtc.formats.fp8 import e4m3_table

# -- the attribute ----------------------------------------------------------------------------------------------------


def test_defaults_and_parsing():
    a = QMoEAttributes.from_kwargs()
    assert (a.activation_quant, a.activation_quant_group) == ("none", 0)
    a = QMoEAttributes.from_kwargs(activation_quant=b"FP8_E4M3", activation_quant_group=128)
    assert (a.activation_quant, a.activation_quant_group) == ("fp8_e4m3", 128)
    assert a.shared_attrs().activation_quant == "fp8_e4m3"  # the shared experts' GEMMs take the same inputs


@pytest.mark.parametrize("kw, name, says", [
    (dict(activation_quant="int8"), "activation_quant", "one of ('none', 'fp8_e4m3')"),
    (dict(activation_quant="fp8_e4m3", activation_quant_group=-1), "activation_quant_group", "a positive group"),
    (dict(activation_quant_group=128), "activation_quant_group", "0 unless activation_quant='fp8_e4m3'"),
    (dict(activation_quant="fp8_e4m3", activation_quant_group=1.5), "activation_quant_group", "an integer"),
])
def test_bad_values_name_the_attribute(kw, name, says):
    with pytest.raises(errors.QMoEAttributeError, match=name) as ei:
        QMoEAttributes.from_kwargs(**kw)
    assert says in str(ei.value)


# -- the rounding -----------------------------------------------------------------------------------------------------
FINITE = [(c, float(v)) for c, v in enumerate(e4m3_table()) if np.isfinite(v)]


def _nearest_code(q: float) -> int:
    """The e4m3fn code nearest q by search over every finite code; a tie goes to the even code (even mantissa)."""
    best = min(abs(v - q) for _, v in FINITE)
    tied = [c for c, v in FINITE if abs(v - q) == best]
    if len(tied) > 1:  # +0 / -0 aside, a tie is two neighbours: keep the even one
        tied = [c for c in tied if c % 2 == 0] or tied
    return tied[0]


def _transcribed(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    rows, K = x.shape
    g = group or K
    codes = np.zeros((rows, K), np.uint8)
    scales = np.zeros((rows, group_count(K, group)), np.float32)
    for r in range(rows):
        for j in range(scales.shape[1]):
            vals = [np.float32(v) for v in x[r, j * g:(j + 1) * g]]
            amax = max(abs(v) for v in vals)
            s = np.float32(amax / np.float32(448)) if amax > 0 else np.float32(1)
            scales[r, j] = s
            for i, v in enumerate(vals):
                q = float(min(max(np.float32(v / s), np.float32(-448)), np.float32(448)))
                codes[r, j * g + i] = _nearest_code(q)
    return codes, scales


@pytest.mark.parametrize("group", [0, 16, 48])
def test_codes_and_scales_are_the_transcription(group):
    rng = np.random.default_rng(group)
    x = (rng.standard_normal((3, 80)) * np.exp(rng.uniform(-6, 6, (3, 1)))).astype(np.float32)
    x[1, 5:40] = 0  # small values next to large ones: subnormal codes
    x[1, 2] = 1e-30
    codes, scales = quantize_activations(x, group)
    want_codes, want_scales = _transcribed(x, group)
    assert scales.shape == (3, group_count(80, group))
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, want_codes)


def test_each_groups_largest_value_is_448_times_its_scale_and_groups_are_independent():
    x = np.random.default_rng(1).standard_normal((2, 300)).astype(np.float32)
    x[0, :128] *= 1e-3  # a quiet group next to a loud one: a scale of its own keeps it out of e4m3's underflow
    x[0, 128:256] *= 1e3
    y = fake_quantize(x, 128)
    for j in range(3):
        seg = slice(128 * j, min(128 * (j + 1), 300))
        i = np.argmax(np.abs(x[0, seg]))
        assert abs(y[0, seg][i]) == pytest.approx(abs(float(x[0, seg][i])), rel=2e-7)
        assert np.max(np.abs(y[0, seg] - x[0, seg]) / np.abs(x[0, seg]).max()) <= 2.0 ** -4
    per_row = fake_quantize(x, 0)  # the loud group's scale: the quiet values fall below e4m3's smallest step
    assert np.abs(per_row[0, :128] - x[0, :128]).max() > 10 * np.abs(y[0, :128] - x[0, :128]).max()
    np.testing.assert_array_equal(fake_quantize(x, 300), per_row)  # one group as long as the row: a scale a row
    np.testing.assert_array_equal(fake_quantize(x, 1000), per_row)


def test_zero_rows_stay_zero_and_a_non_finite_value_spoils_only_its_group():
    x = np.zeros((2, 64), np.float32)
    x[1] = np.linspace(-3, 3, 64)
    x[1, 40] = np.inf
    y = fake_quantize(x, 32)
    assert (y[0] == 0).all()
    assert np.isfinite(y[1, :32]).all() and np.isnan(y[1, 32:]).all()
    codes, scales = quantize_activations(x, 32)  # the group's scale is NaN, its codes those of its finite values
    assert np.isnan(scales[1, 1]) and not np.isnan(scales[1, 0]) and codes[1, 40] == 0
    finite = x[1:, 32:64].copy()
    finite[0, 8] = 0  # the infinity, read as zero
    np.testing.assert_array_equal(codes[1, 32:64], quantize_activations(finite, 0)[0][0])
    assert np.isnan(fake_quantize(np.array([[1.0, np.nan]], np.float32), 0)).all()


# -- the reference ----------------------------------------------------------------------------------------------------
def _one_expert_layer(rng, **kw):
    w, a = random_layer(rng, E=1, H=64, I=64, k=1, bits=4, block_size=32, dtype="float32", activation_type="silu")
    a.update(kw)
    x, logits, _ = random_inputs(rng, 5, 64, 1, dtype="float32")
    return w, a, x, logits


@pytest.mark.parametrize("group", [0, 32])
def test_the_reference_rounds_both_gemm_inputs(rng, group):
    w, a, x, logits = _one_expert_layer(rng, activation_quant="fp8_e4m3", activation_quant_group=group)
    got = reference.qmoe(x, logits, **w, **a)
    attrs = QMoEAttributes.from_kwargs(**a)
    layer = qmoe_rtc.contract.describe_layer(w, attrs)
    w1, w2 = (reference._dequantized(w, p, attrs, 0) for p in (layer.fc1, layer.fc2))  # [I, H], [H, I]
    h = fake_quantize(x, group) @ w1.T
    act = h / (1.0 + np.exp(-h))  # silu
    want = fake_quantize(act, group) @ w2.T  # one expert, k = 1: routing weight 1
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, atol=1e-6)
    plain = reference.qmoe(x, logits, **w, **{n: v for n, v in a.items() if not n.startswith("activation_quant")})
    rel = np.abs(got - plain).max() / np.abs(plain).max()
    assert 1e-4 < rel < 0.1  # the inputs were rounded, to e4m3's precision


# -- the GPU side -----------------------------------------------------------------------------------------------------
def test_gpu_layers_refuse_fp8_activations_before_the_gpu(machine, rng):
    calls = machine(lib=False)  # no driver: any GPU access would be a DeviceError, not this
    w, a = random_layer(rng, E=4, H=64, I=32, k=2, dtype="float32")
    with pytest.raises(errors.QMoEUnsupportedError, match="activation_quant='fp8_e4m3'") as ei:
        qmoe_rtc.QMoE(**w, **a, activation_quant="fp8_e4m3")
    assert "reference" in str(ei.value) and calls == []
    with pytest.raises(errors.QMoEUnsupportedError, match="activation_quant"):
        qmoe_rtc.tiled.given.tiled_weights(w, **a, activation_quant="fp8_e4m3", activation_quant_group=128)
