"""The prefill engines' output does not depend on the order of routes inside an expert (GPU).

``group_by_expert`` placed an expert's routes with atomics, in an order that changed from call to call
with the GPU's timing (under contention most of all); it now sorts them stably (ascending route id,
``tests/test_group_order*.py``), so a graph replay and an eager call group alike whatever this test finds.
What is checked here is the stronger property: every route's result depends on its own row only,
whichever tile and position it lands in. The forward runs launch by launch, and between the grouping
and FC1 each expert's routes are reversed or shuffled in place: the output must stay bitwise the same.
"""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.settings import knobs

from support.gpu_checks import to_dev

pytestmark = pytest.mark.gpu

# (name, random_layer kwargs, E, H, I, dtype): the layout of issue 23's report first
LAYERS = [
    ("bf16-b8-row-silu", dict(bits=8, block_size=0, activation_type="silu", k=2), 16, 256, 128, "bfloat16"),
    ("f16-b4-bs128-swiglu", dict(bits=4, block_size=128, activation_type="swiglu", k=2), 16, 256, 128, "float16"),
    ("bf16-b3-bs32-zp-gelu-k4", dict(bits=3, block_size=32, zero_points=True, activation_type="gelu", k=4), 8, 256,
     128, "bfloat16"),
]


def _run_steps(cp, moe, x, lg, out, reorder=None):
    """The planned forward launch by launch on the current stream; after the grouping step
    ``reorder(pool buffers, problem)`` may rewrite the sorted route list."""
    from qmoe_rtc.jit import driver

    stream = cp.cuda.get_current_stream()
    plan = moe.plan(x.shape[0], x.dtype.name)
    b = plan.bind(moe._pools[stream.ptr], moe._table, stream.ptr)
    ptrs = (x.data.ptr, lg.data.ptr, 0, out.data.ptr)
    for item, step in zip(b.items, plan.steps):
        fn, gx, gy, gz, bx, by, bz, smem, vals, address, slots = item[:11]
        for i, w in slots:
            vals[i] = ptrs[w]
        driver.launch(fn, (gx, gy, gz), (bx, by, bz), smem, stream.ptr, address)
        if step.role == "group" and reorder is not None:
            stream.synchronize()
            reorder(moe._pools[stream.ptr].bufs, plan.problem)
    stream.synchronize()
    return plan


@pytest.mark.parametrize("engine", ["mma", "wgmma"])
@pytest.mark.parametrize("rows", [64, 1000])
@pytest.mark.parametrize("name, kw, E, H, I, dtype", LAYERS, ids=[c[0] for c in LAYERS])
def test_prefill_output_is_independent_of_route_order(rng, engine, rows, name, kw, E, H, I, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    if engine == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma engine needs sm_90a")
    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    moved = []

    def shuffled(order):
        def reorder(bufs, problem):
            off = cp.asnumpy(bufs["offsets"].view(cp.int32)[: problem.experts + 1])
            s = cp.asnumpy(bufs["sorted"].view(cp.int32)[: problem.routes])
            new = s.copy()
            for e in range(problem.experts):
                seg = new[off[e]:off[e + 1]]
                seg[...] = seg[::-1] if order == "reverse" else rng.permutation(seg)
            moved.append(int((new != s).sum()))
            bufs["sorted"].view(cp.int32)[: problem.routes] = cp.asarray(new)
        return reorder

    with knobs.scope(prefill_engine=engine):
        moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
        x0, l0, _ = random_inputs(rng, rows, H, E, dtype)
        x, lg = cp.asarray(x0), cp.asarray(l0)
        base = cp.full(x.shape, cp.nan, x.dtype)
        moe(x, lg, out=base)
        assert moe.engine_for(rows, dtype).pipeline.name == f"prefill-{engine}"
        for order in ("as grouped", "reverse", "shuffle"):
            out = cp.full(x.shape, cp.nan, x.dtype)
            _run_steps(cp, moe, x, lg, out, None if order == "as grouped" else shuffled(order))
            np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint16), cp.asnumpy(base).view(np.uint16),
                                          err_msg=f"{order}: output changed with the order of routes")
    assert len(moved) == 2 and min(moved) > rows  # the reorders did move routes between positions
