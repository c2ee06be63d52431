"""GPU executor vs the float64 reference across the contract matrix (skipped without a GPU).

Every output is poisoned with NaN before the run, so an unwritten element fails the check.
"""


import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.errors import CaptureError, QMoEInputError

from support.gpu_checks import TOL, check_graph_replay_equals_eager, rel_err, to_dev

pytestmark = pytest.mark.gpu

# (name, random_layer kwargs, E, H, I): covers bits 1/2/3/4/8 and mixed, block 0/16/32/64/128, zero
# points none/packed/offset, every activation and fusion, fc3, biases, normalize, sparse mixer, k 1..10
LAYERS = [
    ("b4-bs128-swiglu1-f16", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1,
                                  activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0, k=8,
                                  normalize_routing_weights=1), 64, 256, 128, "float16"),
    ("b4-bs128-swiglu1-bf16", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4,
                                   swiglu_limit=0.5, swiglu_limit_after_activation=1), 32, 256, 128, "bfloat16"),
    ("b4-bs32-swiglu2-zp-f32", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu",
                                    swiglu_fusion=2, k=2, bias=True), 16, 128, 64, "float32"),
    ("b8-rowwise-relu-f16", dict(bits=8, block_size=0, activation_type="relu", k=1), 8, 128, 64, "float16"),
    ("b8-bs64-zp-gelu-bf16", dict(bits=8, block_size=64, zero_points=True, activation_type="gelu", k=2,
                                  bias=True), 8, 128, 128, "bfloat16"),
    ("b2-bs16-zp-silu-fc3-f16", dict(bits=2, block_size=16, zero_points=True, activation_type="silu", fc3=True,
                                     k=4, normalize_routing_weights=1), 16, 128, 64, "float16"),
    ("b2-offset-identity-f32", dict(bits=2, block_size=0, zero_point_offset=1.5, activation_type="identity", k=2),
     8, 128, 64, "float32"),
    ("b3-bs16-swiglu-fc3-f16", dict(bits=3, block_size=16, activation_type="swiglu", fc3=True, swiglu_fusion=0,
                                    k=2, bias=True), 8, 128, 64, "float16"),
    ("b3-rowwise-zp-geglu2-bf16", dict(bits=3, block_size=0, zero_points=True, activation_type="geglu",
                                       swiglu_fusion=2, k=10), 16, 128, 64, "bfloat16"),
    ("b1-bs32-relu2-f32", dict(bits=1, block_size=32, activation_type="relu2", k=2), 8, 128, 64, "float32"),
    ("b1-offset-gelu-fc3-f16", dict(bits=1, block_size=0, zero_point_offset=0.5, activation_type="gelu", fc3=True,
                                    k=2), 8, 128, 64, "float16"),
    ("mixed-4-8-2-zp-silu-fc3-bf16", dict(bits=(4, 8, 2), block_size=16, zero_points=(True, False, True),
                                          activation_type="silu", fc3=True, k=2, bias=True), 8, 128, 64, "bfloat16"),
    ("mixed-3-1-geglu1-f32", dict(bits=(3, 1, 4), block_size=64, activation_type="geglu", swiglu_fusion=1, k=4),
     16, 128, 64, "float32"),
    ("sparse-mixer-silu-fc3-f16", dict(bits=4, block_size=32, activation_type="silu", fc3=True, k=2,
                                       use_sparse_mixer=1), 16, 128, 64, "float16"),
    ("e512-k10-b4-swiglu1-f16", dict(bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=1, k=10),
     512, 128, 64, "float16"),
    ("odd-K-b3-rowwise-relu-f32", dict(bits=3, block_size=0, activation_type="relu", k=2), 8, 100, 36, "float32"),
    ("f32-scales-f16-b4-bs16", dict(bits=4, block_size=16, activation_type="swiglu", swiglu_fusion=1, k=2,
                                    scale_dtype="float32"), 8, 128, 64, "float16"),
]

ROWS = [0, 1, 3, 7, 64, 1000]


@pytest.mark.parametrize("name, kw, E, H, I, dtype", LAYERS, ids=[c[0] for c in LAYERS])
def test_matrix_vs_reference(rng, name, kw, E, H, I, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    moe = QMoE(**to_dev(w), **a)
    worst = {}
    for rows in ROWS:
        shape = (rows,) if rows != 64 else (4, 16)  # one 3-D case
        for rw in (False, True) if not a.get("use_sparse_mixer") else (False,):
            for rdt in ("float32", dtype):
                x, lg, rwv = random_inputs(rng, shape, H, E, dtype, router_dtype=rdt, router_weights=rw)
                want = reference(x, lg, router_weights=rwv, **w, **a)
                out = cp.full(x.shape, cp.nan, dtype=x.dtype)
                got = moe(cp.asarray(x), cp.asarray(lg), None if rwv is None else cp.asarray(rwv), out=out)
                assert got is out
                if rows == 0:
                    assert got.shape == x.shape
                    continue
                e = rel_err(cp.asnumpy(got), want)
                worst[(rows, rw, rdt)] = e
                assert e <= TOL[dtype], f"{name} rows={rows} router_weights={rw} logits={rdt}: rel err {e:.3e}"
    print(f"{name}: worst rel err {max(worst.values()):.3e}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decode_and_prefill_paths_agree(rng, dtype):
    """The same inputs through both paths (forced by decode_max_routes) match the reference."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=16, H=256, I=128, k=4, bits=4, block_size=64, dtype=dtype, activation_type="swiglu",
                        swiglu_fusion=1, zero_points=True, bias=True)
    x, lg, _ = random_inputs(rng, 9, 256, 16, dtype)
    want = reference(x, lg, **w, **a)
    wd = to_dev(w)
    for limit in (0, 10**6):
        moe = QMoE(decode_max_routes=limit, **wd, **a)
        got = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg)))
        assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("bits, bs, H, I", [(4, 128, 256, 128), (3, 128, 256, 128), (3, 32, 160, 96)],
                         ids=["b4", "b3-aligned-chunks", "b3-K%128"])  # 3-bit: both copy variants of the ring
def test_graph_replay_matches_eager_bitwise(rng, bits, bs, H, I):
    from qmoe_rtc.executor import QMoE

    for rows, E in ((1, 32), (3, 32), (200, 32)):  # decode and prefill graphs
        w, a = random_layer(rng, E=E, H=H, I=I, k=4, bits=bits, block_size=bs, dtype="float16",
                            activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)
        moe = QMoE(**to_dev(w), **a)
        assert moe.plan(rows, "float16", "float32").engine not in ("decode-gemv", "prefill-simt"), bits  # tensor cores
        check_graph_replay_equals_eager(rng, moe, rows, H, E, w, a)


def test_graph_survives_scratch_regrowth(rng):
    """A graph keeps the scratch it was recorded on: a later, larger eager call regrows the pool."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=16, H=128, I=64, k=2, dtype="float16", activation_type="swiglu", swiglu_fusion=1)
    moe = QMoE(**to_dev(w), **a)
    x, lg, _ = random_inputs(rng, 2, 128, 16, "float16")
    g = moe.capture(cp.asarray(x), cp.asarray(lg))
    xb, lb, _ = random_inputs(rng, 1000, 128, 16, "float16")
    moe(cp.asarray(xb), cp.asarray(lb))  # regrows the pool (and switches to the prefill path)
    cp.get_default_memory_pool().free_all_blocks()
    filler = cp.full((1 << 24,), 7, cp.float32)  # reuse any freed memory
    g.output.fill(cp.nan)
    y = cp.asnumpy(g.replay()).copy()
    np.testing.assert_array_equal(y, cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg))))
    del filler


def test_capture_needs_a_sized_pool(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=8, H=128, I=64, k=2, dtype="float16", activation_type="relu")
    moe = QMoE(**to_dev(w), **a)
    x, lg, _ = random_inputs(rng, 4, 128, 8, "float16")
    xd, ld, out = cp.asarray(x), cp.asarray(lg), cp.empty((4, 128), cp.float16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            with pytest.raises(CaptureError, match="eager call"):
                moe(xd, ld, out=out)  # never planned at this shape: refused, nothing allocated or compiled
        finally:
            s.end_capture()
    moe(xd, ld, out=out)  # eager call plans and sizes the pool
    with s:
        s.begin_capture()
        try:
            with pytest.raises(CaptureError, match="out="):
                moe(xd, ld)  # planned, but an output cannot be allocated inside capture
        finally:
            s.end_capture()


def test_two_layouts_one_process_and_non_default_stream(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    wa, aa = random_layer(rng, E=8, H=128, I=64, k=2, bits=4, block_size=32, dtype="float16", activation_type="gelu")
    wb, ab = random_layer(rng, E=16, H=128, I=64, k=3, bits=2, block_size=0, dtype="bfloat16",
                          activation_type="swiglu", swiglu_fusion=2)
    ma, mb = QMoE(**to_dev(wa), **aa), QMoE(**to_dev(wb), **ab)
    s = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        xa, la, _ = random_inputs(rng, 5, 128, 8, "float16")
        xb, lb, _ = random_inputs(rng, 70, 128, 16, "bfloat16")
        with s:
            ya = ma(cp.asarray(xa), cp.asarray(la))
            yb = mb(cp.asarray(xb), cp.asarray(lb))
        s.synchronize()
        assert rel_err(cp.asnumpy(ya), reference(xa, la, **wa, **aa)) <= TOL["float16"]
        assert rel_err(cp.asnumpy(yb), reference(xb, lb, **wb, **ab)) <= TOL["bfloat16"]


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=8, H=128, I=64, k=2, dtype="float16", activation_type="silu", fc3=True)
    moe = QMoE(**{n: torch.from_numpy(v).cuda() for n, v in w.items()}, **a)
    x, lg, _ = random_inputs(rng, 6, 128, 8, "float16")
    y = moe(torch.from_numpy(x).cuda(), torch.from_numpy(lg).cuda())
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16 and y.shape == (6, 128)
    assert rel_err(y.cpu().numpy(), reference(x, lg, **w, **a)) <= TOL["float16"]
    del cp


def test_bad_input_refused_before_launch(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=8, H=128, I=64, k=2, dtype="float16", activation_type="relu")
    moe = QMoE(**to_dev(w), **a)
    x, lg, _ = random_inputs(rng, 3, 128, 8, "float16")
    with pytest.raises(QMoEInputError, match="router_probs"):
        moe(cp.asarray(x), cp.asarray(lg[:, :4]))
    with pytest.raises(QMoEInputError, match="'out'"):
        moe(cp.asarray(x), cp.asarray(lg), out=cp.empty((3, 128), cp.float32))


@pytest.mark.parametrize("kw, dtype", [(dict(bits=8, activation_type="relu"), "float32"),
                                       (dict(format="fp8_e4m3", block_size=0, activation_type="silu"), "bfloat16")])
def test_one_shot_function(rng, kw, dtype):
    """qmoe_rtc.qmoe(...): ONNX Runtime's positional inputs, other layer tensors (FP8 global scales) as
    keywords."""
    import cupy as cp

    import qmoe_rtc

    w, a = random_layer(rng, E=8, H=128, I=64, k=2, dtype=dtype, **kw)
    x, lg, _ = random_inputs(rng, 4, 128, 8, dtype)
    wd = to_dev(w)
    extra = {n: v for n, v in wd.items() if n.endswith("_global_scale")}
    y = qmoe_rtc.qmoe(cp.asarray(x), cp.asarray(lg), wd["fc1_experts_weights"], wd.get("fc1_scales"), None,
                      wd["fc2_experts_weights"], wd.get("fc2_scales"), **extra, **a)
    assert rel_err(cp.asnumpy(y), reference(x, lg, **w, **a)) <= TOL[dtype]
