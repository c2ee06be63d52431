"""SwiGLU with a NaN gate or linear value, on the CPU: the float64 reference keeps it NaN
(docs/contract.md, "What each route computes"), and the device clamp follows the reference's rule -- checked
at compile time (NVRTC's PTX: the swiglu clamp of ``epilogue/act.cuh`` is NaN-propagating ``min.NaN`` /
``max.NaN`` only), and the swiglu branch clamps only through those helpers. The GPU test
(tests/contract/test_swiglu_nan_gpu.py) runs every engine."""

from __future__ import annotations

import re

import numpy as np
import pytest

from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import activate
from qmoe_rtc.contract.reference import qmoe as reference

LIMITS = [7.0, np.inf]


def _attrs(fusion: int, limit: float, after: int) -> QMoEAttributes:
    return QMoEAttributes.from_kwargs(activation_type="swiglu", swiglu_fusion=fusion, swiglu_limit=limit,
                                      swiglu_limit_after_activation=after, activation_alpha=1.702,
                                      activation_beta=1.0, k=1)


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("after", [0, 1])
@pytest.mark.parametrize("fusion", [0, 1, 2])
def test_reference_keeps_a_nan_gate_or_linear_value_nan(rng, fusion, limit, after):
    """NaN exactly where the gate or the linear value of an output is NaN; large finite values are clamped
    (finite output) wherever the limit is finite."""
    n, I = 6, 8
    g = rng.normal(size=(n, I)) * 20  # beyond the limit 7 in places
    lin = rng.normal(size=(n, I)) * 20
    g[1, 2] = g[3, :] = np.nan
    lin[2, 5] = lin[4, 0] = np.nan
    if fusion == 1:
        h, u = np.stack([g, lin], axis=-1).reshape(n, 2 * I), None
    elif fusion == 2:
        h, u = np.concatenate([g, lin], axis=1), None
    else:
        h, u = g, lin
    a = activate(h, _attrs(fusion, limit, after), 2, u)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(g) | np.isnan(lin))
    if np.isfinite(limit):
        assert np.isfinite(a[~(np.isnan(g) | np.isnan(lin))]).all()


@pytest.mark.parametrize("after", [0, 1])
def test_reference_layer_output_is_nan_in_the_rows_whose_fc1_output_is_nan(rng, after):
    H, I, E = 64, 32, 8
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, bits=4, block_size=32, dtype="float32", activation_type="swiglu",
                        swiglu_fusion=1, swiglu_limit=7.0, swiglu_limit_after_activation=after)
    x, lg, _ = random_inputs(rng, 9, H, E, "float32")
    x[[1, 4, 7], 3] = np.nan
    out = reference(x, lg, **w, **a)
    assert np.isnan(out).any(axis=1).tolist() == [r in (1, 4, 7) for r in range(9)]
    assert np.isnan(out[[1, 4, 7]]).all() and np.isfinite(np.delete(out, [1, 4, 7], axis=0)).all()


# ---- the device clamp, at compile time ------------------------------------------------------------------

PROBE = r"""
#include "epilogue/act.cuh"
extern "C" __global__ void probe(const float* g, const float* l, float* o, qmoe::ActParams p) {
  o[threadIdx.x] = qmoe::act_gated<qmoe::ACT_SWIGLU>(g[threadIdx.x], l[threadIdx.x], p);
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_device_clamp_keeps_nan_at_compile_time(arch):
    """act_gated's swiglu clamps with PTX ``min.NaN`` / ``max.NaN`` (sm_80+: NaN when either operand is
    NaN, which is np.minimum's and np.clip's rule, the reference's; the limit is never NaN), never with
    ``min.f32`` / ``max.f32`` (fminf / fmaxf: the other operand, so a NaN became ±limit): one max and one
    min for L, one min for G (or, with the limit after the activation, for G·σ(αG))."""
    from qmoe_rtc.jit import compiler

    ptx = compiler.compile_ptx_listing("swiglu_clamp", PROBE, {}, arch, compiler.base_options(arch))
    assert ".entry probe" in ptx, ptx[:3000]
    body = ptx.split(".entry probe", 1)[1]
    assert not re.findall(r"\b(?:min|max)(?:\.ftz)?\.f32\b", body), body
    assert body.count("max.NaN.f32") == 1 and body.count("min.NaN.f32") == 3, body


def test_the_swiglu_branch_clamps_only_through_the_nan_keeping_helpers():
    """fminf / fmaxf return the other operand for a NaN one: the swiglu branch of act_gated uses neither."""
    from qmoe_rtc.jit.compiler import cuda_src_dir

    src = (cuda_src_dir() / "epilogue" / "act.cuh").read_text()
    branch = re.search(r"if constexpr \(ACT == ACT_SWIGLU\) \{(.*?)\} else if constexpr", src, re.S)
    assert branch, "act_gated's swiglu branch not found"
    body = branch.group(1)
    assert "fminf" not in body and "fmaxf" not in body and "min(" not in body.replace("min_keep_nan(", "")
    assert body.count("min_keep_nan(") == 2 and body.count("clamp_keep_nan(") == 1
