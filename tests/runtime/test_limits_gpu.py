"""The limits of this build at their edges, on the GPU: k up to 32 and E = 512 (docs/contract.md,
"Limits of this build"; the attribute check used to stop at k = 10), every engine of both paths
against the float64 reference. Skipped without a GPU; on the CPU tests/runtime/test_errors.py checks that
k = 33 and E = 513 are refused before the GPU."""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference

pytestmark = pytest.mark.gpu

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}

# (random_layer kwargs, E, H, I, dtype): tensor-core engines (f16/bf16, 4-bit) and SIMT ones (I not a multiple
# of 32, f32)
CASES = [
    (dict(k=16, bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=1), 64, 128, 64, "float16"),
    (dict(k=32, bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=1), 512, 128, 64, "bfloat16"),
    (dict(k=32, bits=3, block_size=0, zero_points=True, activation_type="silu"), 40, 128, 48, "float16"),
    (dict(k=24, bits=8, block_size=0, activation_type="relu"), 512, 64, 32, "float32"),
]


@pytest.mark.parametrize("kw, E, H, I, dtype", CASES, ids=[f"k{c[0]['k']}-E{c[1]}-b{c[0]['bits']}-{c[4]}" for c in CASES])
@pytest.mark.parametrize("decode_max_routes", [0, 512], ids=["prefill", "decode"])
def test_large_k_and_e_vs_reference(rng, kw, E, H, I, dtype, decode_max_routes):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, normalize_routing_weights=1, **kw)
    moe = QMoE(**{n: cp.asarray(v) for n, v in w.items()}, **a, decode_max_routes=decode_max_routes)
    for rows in (1, 5, 16):
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        want = reference(x, lg, **w, **a).astype(np.float64)
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
        got = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg), out=out)).astype(np.float64)
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= TOL[dtype], f"k={k} E={E} rows={rows}: rel err {err:.3e}"
