"""qmoe_rtc.torch on the CPU: the custom op ``qmoe_rtc::moe`` is registered with its schema, its fake returns the
input's shape and dtype (fake CUDA tensors and meta tensors, no GPU), ``torch.library.opcheck`` passes,
``torch.compile(fullgraph=True)`` traces a model calling it, bad input is refused with the package's typed errors,
the handle registry is weak; without torch, ``import qmoe_rtc.torch`` says how to install it. The op runs here
on a stand-in layer (a CPU function with the layer's call signature); the real layer is
``test_torch_op_gpu.py``'s."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys

import pytest

from qmoe_rtc.errors import DeviceError, QMoEInputError

H, E = 16, 4


class StandIn:
    """A layer's call contract on the CPU: writes ``out`` (the input's shape and dtype), refuses non-contiguous
    inputs and an unaligned ``input`` as the layer does (the latter inside a capture); ``out = 2·x + (first logit)``
    (+ the first router weight), so every output element depends on the inputs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input, router_probs, router_weights=None, out=None):
        self.calls += 1
        for name, t in (("input", input), ("router_probs", router_probs), ("router_weights", router_weights)):
            if t is not None and not t.is_contiguous():
                raise QMoEInputError(name, "a C-contiguous array", "a non-contiguous view")
        if input.data_ptr() % 16:
            raise QMoEInputError("input", "a 16-byte aligned array inside graph capture", "an unaligned address")
        first = router_probs[:, :1].to(input.dtype).reshape(*input.shape[:-1], 1)
        extra = 0 if router_weights is None else router_weights[:, :1].to(input.dtype).reshape(*input.shape[:-1], 1)
        out.copy_(2 * input + first + extra)
        return out


class _NoWeakRefs:
    __slots__ = ()

    def __call__(self, input, router_probs, router_weights=None, out=None):
        return out


def _expect(x, lg, rw=None):
    first = lg[:, :1].to(x.dtype).reshape(*x.shape[:-1], 1)
    return 2 * x + first + (0 if rw is None else rw[:, :1].to(x.dtype).reshape(*x.shape[:-1], 1))


@pytest.fixture
def qt():
    pytest.importorskip("torch")
    import qmoe_rtc.torch as qt

    return qt


def test_import_without_torch_names_the_extra():
    code = "import sys; sys.modules['torch'] = None\nimport qmoe_rtc.torch"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "ImportError" in r.stderr, r.stderr
    assert "pip install qmoe_rtc[torch]" in r.stderr, r.stderr


def test_the_package_and_its_entries_import_no_torch():
    """``import qmoe_rtc`` (and the layer's own modules) never import torch; only ``qmoe_rtc.torch`` does."""
    code = ("import sys, qmoe_rtc, qmoe_rtc.executor, qmoe_rtc.distributed; qmoe_rtc.QMoE\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_subpackage_does_not_shadow_torch(qt):
    import torch

    assert qt.__name__ == "qmoe_rtc.torch" and torch.__name__ == "torch" and hasattr(torch, "library")
    assert sys.modules["torch"] is torch and sys.modules["qmoe_rtc.torch"] is qt


def test_the_op_is_registered_functional_with_its_schema(qt):
    import torch

    op = torch.ops.qmoe_rtc.moe.default
    assert qt.OP_NAME == "qmoe_rtc::moe"
    assert str(op._schema) == ("qmoe_rtc::moe(Tensor input, Tensor? router_probs, Tensor? router_weights, int handle) "
                               "-> Tensor")
    assert not op._schema.is_mutable and all(a.alias_info is None for a in op._schema.arguments)


@pytest.mark.parametrize("shape", [(5, H), (2, 3, H), (0, H)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_fake_returns_the_inputs_shape_and_dtype(qt, shape, dtype):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = StandIn()
    h = qt.register(layer)
    dt = getattr(torch, dtype)
    rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
    with FakeTensorMode():  # fake CUDA tensors: nothing touches a GPU
        y = qt.moe(torch.empty(shape, dtype=dt, device="cuda"), torch.empty(rows, E, device="cuda"), h)
    assert (tuple(y.shape), y.dtype, y.device.type, y.is_contiguous()) == (shape, dt, "cuda", True)
    y = qt.moe(torch.empty(shape, dtype=dt, device="meta"), torch.empty(rows, E, dtype=dt, device="meta"), h)
    assert (tuple(y.shape), y.dtype, y.device.type) == (shape, dt, "meta")
    assert layer.calls == 0  # the fake never calls the layer


@pytest.mark.parametrize("case", ["2d", "3d", "router_weights", "bf16-logits"])
def test_opcheck(qt, case):
    """torch's own checks of a custom op: schema, autograd registration, the fake against the real output, and
    AOT dispatch with dynamic shapes."""
    import torch

    h = qt.register(layer := StandIn())
    x = torch.randn(2, 3, H) if case == "3d" else torch.randn(6, H, dtype=torch.bfloat16 if case == "bf16-logits"
                                                                 else torch.float32)
    lg = torch.randn(6, E, dtype=x.dtype)
    rw = torch.rand(6, E) if case == "router_weights" else None
    torch.library.opcheck(torch.ops.qmoe_rtc.moe.default, (x, lg, rw, h))
    assert layer.calls > 0
    assert torch.equal(qt.moe(x, lg, h, rw), _expect(x, lg, rw))


class _Block:
    """Built on first use (torch is optional): linear -> the op -> linear, returning the op's input and output too."""

    @staticmethod
    def make(qt, layer):
        import torch

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up = torch.nn.Linear(H, H, bias=False)
                self.moe = qt.MoEModule(layer)
                self.down = torch.nn.Linear(H, H, bias=False)

            def forward(self, x, logits):
                h = self.up(x)
                y = self.moe(h, logits)
                return self.down(y), h, y

        return Block()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_traces_the_op(qt, backend):
    """One graph holding the op (no break), the same results as eager on several row counts (a recompile with a
    dynamic row count on the second), and the layer called once per run."""
    import torch

    if backend == "inductor" and not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    layer = StandIn()
    model = _Block.make(qt, layer)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording)
    with torch.no_grad():
        for rows in (4, 5, 9):
            x, lg = torch.randn(rows, H), torch.randn(rows, E)
            calls = layer.calls
            out, h, y = compiled(x, lg)
            assert layer.calls == calls + 1
            assert torch.equal(y, _expect(h, lg))
            want, _, _ = model(x, lg)
            torch.testing.assert_close(out, want)
    assert graphs and all(torch.ops.qmoe_rtc.moe.default in [n.target for n in g.graph.nodes] for g in graphs)
    torch._dynamo.reset()


def test_views_and_unaligned_inputs_are_copied_first(qt):
    """The layer refuses non-contiguous views, and an unaligned input inside a capture (as QMoE does); the op hands
    it contiguous, aligned copies, as torch's own ops take any strides."""
    import torch

    layer = StandIn()  # kept: the registry holds it weakly
    h = qt.register(layer)
    x = torch.randn(H, 6).t()  # [6, H], a transposed view
    lg = torch.randn(E, 6).t()  # [6, E], likewise
    rw = torch.rand(6, 2 * E)[:, :E]  # [6, E], rows strided
    assert not (x.is_contiguous() or lg.is_contiguous() or rw.is_contiguous())
    assert torch.equal(qt.moe(x, lg, h, rw), _expect(x.contiguous(), lg, rw))
    x = torch.randn(6 * H + 1)[1:].view(6, H)  # contiguous, 4 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 == 4
    assert torch.equal(qt.moe(x, lg, h), _expect(x, lg))


def _bad_cases(torch):
    """(what, x, logits, router_weights, the error type, the input it names)."""
    f = torch.float32
    return [
        ("rank 1", torch.empty(H), torch.empty(1, E), None, QMoEInputError, "input"),
        ("rank 4", torch.empty(1, 1, 2, H), torch.empty(2, E), None, QMoEInputError, "input"),
        ("int input", torch.empty(3, H, dtype=torch.int32), torch.empty(3, E), None, QMoEInputError, "input"),
        ("float64 input", torch.empty(3, H, dtype=torch.float64), torch.empty(3, E), None, QMoEInputError, "input"),
        ("rows differ", torch.empty(3, H), torch.empty(4, E), None, QMoEInputError, "router_probs"),
        ("3-D rows differ", torch.empty(2, 3, H), torch.empty(5, E), None, QMoEInputError, "router_probs"),
        ("logits rank 3", torch.empty(3, H), torch.empty(3, E, 1), None, QMoEInputError, "router_probs"),
        ("float64 logits", torch.empty(3, H), torch.empty(3, E, dtype=torch.float64), None, QMoEInputError,
         "router_probs"),
        ("bf16 logits, f16 input", torch.empty(3, H, dtype=torch.float16), torch.empty(3, E, dtype=torch.bfloat16),
         None, QMoEInputError, "router_probs"),
        ("router_weights E", torch.empty(3, H), torch.empty(3, E), torch.empty(3, E + 1, dtype=f), QMoEInputError,
         "router_weights"),
        ("router_weights rows", torch.empty(3, H), torch.empty(3, E), torch.empty(2, E), QMoEInputError,
         "router_weights"),
        ("logits on meta", torch.empty(3, H), torch.empty(3, E, device="meta"), None, DeviceError, "router_probs"),
    ]


def test_bad_input_is_refused_with_typed_errors(qt):
    """Eagerly (the real implementation) and on meta tensors (the fake): the same typed error naming the input,
    what was expected and what came; the layer is never called."""
    import torch

    layer = StandIn()
    h = qt.register(layer)
    for what, x, lg, rw, err, name in _bad_cases(torch):
        for dev in ("cpu",) if err is DeviceError else ("cpu", "meta"):
            args = [None if t is None else (t if t.device.type == "meta" else t.to(dev)) for t in (x, lg, rw)]
            with pytest.raises(err, match=f"'{name}'") as info:
                qt.moe(args[0], args[1], h, args[2])
            assert err is DeviceError or (info.value.name == name and info.value.expected and info.value.actual), what
    assert layer.calls == 0
    with pytest.raises(QMoEInputError, match="input 'input'"):
        qt.check_inputs("not a tensor", None, None)


def test_bad_input_is_refused_while_compiling(qt):
    """Under torch.compile the fake refuses at trace time: dynamo reports it inside its own error, with the
    package's message."""
    import torch

    layer = StandIn()
    m = qt.MoEModule(layer)
    torch._dynamo.reset()
    f = torch.compile(lambda x, lg: m(x, lg) * 2, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"input 'router_probs': expected \[rows, E\] with rows = 4"):
        f(torch.randn(4, H), torch.randn(5, E))
    assert layer.calls == 0
    torch._dynamo.reset()


def test_registry_handles_are_stable_weak_and_never_reused(qt):
    import torch

    a, b = StandIn(), StandIn()
    ha, hb = qt.register(a), qt.register(b)
    assert ha != hb and qt.register(a) == ha and qt.layer_of(ha) is a and qt.registered()[hb] is b
    qt.unregister(ha)
    with pytest.raises(QMoEInputError, match="input 'handle'"):
        qt.layer_of(ha)
    with pytest.raises(QMoEInputError, match="input 'handle'"):
        qt.moe(torch.empty(2, H), torch.empty(2, E), ha)
    with pytest.raises(QMoEInputError, match="input 'handle'"):  # the fake refuses a stale handle too
        qt.moe(torch.empty(2, H, device="meta"), torch.empty(2, E, device="meta"), ha)
    ha2 = qt.register(a)
    assert ha2 not in (ha, hb) and qt.layer_of(ha2) is a  # a new handle: a stale one never finds another layer
    qt.unregister(ha)  # an unknown handle: ignored
    del b
    gc.collect()
    assert hb not in qt.registered()  # the registry does not keep layers alive
    with pytest.raises(QMoEInputError, match="its layer freed"):
        qt.layer_of(hb)
    with pytest.raises(QMoEInputError, match="input 'layer'"):
        qt.register(42)
    with pytest.raises(QMoEInputError, match="weak references"):
        qt.register(_NoWeakRefs())


def test_moe_module(qt):
    import torch

    layer = StandIn()
    m = qt.MoEModule(layer)
    assert m.layer is layer and m.handle == qt.register(layer) and m.state_dict() == {}
    assert repr(m) == f"MoEModule(handle={m.handle}, layer=StandIn)"
    x, lg, rw = torch.randn(2, 3, H), torch.randn(6, E), torch.rand(6, E)
    assert torch.equal(m(x, lg), _expect(x, lg)) and torch.equal(m(x, lg, rw), _expect(x, lg, rw))
    h = m.handle
    del m
    gc.collect()
    assert qt.layer_of(h) is layer  # the handle lives as long as its layer, not only the module
    del layer
    gc.collect()
    assert h not in qt.registered()


def test_reserve_plans_on_torchs_current_stream(qt, monkeypatch):
    """MoEModule.reserve passes torch dtypes as the layer's names and torch's current stream (faked here: no CUDA);
    an ExpertParallelQMoE reserves its local slice; a layer without reserve() is refused, naming what to do."""
    import types

    import torch

    from qmoe_rtc.errors import QMoEUnsupportedError

    class Reserving(StandIn):
        device_id = 0

        def reserve(self, max_rows, dtype=None, router_dtype="float32", router_weights_dtype=None, stream=None):
            self.reserved = (max_rows, dtype, router_dtype, router_weights_dtype, stream)

    class Sliced(StandIn):  # an ExpertParallelQMoE holds its QMoE slice as .local
        def __init__(self):
            super().__init__()
            self.local = Reserving()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0x1234))
    layer, sliced = Reserving(), Sliced()
    qt.MoEModule(layer).reserve(64, torch.bfloat16)
    assert layer.reserved == (64, "bfloat16", "float32", None, 0x1234)
    qt.MoEModule(sliced).reserve(8, "float16", torch.float16, torch.float32)
    assert sliced.local.reserved == (8, "float16", "float16", "float32", 0x1234)
    with pytest.raises(QMoEUnsupportedError, match="no reserve"):
        qt.MoEModule(StandIn()).reserve(8)
