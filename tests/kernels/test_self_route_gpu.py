"""The decode kernels' own routing (engines/self_route.cuh; kernels/route.py routes_in_decode) on the GPU: the forward
whose FC1 and FC2 blocks route the call themselves (knob ``route_in_decode`` 'on') against the one with the routing
kernel as a launch of its own ('off').

Each meets the float64 reference with a NaN-poisoned output (every element written), its graph replay equals its eager
call bitwise, and the two forms agree bit for bit (the same routes, the same weights: the same sums). The plans are
checked too: 'on' launches no routing kernel and FC1 first; 'off' keeps the routing kernel.
Layers: 128 and 8 experts, k from 2 to 32 (64 routes at 2 rows), shared experts, normalised weights, bf16 and float32
logits, float16 activations, a scale block of 32 (the ring whose scan comes first) and of 128 (the ring's gate), 2-bit
codes (no x rings) and 4-bit (x rings up to 4 tokens); rows 1 to 4, and 5 (past the rule: the routing kernel); an
expert slice [ext] (routes to experts another slice holds left out), against its own float64 part; and the decode
engine's layout matrix (bit widths 1/2/3/4/8 and mixed, zero points, FC3 gates, scale blocks 0/16/32/128, float32
scales) at 1-4 rows in float16 and bfloat16.
"""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.gpu_checks import TENSOR_CORE_3BIT, eager_and_replay, slice_case, to_dev

pytestmark = pytest.mark.gpu

# (name, random_layer kwargs, E, H, I, dtype, logits dtype)
LAYERS = [
    ("e128-k8-b4-bs128", dict(bits=4, block_size=128, k=8, activation_type="swiglu", swiglu_fusion=1), 128, 256, 128,
     "bfloat16", "float32"),
    ("e8-k2-b4-bs32-bf16-logits", dict(bits=4, block_size=32, k=2, activation_type="swiglu", swiglu_fusion=2), 8, 256,
     256, "bfloat16", "bfloat16"),
    ("e64-k32-b2-norm", dict(bits=2, block_size=64, k=32, activation_type="silu", normalize_routing_weights=1), 64, 128,
     64, "bfloat16", "float32"),
    ("e16-k4-b8-shared-f16", dict(bits=8, block_size=0, k=4, activation_type="gelu", shared=1, bias=True), 16, 128, 128,
     "float16", "float16"),
]


# the decode engine's layout matrix (test_mma_decode_gpu.py's kinds): (name, random_layer kwargs, E, H, I)
MATRIX = [
    ("b1-bs32-relu2", dict(bits=1, block_size=32, activation_type="relu2", k=2), 8, 128, 64),
    ("b2-bs16-zp-silu-fc3", dict(bits=2, block_size=16, zero_points=True, activation_type="silu", fc3=True, k=4), 16,
     128, 64),
    ("b4-bs32-zp-swiglu2-bias", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu",
                                     swiglu_fusion=2, k=2, bias=True), 8, 160, 96),
    ("b8-bs64-zp-gelu-bias", dict(bits=8, block_size=64, zero_points=True, activation_type="gelu", k=2, bias=True),
     8, 128, 128),
    ("mixed-4-8-4-fc3-zp", dict(bits=(4, 8, 4), block_size=16, zero_points=(True, False, True),
                                activation_type="silu", fc3=True, k=2, bias=True), 8, 128, 64),
    *TENSOR_CORE_3BIT,
]


def _check_plan(plan, own: bool, label: str) -> None:
    from qmoe_rtc.kernels.route import routes_in_decode

    assert plan.engine == "decode-mma" and routes_in_decode(plan.problem) is own, label
    families = [s.family for s in plan.steps]
    if own:
        assert "route" not in families and plan.steps[0].role == "fc1", (label, plan.steps)
    else:
        assert families[0] == "route", (label, plan.steps)


@pytest.mark.parametrize("layer", LAYERS, ids=[n[0] for n in LAYERS])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_the_decode_kernels_own_routing_equals_the_routing_launch(rng, layer, rows):
    from qmoe_rtc.executor import QMoE

    name, kw, E, H, I, dtype, ldt = layer  # noqa: E741
    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    x, lg, _ = random_inputs(rng, rows, H, E, dtype, router_dtype=ldt)
    want = reference(x, lg, **w, **a)
    outs = {}
    for mode in ("on", "off"):
        with knobs.scope(route_in_decode=mode):
            moe = QMoE(**to_dev(w), **a, decode_max_routes=512)  # the decode path at every row count here
            own = mode == "on" and rows <= 4 and rows * (k + kw.get("shared", 0)) <= 64
            _check_plan(moe.plan(rows, dtype, ldt), own, f"{name} {rows} rows {mode}")
            outs[mode] = eager_and_replay(moe, x, lg, want, f"{name} {rows} rows route_in_decode={mode}", dtype)
    np.testing.assert_array_equal(outs["on"], outs["off"], err_msg=f"{name} {rows} rows")


@pytest.mark.parametrize("rows", [1, 3])
def test_the_decode_kernels_own_routing_on_an_expert_slice(rng, rows):
    """An expert slice [ext] (experts 4..11 of 16): the blocks route over all 16 experts, skip the routes another slice
    holds, and equal the routing launch bit for bit and the slice's float64 part (poisoned output, replay = eager)."""
    from qmoe_rtc.executor import QMoE

    part, a, x, lg, want, held = slice_case(rng, rows)
    outs = {}
    for mode in ("on", "off"):
        with knobs.scope(route_in_decode=mode):
            moe = QMoE(**to_dev(part), **a, **held, decode_max_routes=512)
            _check_plan(moe.plan(rows, "bfloat16", "float32"), mode == "on", f"slice {rows} rows {mode}")
            outs[mode] = eager_and_replay(moe, x, lg, want, f"slice {rows} rows route_in_decode={mode}")
    np.testing.assert_array_equal(outs["on"], outs["off"], err_msg=f"slice {rows} rows")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, kw, E, H, I", MATRIX, ids=[c[0] for c in MATRIX])
def test_the_own_routing_across_the_layout_matrix(rng, name, kw, E, H, I, dtype):  # noqa: E741
    """Every layout kind of the decode engine at 1-4 rows: the own routing against the float64 reference (poisoned
    output, replay = eager) and bit for bit against the routing launch."""
    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    for rows in (1, 2, 3, 4):
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        want = reference(x, lg, **w, **a)
        outs = {}
        for mode in ("on", "off"):
            with knobs.scope(route_in_decode=mode):
                moe = QMoE(**to_dev(w), **a, decode_max_routes=512)
                _check_plan(moe.plan(rows, dtype, "float32"), mode == "on", f"{name} {dtype} {rows} rows {mode}")
                outs[mode] = eager_and_replay(moe, x, lg, want, f"{name} {dtype} {rows} rows route_in_decode={mode}",
                                              dtype)
        np.testing.assert_array_equal(outs["on"], outs["off"], err_msg=f"{name} {dtype} {rows} rows")
