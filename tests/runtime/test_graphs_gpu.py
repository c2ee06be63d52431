"""Serving integration on the GPU: the layer inside the caller's own graph capture (torch.cuda.graph,
CuPy stream capture), QMoE.capture on the caller's arrays, one scratch pool for graphs of several
batch sizes, two streams at once, and a tuning knob changed inside one process."""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference

from support.gpu_checks import TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

H, I, E = 256, 128, 32


def _layer(rng, dtype="float16", **kw):
    return random_layer(rng, E=E, H=H, I=I, k=4, bits=4, block_size=128, dtype=dtype, activation_type="swiglu",
                        swiglu_fusion=1, normalize_routing_weights=1, **kw)


@pytest.mark.parametrize("rows", [1, 8, 300])  # decode and prefill
def test_torch_cuda_graph_of_the_layer_replays_rewritten_inputs(rng, rows):
    torch = pytest.importorskip("torch")
    from qmoe_rtc.executor import QMoE

    w, a = _layer(rng)
    moe = QMoE(**{n: torch.from_numpy(v).cuda() for n, v in w.items()}, **a)
    x0, l0, _ = random_inputs(rng, rows, H, E, "float16")
    x, lg = torch.from_numpy(x0).cuda(), torch.from_numpy(l0).cuda()
    o = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual warm-up before torch.cuda.graph
        moe(x, lg, out=o)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe(x, lg, out=o)
        o.mul_(1.0)  # something of torch's own in the same graph
    for _ in range(2):
        xn, ln, _ = random_inputs(rng, rows, H, E, "float16")
        x.copy_(torch.from_numpy(xn))
        lg.copy_(torch.from_numpy(ln))
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(o.cpu().numpy(), reference(xn, ln, **w, **a)) <= TOL["float16"]


def test_cupy_stream_capture_of_the_layer(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = _layer(rng)
    moe = QMoE(**to_dev(w), **a)
    x0, l0, _ = random_inputs(rng, 5, H, E, "float16")
    x, lg = cp.asarray(x0), cp.asarray(l0)
    o = cp.empty_like(x)
    moe(x, lg, out=o)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        moe(x, lg, out=o)
        graph = s.end_capture()
    xn, ln, _ = random_inputs(rng, 5, H, E, "float16")
    with s:  # written on the replay's stream (a non-blocking one does not wait for the default stream)
        x[...] = cp.asarray(xn)
        lg[...] = cp.asarray(ln)
        o.fill(cp.nan)
        graph.launch(s)
    s.synchronize()
    assert rel_err(cp.asnumpy(o), reference(xn, ln, **w, **a)) <= TOL["float16"]


@pytest.mark.parametrize("rows", [2, 300])
def test_capture_records_on_the_callers_arrays(rng, rows):
    """capture() makes no copies: values written into the arrays it was given are what replay reads."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = _layer(rng)
    moe = QMoE(**to_dev(w), **a)
    x0, l0, _ = random_inputs(rng, rows, H, E, "float16")
    x, lg = cp.asarray(x0), cp.asarray(l0)
    g = moe.capture(x, lg)
    assert g.input is x and g.router_probs is lg
    for _ in range(2):
        xn, ln, _ = random_inputs(rng, rows, H, E, "float16")
        x[...] = cp.asarray(xn)
        lg[...] = cp.asarray(ln)
        g.output.fill(cp.nan)
        y = cp.asnumpy(g.replay()).copy()
        eager = cp.asnumpy(moe(x, lg))
        np.testing.assert_array_equal(y, eager)
        assert rel_err(y, reference(xn, ln, **w, **a)) <= TOL["float16"]


def test_reserve_serves_graphs_of_many_batch_sizes_on_one_pool(rng, monkeypatch):
    """reserve() plans every size with one batch of loads (its pieces side by side), then graphs of those sizes
    capture on its one pool and replay to the reference."""
    torch = pytest.importorskip("torch")
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.runtime import plan as plan_mod

    w, a = _layer(rng, dtype="bfloat16")
    moe = QMoE(**to_dev(w), **a)  # CuPy weights (bfloat16 scales), torch inputs
    sizes = (1, 2, 4, 8, 16, 64, 160)
    batches, real = [], plan_mod.load_modules
    monkeypatch.setattr(plan_mod, "load_modules", lambda *args, **kw: batches.append(args[0]) or real(*args, **kw))
    moe.reserve(max(sizes))
    assert len(batches) == 1 and len(moe._plans) == max(sizes)  # decode and prefill modules in one batch
    graphs = {}
    for rows in sizes:  # no eager call at any of these sizes: reserve() planned and sized them all
        x0, l0, _ = random_inputs(rng, rows, H, E, "bfloat16")
        x = torch.from_numpy(x0.astype(np.float32)).cuda().bfloat16()  # exact: x0 holds bfloat16 values
        lg = torch.from_numpy(l0).cuda()
        o = torch.empty_like(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            moe(x, lg, out=o)
        graphs[rows] = (g, x, lg, o, reference(x0, l0, **w, **a))  # a graph's inputs must outlive it
    assert len(moe._pools) == 1  # every graph recorded on the reserved pool
    for rows, (g, _x, _lg, o, want) in graphs.items():
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(o.float().cpu().numpy(), want) <= TOL["bfloat16"], rows


def test_two_streams_at_once_do_not_share_scratch(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = _layer(rng)
    moe = QMoE(**to_dev(w), **a)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    cases = []
    for rows in (3, 200):
        for s in streams:
            x, lg, _ = random_inputs(rng, rows, H, E, "float16")
            cases.append((s, cp.asarray(x), cp.asarray(lg), reference(x, lg, **w, **a)))
    cp.cuda.Device().synchronize()  # the inputs' copies (default stream) done before the non-blocking streams read them
    for s, x, lg, _ in cases:  # plan and size each stream's pool
        with s:
            moe(x, lg)
    for s in streams:
        s.synchronize()
    outs = []
    for _ in range(20):  # interleaved, never synchronised: each stream's forwards overlap the other's
        for s, x, lg, _ in cases:
            with s:
                outs.append(moe(x, lg))
    for s in streams:
        s.synchronize()
    assert len(moe._pools) == 2
    for i, y in enumerate(outs):
        assert rel_err(cp.asnumpy(y), cases[i % len(cases)][3]) <= TOL["float16"]


def test_changing_a_tuning_knob_in_process_loads_the_matching_module(rng):
    """Used to return the old cubin while the launch sized shared memory from the new knob value."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.jit import load_module
    from qmoe_rtc.kernels import get_family
    from qmoe_rtc.settings import knobs

    w, a = _layer(rng)
    x, lg, _ = random_inputs(rng, 4, H, E, "float16")
    want = reference(x, lg, **w, **a)
    keys = []
    for stages in (4, 3, 2):
        with knobs.scope(mma_stages=stages):
            moe = QMoE(**to_dev(w), **a, decode_max_routes=512)  # the decode engine at 4 tokens, whatever the device
            out = cp.full(x.shape, cp.nan, dtype=x.dtype)
            moe(cp.asarray(x), cp.asarray(lg), out=out)
            cp.cuda.get_current_stream().synchronize()
        step = next(s for s in moe.plan(4, "float16").steps if s.family == "mma_decode")
        module = load_module(get_family("mma_decode").unit(step.spec), moe.device_id, {step.kernel.key})  # the one in use
        assert step.kernel is module[step.kernel.key]
        assert all(f"-DQMOE_MMA_STAGES={stages}" in part.options for part in module.parts)
        keys.append(step.launch.shared_mem)
        assert rel_err(cp.asnumpy(out), want) <= TOL["float16"], stages
    assert len(set(keys)) == 3  # each plan's shared memory follows its own module's ring depth
