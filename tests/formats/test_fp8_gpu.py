"""FP8 (float8 e4m3fn) experts on the GPU engines vs the float64 reference (skipped without a GPU).

The whole layer ``QMoE(quant_type="fp8", ...)`` on fresh random data: the per-expert global scale and
square block scales (128, 64 and 16, with K and N not multiples of the block: partial blocks),
float16 / bfloat16 on every tensor-core engine (decode mma.sync, prefill mma.sync, prefill wgmma on
sm_90), float32 and shapes that are not multiples of 32 on the SIMT engines; decode rows 1, 2, 8 and
prefill rows 64, 512, 4096. Outputs are NaN-poisoned before each call; a graph replay must equal
the eager call bitwise; a NaN code (0x7F / 0xFF) in one expert gives NaN in exactly the rows routed
to it. The dequant kernel is checked bit for bit against qmoe_rtc.formats.fp8.
"""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.formats.fp8 import decode_e4m3fn, fp8_scale_shape
from qmoe_rtc.settings import knobs

from support.gpu_checks import TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

FP8_MIN_CC = 89  # the tensor-core engines' e4m3 conversion (kernels/arch.py FP8_MIN_CC)


def _cc() -> int:
    import cupy as cp

    return int(cp.cuda.Device().compute_capability)


# (name, random_layer kwargs, E, H, I): H is FC1's K and FC2's N, I FC2's K (FC1's N is F·I)
LAYERS = [
    ("global-swiglu1", dict(block_size=0, activation_type="swiglu", swiglu_fusion=1, k=4), 16, 256, 128),
    ("bs128-silu-bias-partial", dict(block_size=128, activation_type="silu", k=2, bias=True), 8, 320, 192),
    ("bs64-swiglu2-partial", dict(block_size=64, activation_type="swiglu", swiglu_fusion=2, k=2, swiglu_limit=7.0,
                                  activation_alpha=1.702, activation_beta=1.0), 8, 160, 96),
    ("bs16-gelu", dict(block_size=16, activation_type="gelu", k=2), 8, 128, 64),
    ("bs128-f32-scales-swiglu1", dict(block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2,
                                      scale_dtype="float32"), 8, 256, 256),
]
DECODE_ROWS = (1, 2, 8)
PREFILL_ROWS = (64, 512, 4096)
# engine -> (QMoE decode_max_routes, tuning knob prefill_engine, rows)
ENGINES = {
    "decode-mma": (512, "auto", DECODE_ROWS),
    "prefill-mma": (0, "mma", PREFILL_ROWS),
    "prefill-wgmma": (0, "wgmma", PREFILL_ROWS),
}


@pytest.fixture(params=sorted(ENGINES))
def engine(request):
    """Each test once per tensor-core engine (the knob forces the prefill one); FP8 needs sm_89+ there,
    wgmma sm_90."""
    cc = _cc()
    if cc < FP8_MIN_CC:
        pytest.skip(f"FP8 on the tensor-core engines needs sm_{FP8_MIN_CC}+ (this GPU: sm_{cc})")
    if request.param == "prefill-wgmma" and cc != 90:
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    limit, knob, rows = ENGINES[request.param]
    with knobs.scope(prefill_engine=knob):
        yield request.param, limit, rows


def _layer(rng, kw, E, H, I, dtype):
    kw = dict(kw)
    k = kw.pop("k")
    return random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, format="fp8_e4m3", **kw)


def _run(moe, x, lg):
    """The layer on fresh device copies of x / lg into a NaN-poisoned output (host result, and the
    device arrays for a capture)."""
    import cupy as cp

    xd, ld = cp.asarray(x), cp.asarray(lg)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    got = moe(xd, ld, out=out)
    assert got is out
    return cp.asnumpy(out), (xd, ld, out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, kw, E, H, I", LAYERS, ids=[c[0] for c in LAYERS])
def test_fp8_tensor_core_engines_vs_reference(rng, name, kw, E, H, I, dtype, engine):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    want_engine, limit, rows_list = engine
    w, a = _layer(rng, kw, E, H, I, dtype)
    moe = QMoE(**to_dev(w), **a, decode_max_routes=limit)
    worst = 0.0
    for rows in rows_list:
        assert moe.plan(rows, dtype, "float32").engine == want_engine, (name, rows)
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        got, (xd, ld, out) = _run(moe, x, lg)
        e = rel_err(got, reference(x, lg, **w, **a))
        worst = max(worst, e)
        assert e <= TOL[dtype], f"{name} {dtype} {want_engine} rows={rows}: rel err {e:.3e}"
    g = moe.capture(xd, ld)  # the last shape: replay equals the eager call bitwise
    g.output.fill(cp.nan)
    g.replay()
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(g.output).view(np.uint16), cp.asnumpy(out).view(np.uint16))
    print(f"fp8 {want_engine} {name} {dtype}: worst rel err {worst:.3e}")


# The SIMT engines: float32 activations (gemv's 16-byte chunk path, the grouped float32 GEMM) and
# shapes that are not multiples of 32 (gemv's byte-wise groups, a partial last group of 8).
SIMT_LAYERS = [
    ("f32-global-swiglu1", dict(block_size=0, activation_type="swiglu", swiglu_fusion=1, k=4), 16, 256, 128,
     "float32"),
    ("f32-bs64-silu-bias-partial", dict(block_size=64, activation_type="silu", k=2, bias=True), 8, 160, 96, "float32"),
    ("f32-bs16-gelu", dict(block_size=16, activation_type="gelu", k=2), 8, 128, 64, "float32"),
    ("f16-unaligned-bs32-swiglu2", dict(block_size=32, activation_type="swiglu", swiglu_fusion=2, k=2), 8, 100, 36,
     "float16"),
    ("bf16-unaligned-global-relu", dict(block_size=0, activation_type="relu", k=2), 8, 144, 84, "bfloat16"),
]


@pytest.mark.parametrize("name, kw, E, H, I, dtype", SIMT_LAYERS, ids=[c[0] for c in SIMT_LAYERS])
def test_fp8_simt_engines_vs_reference(rng, name, kw, E, H, I, dtype):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = _layer(rng, kw, E, H, I, dtype)
    dev = to_dev(w)
    for engine, limit, rows_list in (("decode-gemv", 512, DECODE_ROWS), ("prefill-simt", 0, PREFILL_ROWS)):
        moe = QMoE(**dev, **a, decode_max_routes=limit)
        for rows in rows_list:
            assert moe.plan(rows, dtype, "float32").engine == engine, (name, rows)
            x, lg, _ = random_inputs(rng, rows, H, E, dtype)
            got, (xd, ld, out) = _run(moe, x, lg)
            e = rel_err(got, reference(x, lg, **w, **a))
            assert e <= TOL[dtype], f"{name} {engine} rows={rows}: rel err {e:.3e}"
        g = moe.capture(xd, ld)
        g.output.fill(cp.nan)
        g.replay()
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(cp.asnumpy(g.output).view(np.uint8), cp.asnumpy(out).view(np.uint8))


def test_fp8_below_sm89_runs_the_simt_engines(rng):
    """On sm_80 .. sm_88 the tensor-core engines refuse FP8 (saying so) and the SIMT ones compute it."""
    import cupy as cp  # noqa: F401

    from qmoe_rtc.executor import QMoE

    cc = _cc()
    if cc >= FP8_MIN_CC:
        pytest.skip(f"this GPU (sm_{cc}) runs FP8 on the tensor-core engines")
    w, a = _layer(rng, dict(block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2), 8, 256, 128, "float16")
    moe = QMoE(**to_dev(w), **a)
    for rows, engine in ((2, "decode-gemv"), (512, "prefill-simt")):
        choice = moe.engine_for(rows, "float16")
        assert choice.pipeline.name == engine and any("sm_89" in why for _, why in choice.skipped)
        x, lg, _ = random_inputs(rng, rows, 256, 8, "float16")
        got, _ = _run(moe, x, lg)
        assert rel_err(got, reference(x, lg, **w, **a)) <= TOL["float16"]


def _all_engines():
    """(engine, decode_max_routes, prefill knob, rows) for every engine this GPU runs FP8 on."""
    cc = _cc()
    out = [("decode-gemv", 512, "auto", 8, "float32"), ("prefill-simt", 0, "auto", 64, "float32")]
    if cc >= FP8_MIN_CC:
        out += [("decode-mma", 512, "auto", 8, "bfloat16"), ("prefill-mma", 0, "mma", 64, "float16")]
    if cc == 90:
        out.append(("prefill-wgmma", 0, "wgmma", 64, "bfloat16"))
    return out


@pytest.mark.parametrize("proj, code", [("fc1", 0x7F), ("fc2", 0xFF)])
def test_a_nan_code_poisons_exactly_the_rows_routed_to_its_expert(rng, proj, code):
    """One NaN code in expert 5: FC2 row n -> column n of the rows routed to 5 is NaN; FC1 row n (with
    the identity activation, which keeps the NaN) -> those rows are NaN everywhere. Nothing else is."""
    from qmoe_rtc.executor import QMoE

    E, H, I, hot, n = 8, 256, 128, 5, 37
    for engine, limit, knob, rows, dtype in _all_engines():
        w, a = _layer(rng, dict(block_size=128, activation_type="identity" if proj == "fc1" else "silu", k=2),
                      E, H, I, dtype)
        codes = w[f"{proj}_experts_weights"].copy()
        codes[hot, n, 11] = code
        w[f"{proj}_experts_weights"] = codes
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        routed = np.arange(rows) % 3 == 1  # rows 1, 4, 7, ... take expert 5 first; the others never
        lg = lg.astype(np.float32)
        lg[:, hot] = np.where(routed, 30.0, -30.0)
        with knobs.scope(prefill_engine=knob):
            moe = QMoE(**to_dev(w), **a, decode_max_routes=limit)
            assert moe.plan(rows, dtype, "float32").engine == engine
            got, _ = _run(moe, x, lg)
        want_nan = np.zeros((rows, H), bool)
        if proj == "fc2":
            want_nan[routed, n] = True
        else:
            want_nan[routed, :] = True
        got32 = got.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got32), want_nan, err_msg=f"{engine} {proj}")
        ok = ~routed
        e = rel_err(got32[ok], reference(x, lg, **w, **a)[ok])  # the other rows are still right
        assert e <= TOL[dtype], f"{engine} {proj}: rel err {e:.3e} on the rows not routed to expert {hot}"


def test_float8_arrays_are_read_as_their_codes(rng):
    """Weights given as float8_e4m3fn arrays (NumPy via ml_dtypes, uploaded; torch CUDA tensors, read in
    place) run as their uint8 codes: the same output bit for bit."""
    import cupy as cp
    import ml_dtypes

    from qmoe_rtc.executor import QMoE

    E, H, I = 8, 256, 128
    w, a = _layer(rng, dict(block_size=128, activation_type="swiglu", swiglu_fusion=1, k=2), E, H, I, "bfloat16")
    x, lg, _ = random_inputs(rng, 5, H, E, "bfloat16")
    want, _ = _run(QMoE(**to_dev(w), **a), x, lg)
    f8 = {n: v.view(ml_dtypes.float8_e4m3fn) if n.endswith("_weights") else v for n, v in w.items()}
    got, _ = _run(QMoE(**f8, **a), x, lg)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    torch = pytest.importorskip("torch")
    tw = {n: torch.from_numpy(v).cuda().view(torch.float8_e4m3fn) if n.endswith("_weights") else cp.asarray(v)
          for n, v in w.items()}
    got, _ = _run(QMoE(**tw, **a), x, lg)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


# ---- the dequant kernel --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bs, scales_in", [(0, "float32"), (128, "float32"), (64, "T"), (16, "T")])
@pytest.mark.parametrize("E, N, K", [(3, 200, 136), (2, 50, 77)])  # partial blocks; K % 8 != 0
def test_dequant_kernel_fp8_is_bit_exact(rng, dtype, bs, scales_in, E, N, K):
    """dequantize_experts(format="fp8_e4m3") == T(decode_e4m3fn(codes) · scale) for every code (NaN ones too)."""
    import cupy as cp
    import ml_dtypes

    from qmoe_rtc.kernels.dequant import dequantize_experts

    np_t = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
    codes = rng.integers(0, 256, size=(E, N, K), dtype=np.uint8)
    codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every code, NaN codes included
    sdt = np.dtype(np.float32) if scales_in == "float32" else np_t
    scales = np.exp2(rng.uniform(-9.0, -3.0, size=fp8_scale_shape(E, N, K, bs))).astype(np.float32).astype(sdt)
    s32 = scales.astype(np.float32)
    full = s32.reshape(E, 1, 1) if bs == 0 else np.repeat(np.repeat(s32, bs, 1), bs, 2)[:, :N, :K]
    want = (decode_e4m3fn(codes) * full).astype(np.float32).astype(np_t)

    out_dt = cp.uint16 if dtype == "bfloat16" else np_t
    out = cp.empty((E, N, K), dtype=out_dt)
    sentinel = np.array(12288.0, np_t)  # never a result: |value| <= 448 · 2^-3
    out.fill(sentinel.view(np.uint16) if dtype == "bfloat16" else sentinel)
    s_dev = cp.asarray(scales.view(np.uint16) if sdt == np_t and dtype == "bfloat16" else scales)
    dequantize_experts(cp.asarray(codes), s_dev, 8, block_size=bs, dtype=dtype, out=out, format="fp8_e4m3")
    got = cp.asnumpy(out)
    got = got.view(np_t) if dtype == "bfloat16" else got
    g32, w32 = got.astype(np.float32), want.astype(np.float32)
    assert not (g32 == 12288.0).any(), "unwritten output elements"
    nan = (codes & 0x7F) == 0x7F
    np.testing.assert_array_equal(np.isnan(g32), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))  # bits, signed zeros too
    assert np.array_equal(g32[~nan], w32[~nan])
