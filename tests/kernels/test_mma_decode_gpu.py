"""The tensor-core decode kernels (family ``mma``) vs the float64 reference on the GPU.

Covers bit widths 1/2/3/4/8 (and mixed), block sizes 0/16/32/128, zero points, every gate source,
float16/bfloat16, K not a multiple of 128, all three K splits, route groups of 8/16/32 and experts
with more routes than one pass serves. Outputs are NaN-poisoned first.
"""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference

from support.gpu_checks import TENSOR_CORE_3BIT, TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

# (name, random_layer kwargs, E, H, I)
LAYERS = [
    ("b4-bs128-swiglu1", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4), 16, 256, 128),
    ("b4-bs32-zp-swiglu2-bias", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu",
                                     swiglu_fusion=2, k=2, bias=True), 8, 160, 96),  # K % 128 != 0
    ("b8-rowwise-relu", dict(bits=8, block_size=0, activation_type="relu", k=2), 8, 256, 128),
    ("b8-bs64-zp-gelu-bias", dict(bits=8, block_size=64, zero_points=True, activation_type="gelu", k=2, bias=True),
     8, 128, 128),
    ("b2-bs16-zp-silu-fc3", dict(bits=2, block_size=16, zero_points=True, activation_type="silu", fc3=True, k=4),
     16, 128, 64),
    ("b1-bs32-relu2", dict(bits=1, block_size=32, activation_type="relu2", k=2), 8, 128, 64),
    ("mixed-4-8-4-fc3-zp", dict(bits=(4, 8, 4), block_size=16, zero_points=(True, False, True),
                                activation_type="silu", fc3=True, k=2, bias=True), 8, 128, 64),
    ("mixed-2-1-geglu1", dict(bits=(2, 1, 2), block_size=0, activation_type="geglu", swiglu_fusion=1, k=2),
     4, 128, 64),
    *TENSOR_CORE_3BIT,  # test_executor_gpu.py
    ("wide-I-b4-swiglu1", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2),
     16, 256, 4096),  # many fc1 tiles: K split 1
]
ROWS = [1, 2, 5, 8, 9, 17, 40, 64]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, kw, E, H, I", LAYERS, ids=[c[0] for c in LAYERS])
def test_mma_decode_vs_reference(rng, name, kw, E, H, I, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    moe = QMoE(**to_dev(w), **a, decode_max_routes=512)  # the decode path at every row count here
    worst = 0.0
    for rows in ROWS:
        assert moe.plan(rows, dtype, "float32").engine == "decode-mma", (name, rows)
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        want = reference(x, lg, **w, **a)
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
        moe(cp.asarray(x), cp.asarray(lg), out=out)
        e = rel_err(cp.asnumpy(out), want)
        worst = max(worst, e)
        assert e <= TOL[dtype], f"{name} {dtype} rows={rows}: rel err {e:.3e}"
    print(f"mma {name} {dtype}: worst rel err {worst:.3e}")


@pytest.mark.parametrize("rows", [33, 100])
def test_one_expert_chosen_by_every_row(rng, rows):
    """Every row picks expert 3 first: one expert serves more routes than a pass holds (32)."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, I = 8, 128, 64
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float16", bits=4, block_size=32,
                        activation_type="swiglu", swiglu_fusion=1)
    x, lg, _ = random_inputs(rng, rows, H, E, "float16")
    lg = lg.astype(np.float32)
    lg[:, 3] += 50.0
    want = reference(x, lg, **w, **a)
    moe = QMoE(**to_dev(w), **a, decode_max_routes=512)  # the decode path at every row count here
    assert moe.plan(rows, "float16", "float32").engine == "decode-mma"
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    moe(cp.asarray(x), cp.asarray(lg), out=out)
    assert rel_err(cp.asnumpy(out), want) <= TOL["float16"]


def test_counters_reset_between_calls(rng):
    """The per-tile counters return to zero after each call (else the next call's combine misfires)."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=8, H=256, I=128, k=2, dtype="bfloat16", bits=4, block_size=128,
                        activation_type="swiglu", swiglu_fusion=1)
    moe = QMoE(**to_dev(w), **a, decode_max_routes=512)  # the decode path at every row count here
    for rows in (1, 7, 3, 7):
        x, lg, _ = random_inputs(rng, rows, 256, 8, "bfloat16")
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
        moe(cp.asarray(x), cp.asarray(lg), out=out)
        cp.cuda.get_current_stream().synchronize()
        assert int(moe._pools[0].bufs["counters"].sum()) == 0  # the null stream's pool
        assert rel_err(cp.asnumpy(out), reference(x, lg, **w, **a)) <= TOL["bfloat16"]


def test_misaligned_input_scales_and_zero_points(rng):
    """Views that start 2 bytes past a 16-byte boundary (input, scales) or 1 byte (zero points) give
    the reference result (the layer copies what its 16-byte / 4-byte-word loads cannot read in place)."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    def shifted(a, by_elems=1):  # same values, C-contiguous, at a pointer by_elems past an aligned one
        buf = cp.empty(a.size + by_elems, dtype=a.dtype)
        v = buf[by_elems:].reshape(a.shape)
        v[...] = cp.asarray(a)
        return v

    E, H, I = 5, 128, 64
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float16", bits=4, block_size=0, zero_points=True,
                        activation_type="swiglu", swiglu_fusion=1)
    dev = to_dev(w)
    for n in ("fc1_scales", "fc2_scales", "fc1_zero_points", "fc2_zero_points"):
        dev[n] = shifted(dev[n])
        assert dev[n].data.ptr % 4 != 0
    moe = QMoE(**dev, **a, decode_max_routes=512)
    for rows in (1, 3):
        x, lg, _ = random_inputs(rng, rows, H, E, "float16")
        xs = shifted(cp.asarray(x))
        assert xs.data.ptr % 16 != 0
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
        moe(xs, cp.asarray(lg), out=out)
        assert moe.plan(rows, "float16", "float32").engine == "decode-mma"
        assert rel_err(cp.asnumpy(out), reference(x, lg, **w, **a)) <= TOL["float16"]


# (name, random_layer kwargs, E, H, I): layers whose experts get several routes at 2-8 tokens
X_RING_LAYERS = [LAYERS[0], LAYERS[1], LAYERS[3], TENSOR_CORE_3BIT[0]]


@pytest.mark.parametrize("prepack", [True, False], ids=["tiled", "contract"])
@pytest.mark.parametrize("name, kw, E, H, I", X_RING_LAYERS, ids=[c[0] for c in X_RING_LAYERS])
def test_x_ring_gives_the_bits_of_global_loads(rng, monkeypatch, name, kw, E, H, I, prepack):
    """Activations staged in the x rings (engines/x_ring.cuh; the ``_xr`` kernels, up to 4 tokens) give the same
    bits as the kernels that load them from global memory as they compute (QMOE_RTC_TUNE=mma_x_ring=0), and the
    reference, at 1-4 tokens with up to 4 routes an expert (5 and 8 tokens: the plain kernels either way), in the
    tiled and the contract layout; outputs NaN-poisoned."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype="bfloat16", **kw)
    inputs = [random_inputs(rng, rows, H, E, "bfloat16")[:2] for rows in (1, 2, 3, 5, 8)]

    def outputs():
        moe = QMoE(**to_dev(w), **a, prepack=prepack, decode_max_routes=512)
        outs = []
        for x, lg in inputs:
            assert moe.plan(len(x), "bfloat16", "float32").engine == "decode-mma"
            out = cp.full(x.shape, cp.nan, dtype=x.dtype)
            moe(cp.asarray(x), cp.asarray(lg), out=out)
            outs.append(cp.asnumpy(out))
        return moe, outs

    staged, got = outputs()
    monkeypatch.setenv("QMOE_RTC_TUNE", "mma_x_ring=0")
    plain, want = outputs()
    for moe, on in ((staged, True), (plain, False)):  # the kernels each ran: with and without the x rings
        for x, _ in inputs:
            plan = moe.plan(len(x), "bfloat16", "float32")
            fc1 = next(st for st in plan.steps if st.role == "fc1")
            kernel = fc1.kernel.kdef.key
            tokens = plan.problem.device.tuning.x_ring_tokens  # the GPU's arch's table (kernels/tuning/)
            assert kernel.endswith("_xr") == (on and len(x) <= tokens), (name, len(x), kernel)
    for (x, lg), g, p in zip(inputs, got, want):
        assert np.array_equal(g.view(np.uint16), p.view(np.uint16)), (name, len(x))
        assert rel_err(g, reference(x, lg, **w, **a)) <= TOL["bfloat16"], (name, len(x))
