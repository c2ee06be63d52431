"""Routing inside the grouping's launch (routing/route_group.cuh; kernels/route.py routes_in_group) on the GPU, on every
grouped tensor-core engine (wgmma on sm_90a only): the forward that routes in its group step (knob ``route_in_group``
'on') against the one with the routing kernel, the grouping and (wgmma) wg_prepare as launches of their own ('off').

Each meets the float64 reference with a NaN-poisoned output (every element written), its graph replay equals its eager
call bitwise, and the two forms agree bit for bit (the same routes, grouped in the same order: the same sums). The plans
are checked too: 'on' launches no routing kernel and its first kernel is the lead (where the rule takes the call: not
with router weights, which keep the routing kernel); 'off' keeps the routing kernel.
Layers: fewer and more than 32 experts (the wgmma tile table), shared experts (with and without router weights),
router weights, bf16 logits, normalised weights; rows from 1 to 130 (past the 'auto' limit of 64, where 'on' still
takes it); and an expert slice [ext] (the lead kernel with an expert map: routes to experts another slice holds left
out), against its own float64 part.
"""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.gpu_checks import eager_and_replay, slice_case, to_dev

pytestmark = pytest.mark.gpu

# (name, random_layer kwargs, E, H, I, router weights, logits dtype)
LAYERS = [
    ("e16-k4-b4-bs128", dict(bits=4, block_size=128, k=4, activation_type="swiglu", swiglu_fusion=1), 16, 256, 128,
     False, "float32"),
    ("e64-k8-b4-bs32-norm", dict(bits=4, block_size=32, k=8, activation_type="swiglu", swiglu_fusion=2,
                                 normalize_routing_weights=1), 64, 256, 192, False, "float32"),
    ("e8-k2-b8-shared-rw", dict(bits=8, block_size=64, k=2, activation_type="silu", shared=1, bias=True), 8, 192, 128,
     True, "float32"),
    ("e40-k6-b4-bf16-logits", dict(bits=4, block_size=128, k=6, activation_type="swiglu", swiglu_fusion=1), 40, 256,
     256, False, "bfloat16"),
    # shared experts without router weights: the lead kernel with shared slots (the layout above with router weights
    # keeps the routing kernel)
    ("e16-k2-b4-shared", dict(bits=4, block_size=64, k=2, activation_type="swiglu", swiglu_fusion=1, shared=1), 16, 256,
     128, False, "float32"),
]


@pytest.mark.parametrize("engine", ["batched", "mma", "wgmma"])
@pytest.mark.parametrize("layer", LAYERS, ids=[n[0] for n in LAYERS])
@pytest.mark.parametrize("rows", [1, 7, 64, 130])
def test_routing_in_the_group_launch_equals_its_own_launches(rng, engine, layer, rows):
    import cupy as cp

    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.kernels.route import routes_in_group

    if engine == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    name, kw, E, H, I, with_rw, ldt = layer  # noqa: E741
    w, a = random_layer(rng, E=E, H=H, I=I, dtype="bfloat16", **kw)
    x, lg, rw = random_inputs(rng, rows, H, E, "bfloat16", router_dtype=ldt, router_weights=with_rw)
    want = reference(x, lg, **w, **a, router_weights=rw)
    outs = {}
    for mode in ("on", "off"):
        with knobs.scope(prefill_engine=engine, route_in_group=mode):
            moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
            plan = moe.plan(rows, "bfloat16", ldt, ldt if with_rw else None)  # router weights in the logits' dtype
            assert plan.engine == f"prefill-{engine}", plan.engine
            families = [s.family for s in plan.steps]
            lead = routes_in_group(plan.problem)
            assert lead == (mode == "on" and not with_rw), (mode, with_rw)
            if lead:
                assert "route" not in families and "route_group" in plan.steps[0].kernel.key, plan.steps
                assert all(s.role != "permute" for s in plan.steps), plan.steps
            else:
                assert families[0] == "route" and plan.steps[1].kernel.key == "group", plan.steps
            outs[mode] = eager_and_replay(moe, x, lg, want, f"{name} {engine} {rows} rows route_in_group={mode}",
                                          rw=rw)
    np.testing.assert_array_equal(outs["on"], outs["off"], err_msg=f"{name} {engine} {rows} rows")


@pytest.mark.parametrize("engine", ["batched", "mma", "wgmma"])
@pytest.mark.parametrize("rows", [3, 16, 130])
def test_routing_in_the_group_launch_on_an_expert_slice(rng, engine, rows):
    """An expert slice [ext] (experts 4..11 of 16, ``expert_range`` + ``num_experts``): the lead kernel routes over all
    16 experts, keeps the routes its slice holds, and equals the separate launches bit for bit and the slice's float64
    part (poisoned output, replay = eager)."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.kernels.route import routes_in_group

    if engine == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    part, a, x, lg, want, held = slice_case(rng, rows)
    outs = {}
    for mode in ("on", "off"):
        with knobs.scope(prefill_engine=engine, route_in_group=mode):
            moe = QMoE(**to_dev(part), **a, **held, decode_max_routes=0)
            plan = moe.plan(rows, "bfloat16", "float32")
            assert plan.engine == f"prefill-{engine}" and routes_in_group(plan.problem) == (mode == "on"), plan.steps
            outs[mode] = eager_and_replay(moe, x, lg, want, f"slice {engine} {rows} rows route_in_group={mode}")
    np.testing.assert_array_equal(outs["on"], outs["off"], err_msg=f"slice {engine} {rows} rows")
