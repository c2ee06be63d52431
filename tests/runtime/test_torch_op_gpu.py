"""qmoe_rtc.torch on the GPU: a torch model calling a real layer through the custom op ``qmoe_rtc::moe`` (linear ->
the op -> linear), under ``torch.compile(fullgraph=True)`` (default Inductor, and ``mode="reduce-overhead"``: its
CUDA graphs) and captured eagerly in ``torch.cuda.graph``.

What is compared, and how exactly: graph replay against eager is bitwise (the same kernels on the same inputs; every
output the graph writes is poisoned with NaN before each replay). A compiled model against eager is held to the
layer's tolerance (:data:`support.gpu_checks.TOL`), because Inductor may run the linear layers as other cuBLAS calls
than eager does, which can move the op's input by an ulp; the op itself is bitwise: its output in the compiled graph
equals the layer called directly on the input the graph gave it."""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.errors import QMoEInputError

from support.gpu_checks import TOL, rel_err, to_dev

pytestmark = pytest.mark.gpu

H, I, E = 256, 128, 32


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _layer(rng, dtype):
    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=E, H=H, I=I, k=4, bits=4, block_size=128, dtype=dtype, activation_type="swiglu",
                        swiglu_fusion=1, normalize_routing_weights=1)
    return QMoE(**to_dev(w), **a)  # CuPy weights (NumPy bfloat16 does not convert to torch); torch calls


def _model(torch, layer, dtype):
    import qmoe_rtc.torch as qt

    class Block(torch.nn.Module):
        """linear -> the layer -> linear; returns the op's input and output too, to check the op on its own."""

        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(H, H, bias=False)
            self.moe = qt.MoEModule(layer)
            self.down = torch.nn.Linear(H, H, bias=False)

        def forward(self, x, logits):
            h = self.up(x)  # [rows, H]
            y = self.moe(h, logits)  # [rows, H], the input's dtype
            return self.down(y), h, y

    return Block().to(device="cuda", dtype=getattr(torch, dtype))


def _inputs(torch, rng, rows, dtype):
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    x = torch.randn(rows, H, device="cuda", dtype=getattr(torch, dtype), generator=g)  # [rows, H]
    return x, 2 * torch.randn(rows, E, device="cuda", generator=g)  # logits [rows, E] float32


def _err(got, want) -> float:
    return rel_err(got.float().cpu().numpy(), want.float().cpu().numpy().astype(np.float64))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compile_fullgraph_matches_eager(rng, torch, dtype):
    """Decode and prefill row counts through one compiled model (the second count recompiles with dynamic rows)."""
    layer = _layer(rng, dtype)
    model = _model(torch, layer, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for rows in (1, 8, 300):
            x, lg = _inputs(torch, rng, rows, dtype)
            out_c, h_c, y_c = compiled(x, lg)
            assert torch.equal(y_c, layer(h_c, lg)), rows  # the op in the compiled graph = the layer, bitwise
            out_e, _, y_e = model(x, lg)
            assert _err(y_c, y_e) <= TOL[dtype] and _err(out_c, out_e) <= TOL[dtype], rows
    torch._dynamo.reset()


def test_cuda_graph_of_the_eager_model_replays_bitwise(rng, torch):
    dtype, rows = "float16", 8
    layer = _layer(rng, dtype)
    model = _model(torch, layer, dtype)
    xs, ls = _inputs(torch, rng, rows, dtype)  # the graph's static inputs
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # torch's usual warm-up; it also plans the layer at this batch size
            model(xs, ls)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = model(xs, ls)  # (out, h, y), allocated in the graph's pool
        for _ in range(3):
            x, lg = _inputs(torch, rng, rows, dtype)
            xs.copy_(x)
            ls.copy_(lg)
            for t in outs:
                t.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            want = model(x, lg)
            for got, w in zip(outs, want):
                assert torch.equal(got, w)


def test_compile_reduce_overhead_replays_its_graphs(rng, torch):
    """``mode="reduce-overhead"``: Inductor's CUDA graphs (a warm-up run, a recording, then replays) around the op."""
    dtype, rows = "bfloat16", 8
    layer = _layer(rng, dtype)
    model = _model(torch, layer, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(5):
            x, lg = _inputs(torch, rng, rows, dtype)
            out_c, h_c, y_c = compiled(x, lg)
            assert torch.equal(y_c, layer(h_c, lg))  # read before the next replay overwrites the graph's outputs
            out_e, _, y_e = model(x, lg)
            assert _err(y_c, y_e) <= TOL[dtype] and _err(out_c, out_e) <= TOL[dtype]
    torch._dynamo.reset()


def test_reserve_then_capture_with_no_eager_call(rng, torch):
    """``MoEModule.reserve`` plans every batch size up to max_rows on torch's current stream: a capture at any of
    them then needs no eager call first; replay = eager, bitwise, into a poisoned output."""
    import qmoe_rtc.torch as qt

    layer = _layer(rng, "float16")
    m = qt.MoEModule(layer)
    m.reserve(16, torch.float16)
    for rows in (3, 16):
        xs, ls = _inputs(torch, rng, rows, "float16")
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            ys = m(xs, ls)
        x, lg = _inputs(torch, rng, rows, "float16")
        xs.copy_(x)
        ls.copy_(lg)
        ys.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(ys, layer(x, lg))


def test_the_layers_own_checks_come_through_the_op(rng, torch):
    import qmoe_rtc.torch as qt

    layer = _layer(rng, "float16")
    m = qt.MoEModule(layer)
    x, lg = _inputs(torch, rng, 3, "float16")
    with pytest.raises(QMoEInputError, match="input 'input'"):  # H = 256 expected
        m(torch.zeros(3, H + 32, device="cuda", dtype=torch.float16), lg)
    with pytest.raises(QMoEInputError, match="input 'router_probs'"):  # E = 32 expected
        m(x, torch.zeros(3, E + 1, device="cuda"))
    with pytest.raises(QMoEInputError, match="input 'input'"):  # the layer's scales are float16
        m(x.bfloat16(), lg)
    assert torch.equal(m(x, lg), layer(x, lg))
