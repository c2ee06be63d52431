"""The GPU-free parts of the benchmark (qmoe_rtc/bench/: report, layers, targets, torch_ref, run), and a CPU
smoke run of ``run.main`` through a NumPy stand-in for CuPy and a reference-backed stand-in for the executor
(no timing is meaningful)."""

from __future__ import annotations

import json
import sys
import time
import types

import numpy as np
import pytest

from qmoe_rtc.bench import layers, report, run, torch_ref
from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.contract.reference import route
from qmoe_rtc.formats.quantize import quantize
from qmoe_rtc.specialize.presets import PRESETS


# -- arguments -------------------------------------------------------------------------------------
def test_defaults():
    a = report.parse_args([])
    assert [s.name for s in a.shapes] == ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b", "ort-2048"]
    assert a.tokens == [1, 2, 4, 8, 16, 32, 64] and a.bits == [(4, 4)] and a.dtypes == ["float16"]
    assert (a.iters, a.warmup, a.block_size, a.zero_points, a.no_torch, a.no_eager) == (100, 10, None, False, False,
                                                                                         False)
    assert [report.block_for(s, a.block_size) for s in a.shapes] == [128, 128, 32, 128]
    assert [report.block_for(s, 64) for s in a.shapes] == [64] * 4


def test_options():
    a = report.parse_args(["--preset", "deepseek-v3-tp8,ort-2048", "--shape", "512,256,16,4", "--tokens", "1,128",
                          "--bits", "4,2", "--bits", "8", "--dtype", "float16,bfloat16", "--zero-points",
                          "--iters", "50", "--json", "x.json", "--no-torch", "--no-eager", "--seed", "3"])
    assert [(s.name, s.H, s.I, s.E, s.k) for s in a.shapes] == [
        ("deepseek-v3-tp8", 7168, 256, 256, 8), ("ort-2048", 2048, 2048, 8, 2), ("512x256x16x4", 512, 256, 16, 4)]
    assert a.tokens == [1, 128] and a.bits == [(4, 2), (8, 8)] and a.dtypes == ["float16", "bfloat16"]
    assert a.zero_points and a.no_torch and a.no_eager and a.iters == 50 and a.seed == 3 and a.json == "x.json"
    assert [s.name for s in report.parse_args(["--shape", "64,32,4,2"]).shapes] == ["64x32x4x2"]  # --shape alone
    assert len(report.parse_args(["--preset", "all"]).shapes) == len(report.BENCH_SHAPES)


@pytest.mark.parametrize("argv", [["--iters", "49"], ["--bits", "5"], ["--bits", "4,4,4"], ["--dtype", "int8"],
                                  ["--preset", "nope"], ["--shape", "1,2,3"], ["--shape", "8,8,2,3"],
                                  ["--block-size", "48"], ["--tokens", "0"], ["--preset", ""]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        report.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_without_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        run.main(["--help"])
    assert e.value.code == 0
    assert "--zero-points" in capsys.readouterr().out


def test_shapes_agree_with_presets():
    seen = set()
    for name, s in report.BENCH_SHAPES.items():
        p = PRESETS.get(name)
        if p is None:
            continue
        seen.add(name)
        assert (s.H, s.I, s.E, s.k) == (p.hidden, p.inter, p.experts, p.k), name
        assert (s.shared, s.shared_gate, s.router) == (p.shared, p.shared_gate, p.router_gemm), name
    assert {"qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3-tp8", "qwen3-next-80b-a3b"} <= seen
    assert PRESETS["deepseek-v3-tp8"].inter == PRESETS["deepseek-v3"].inter // 8
    gpt = report.BENCH_SHAPES["gpt-oss-120b"]
    assert report.layout_problem(gpt, 128) and not report.layout_problem(gpt, 32) and not report.layout_problem(gpt, 0)


# -- floors ----------------------------------------------------------------------------------------
def test_top_k_ties_and_reference_routing(rng):
    lg = np.array([[0.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, 0.5, 0.5]], np.float32)
    assert report.top_k_experts(lg, 2).tolist() == [[1, 2], [0, 1], [2, 3]]
    attrs = QMoEAttributes.from_kwargs(k=3, normalize_routing_weights=1)
    for _ in range(5):
        lg = (2 * rng.standard_normal((17, 12))).astype(np.float32)
        lg[3, 5] = lg[3, 7]  # a tie
        assert (report.top_k_experts(lg, 3) == route(lg, attrs)[0]).all()
    assert (report.top_k_experts(lg[:1], 1) == route(lg[:1], QMoEAttributes.from_kwargs(k=1))[0]).all()


def test_expert_bytes_hand_count():
    # H 256, I 128, 4-bit, block 128, float16 scales. FC1 [256, 256]: codes 256·128 = 32768, scales 256·2·2 = 1024;
    # FC2 [256, 128]: codes 256·64 = 16384, scales 256·1·2 = 512. Zero points: FC1 256·ceil(2·4/8) = 256,
    # FC2 256·ceil(1·4/8) = 256.
    assert report.expert_bytes(256, 128, (4, 4), 128, False, 2) == 32768 + 1024 + 16384 + 512
    assert report.expert_bytes(256, 128, (4, 4), 128, True, 2) == 32768 + 1024 + 16384 + 512 + 512
    # mixed 4/2-bit, row-wise, zero points packed along N: FC1 256·128 + 256·2 + ceil(256·4/8)=128;
    # FC2 256·32 + 256·2 + ceil(256·2/8)=64
    assert report.expert_bytes(256, 128, (4, 2), 0, True, 2) == (32768 + 512 + 128) + (8192 + 512 + 64)


@pytest.mark.parametrize("bits,bs,zp,dt", [((4, 4), 64, False, np.float16), ((4, 2), 32, True, np.float16),
                                           ((3, 8), 16, True, np.float32), ((2, 4), 0, True, np.float16),
                                           ((8, 1), 0, False, np.float32)])
def test_expert_bytes_match_quantized_arrays(rng, bits, bs, zp, dt):
    E, H, I = 3, 128, 64
    n = 0
    for N, K, b in ((2 * I, H, bits[0]), (H, I, bits[1])):
        q = quantize(rng.standard_normal((E, N, K)).astype(np.float32), b, bs, symmetric=not zp, scale_dtype=dt)
        n += sum(a.nbytes for a in q if a is not None)
    assert report.expert_bytes(H, I, bits, bs, zp, np.dtype(dt).itemsize) == n // E


def test_floor_bytes_unique_experts():
    lg = np.full((3, 6), -1.0, np.float32)
    lg[0, [1, 4]] = 5.0, 4.0
    lg[1, [4, 2]] = 3.0, 2.0
    lg[2, [1, 0]] = 1.0, 0.5  # chosen: {1, 4}, {4, 2}, {1, 0} -> unique {0, 1, 2, 4}
    nbytes, uniq = report.floor_bytes(lg, 2, H=8, per_expert=1000, act_itemsize=2)
    assert uniq == 4 and nbytes == 4 * 1000 + 2 * 3 * 8 * 2 + 3 * 6 * 4
    assert report.flop_count(3, 2, 8, 4) == 2 * 3 * 2 * (8 * 8 + 4 * 8)


def test_check_rows():
    assert report.check_rows(5, 256).tolist() == list(range(5))
    r = report.check_rows(1000, 64)
    assert len(r) == 64 and r[0] == 0 and r[-1] == 999 and (np.diff(r) > 0).all()


def test_poison_and_rel_err():
    from qmoe_rtc._arrays import np_dtype

    for dt in ("float16", "bfloat16", "float32"):
        a = np.ones((3, 5), np_dtype(dt))
        run._poison(np, a)
        assert np.isnan(a.astype(np.float32)).all(), dt
        assert report.rel_err(a, np.ones((3, 5))) == float("inf")
    assert report.rel_err(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.0
    assert abs(report.rel_err(np.array([3.0, 4.0 + 0.5]), np.array([3.0, 4.0])) - 0.1) < 1e-12


# -- table -----------------------------------------------------------------------------------------
def test_format_row():
    p = dict(shape="qwen3-30b-a3b", dtype="float16", bits=[4, 4], T=8, graph_us=41.234, eager_us=80.0, torch_us=None,
             floor_us=20.0, bound="bytes", floor_bytes=81_500_000, pct_floor=48.5, rel_err=3.1e-4, ok=True,
             torch_err=None)
    row = report.format_row(p)
    head = report.table_header()
    assert row.index("|") == head.index("|") and row.rindex("|") == head.rindex("|") and len(row) == len(head)
    for s in ("qwen3-30b-a3b", "float16", "41.2", "80.0", "20.0", "81.50", "48.5", "3.10e-04"):
        assert s in row
    assert " - " in row and "FAIL" not in row
    bad = report.format_row(dict(p, bits=[4, 2], ok=False, rel_err=0.5, bound="flop", torch_err=1.5e-3))
    assert "4,2" in bad and bad.endswith("1.50e-03") and "FAIL" in bad and "20.0*" in bad
    err = report.format_row(dict(shape="x", dtype="bfloat16", bits=[4, 4], T=1, error="CompileError: boom"))
    assert "ERR CompileError: boom" in err and "bfloat16" in err


@pytest.mark.parametrize("dtype,zp,bs", [("float32", False, 32), ("bfloat16", True, 0), ("float16", False, 64)])
def test_torch_baseline_on_cpu(rng, dtype, zp, bs):
    torch = pytest.importorskip("torch")
    from qmoe_rtc._arrays import np_dtype

    shape = report.Shape("t", 128, 64, 8, 3)
    weights, attrs = layers.build_layer(np, _fake_cupy().random.RandomState(1), shape, dtype, (4, 2), bs, zp)
    W1, W2 = torch_ref.torch_weights(np, torch, weights, shape, dtype, (4, 2), bs, device="cpu")
    assert tuple(W1.shape) == (8, 128, 128) and tuple(W2.shape) == (8, 128, 64)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    lg = (2 * rng.standard_normal((5, 8))).astype(np.float32)
    want = reference(x.astype(np_dtype(dtype)), lg, **weights, **attrs)
    tx = torch.from_numpy(x).to(W1.dtype)
    got = torch_ref.torch_moe(torch, tx, torch.from_numpy(lg), W1, W2, 3)
    assert got.dtype == W1.dtype and tuple(got.shape) == (5, 128)
    assert report.rel_err(got.float().numpy(), want) < {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]


def test_bench_layer_uniform_codes():
    """``bench ab --codes uniform --swiglu-fusion 2`` builds the layer as the peers' benchmark draws it: every
    4-bit code equally likely (the quantized layer's crowd the middle), scales (U + 0.5) / (std · sqrt(K)) in the
    scales' shape and dtype, FC1 as [gate | linear] halves; refused with zero points."""
    shape = report.Shape("t", 128, 64, 8, 3)
    fake = _fake_cupy()
    q, _ = layers.build_layer(np, fake.random.RandomState(1), shape, "bfloat16", (4, 4), 32, False)
    u, attrs = layers.build_layer(np, fake.random.RandomState(1), shape, "bfloat16", (4, 4), 32, False, codes="uniform",
                                  swiglu_fusion=2)
    assert attrs["swiglu_fusion"] == 2
    std = (255 / 12) ** 0.5
    for proj, k in (("fc1", 128), ("fc2", 64)):
        codes, scales = u[f"{proj}_experts_weights"], u[f"{proj}_scales"]
        assert codes.shape == q[f"{proj}_experts_weights"].shape and codes.dtype == np.uint8
        assert scales.shape == q[f"{proj}_scales"].shape and scales.dtype == q[f"{proj}_scales"].dtype
        nibbles = np.concatenate([codes & 15, codes >> 4]).ravel()
        share = np.bincount(nibbles, minlength=16) / nibbles.size
        assert share.min() > 0.05 and share.max() < 0.075, share
        middle = np.bincount((q[f"{proj}_experts_weights"] & 15).ravel(), minlength=16)[8] / codes.size
        assert middle > 0.1  # the quantized layer's codes crowd the middle
        sf = scales.astype(np.float32) * std * k ** 0.5
        assert sf.min() >= 0.49 and sf.max() <= 1.51
    with pytest.raises(ValueError, match="without zero points"):
        layers.build_layer(np, fake.random.RandomState(1), shape, "bfloat16", (4, 4), 32, True, codes="uniform")


# -- the whole run on the CPU, with stand-ins for CuPy and the executor --------------------------
class _Event:
    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def _fake_cupy():
    class RandomState:
        def __init__(self, seed):
            self.r = np.random.default_rng(seed)

        def standard_normal(self, size, dtype=np.float64):
            return self.r.standard_normal(size, dtype=dtype)

        def random_sample(self, size, dtype=np.float64):
            return self.r.random(size, dtype=dtype)

        def randint(self, low, high, size, dtype=np.int64):
            return self.r.integers(low, high, size, dtype=dtype)

    props = dict(name=b"Fake GPU", major=9, minor=0, multiProcessorCount=132, totalGlobalMem=141 << 30)
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda d: props,
                                    driverGetVersion=lambda: 13000, runtimeGetVersion=lambda: 13000)
    stream = types.SimpleNamespace(synchronize=lambda: None)
    cuda = types.SimpleNamespace(Event=_Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3 + 1e-3,
                                 get_current_stream=lambda: stream, runtime=runtime)
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    cp = types.SimpleNamespace(__version__="fake", cuda=cuda, random=types.SimpleNamespace(RandomState=RandomState),
                               get_default_memory_pool=lambda: pool, asnumpy=np.asarray)
    for n in ("empty", "empty_like", "concatenate", "copyto", "float16", "float32", "uint8", "uint16", "uint32"):
        setattr(cp, n, getattr(np, n))
    return cp


class _FakeQMoE:
    """The executor's surface that bench uses, computed by the reference; fails at T == fail_rows on purpose."""

    decode_max_routes = 64
    fail_rows = 2

    def __init__(self, **kw):
        self.kw = kw

    def path_for(self, rows):
        return "decode" if rows * self.kw["k"] <= self.decode_max_routes else "prefill"

    def __call__(self, x, logits, out=None):
        if x.shape[0] == self.fail_rows:
            raise RuntimeError("injected failure")
        out[...] = reference(x, logits, **self.kw)
        return out

    def capture(self, x, logits):
        moe = self

        class Graph:
            output = np.empty_like(x)

            def replay(self):
                return moe(x, logits, out=self.output)

        return Graph()


def test_main_on_cpu_with_stand_ins(monkeypatch, tmp_path, capsys):
    import qmoe_rtc.executor

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError: no baseline
    monkeypatch.setattr(qmoe_rtc.executor, "QMoE", _FakeQMoE)
    monkeypatch.setattr(run, "_d2d", lambda dst, src: np.copyto(dst, src))
    monkeypatch.setattr(run, "FLUSH_BYTES", 1 << 10)
    monkeypatch.setattr(run, "COPY_BYTES", 1 << 16)
    monkeypatch.setattr(run, "MATMUL_N", 32)
    path = tmp_path / "b.json"
    argv = ["--shape", "64,32,8,2", "--shape", "80,32,8,2", "--tokens", "1,2,3", "--bits", "4,2", "--block-size", "32",
            "--dtype", "float16,bfloat16", "--zero-points", "--iters", "50", "--warmup", "1", "--json", str(path)]
    assert run.main(argv) == 1  # the injected failure and the bad layout make the run fail
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if l.startswith(("64x32", "80x32"))]
    assert len(rows) == 2 * 2 * 3, out
    assert sum("ERR RuntimeError: injected failure" in r for r in rows) == 2
    assert sum("ERR block_size 32 does not divide H=80" in r for r in rows) == 6
    good = [r for r in rows if "ERR" not in r]
    assert len(good) == 4 and not any("FAIL" in r for r in good)
    assert "12 points, 8 failed" in out and "Fake GPU" in out and "torch baseline skipped" in out
    doc = json.loads(path.read_text())
    assert doc["environment"]["device"] == "Fake GPU" and doc["ceilings"]["matmul_TFLOPs"] > 0
    pts = [p for p in doc["points"] if not p.get("error")]
    assert len(pts) == 4 and all(p["rel_err"] == 0.0 and p["ok"] for p in pts)
    p = next(p for p in pts if p["T"] == 3 and p["dtype"] == "float16")
    # 3 tokens, k 2 over 8 experts; per expert: FC1 [64, 64] 4-bit + FC2 [64, 32] 2-bit, block 32, zp, f16 scales
    per = (64 * 32 + 64 * 2 * 2 + 64 * 1) + (64 * 8 + 64 * 1 * 2 + 64 * 1)
    assert p["floor_bytes"] == p["unique_experts"] * per + 2 * 3 * 64 * 2 + 3 * 8 * 4
    assert 2 <= p["unique_experts"] <= 6 and p["path"] == "decode" and p["bits"] == [4, 2]
    assert p["floor_us"] == max(p["bytes_floor_us"], p["flop_floor_us"]) and p["graph_us"] > 0 and p["eager_us"] > 0
