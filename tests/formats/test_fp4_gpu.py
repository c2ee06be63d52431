"""FP4 experts [ext] (MXFP4, NVFP4) on the GPU engines vs the float64 reference (skipped without a GPU).

The whole layer ``QMoE(quant_type="mxfp4" | "nvfp4", ...)`` on fresh random data: float16 / bfloat16 on
every tensor-core engine (decode mma.sync, prefill mma.sync, prefill wgmma on sm_90),
float32 on the SIMT engines. FP4 layers hold their codes tiled (the tensor-core layout) by default; the
``-contract`` layers are built with ``prepack="off"`` and keep the contract layout. Outputs are NaN-poisoned before each call; a
graph replay must equal the eager call bitwise. Every e2m1 code and extreme e8m0 scales go through the
decode: the dequant kernel is checked bit for bit against qmoe_rtc.formats.fp4.
"""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.gpu_checks import TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

GPT_OSS = dict(activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0,
               swiglu_limit=7.0)
# (name, random_layer kwargs, E, H, I): H is FC1's K and FC2's N, I FC2's K (FC1's N is F·I)
LAYERS = [
    ("mxfp4-gptoss-bias", dict(format="mxfp4", k=4, bias=True, **GPT_OSS), 16, 256, 128),
    ("mxfp4-silu-fc3-contract", dict(format="mxfp4", activation_type="silu", fc3=True, k=2), 8, 320, 192),
    ("nvfp4-swiglu2-bias", dict(format="nvfp4", activation_type="swiglu", swiglu_fusion=2, k=2, bias=True),
     8, 256, 96),
    ("nvfp4-gelu-contract", dict(format="nvfp4", activation_type="gelu", k=2), 8, 128, 64),
]
#: tools/precompile.py builds the modules tiled and in the contract layout
PRECOMPILE_KNOBS = [{}, {"prepack": "off"}]
# engine -> (QMoE decode_max_routes, tuning knob prefill_engine, rows)
ENGINES = {
    "decode-mma": (512, "auto", (1, 2, 8)),
    "prefill-mma": (0, "mma", (64, 512)),
    "prefill-wgmma": (0, "wgmma", (512, 4096)),
}


@pytest.fixture(params=sorted(ENGINES))
def engine(request):
    import cupy as cp

    if request.param.startswith("prefill-wgmma") and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    limit, kind, rows = ENGINES[request.param]
    with knobs.scope(prefill_engine=kind):
        yield request.param, limit, rows


def _layer(rng, kw, E, H, I, dtype):
    kw = dict(kw)
    k = kw.pop("k")
    return random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)


def _run(moe, x, lg):
    """The layer on fresh device copies of x / lg into a NaN-poisoned output."""
    import cupy as cp

    xd, ld = cp.asarray(x), cp.asarray(lg)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    assert moe(xd, ld, out=out) is out
    return cp.asnumpy(out), (xd, ld, out)


def _replay_equals_eager(moe, xd, ld, out):
    import cupy as cp

    g = moe.capture(xd, ld)
    g.output.fill(cp.nan)
    g.replay()
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(g.output).view(np.uint8), cp.asnumpy(out).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, kw, E, H, I", LAYERS, ids=[c[0] for c in LAYERS])
def test_fp4_tensor_core_engines_vs_reference(rng, name, kw, E, H, I, dtype, engine):
    from qmoe_rtc.executor import QMoE

    want_engine, limit, rows_list = engine
    w, a = _layer(rng, kw, E, H, I, dtype)
    contract = name.endswith("-contract")
    moe = QMoE(**to_dev(w), **a, decode_max_routes=limit, prepack="off" if contract else "auto")
    assert moe.tiled is not contract
    worst = 0.0
    for rows in rows_list:
        assert moe.plan(rows, dtype, "float32").engine == want_engine, (name, rows)
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        got, (xd, ld, out) = _run(moe, x, lg)
        e = rel_err(got, reference(x, lg, **w, **a))
        worst = max(worst, e)
        assert e <= TOL[dtype], f"{name} {dtype} {want_engine} rows={rows}: rel err {e:.3e}"
    _replay_equals_eager(moe, xd, ld, out)
    print(f"fp4 {want_engine} {name} {dtype} tiled={moe.tiled}: worst rel err {worst:.3e}")


@pytest.mark.parametrize("name, kw, E, H, I", LAYERS[1::2], ids=[c[0] for c in LAYERS[1::2]])
def test_fp4_simt_engines_vs_reference(rng, name, kw, E, H, I):
    from qmoe_rtc.executor import QMoE

    w, a = _layer(rng, kw, E, H, I, "float32")
    dev = to_dev(w)
    for engine, limit, rows_list in (("decode-gemv", 512, (1, 8)), ("prefill-simt", 0, (64, 700))):
        moe = QMoE(**dev, **a, decode_max_routes=limit, prepack="off")  # FP4 is tiled by default
        for rows in rows_list:
            assert moe.plan(rows, "float32", "float32").engine == engine, (name, rows)
            x, lg, _ = random_inputs(rng, rows, H, E, "float32")
            got, (xd, ld, out) = _run(moe, x, lg)
            e = rel_err(got, reference(x, lg, **w, **a))
            assert e <= TOL["float32"], f"{name} {engine} rows={rows}: rel err {e:.3e}"
        _replay_equals_eager(moe, xd, ld, out)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_code_and_wide_scales_on_the_tensor_core_decode(rng, fmt, dtype):
    """Every e2m1 code (subnormal ±0.5 and both zeros included) in every lane position, with MXFP4
    scales from 2^-20 to 2^4 (float16's products stay normal or exact subnormal), through the tiled
    decode engine: the layer equals the reference."""
    from qmoe_rtc.executor import QMoE

    E, H, I = 4, 256, 128
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype=dtype, format=fmt, bias=True, activation_type="silu")
    for p, (N, K) in (("fc1", (I, H)), ("fc2", (H, I))):
        w[f"{p}_experts_weights"] = rng.integers(0, 256, size=(E, N, K // 2), dtype=np.uint8)
        if fmt == "mxfp4":
            w[f"{p}_scales"] = rng.integers(127 - 20, 127 - 8, size=w[f"{p}_scales"].shape, dtype=np.uint8)
            w[f"{p}_scales"][0, :2] = 127 + 4 if p == "fc2" else 127 - 20
    w["fc1_experts_weights"][0, 0, :8] = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], np.uint8)
    moe = QMoE(**to_dev(w), **a)
    assert moe.tiled
    for rows in (1, 3):
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        got, _ = _run(moe, x, lg)
        e = rel_err(got, reference(x, lg, **w, **a))
        assert e <= TOL[dtype], f"{fmt} {dtype} rows={rows}: rel err {e:.3e}"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dequant_kernel_fp4_is_bit_exact(rng, fmt, dtype):
    """The dequant family on an FP4 projection == T(e2m1(code) · float32 block scale), every code."""
    import cupy as cp
    import ml_dtypes

    from qmoe_rtc.formats import weight_format
    from qmoe_rtc.formats.fp4 import decode_e2m1, engine_scales
    from qmoe_rtc.formats.quantize import unpack_codes
    from qmoe_rtc.kernels.dequant import dequantize_experts

    np_t = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
    E, N, K = 3, 40, 256
    bs = weight_format(fmt).scale.block
    packed = rng.integers(0, 256, size=(E, N, K // 2), dtype=np.uint8)
    raw = (rng.integers(127 - 12, 127 - 2, size=(E, N, K // bs), dtype=np.uint8) if fmt == "mxfp4"
           else rng.integers(0x20, 0x50, size=(E, N, K // bs), dtype=np.uint8))
    g = np.full(E, 0.5, np.float32) if fmt == "nvfp4" else None
    s32 = engine_scales(fmt, raw, g)
    want = (decode_e2m1(unpack_codes(packed, 4, K)) * np.repeat(s32, bs, axis=2)).astype(np_t)
    out_dt = cp.uint16 if dtype == "bfloat16" else np_t
    out = cp.full((E, N, K), np.array(np.nan, np_t).view(np.uint16) if dtype == "bfloat16" else np.nan, dtype=out_dt)
    dequantize_experts(cp.asarray(packed), cp.asarray(s32), 4, block_size=bs, dtype=dtype, out=out, format=fmt)
    got = cp.asnumpy(out)
    got = got.view(np_t) if dtype == "bfloat16" else got
    assert not np.isnan(got.astype(np.float32)).any(), "unwritten output elements"
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
