"""GPU: checkpoints of grouped sigmoid routers (tests/checkpoints/test_checkpoints_grouped.py writes them: DeepSeek-V3's
FP8 blocks, Kimi-K2's compressed-tensors int4, GLM-4.5 / GLM-4.5V AWQ, each with its e_score_correction_bias and a
shared expert) loaded and run as ``QMoE(**layer.weights, **layer.attributes)`` in bfloat16 against the float64
reference at 1, 8 and 300 rows, outputs poisoned with NaN first, graph replay equal to the eager call bit for bit;
and with the checkpoint's router linear inside the layer. Rows whose routing choice float32 rounding may change
(near ties, tests/support/grouped_routing.py) are left out of the comparison and must be few."""

from __future__ import annotations

import numpy as np
import pytest
from test_checkpoints_grouped import STYLES, E, H, write_grouped

from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs
from qmoe_rtc.contract.reference import qmoe as reference

from support.gpu_checks import TOL, rel_err
from support.grouped_routing import near_tie_rows

pytest.importorskip("safetensors")
pytestmark = pytest.mark.gpu

DTYPE = "bfloat16"


def _compare(got, want, near, label):
    """rel err over the rows without near ties."""
    keep = ~near
    if keep.any():
        e = rel_err(np.asarray(got)[keep], np.asarray(want)[keep])
        assert e <= TOL[DTYPE], f"{label}: rel err {e:.3e}"


#: (style, prepack): DeepSeek-V3's float32 FP8 scales keep the codes in the contract layout by default (the SIMT
#: engines, float32 activations allowed); prepack='on' tiles them for the tensor-core engines (16-bit calls only)
CASES = [(s, None) for s in sorted(STYLES)] + [("deepseek_v3", "on")]


@pytest.mark.parametrize("style, prepack", CASES, ids=[f"{s}-{p or 'auto'}" for s, p in CASES])
def test_grouped_checkpoints_run_as_loaded(tmp_path, rng, style, prepack):
    import cupy as cp

    from qmoe_rtc.checkpoints import load_layer
    from qmoe_rtc.executor import QMoE

    write_grouped(tmp_path, rng, style)
    layer = load_layer(tmp_path, 2)
    w, a = layer.weights, layer.attributes
    attrs = QMoEAttributes.from_kwargs(**a)
    moe = QMoE(**w, **a, prepack=prepack)
    assert moe.tiled == (prepack == "on" or style != "deepseek_v3")
    near_rows = total = 0
    for rows in (1, 8, 300):
        x, lg, _ = random_inputs(rng, rows, H, E, DTYPE)
        near = near_tie_rows(lg, w["router_score_bias"], attrs)
        near_rows, total = near_rows + int(near.sum()), total + rows
        xd, ld = cp.asarray(x), cp.asarray(lg)
        got = cp.asnumpy(moe(xd, ld, out=cp.full(x.shape, cp.nan, dtype=xd.dtype)))
        assert np.isfinite(got.astype(np.float32)).all()  # every element written
        _compare(got, reference(x, lg, **w, **a), near, f"{style} rows={rows} ({moe.plan(rows, DTYPE).engine})")
        graph = moe.capture(xd, ld, out=cp.full(x.shape, cp.nan, dtype=xd.dtype))
        graph.replay()
        eager = moe(xd, ld)
        cp.cuda.Device().synchronize()
        assert cp.array_equal(graph.output.view(cp.uint16), eager.view(cp.uint16)), f"{style} rows={rows}"
    assert near_rows <= 0.05 * total, f"{near_rows} of {total} rows are near ties"


@pytest.mark.parametrize("style", ["deepseek_v3", "kimi_k2"])
def test_grouped_checkpoints_with_their_router_inside(tmp_path, rng, style):
    """The checkpoint's bfloat16 router linear as ``router_weight``: the layer computes the logits (near ties
    judged on float64 logits, with the router GEMM's rounding as the tolerance)."""
    import cupy as cp

    from qmoe_rtc.checkpoints import load_layer
    from qmoe_rtc.executor import QMoE

    write_grouped(tmp_path, rng, style)
    layer = load_layer(tmp_path, 1)
    w, a, rw = layer.weights, layer.attributes, layer.router_weight
    assert str(rw.dtype) == DTYPE
    attrs = QMoEAttributes.from_kwargs(**a)
    moe = QMoE(**w, **a, router_weight=rw)
    for rows in (1, 300):
        x = random_inputs(rng, rows, H, E, DTYPE)[0]
        lg = (x.astype(np.float64) @ rw.astype(np.float64).T).astype(np.float32)
        near = near_tie_rows(lg, w["router_score_bias"], attrs, 1e-4)
        assert near.sum() <= max(1, 0.05 * rows), f"{near.sum()} of {rows} rows are near ties"
        got = cp.asnumpy(moe(cp.asarray(x), None))
        _compare(got, reference(x, None, **w, **a, router_weight=rw), near, f"{style} router rows={rows}")
