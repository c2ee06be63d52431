"""The decode engine with and without the expert flow (tuning knob mma_expert_flow, on by default: FC2's
blocks of an expert wait for that expert's FC1 blocks, counted in scratch, instead of the whole FC1
grid; off: the whole-grid wait) vs the float64 reference on the GPU: poisoned outputs, every row count
of the decode path, the counters back at zero after every call (a count left over would let the next
call's FC2 read act early), the two modes bitwise equal (the same sums in the same order), graph
replay = eager bitwise."""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.gpu_checks import TOL, check_graph_replay_equals_eager, rel_err, to_dev

pytestmark = pytest.mark.gpu

#: read by tools/precompile.py: the modules of LAYERS are compiled with these knobs
PRECOMPILE_KNOBS = [{"mma_expert_flow": True}, {"mma_expert_flow": False}]

# (name, random_layer kwargs, E, H, I, dtype): one expert's many tiles (FC1 K split 1), experts hit
# by several routes (duplicate blocks), FC3 + zero points, 3-bit with the warp's shared copies, a shared expert
LAYERS = [
    ("b4-bs128-swiglu1-wide-I", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2),
     16, 256, 4096, "bfloat16"),
    ("b4-bs32-zp-swiglu2-bias", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu",
                                     swiglu_fusion=2, k=4, bias=True), 8, 160, 96, "float16"),
    ("b2-bs16-zp-silu-fc3", dict(bits=2, block_size=16, zero_points=True, activation_type="silu", fc3=True, k=4),
     16, 128, 64, "float16"),
    ("b3-bs128-swiglu1", dict(bits=3, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4),
     16, 256, 128, "bfloat16"),
]
ROWS = [1, 2, 5, 8, 17, 64]


def _counters_zero(moe):
    import cupy as cp

    cp.cuda.get_current_stream().synchronize()
    seen = 0
    for pool in moe._pools.values():
        for name in ("fc1_done", "fc2_seen"):
            if name in pool.bufs:
                seen += 1
                assert not cp.asnumpy(pool.bufs[name]).any(), f"{name} not reset: {cp.asnumpy(pool.bufs[name])}"
    assert seen, "the expert flow's counters are not in the scratch pool"


@pytest.mark.parametrize("name, kw, E, H, I, dtype", LAYERS, ids=[c[0] for c in LAYERS])
def test_expert_flow_vs_reference_and_the_whole_grid_wait(rng, name, kw, E, H, I, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    layers = {}
    for flow in (True, False):
        with knobs.scope(mma_expert_flow=flow):
            layers[flow] = QMoE(**to_dev(w), **a, decode_max_routes=512)
            for rows in ROWS:
                plan = layers[flow].plan(rows, dtype, "float32")
                assert plan.engine == "decode-mma", (name, rows)
                assert any(s.spec.get("expert_flow") for s in plan.steps) is flow, (name, rows, flow)
    for rows in ROWS:
        for _ in range(2):  # twice: the second call runs on the counters the first one reset
            x, lg, _ = random_inputs(rng, rows, H, E, dtype)
            outs = {}
            for flow, moe in layers.items():
                out = outs[flow] = cp.full(x.shape, cp.nan, dtype=x.dtype)
                with knobs.scope(mma_expert_flow=flow):
                    moe(cp.asarray(x), cp.asarray(lg), out=out)
                _counters_zero(moe)
            y = cp.asnumpy(outs[True])
            e = rel_err(y, reference(x, lg, **w, **a))
            assert e <= TOL[dtype], f"{name} {dtype} rows={rows}: rel err {e:.3e}"
            np.testing.assert_array_equal(y, cp.asnumpy(outs[False]), err_msg=f"{name} rows={rows}: flow on != off")


def test_expert_flow_with_a_shared_expert(rng):
    """The shared expert is one more route (ids E..E+S-1): its FC1 tiles are counted like a routed one's."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    from support.ext_layers import build

    E, H, I = 16, 256, 128
    w, a, ext = build(rng, E=E, H=H, I=I, k=2, dtype="float16", S=1, gate=True, bits=4, block_size=128,
                      activation_type="swiglu", swiglu_fusion=1)
    with knobs.scope(mma_expert_flow=True):
        moe = QMoE(**to_dev(w), **a, **to_dev(ext), decode_max_routes=512)  # the decode engine, whatever the device
        for rows in (1, 4):
            x, lg, _ = random_inputs(rng, rows, H, E, "float16")
            out = cp.full(x.shape, cp.nan, dtype=x.dtype)
            moe(cp.asarray(x), cp.asarray(lg), out=out)
            assert moe.plan(rows, "float16", "float32").engine == "decode-mma"
            assert rel_err(cp.asnumpy(out), reference(x, lg, **w, **a, **ext)) <= TOL["float16"]
            _counters_zero(moe)


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "whole-grid-wait"])
def test_expert_flow_graph_replay_matches_eager_bitwise(rng, flow):
    from qmoe_rtc.executor import QMoE

    E, H, I = 32, 256, 128
    w, a = random_layer(rng, E=E, H=H, I=I, k=4, bits=4, block_size=128, dtype="float16", activation_type="swiglu",
                        swiglu_fusion=1, normalize_routing_weights=1)
    with knobs.scope(mma_expert_flow=flow):
        moe = QMoE(**to_dev(w), **a)
        for rows in (1, 3):
            check_graph_replay_equals_eager(rng, moe, rows, H, E, w, a)
            _counters_zero(moe)
