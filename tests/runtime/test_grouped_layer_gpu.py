"""GPU: layers with grouped sigmoid routing [ext] (DeepSeek-V3-style) on every engine, against the float64 reference
(skipped without a GPU).

The routing kernel is tests/kernels/test_route_grouped_gpu.py's; here it runs inside the layer: given logits and the
router GEMM [ext], shared experts [ext], decode and prefill engines, graph replay equal to the eager call bitwise.
Rows whose choice float32 rounding may change (near ties, tests/support/grouped_routing.py) are left out of the
comparison and must be few. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.ext_layers import build, engines, to_dev
from support.gpu_checks import TOL, rel_err
from support.grouped_routing import near_tie_rows

pytestmark = pytest.mark.gpu

ROUTING = dict(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, normalize_routing_weights=1)
CASES = [  # name, build keywords (ext_layers.build), routing attributes
    ("b4-bs128-swiglu1", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, S=0), ROUTING),
    ("b4-bs64-swiglu1-S1-router", dict(bits=4, block_size=64, activation_type="swiglu", swiglu_fusion=1, S=1,
                                       router="T"), ROUTING),
    ("b8-silu-S2-gate-one-group", dict(bits=8, block_size=0, activation_type="silu", S=2, gate=True),
     dict(scoring_func="sigmoid", n_group=1, routed_scaling_factor=1.5, normalize_routing_weights=0)),
    ("fp8-bs128-swiglu2", dict(format="fp8_e4m3", block_size=128, activation_type="swiglu", swiglu_fusion=2, S=0),
     ROUTING),
]
DECODE_ROWS = (1, 5, 16)
PREFILL_ROWS = (64, 300)


def grouped_layer(rng, dtype, kw, routing, E=32, H=256, I=128, k=4):  # noqa: E741
    w, a, ext = build(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    a = {**a, **routing}
    ext["router_score_bias"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
    return w, a, ext


def compare(got, want, near):
    """rel err over the rows without near ties (at most 5% of them are left out)."""
    assert near.mean() <= 0.05, f"{near.sum()} of {near.size} rows are near ties"
    return rel_err(np.asarray(got)[~near], np.asarray(want)[~near])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name, kw, routing", CASES, ids=[c[0] for c in CASES])
def test_grouped_layer_vs_reference_on_every_engine(rng, name, kw, routing, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H = 32, 256
    w, a, ext = grouped_layer(rng, dtype, kw, routing, E=E, H=H)
    attrs = QMoEAttributes.from_kwargs(**a)
    router = "router_weight" in ext
    wd, xd = to_dev(w), to_dev(ext)
    worst = 0.0
    for path, knob, pipeline in engines(dtype):
        limit = 10**6 if path == "decode" else 0
        with knobs.scope(**knob):
            moe = QMoE(decode_max_routes=limit, **wd, **a, **xd)
            for rows in DECODE_ROWS if path == "decode" else PREFILL_ROWS:
                x, lg, _ = random_inputs(rng, rows, H, E, dtype)
                want = reference(x, None if router else lg, **w, **a, **ext)
                out = cp.full(x.shape, cp.nan, dtype=x.dtype)
                got = cp.asnumpy(moe(cp.asarray(x), None if router else cp.asarray(lg), out=out))
                assert moe.plan(rows, dtype, "float32").engine == pipeline, (name, rows, pipeline)
                assert np.isfinite(got).all()  # every element written
                if router:  # the logits the layer computes, within the router GEMM's rounding
                    W = ext["router_weight"].astype(np.float32).astype(np.float64)
                    lg, tol = (x.astype(np.float32).astype(np.float64) @ W.T).astype(np.float32), 1e-4
                else:
                    tol = 2e-6
                near = near_tie_rows(lg, ext["router_score_bias"], attrs, tol)
                e = compare(got, want, near)
                worst = max(worst, e)
                assert e <= TOL[dtype], f"{name} {dtype} {pipeline} rows={rows}: rel err {e:.3e}"
    print(f"{name} {dtype}: worst rel err {worst:.3e}")


def test_routing_attributes_change_the_output(rng):
    """The comparisons above would pass if the layer ignored the groups, the bias or the scaling only where they
    change little: each one changes this layer's output by far more than the tolerance."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, dtype = 32, 256, "bfloat16"
    w, a, ext = grouped_layer(rng, dtype, CASES[0][1], ROUTING, E=E, H=H)
    ext["router_score_bias"] = (0.5 * rng.standard_normal(E)).astype(np.float32)
    x, lg, _ = random_inputs(rng, 64, H, E, dtype)
    base = cp.asnumpy(QMoE(**to_dev(w), **a, **to_dev(ext))(cp.asarray(x), cp.asarray(lg)))
    assert rel_err(base, reference(x, lg, **w, **a, **ext)) <= TOL[dtype]
    for change in (dict(topk_group=4), dict(routed_scaling_factor=1.0), dict(router_score_bias=None)):
        a2 = {**a, **{n: v for n, v in change.items() if n != "router_score_bias"}}
        e2 = {n: v for n, v in ext.items() if n not in change}
        other = cp.asnumpy(QMoE(**to_dev(w), **a2, **to_dev(e2))(cp.asarray(x), cp.asarray(lg)))
        assert rel_err(other, base) > 20 * TOL[dtype], change


@pytest.mark.parametrize("rows", [1, 8, 256])
def test_graph_replay_equals_eager(rng, rows):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, dtype = 32, 256, "float16"
    w, a, ext = grouped_layer(rng, dtype, CASES[1][1], ROUTING, E=E, H=H)
    moe = QMoE(**to_dev(w), **a, **to_dev(ext))
    x0, _, _ = random_inputs(rng, rows, H, E, dtype)
    g = moe.capture(cp.asarray(x0), None)
    for _ in range(3):
        x, _, _ = random_inputs(rng, rows, H, E, dtype)
        g.output.fill(cp.nan)
        g.update(cp.asarray(x), None)
        y_graph = cp.asnumpy(g.replay()).copy()
        np.testing.assert_array_equal(y_graph, cp.asnumpy(moe(cp.asarray(x), None)))
