"""SwiGLU with a finite ``swiglu_limit`` and NaN in FC1's output, on every engine of both paths (GPU): the
output is NaN exactly where the float64 reference's is (a NaN gate or linear value stays NaN through the
limit's clamp, docs/contract.md "What each route computes"; fminf/fmaxf used to turn it into ±limit) and
equal elsewhere within the contract's tolerance. NaN enters FC1's output three ways: an input row with a NaN
(every FC1 value of its routes), a NaN FC1 bias on a gate row of expert 0 (the gate value alone) and one
on a linear row of expert 1 (the linear value alone). Outputs are poisoned first with NaN (the finite rows
must be written) and then with a finite value (the NaN rows must be written); graph replay equals the eager
call bitwise (NaN where NaN). relu likewise (max(NaN, 0) stays NaN). The CPU side: tests/contract/test_swiglu_nan.py."""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.gpu_checks import TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

E, H, I, K = 16, 256, 128, 2
# (engine, knobs, decode_max_routes, rows, SIMT: float32 activations)
ENGINES = [
    ("decode-mma", {}, 512, (1, 8, 256), False),  # 256 rows: 512 routes, the most one decode block scans
    ("decode-gemv", {}, 512, (1, 8, 256), True),
    ("prefill-batched", {"prefill_engine": "batched"}, 0, (1, 8, 300), False),
    ("prefill-mma", {"prefill_engine": "mma"}, 0, (1, 8, 300), False),
    ("prefill-wgmma", {"prefill_engine": "wgmma"}, 0, (1, 8, 300), False),
    ("prefill-simt", {}, 0, (1, 8, 300), True),
]
# (name, random_layer kwargs, tensor-core dtype): interleaved gate rows with the limit on the gate first,
# gate-first halves with the limit after the activation
LAYERS = [
    ("swiglu1-limit7", dict(bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=1, swiglu_limit=7.0,
                            activation_alpha=1.702, activation_beta=1.0), "float16"),
    ("swiglu2-limit7-after", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=2, swiglu_limit=7.0,
                                  swiglu_limit_after_activation=1), "bfloat16"),
    # relu: max(NaN, 0) is NaN too (no gate: the two biases make outputs 0 and 1 of experts 0 and 1 NaN)
    ("relu", dict(bits=4, block_size=32, activation_type="relu"), "float16"),
]
SENTINEL = 1234.5


def _inputs(rng, rows, dtype):
    """x with NaN in rows 1, 4, 7, ...; row 0 routed first to expert 0 (its gate value NaN), row 2 to
    expert 1 (its linear value NaN); no other row routed to experts 0 or 1."""
    x, lg, _ = random_inputs(rng, rows, H, E, dtype)
    x[1::3, 5] = np.nan
    lg[:, :2] = lg.min(axis=1, keepdims=True) - 5.0
    lg[0, 0] = lg[0].max() + 5.0
    if rows > 2:
        lg[2, 1] = lg[2].max() + 5.0
    nan_rows = np.zeros(rows, bool)
    nan_rows[1::3] = nan_rows[0] = True
    nan_rows[2:3] = True
    return x, lg, nan_rows


@pytest.mark.parametrize("name, kw, tc_dtype", LAYERS, ids=[c[0] for c in LAYERS])
@pytest.mark.parametrize("engine, scope, limit, rows_list, simt", ENGINES, ids=[e[0] for e in ENGINES])
def test_swiglu_nan_rows_match_the_reference(rng, name, kw, tc_dtype, engine, scope, limit, rows_list, simt):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    if "wgmma" in engine and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    dtype = "float32" if simt else tc_dtype
    w, a = random_layer(rng, E=E, H=H, I=I, k=K, dtype=dtype, bias=True, **kw)
    w["fc1_experts_bias"][0, 0] = np.nan  # gate of output 0 (both orders put it first)
    w["fc1_experts_bias"][1, I if a.get("swiglu_fusion") == 2 else 1] = np.nan  # the linear value of output 0
    with knobs.scope(**scope):
        moe = QMoE(**to_dev(w), **a, decode_max_routes=limit)
        for rows in rows_list:
            assert moe.plan(rows, dtype, "float32").engine == engine, (name, rows)
            x, lg, nan_rows = _inputs(rng, rows, dtype)
            want = reference(x, lg, **w, **a).astype(np.float64)
            ref_nan = np.isnan(want)
            assert (ref_nan.any(axis=1) == nan_rows).all() and (ref_nan.all(axis=1) == nan_rows).all(), rows
            xd, ld = cp.asarray(x), cp.asarray(lg)
            for poison in (np.nan, SENTINEL):
                out = cp.full(x.shape, poison, dtype=x.dtype)
                got = cp.asnumpy(moe(xd, ld, out=out)).astype(np.float64)
                bad = np.argwhere(np.isnan(got) != ref_nan)
                assert bad.size == 0, f"{engine} {name} rows={rows} poison={poison}: NaN differs at {bad[:8].tolist()}"
                if (~nan_rows).any():
                    e = rel_err(got[~nan_rows], want[~nan_rows])
                    assert e <= TOL[dtype], f"{engine} {name} rows={rows}: rel err {e:.3e} of the finite rows"
            g = moe.capture(xd, ld)
            g.output.fill(cp.nan)
            g.replay()
            cp.cuda.get_current_stream().synchronize()
            # bit for bit (NaN payloads included; NumPy's comparison does not know bfloat16's NaN)
            np.testing.assert_array_equal(cp.asnumpy(g.output).view(np.uint8), cp.asnumpy(moe(xd, ld)).view(np.uint8))
