"""One test per validation rule: each bad input is refused, and the message names it."""

import math

import numpy as np
import pytest

from qmoe_rtc.contract import QMoEAttributes, check_call, check_content, describe_layer
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe
from qmoe_rtc.errors import QMoEAttributeError, QMoEInputError

E, H, I = 4, 32, 16


def layer(rng, **kw):
    kw.setdefault("activation_type", "silu")
    return random_layer(rng, E=E, H=H, I=I, **kw)


def run(weights, attrs, x=None, logits=None, rw=None, rng=None):
    rng = rng or np.random.default_rng(0)
    if x is None:
        x, logits, _ = random_inputs(rng, 3, H, E, "float16")
    return qmoe(x, logits, router_weights=rw, **weights, **attrs)


# ---- attributes -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "attrs, name",
    [
        (dict(k=0), "k"),
        (dict(k=2.0), "k"),
        (dict(activation_type="tanh"), "activation_type"),
        (dict(normalize_routing_weights=2), "normalize_routing_weights"),
        (dict(use_sparse_mixer=1, k=1), "k"),
        (dict(expert_weight_bits=5), "expert_weight_bits"),
        (dict(fc2_expert_weight_bits=6), "fc2_expert_weight_bits"),
        (dict(block_size=8), "block_size"),
        (dict(block_size=48), "block_size"),
        (dict(swiglu_fusion=3), "swiglu_fusion"),
        (dict(swiglu_fusion=1, activation_type="relu"), "swiglu_fusion"),
        (dict(swiglu_limit=0.0), "swiglu_limit"),
        (dict(swiglu_limit=float("nan")), "swiglu_limit"),
        (dict(activation_alpha="x"), "activation_alpha"),
        (dict(swiglu_limit_after_activation=2), "swiglu_limit_after_activation"),
        (dict(quant_type="fp4"), "quant_type"),
        (dict(zero_point_offset=float("inf")), "zero_point_offset"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_bad_attribute(attrs, name):
    with pytest.raises(QMoEAttributeError) as ei:
        QMoEAttributes.from_kwargs(**attrs)
    assert ei.value.name == name and f"'{name}'" in str(ei.value)


def test_attribute_defaults_are_ort_defaults():
    a = QMoEAttributes.from_kwargs()
    assert (a.k, a.activation_type, a.normalize_routing_weights, a.use_sparse_mixer) == (1, "relu", 0, 0)
    assert (a.expert_weight_bits, a.block_size, a.swiglu_fusion, a.quant_type) == (4, 0, 0, "int")
    assert math.isinf(a.swiglu_limit) and (a.activation_alpha, a.activation_beta) == (1.0, 0.0)
    assert a.zero_point_offset is None
    b = QMoEAttributes.from_kwargs(expert_weight_bits=8, fc2_expert_weight_bits=4)
    assert (b.bits("fc1"), b.bits("fc2"), b.bits("fc3")) == (8, 4, 8)


def test_k_larger_than_experts(rng):
    w, a = layer(rng)
    a["k"] = E + 1 if E + 1 <= 10 else 10
    with pytest.raises(QMoEAttributeError, match="k"):
        run(w, a)


# ---- weights ----------------------------------------------------------------------------------------

def expect_input_error(name, fn, *args, match=None, **kw):
    with pytest.raises(QMoEInputError) as ei:
        fn(*args, **kw)
    assert ei.value.name == name, str(ei.value)
    assert f"'{name}'" in str(ei.value)
    if match:
        assert match in str(ei.value), str(ei.value)
    return ei.value


def test_weight_dtype(rng):
    w, a = layer(rng)
    w["fc1_experts_weights"] = w["fc1_experts_weights"].astype(np.int8)
    expect_input_error("fc1_experts_weights", run, w, a, match="uint8")


def test_weight_rank(rng):
    w, a = layer(rng)
    w["fc2_experts_weights"] = w["fc2_experts_weights"][0]
    expect_input_error("fc2_experts_weights", run, w, a, match="rank 3")


def test_weight_packed_width_for_bits(rng):
    w, a = layer(rng, bits=4)
    a["expert_weight_bits"] = 8  # bytes now say 4-bit, attribute says 8-bit
    expect_input_error("fc1_experts_weights", run, w, a, match="ceil(K·b/8)")


def test_mixed_widths_checked_per_projection(rng):
    w, a = layer(rng, bits=(4, 2, 4))
    run(w, a)  # fine as built
    a.pop("fc2_expert_weight_bits")
    expect_input_error("fc2_experts_weights", run, w, a)


def test_expert_count_mismatch(rng):
    w, a = layer(rng)
    w["fc2_experts_weights"] = w["fc2_experts_weights"][:-1]
    expect_input_error("fc2_experts_weights", run, w, a, match="experts")


def test_non_contiguous(rng):
    w, a = layer(rng)
    big = np.zeros((E, 2 * I, w["fc1_experts_weights"].shape[2]), np.uint8)
    w["fc1_experts_weights"] = big[:, ::2]
    expect_input_error("fc1_experts_weights", run, w, a, match="C-contiguous")


def test_scales_shape_rowwise_and_blockwise(rng):
    w, a = layer(rng, block_size=16)
    w["fc1_scales"] = np.ascontiguousarray(w["fc1_scales"][:, :, :1])
    expect_input_error("fc1_scales", run, w, a, match="block")
    w, a = layer(rng, block_size=0)
    w["fc2_scales"] = np.ones((E, H, 2), np.float16)
    expect_input_error("fc2_scales", run, w, a, match="row-wise")
    w, a = layer(rng, block_size=0)
    w["fc2_scales"] = w["fc2_scales"][..., None]  # [E, N, 1] is accepted
    run(w, a)


def test_scales_dtype(rng):
    w, a = layer(rng)
    w["fc1_scales"] = w["fc1_scales"].astype(np.float64)
    expect_input_error("fc1_scales", run, w, a, match="dtype")


def test_block_size_must_divide_k(rng):
    w, a = random_layer(rng, E=E, H=48, I=16, block_size=16, activation_type="relu")
    a["block_size"] = 32  # 48 % 32 != 0
    with pytest.raises(QMoEAttributeError, match="divisor"):
        describe_layer(w, QMoEAttributes.from_kwargs(**a))


def test_zero_point_shapes(rng):
    w, a = layer(rng, block_size=16, zero_points=True, bits=4)  # nb = 2 → 1 byte per row
    w["fc1_zero_points"] = np.zeros((E, 2 * 0 + I, 2), np.uint8)
    expect_input_error("fc1_zero_points", run, w, a, match="block-wise")
    w, a = layer(rng, block_size=0, zero_points=True, bits=2)
    w["fc2_zero_points"] = np.zeros((E, H), np.uint8)  # row-wise 2-bit wants [E, ceil(H·2/8)] = [E, 8]
    expect_input_error("fc2_zero_points", run, w, a, match="row-wise")
    w, a = layer(rng, block_size=0, zero_points=True, bits=8)
    assert w["fc1_zero_points"].shape == (E, I)  # 8-bit: unpacked [E, N]
    run(w, a)


def test_zero_point_offset_range(rng):
    w, a = layer(rng, bits=2)
    a["zero_point_offset"] = 3.5
    with pytest.raises(QMoEAttributeError, match="zero_point_offset"):
        run(w, a)


def test_fc3_presence_rules(rng):
    w, a = layer(rng, activation_type="relu", fc3=True)
    expect_input_error("fc3_experts_weights", run, w, a, match="does not use fc3")
    w, a = layer(rng, activation_type="swiglu", swiglu_fusion=0)
    expect_input_error("fc3_experts_weights", run, w, a, match="fc3")
    w, a = layer(rng, activation_type="swiglu", fc3=True, swiglu_fusion=0)
    a["swiglu_fusion"] = 1
    expect_input_error("fc3_experts_weights", run, w, a, match="absent")
    w, a = layer(rng, activation_type="silu")
    w["fc3_scales"] = w["fc1_scales"]
    expect_input_error("fc3_scales", run, w, a)


def test_fused_rows_must_be_even(rng):
    w, a = layer(rng, activation_type="relu")  # fc1 has I rows
    w2 = dict(w)
    w2["fc1_experts_weights"] = np.ascontiguousarray(w["fc1_experts_weights"][:, :-1])
    a2 = dict(a, activation_type="swiglu", swiglu_fusion=1)
    expect_input_error("fc1_experts_weights", run, w2, a2, match="even")


def test_bias_shape(rng):
    w, a = layer(rng, bias=True)
    w["fc2_experts_bias"] = w["fc2_experts_bias"][:, :-1]
    expect_input_error("fc2_experts_bias", run, w, a)


def test_mixed_activation_dtypes_in_weights(rng):
    w, a = layer(rng, bias=True, dtype="float16")
    w["fc2_experts_bias"] = w["fc2_experts_bias"].astype(np.float32)  # float32 is always fine
    run(w, a)
    import ml_dtypes

    w["fc2_scales"] = w["fc2_scales"].astype(ml_dtypes.bfloat16)
    expect_input_error("fc2_scales", run, w, a, match="same dtype")


# ---- per-call inputs --------------------------------------------------------------------------------

def test_input_rank_dtype_and_hidden(rng):
    w, a = layer(rng)
    x, lg, _ = random_inputs(rng, 3, H, E, "float16")
    expect_input_error("input", run, w, a, x=x[0], logits=lg, match="rank")
    expect_input_error("input", run, w, a, x=x.astype(np.float32), logits=lg, match="float16")
    expect_input_error("input", run, w, a, x=x.astype(np.int32), logits=lg, match="dtype")
    expect_input_error("input", run, w, a, x=np.ascontiguousarray(x[:, :-1]), logits=lg, match="last dim")


def test_router_probs_shape_and_dtype(rng):
    w, a = layer(rng)
    x, lg, _ = random_inputs(rng, 3, H, E, "float16")
    expect_input_error("router_probs", run, w, a, x=x, logits=lg[:2], match="[3, 4]")
    expect_input_error("router_probs", run, w, a, x=x, logits=lg.astype(np.float64), match="dtype")
    # 3-D input: router_probs is [B·S, E]
    x3, lg3, _ = random_inputs(rng, (2, 3), H, E, "float16")
    assert run(w, a, x=x3, logits=lg3).shape == (2, 3, H)
    expect_input_error("router_probs", run, w, a, x=x3, logits=lg3.reshape(2, 3, E))


def test_router_weights_shape(rng):
    w, a = layer(rng)
    x, lg, rw = random_inputs(rng, 3, H, E, "float16", router_weights=True)
    expect_input_error("router_weights", run, w, a, x=x, logits=lg, rw=rw[:, :2])
    a2 = dict(a, use_sparse_mixer=1, k=2)
    expect_input_error("router_weights", run, w, a2, x=x, logits=lg, rw=rw, match="sparse mixer")


def test_content_checks(rng):
    w, a = layer(rng, zero_points=True, block_size=16, bits=3, bias=True)
    attrs = QMoEAttributes.from_kwargs(**a)
    spec = describe_layer(w, attrs)
    check_content(w, spec)  # clean layer passes
    bad = dict(w, fc1_scales=w["fc1_scales"].copy())
    bad["fc1_scales"][1, 2, 0] = -1.0
    expect_input_error("fc1_scales", check_content, bad, spec, match="index [1, 2, 0]")
    bad = dict(w, fc2_experts_bias=w["fc2_experts_bias"].copy())
    bad["fc2_experts_bias"][0, 0] = np.nan
    expect_input_error("fc2_experts_bias", check_content, bad, spec, match="finite")
    bad = dict(w, fc1_zero_points=w["fc1_zero_points"].copy())
    bad["fc1_zero_points"][..., -1] |= 0x80  # 2 blocks × 3 bits = 6 bits: bit 7 is padding
    expect_input_error("fc1_zero_points", check_content, bad, spec, match="padding")


def test_layer_spec_derived_sizes(rng):
    w, a = random_layer(rng, E=E, H=64, I=48, bits=(3, 2, 4), block_size=16, zero_points=True,
                        activation_type="swiglu", swiglu_fusion=2)
    spec = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    assert (spec.E, spec.H, spec.I, spec.F, spec.fused_width) == (E, 64, 48, 2, 96)
    assert (spec.fc1.N, spec.fc1.K, spec.fc1.bits, spec.fc1.row_bytes, spec.fc1.n_blocks) == (96, 64, 3, 24, 4)
    assert (spec.fc2.N, spec.fc2.K, spec.fc2.bits, spec.fc2.row_bytes, spec.fc2.n_blocks) == (64, 48, 2, 12, 3)
    assert spec.fc1.zp_mode == "packed" and spec.fc1.zp_row_bytes == 2 and spec.fc3 is None
    call = check_call(spec, np.zeros((2, 5, 64), np.float16), np.zeros((10, E), np.float32))
    assert call.rows == 10 and call.input_shape == (2, 5, 64)


def test_import_does_no_work():
    """`import qmoe_rtc` loads no submodule, no CuPy and no NumPy until something is used (but ``qmoe_rtc._lazy``, the
    one function that makes its names load on first use)."""
    import subprocess
    import sys

    code = ("import sys, qmoe_rtc; bad = [m for m in sys.modules if m.startswith(('cupy', 'numpy', 'cuda', "
            "'qmoe_rtc.')) and m != 'qmoe_rtc._lazy']; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
