"""GPU: expert slices [ext] — R slices of one layer, summed, equal the whole layer on every engine, graph
replay included; the torch.distributed wrapper on a one-rank group (skipped without a GPU).

The partial outputs are in the activation dtype T, so the sum of R slices rounds R times instead of
once: each slice is held to the tolerance of docs/contract.md against its own float64 part, the sum
to R times it against the whole layer (docs/contract.md, "Expert slices").
"""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.contract.slices import even_split
from qmoe_rtc.settings import knobs

from support.ext_layers import engines, to_dev
from support.gpu_checks import TOL, rel_err

pytestmark = pytest.mark.gpu

EXPERT_AXIS = tuple(f"{p}_{t}" for p in ("fc1", "fc2", "fc3")
                    for t in ("experts_weights", "scales", "zero_points", "experts_bias", "global_scale"))


def take(w: dict, experts) -> dict:
    idx = np.asarray(list(experts))
    return {n: (v[idx] if n in EXPERT_AXIS and v is not None else v) for n, v in w.items()}


CASES = [
    ("b4-bs64-swiglu1", dict(bits=4, block_size=64, activation_type="swiglu", swiglu_fusion=1, bias=True), 16, 4),
    ("b8-zp-silu-fc3", dict(bits=8, zero_points=True, activation_type="silu", fc3=True), 8, 2),
]


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name, kw, E, k", CASES, ids=[c[0] for c in CASES])
def test_slices_sum_to_the_whole_layer_on_every_engine(rng, name, kw, E, k, dtype, R):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    H, I = 256, 128  # noqa: E741
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    for path, knob, pipeline in engines(dtype):
        limit = 10**6 if path == "decode" else 0
        with knobs.scope(**knob):
            whole = QMoE(decode_max_routes=limit, **to_dev(w), **a)
            parts = []
            for r in range(R):
                e0, e1 = even_split(E, R, r)
                parts.append(QMoE(decode_max_routes=limit, **to_dev(take(w, range(e0, e1))), **a,
                                  expert_range=(e0, e1), num_experts=E))
            for rows in (1, 5) if path == "decode" else (64, 333):
                x, lg, _ = random_inputs(rng, rows, H, E, dtype)
                xd, ld = cp.asarray(x), cp.asarray(lg)
                want = reference(x, lg, **w, **a)
                total = np.zeros(x.shape, np.float64)
                for r, p in enumerate(parts):
                    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
                    p(xd, ld, out=out)
                    assert p.plan(rows, dtype, "float32").engine == pipeline
                    e0, e1 = even_split(E, R, r)
                    part_ref = reference(x, lg, **take(w, range(e0, e1)), **a, expert_range=(e0, e1), num_experts=E)
                    assert rel_err(cp.asnumpy(out), part_ref) <= TOL[dtype], (name, pipeline, rows, r)
                    total += cp.asnumpy(out).astype(np.float64)
                assert rel_err(total, want) <= TOL[dtype] * R, (name, pipeline, rows)
                assert rel_err(cp.asnumpy(whole(xd, ld)), want) <= TOL[dtype]


def test_map_slice_with_shared_experts_and_graph_replay(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, H, I, k, dtype = 8, 256, 128, 2, "bfloat16"  # noqa: E741
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, bits=4, block_size=128, activation_type="swiglu",
                        swiglu_fusion=1)
    sw, _ = random_layer(rng, E=1, H=H, I=I, k=1, dtype=dtype, bits=4, block_size=128, activation_type="swiglu",
                         swiglu_fusion=1)
    shared = {f"shared_{n}": v for n, v in sw.items() if n.startswith(("fc1_", "fc2_")) and v is not None}
    held = [[5, 0, 2, 7], [1, 3, 4, 6]]
    for rows in (3, 200):
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        want = reference(x, lg, **w, **a, **shared)
        total = np.zeros(x.shape, np.float64)
        for i, experts in enumerate(held):
            m = np.full(E, -1, dtype=np.int32)
            m[experts] = np.arange(len(experts), dtype=np.int32)
            ext = shared if i == 0 else {}
            moe = QMoE(**to_dev(take(w, experts)), **a, **to_dev(ext), expert_map=m)
            xd, ld = cp.asarray(x), cp.asarray(lg)
            out = cp.full(x.shape, cp.nan, dtype=x.dtype)
            graph = moe.capture(xd, ld, out=out)
            graph.replay()
            cp.cuda.Device().synchronize()
            eager = moe(xd, ld)
            assert cp.array_equal(out.view(cp.uint16), eager.view(cp.uint16))
            total += cp.asnumpy(out).astype(np.float64)
        assert rel_err(total, want) <= 2 * TOL[dtype], rows


def test_distributed_wrapper_on_one_rank_equals_the_layer_and_captures(rng, tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from qmoe_rtc.distributed import ExpertParallelQMoE
    from qmoe_rtc.executor import QMoE

    E, H, I, k, dtype = 8, 256, 128, 2, "bfloat16"  # noqa: E741
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, bits=4, block_size=64, activation_type="swiglu",
                        swiglu_fusion=1)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ep = ExpertParallelQMoE(**to_dev(w), **a, placement=[0] * E)
        whole = QMoE(**to_dev(w), **a)
        x, lg, _ = random_inputs(rng, 4, H, E, dtype)
        xt = torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16).cuda()
        lt = torch.from_numpy(lg).cuda()
        got = ep(xt, lt)
        want = whole(xt, lt)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        out = torch.empty_like(xt)
        ep(xt, lt, out=out)  # eager first: plans the layer, sets up the communicator
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ep(xt, lt, out=out)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    finally:
        dist.destroy_process_group()
