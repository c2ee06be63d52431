"""GPU: shared experts [ext] (with and without the sigmoid gate) and the router GEMM [ext] in the layer,
against the float64 reference, on every engine (skipped without a GPU).

Shared experts run as k+1.. routes of every token inside the routed launches, so each engine is
forced in turn (decode: mma / gemv by dtype; prefill: wgmma / mma / SIMT). Every output is poisoned
with NaN first; graph replay of a router-GEMM layer equals its eager call bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.ext_layers import build, engines, to_dev
from support.gpu_checks import TOL, rel_err

pytestmark = pytest.mark.gpu

# (name, kwargs): int4 block 128 swiglu (fused 1), int8 row-wise with zero points and biases (fused 2),
# int2 block 32 plain gelu, FP8 (block 128 / global scales), each with shared experts and the gate /
# router GEMM in some combination
CASES = [
    ("b4-bs128-swiglu1-S1-gate-router", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1,
                                             S=1, gate=True, router="T", router_bias=True)),
    ("b8-zp-bias-swiglu2-S2", dict(bits=8, block_size=0, zero_points=True, bias=True, activation_type="swiglu",
                                   swiglu_fusion=2, S=2)),
    ("b2-bs32-gelu-S1-router-f32", dict(bits=2, block_size=32, activation_type="gelu", S=1, router="float32")),
    ("b4-bs64-silu-router-only", dict(bits=4, block_size=64, activation_type="silu", S=0, router="T")),
    # FP8 shared experts beside FP8 routed ones: square block scales, and per-expert global scales
    ("fp8-bs128-swiglu1-S1-gate-router", dict(format="fp8_e4m3", block_size=128, activation_type="swiglu",
                                              swiglu_fusion=1, S=1, gate=True, router="T")),
    ("fp8-global-swiglu2-S2", dict(format="fp8_e4m3", block_size=0, activation_type="swiglu", swiglu_fusion=2, S=2)),
]
DECODE_ROWS = (1, 3, 8)
PREFILL_ROWS = (64, 300)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name, kw", CASES, ids=[c[0] for c in CASES])
def test_extensions_vs_reference_on_every_engine(rng, name, kw, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, I, k = 16, 256, 128, 4  # noqa: E741
    w, a, ext = build(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
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
                got = moe(cp.asarray(x), None if router else cp.asarray(lg), out=out)
                assert moe.plan(rows, dtype, "float32").engine == pipeline, (name, rows, pipeline)
                e = rel_err(cp.asnumpy(got), want)
                worst = max(worst, e)
                assert e <= TOL[dtype], f"{name} {dtype} {pipeline} rows={rows}: rel err {e:.3e}"
    print(f"{name} {dtype}: worst rel err {worst:.3e}")


def test_shared_part_is_not_negligible_and_the_gate_matters(rng):
    """The checks above would pass if the shared experts were dropped only when their part is small:
    here the layer with shared experts differs from the routed-only layer by much more than the
    tolerance, and the gated layer from the ungated one."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, I, k, dtype = 8, 256, 128, 2, "bfloat16"  # noqa: E741
    w, a, ext = build(rng, E=E, H=H, I=I, k=k, dtype=dtype, bits=4, block_size=128, activation_type="swiglu",
                      swiglu_fusion=1, S=1, gate=True)
    x, lg, _ = random_inputs(rng, 5, H, E, dtype)
    outs = {}
    for what, extra in (("routed", {}), ("gated", ext),
                        ("ungated", {n: v for n, v in ext.items() if n != "shared_gate_weight"})):
        moe = QMoE(**to_dev(w), **a, **to_dev(extra))
        outs[what] = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg))).astype(np.float64)
        assert rel_err(outs[what], reference(x, lg, **w, **a, **extra)) <= TOL[dtype], what
    assert rel_err(outs["gated"], outs["routed"]) > 20 * TOL[dtype]
    assert rel_err(outs["gated"], outs["ungated"]) > 20 * TOL[dtype]


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_router_gemm_graph_replay_equals_eager_bitwise(rng, rows):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, I, k, dtype = 16, 256, 128, 4, "float16"  # noqa: E741
    w, a, ext = build(rng, E=E, H=H, I=I, k=k, dtype=dtype, bits=4, block_size=64, activation_type="swiglu",
                      swiglu_fusion=1, S=1, gate=True, router="T", router_bias=True)
    moe = QMoE(**to_dev(w), **a, **to_dev(ext))
    x = cp.asarray(random_inputs(rng, rows, H, E, dtype)[0])
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    graph = moe.capture(x, None, out=out)
    for _ in range(2):
        x[...] = cp.asarray(random_inputs(rng, rows, H, E, dtype)[0])
        graph.replay()
        cp.cuda.Device().synchronize()
        eager = moe(x, None)
        assert cp.array_equal(out.view(cp.uint16), eager.view(cp.uint16))
        assert rel_err(cp.asnumpy(out), reference(cp.asnumpy(x), None, **w, **a, **ext)) <= TOL[dtype]


def test_router_gemm_call_refuses_logits(rng):
    import cupy as cp

    from qmoe_rtc.errors import QMoEInputError
    from qmoe_rtc.executor import QMoE

    E, H, I, k, dtype = 8, 128, 64, 2, "float16"  # noqa: E741
    w, a, ext = build(rng, E=E, H=H, I=I, k=k, dtype=dtype, bits=4, activation_type="swiglu", swiglu_fusion=1,
                      S=1, router="T")
    moe = QMoE(**to_dev(w), **a, **to_dev(ext))
    x, lg, _ = random_inputs(rng, 2, H, E, dtype)
    with pytest.raises(QMoEInputError, match="router_probs"):
        moe(cp.asarray(x), cp.asarray(lg))
