"""The tiled weight layout on the GPU: the same layer with prepack on and off, on every tensor-core
engine (decode, batched-decode, mma.sync tiles, wgmma), matches the float64 reference with poisoned
outputs; graph replay equals the eager call bitwise on tiled codes; a tiled layer keeps no reference to
the caller's contract codes (the caller may free them); 'auto' tiles a layer whose scales are in T; a layer
given the tiled codes (prepack='given', qmoe_rtc/tiled/given.py) uses them as they are and computes bitwise
what the layer that tiled them computes."""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.errors import QMoEUnsupportedError
from qmoe_rtc.settings import knobs
from qmoe_rtc.tiled.given import CODE_INPUTS, tiled_weights

from support.gpu_checks import TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

# (engine, knobs, decode_max_routes)
ENGINES = [("decode-mma", {}, 512), ("prefill-batched", {"prefill_engine": "batched"}, 0),
           ("prefill-mma", {"prefill_engine": "mma"}, 0), ("prefill-wgmma", {"prefill_engine": "wgmma"}, 0)]
# (name, random_layer kwargs, E, H, I): interleaved gate rows (tile rows permuted; fused halves too, their
# bias moved to interleaved order), FC3 with 3-bit
# packed zero points and blocks of 16 (two scales per segment), 8-bit row-wise with K % 128 != 0, FP8;
# the tiled meta records (prepack.pack_meta) with zero points on paired rows (one record for both lane
# rows: interleaved FC1, FC2), float32 scales (16-byte records), row-wise zero points packed along N,
# 1-bit codes
LAYERS = [
    ("b4-bs128-zp-swiglu1-f32s", dict(bits=4, block_size=128, zero_points=True, scale_dtype="float32",
                                      activation_type="swiglu", swiglu_fusion=1, k=2), 8, 256, 128),
    ("b4-row-zp-relu", dict(bits=4, block_size=0, zero_points=True, activation_type="relu", k=2), 8, 192, 160),
    ("b1-bs64-zp-gelu", dict(bits=1, block_size=64, zero_points=True, activation_type="gelu", k=2), 8, 256, 128),
    ("b4-bs128-swiglu1", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4), 16, 256, 128),
    ("b3-bs16-zp-silu-fc3", dict(bits=3, block_size=16, zero_points=True, activation_type="silu", fc3=True, k=2),
     8, 256, 96),
    ("b8-row-gelu-bias", dict(bits=8, block_size=0, activation_type="gelu", k=2, bias=True), 8, 160, 224),
    ("b2-bs32-swiglu2-bias", dict(bits=2, block_size=32, activation_type="swiglu", swiglu_fusion=2, k=2, bias=True),
     8, 128, 64),
    ("fp8-bs128-swiglu1", dict(format="fp8_e4m3", block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2),
     8, 256, 128),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, kw, E, H, I", LAYERS, ids=[c[0] for c in LAYERS])
@pytest.mark.parametrize("engine, scope, limit", ENGINES, ids=[e[0] for e in ENGINES])
def test_tiled_and_contract_layouts_agree_with_the_reference(rng, name, kw, E, H, I, dtype, engine, scope, limit):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    if engine == "prefill-wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    dev = to_dev(w)
    with knobs.scope(**scope):
        layers = {p: QMoE(**dev, **a, decode_max_routes=limit, prepack=p) for p in ("on", "off")}
        assert layers["on"]._tiled and not layers["off"]._tiled
        assert "fc1_experts_weights" not in layers["on"]._weights  # the caller's codes are not kept
        for rows in (3, 70):
            x, lg, _ = random_inputs(rng, rows, H, E, dtype)
            want = reference(x, lg, **w, **a)
            xd, ld = cp.asarray(x), cp.asarray(lg)
            for p, moe in layers.items():
                assert moe.plan(rows, dtype, "float32").engine == engine, (p, rows)
                out = cp.full(x.shape, cp.nan, dtype=x.dtype)
                moe(xd, ld, out=out)
                e = rel_err(cp.asnumpy(out), want)
                assert e <= TOL[dtype], f"{engine} {name} {dtype} prepack={p} rows={rows}: rel err {e:.3e}"
            g = layers["on"].capture(xd, ld)
            g.output.fill(cp.nan)
            g.replay()
            cp.cuda.get_current_stream().synchronize()
            np.testing.assert_array_equal(cp.asnumpy(g.output), cp.asnumpy(layers["on"](xd, ld)))


def test_auto_tiles_a_layer_whose_scales_are_in_t(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=8, H=128, I=64, k=2, bits=4, block_size=64, dtype="bfloat16")
    assert QMoE(**to_dev(w), **a)._tiled
    w32, a32 = random_layer(rng, E=8, H=128, I=64, k=2, bits=4, block_size=64, dtype="bfloat16", scale_dtype="float32")
    moe = QMoE(**to_dev(w32), **a32)  # float32 scales: the layer may be called with float32 activations
    assert not moe._tiled
    x, lg, _ = random_inputs(rng, 5, 128, 8, "float32")
    got = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg)))
    assert rel_err(got, reference(x, lg, **w32, **a32)) <= TOL["float32"]


# (name, random_layer kwargs, dtype, E, H, I): interleaved FC1 with a shared expert, 8-bit row-wise with
# zero points, a shared expert and biases (fused halves 2, tiled as interleaved rows; K % 128 != 0), 3-bit
# FC3 with packed zero points and blocks of 16, 2-bit gelu with two shared experts, FP8
GIVEN = [
    ("b4-bs128-swiglu1-bf16-S1", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4, shared=1),
     "bfloat16", 16, 256, 128),
    ("b8-row-zp-swiglu2-f16-S1", dict(bits=8, block_size=0, zero_points=True, activation_type="swiglu", swiglu_fusion=2,
                                      k=2, shared=1, bias=True), "float16", 8, 160, 224),
    ("b3-bs16-zp-silu-fc3-f16", dict(bits=3, block_size=16, zero_points=True, activation_type="silu", fc3=True, k=2),
     "float16", 8, 256, 96),
    ("b2-bs32-gelu-S2-bf16", dict(bits=2, block_size=32, activation_type="gelu", k=2, shared=2), "bfloat16", 8, 128, 64),
    ("fp8-bs128-swiglu1-bf16", dict(format="fp8_e4m3", block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2),
     "bfloat16", 8, 256, 128),
]


def _bits(a: np.ndarray) -> np.ndarray:
    """The output's bytes as integers (bitwise comparison; NaN never equals itself there either)."""
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("name, kw, dtype, E, H, I", GIVEN, ids=[c[0] for c in GIVEN])
def test_given_tiled_codes_run_bitwise_like_the_layer_that_tiles_them(rng, name, kw, dtype, E, H, I):
    """tiled_weights (host and GPU) = the codes a prepack='on' layer made at upload = QMoE.tiled_weights();
    a prepack='given' layer holds the given device arrays themselves (no re-tiling), runs the same engine
    and gives the same output bytes as the 'on' layer, at 1 token (decode) and 64 (prefill), into
    NaN-poisoned outputs."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    host = tiled_weights(w, **a)
    gpu = tiled_weights(to_dev(w), **a)  # tiled on the GPU: the same bytes
    codes = [n for n in CODE_INPUTS if w.get(n) is not None]
    for n in codes:
        np.testing.assert_array_equal(cp.asnumpy(gpu[n]), host[n], err_msg=n)
    limit = 4 * k  # decode up to 4 tokens: 1 token decodes, 64 prefill
    on = QMoE(**to_dev(w), **a, prepack="on", decode_max_routes=limit)
    given_dev = to_dev(host)
    given = QMoE(**given_dev, **a, prepack="given", decode_max_routes=limit)
    assert on._tiled and given._tiled
    made = on.tiled_weights()
    assert sorted(made) == sorted(codes) and sorted(given.tiled_weights()) == sorted(codes)
    for n in codes:
        np.testing.assert_array_equal(cp.asnumpy(made[n]), host[n], err_msg=n)
        assert given.tiled_weights()[n].data.ptr == given_dev[n].data.ptr, n  # used as given, not re-tiled
    for rows, path in ((1, "decode"), (64, "prefill")):
        assert on.path_for(rows) == given.path_for(rows) == path
        assert on.plan(rows, dtype, "float32").engine == given.plan(rows, dtype, "float32").engine
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        xd, ld = cp.asarray(x), cp.asarray(lg)
        outs = {}
        for p, moe in (("on", on), ("given", given)):
            out = cp.full(x.shape, cp.nan, dtype=x.dtype)
            moe(xd, ld, out=out)
            outs[p] = cp.asnumpy(out)
            assert np.isfinite(outs[p].astype(np.float32)).all(), (p, rows)
        np.testing.assert_array_equal(_bits(outs["given"]), _bits(outs["on"]), err_msg=f"{name} rows={rows}")
        e = rel_err(outs["given"], reference(x, lg, **w, **a))
        assert e <= TOL[dtype], f"{name} rows={rows}: rel err {e:.3e}"


def test_an_untiled_layer_has_no_tiled_codes_to_give(rng):
    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=8, H=128, I=64, k=2, bits=4, block_size=64, dtype="float16")
    with pytest.raises(QMoEUnsupportedError, match="contract layout"):
        QMoE(**to_dev(w), **a, prepack="off").tiled_weights()


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_row_wise_scales_as_e_n_1_with_zero_points(rng, bits, activation):
    """The hidden parity cases that raised a raw reshape ValueError: float16, 5 rows, H 64, I 32, E 8, k 2,
    row-wise scales given as [E, N, 1] with packed zero points; now they match the reference, with the
    output poisoned first, on the decode and prefill paths."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, I, k = 8, 64, 32, 2  # noqa: E741
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, bits=bits, block_size=0, zero_points=True, dtype="float16",
                        activation_type=activation)
    w = {n: (v[..., None] if n.endswith("_scales") else v) for n, v in w.items()}  # [E, N] -> [E, N, 1]
    for limit, rows_list in ((512, (5, 64)), (0, (5, 300))):  # decode engine (one block: 512 routes), then prefill
        moe = QMoE(decode_max_routes=limit, **to_dev(w), **a)
        for rows in rows_list:
            x, lg, _ = random_inputs(rng, rows, H, E, "float16")
            out = cp.full(x.shape, cp.nan, dtype=cp.float16)
            got = moe(cp.asarray(x), cp.asarray(lg), out=out)
            e = rel_err(cp.asnumpy(got), reference(x, lg, **w, **a))
            assert e <= TOL["float16"], f"bits={bits} {activation} rows={rows} limit={limit}: {e:.3e}"
            assert moe.plan(rows, "float16").engine.startswith("decode" if limit else "prefill")
