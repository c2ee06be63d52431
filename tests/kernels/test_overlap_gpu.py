"""GPU: programmatic dependent launch (sm_90+). A decode forward's routing, FC1 and FC2 launches start
while the previous kernel finishes (``cuda_src/core/pdl.cuh``); the outputs must equal those of fully
serialized launches bit for bit — eager, as one eager graph, and captured — over many back-to-back
calls with fresh inputs (a missing wait would show as a race), and match the float64 reference.
Skipped without a GPU; below sm_90 it checks that nothing is overlapped."""

from __future__ import annotations

import pytest

from qmoe_rtc.contract.random_layer import random_inputs
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.ext_layers import build, to_dev
from support.gpu_checks import TOL, rel_err

pytestmark = pytest.mark.gpu

# (name, layer): a small layer, and one whose FC1 grid is several waves (blocks wait on the ids while
# others still run), both with the router GEMM (three overlapped launches) and a gated shared expert
LAYERS = [
    ("small-router-shared", dict(E=16, H=256, I=128, k=4, S=1, gate=True, router="T", router_bias=True)),
    ("waves-router", dict(E=64, H=2048, I=768, k=8, S=0, router="T")),
    ("waves-logits-shared", dict(E=64, H=2048, I=768, k=8, S=1)),
]


def _overlapped(moe) -> list[int]:
    """Per bound call of ``moe`` (eager, capture): how many of its launches are overlapped."""
    return [sum(c is not None for c in call.bound.overlapped) for call in moe._calls.values() if call.bound]


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("name, kw", LAYERS, ids=[n for n, _ in LAYERS])
def test_overlapped_decode_equals_serialized_launches_bitwise(rng, name, kw, rows):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    dtype = "bfloat16"
    w, a, ext = build(rng, dtype=dtype, bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, **kw)
    router = "router_weight" in ext
    wd, xd = to_dev(w), to_dev(ext)
    layers = {}
    for mode, knob in (("serial", dict(pdl=False)), ("overlap", {}), ("overlap-plain", dict(eager_graphs=False))):
        with knobs.scope(**knob):
            layers[mode] = QMoE(decode_max_routes=10**6, **wd, **a, **xd)
    H, E = kw["H"], kw["E"]
    x0, l0, _ = random_inputs(rng, rows, H, E, dtype)
    x, lg = cp.asarray(x0), None if router else cp.asarray(l0)
    outs = {m: cp.full(x.shape, cp.nan, dtype=x.dtype) for m in layers}
    for mode, moe in layers.items():
        with knobs.scope(pdl=mode != "serial"):
            moe(x, lg, out=outs[mode])
    graph_out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    graph = layers["overlap"].capture(x, lg, out=graph_out)

    steps = len(layers["overlap"].plan(rows, dtype, "float32").steps)
    assert _overlapped(layers["serial"]) == [0]
    hopper = int(cp.cuda.Device().compute_capability) >= 90
    for mode in ("overlap", "overlap-plain"):  # every launch but the first, on sm_90+
        assert set(_overlapped(layers[mode])) == {steps - 1 if hopper else 0}, (mode, steps)

    for it in range(12):  # back to back, no sync between the modes: a race would differ somewhere
        xn, ln, _ = random_inputs(rng, rows, H, E, dtype)
        x[...] = cp.asarray(xn)
        if lg is not None:
            lg[...] = cp.asarray(ln)
        for o in (*outs.values(), graph_out):
            o.fill(cp.nan)
        for mode, moe in layers.items():
            moe(x, lg, out=outs[mode])
        graph.replay()
        cp.cuda.Device().synchronize()
        want = outs["serial"].view(cp.uint16)
        for mode, got in (*outs.items(), ("graph", graph_out)):
            assert cp.array_equal(got.view(cp.uint16), want), f"{name} rows={rows} call {it}: {mode} != serial"
        if it % 4 == 0:
            e = rel_err(cp.asnumpy(outs["serial"]), reference(xn, None if router else ln, **w, **a, **ext))
            assert e <= TOL[dtype], f"{name} rows={rows}: rel err {e:.3e}"
