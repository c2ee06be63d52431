"""The benchmark, warm tool and presets for shared experts, the router GEMM and FP8 experts, on the CPU:
arguments, shapes, byte and FLOP accounting, the targets' arithmetic, random extension tensors that the
contract and the reference accept, and a smoke run of ``qmoe_rtc.bench.run.main`` through NumPy stand-ins."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from test_bench import _FakeQMoE

from qmoe_rtc.bench import layers, report, run, targets
from qmoe_rtc.cli import warm
from qmoe_rtc.contract import describe_layer
from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.extensions import EXT_INPUTS, describe_extensions
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.contract.reference import router_logits, shared_part
from qmoe_rtc.errors import QMoEAttributeError, WeightFormatError
from qmoe_rtc.formats.quantize import quantize
from qmoe_rtc.specialize.presets import PRESETS

NEW = ("qwen3-next-80b-a3b", "deepseek-v3-tp8")


# -- presets ---------------------------------------------------------------------------------------
def test_new_presets_and_their_configs():
    q, d = PRESETS["qwen3-next-80b-a3b"], PRESETS["deepseek-v3-tp8"]
    assert (q.hidden, q.inter, q.experts, q.k, q.activation, q.shared, q.shared_gate, q.router_gemm) == (
        2048, 512, 512, 10, "swiglu", 1, True, True)
    assert (d.hidden, d.inter, d.experts, d.k, d.activation, d.shared, d.shared_gate, d.router_gemm) == (
        7168, 256, 256, 8, "swiglu", 1, False, True)
    for p in (q, d):
        assert p.block_size == 128 and p.hidden % 128 == 0 and p.inter % 128 == 0
        for dt in ("float16", "bfloat16"):
            c = p.config(dtype=dt)  # the default block size is accepted by ModelConfig for both shapes
            assert (c.shared, c.shared_gate, c.router_gemm, c.layout.block_size) == (1, p.shared_gate, dt, 128)
            assert c.layout.aligned and c.name == p.name
    c = q.config(dtype="bfloat16", router_gemm="", shared=0)
    assert (c.shared, c.shared_gate, c.router_gemm) == (0, False, "")  # no shared experts: no gate either
    assert q.config(router_gemm="float32").router_gemm == "float32"
    assert d.config(shared_gate=True).shared_gate


def test_existing_presets_unchanged():
    for name in ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b", "deepseek-v3", "phi-3.5-moe"):
        c = PRESETS[name].config(dtype="bfloat16")
        assert (c.shared, c.shared_gate, c.router_gemm) == (0, False, ""), name
    assert (PRESETS["deepseek-v3"].inter, PRESETS["qwen3-30b-a3b"].inter) == (2048, 768)


def test_fp8_config():
    c = PRESETS["qwen3-next-80b-a3b"].config(format="fp8_e4m3", bits=4, zero_points="packed", dtype="bfloat16")
    lay = c.layout
    assert (lay.fc1_bits, lay.fc2_bits, lay.fc1_format, lay.fc2_format, lay.fc1_zp, lay.scale_dtype,
            lay.block_size) == (8, 8, "fp8_e4m3", "fp8_e4m3", "none", "float32", 128)
    assert (c.shared, c.shared_gate, c.router_gemm) == (1, True, "bfloat16")  # its shared expert is FP8 too
    assert PRESETS["deepseek-v3-tp8"].config(format="fp8_e4m3", block_size=0, dtype="float16").layout.scale_dtype == \
        "float32"
    assert PRESETS["deepseek-v3-tp8"].config(format="fp8_e4m3", scale_dtype="float16").layout.scale_dtype == "float16"
    assert PRESETS["qwen3-30b-a3b"].config(format="int").layout.fc1_zp == "none"
    with pytest.raises(QMoEAttributeError, match="has_fc3"):
        PRESETS["mixtral-8x7b"].config(format="fp8_e4m3")
    assert not PRESETS["mixtral-8x7b"].config(format="fp8_e4m3", activation="swiglu").layout.has_fc3
    mx = PRESETS["gpt-oss-20b"].config(format="mxfp4", block_size=128, dtype="bfloat16").layout
    assert (mx.fc1_format, mx.fc1_bits, mx.block_size, mx.scale_dtype) == ("mxfp4", 4, 32, "float32")


def test_bad_format_names_the_format_names():
    for bad in ("fp4", "fp8"):  # "fp8" is the contract's quant_type, not the format's name
        with pytest.raises(WeightFormatError, match="format") as ei:
            PRESETS["qwen3-30b-a3b"].config(format=bad)
        assert ei.value.name == "format" and "fp8_e4m3" in ei.value.expected and repr(bad) == ei.value.actual
    assert "spelled 'fp8_e4m3'" in str(ei.value)


# -- warm ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NEW)
def test_warm_lists_the_new_presets(cache, capsys, name):
    from qmoe_rtc.kernels import modules_for
    from qmoe_rtc.runtime.layer import executor_config

    assert warm.main(["--preset", name, "--dtype", "bfloat16", "--arch", "sm_90", "--list"]) == 0
    out = capsys.readouterr().out
    cfg = executor_config(PRESETS[name].config(dtype="bfloat16"))  # scales in bf16: the codes tiled
    assert cfg.layout.tiled
    specs = modules_for(cfg, arch="sm_90a")
    assert specs and all(f"sm_90a {s.name}" in out for s in specs)
    assert f"{len(specs)} modules" in out
    words = ("shared 1 (gated), router GEMM bfloat16" if name.startswith("qwen") else
             "shared 1, router GEMM bfloat16, sigmoid routing (8 groups)")  # DeepSeek-V3 routes as the model
    assert f"E{cfg.experts} k{cfg.k} {words}: " in out
    assert not any(cache.iterdir())


def _warm_args(*argv):
    return warm.build_parser().parse_args(list(argv))


def test_warm_extension_flags():
    cfgs = warm._configs(_warm_args("--preset", "qwen3-next-80b-a3b", "--dtype", "float16,bfloat16"))
    assert [(c.shared, c.shared_gate, c.router_gemm) for c in cfgs] == [(1, True, "float16"), (1, True, "bfloat16")]
    (c,) = warm._configs(_warm_args("--preset", "qwen3-next-80b-a3b", "--no-router-gemm", "--no-shared-gate"))
    assert (c.shared, c.shared_gate, c.router_gemm) == (1, False, "")
    (c,) = warm._configs(_warm_args("--preset", "deepseek-v3-tp8", "--shared", "0"))
    assert (c.shared, c.router_gemm) == (0, "float16")
    (c,) = warm._configs(_warm_args("--hidden", "256", "--inter", "128", "--experts", "8", "--k", "2", "--shared", "2",
                                    "--shared-gate", "--router-gemm", "--dtype", "bfloat16"))
    assert (c.shared, c.shared_gate, c.router_gemm, c.name) == (2, True, "bfloat16", "custom")
    (c,) = warm._configs(_warm_args("--preset", "qwen3-30b-a3b"))
    assert (c.shared, c.shared_gate, c.router_gemm) == (0, False, "")
    with pytest.raises(WeightFormatError) as ei:
        warm._configs(_warm_args("--preset", "qwen3-30b-a3b", "--format", "fp4"))
    assert ei.value.name == "--format"


def test_warm_refuses_the_old_fp8_spelling(capsys):
    assert warm.main(["--preset", "deepseek-v3-tp8", "--format", "int,fp8", "--arch", "sm_90", "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'--format'" in err[0] and "spelled 'fp8_e4m3'" in err[0], err


def test_warm_format_fp8(cache, capsys):
    from qmoe_rtc.kernels import modules_for

    argv = ["--preset", "deepseek-v3-tp8", "--format", "int,fp8_e4m3", "--arch", "sm_90", "--list"]
    cfgs = warm._configs(_warm_args("--preset", "deepseek-v3-tp8", "--format", "int,fp8_e4m3", "--bits", "2,4",
                                    "--zero-points", "none,packed", "--block-size", "0,128"))
    fp8 = [c for c in cfgs if c.layout.fc1_format == "fp8_e4m3"]
    assert len(cfgs) == 2 * 2 * 2 + 2 and len(fp8) == 2  # FP8: one per block size (bits, zero points do not apply)
    assert sorted(c.layout.block_size for c in fp8) == [0, 128]
    assert all(c.layout.fc1_bits == c.layout.fc2_bits == 8 and c.shared == 1 for c in fp8)  # FP8 shared expert
    assert warm.main(argv) == 0
    out = capsys.readouterr().out
    (cfg,) = warm._configs(_warm_args("--preset", "deepseek-v3-tp8", "--format", "fp8_e4m3"))
    assert (f"# deepseek-v3-tp8 H7168 I256 E256 k8 shared 1, router GEMM float16, sigmoid routing (8 groups): "
            f"{cfg.layout.name}") in out
    assert all(f"sm_90a {s.name}" in out for s in modules_for(cfg, arch="sm_90a"))


# -- bench arguments -------------------------------------------------------------------------------
def test_bench_new_shapes_and_flags():
    a = report.parse_args(["--shapes", ",".join(NEW), "--bits", "8", "--format", "int,fp8_e4m3,fp8_e4m3:0",
                          "--variants", "routed,full", "--tokens", "1,4096"])
    q, d = a.shapes
    assert (q.name, q.H, q.I, q.E, q.k, q.shared, q.shared_gate, q.router) == (NEW[0], 2048, 512, 512, 10, 1, True,
                                                                                 True)
    assert (d.name, d.H, d.I, d.E, d.k, d.shared, d.shared_gate, d.router) == (NEW[1], 7168, 256, 256, 8, 1, False,
                                                                                 True)
    LQ = report.LayerQuant
    assert a.bits == [(8, 8)] and a.variants == ["routed", "full"]
    assert a.layers == [LQ("int", (8, 8)), LQ("fp8_e4m3", (8, 8)), LQ("fp8_e4m3", (8, 8), 0)]
    assert [report.block_for(q, None, lq) for lq in a.layers] == [128, 128, 0]
    assert [report.block_for(q, 0, lq) for lq in a.layers] == [0, 0, 0] and report.block_for(q, 64, a.layers[1]) == 64
    assert report.block_for(q, 64, LQ("mxfp4", (4, 4))) == 32  # an FP4 format's own block
    assert not any(report.layout_problem(s, 128) for s in a.shapes)
    assert report.layout_problem(q, 1024) and not report.layout_problem(q, 1024, a.layers[1])  # FP8 blocks may be partial
    assert report.parse_args(["--preset", NEW[0]]).variants == ["routed", "shared", "full"]
    assert a.layers[2].float_codes and not a.layers[0].float_codes
    two = report.parse_args(["--bits", "4", "--bits", "2,4", "--format", "nvfp4,int"]).layers
    assert two == [LQ("nvfp4", (4, 4)), LQ("int", (4, 4)), LQ("int", (2, 4))]
    assert "qwen3-next-80b-a3b (H 2048, I 512, E 512, k 10, 1 shared gated, router GEMM)" in report.build_parser().epilog


@pytest.mark.parametrize("argv, says", [
    (["--bits", "fp8,4"], "--format"), (["--bits", "fp9"], "--format"), (["--variants", "routed,all"], "--variants"),
    (["--variants", ","], "--variants"), (["--bits", "fp8"], "--format fp8_e4m3"), (["--bits", "fp8g"], "fp8_e4m3:0"),
    (["--bits", "mxfp4"], "--format mxfp4"), (["--format", "fp8"], "spelled 'fp8_e4m3'"), (["--format", ","], "--format"),
    (["--format", "mxfp4:16"], "expected 32 with format 'mxfp4'"), (["--format", "int:x"], "FMT:BS")])
def test_bench_bad_new_arguments(argv, says, capsys):
    """Old --bits spellings of formats and old format names are refused, naming the new spelling."""
    with pytest.raises(SystemExit) as e:
        report.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error" in err and says in err, err


def test_variants_for():
    q, d, plain = report.BENCH_SHAPES[NEW[0]], report.BENCH_SHAPES[NEW[1]], report.BENCH_SHAPES["qwen3-30b-a3b"]
    allv = list(report.VARIANTS)
    i4, i8, f8 = (report.LayerQuant(f, b) for f, b in (("int", (4, 4)), ("int", (8, 8)), ("fp8_e4m3", (8, 8))))
    assert report.variants_for(q, i4, allv) == allv and report.variants_for(d, i8, allv) == allv
    assert report.variants_for(q, i4, ["full", "routed"]) == ["routed", "full"]
    assert report.variants_for(q, f8, allv) == ["routed"]  # the FP8 targets time routed layers
    assert report.variants_for(plain, i4, allv) == ["routed"]
    router_only = report.Shape("r", 64, 32, 8, 2, router=True)
    shared_only = report.Shape("s", 64, 32, 8, 2, shared=2)
    assert report.variants_for(router_only, i4, allv) == ["routed", "full"]
    assert report.variants_for(shared_only, i4, allv) == ["routed", "full"]


# -- bytes and FLOPs -------------------------------------------------------------------------------
def test_fp8_expert_bytes_hand_count():
    # H 256, I 128: FC1 [256, 256] codes 65536, FC2 [256, 128] codes 32768. Block 128, float32 scales:
    # FC1 2·2 blocks = 16 B, FC2 2·1 = 8 B. Global: 4 B per projection. Block 96 (partial): FC1 3·3, FC2 3·2.
    assert report.expert_bytes(256, 128, (8, 8), 128, False, 2, "fp8_e4m3") == 65536 + 16 + 32768 + 8
    assert report.expert_bytes(256, 128, (8, 8), 0, True, 2, "fp8_e4m3") == 65536 + 4 + 32768 + 4
    assert report.expert_bytes(256, 128, (8, 8), 96, False, 2, "fp8_e4m3") == 65536 + 9 * 4 + 32768 + 6 * 4


@pytest.mark.parametrize("bs", [0, 32, 128])
def test_fp8_expert_bytes_match_quantized_arrays(rng, bs):
    E, H, I = 3, 96, 64  # 96 is no multiple of 64 or 128: partial blocks
    n = 0
    for N, K in ((2 * I, H), (H, I)):
        q = quantize(rng.standard_normal((E, N, K)).astype(np.float32), None, bs, scale_dtype=np.float32,
                     format="fp8_e4m3")
        n += sum(a.nbytes for a in q if a is not None)
    assert report.expert_bytes(H, I, (8, 8), bs, False, 4, "fp8_e4m3") == n // E


@pytest.mark.parametrize("bits,bs,zp,dt", [((4, 4), 32, False, "float16"), ((4, 2), 16, True, "bfloat16"),
                                           ((8, 8), 0, True, "float32")])
def test_extension_bytes_match_random_layer(rng, bits, bs, zp, dt):
    from qmoe_rtc._arrays import np_dtype

    shape = report.Shape("t", 64, 32, 8, 2, shared=2, shared_gate=True, router=True)
    w, _ = layers.build_layer(np, rng, shape, dt, bits, bs, zp, shared=True)
    isz = np_dtype(dt).itemsize
    shared = sum(a.nbytes for n, a in w.items() if n.startswith("shared_"))
    assert report.extension_bytes(shape, bits, bs, zp, isz, isz) == (shared, w["router_weight"].nbytes)
    assert shared == 2 * report.expert_bytes(64, 32, bits, bs, zp, isz) + 64 * isz
    assert report.extension_bytes(report.Shape("p", 64, 32, 8, 2), bits, bs, zp, isz, isz) == (0, 0)
    routed = sum(a.nbytes for n, a in w.items() if n not in EXT_INPUTS) // 8
    assert routed == report.expert_bytes(64, 32, bits, bs, zp, isz)


def test_ext_flops_hand_count():
    s = report.Shape("t", 64, 32, 8, 2, shared=2, router=True)
    per_route = 2 * (64 * 64 + 32 * 64)  # FC1 [2I, H] + FC2 [H, I], 2 FLOPs a multiply-add
    assert report.ext_flops(3, s, "routed") == 0
    assert report.ext_flops(3, s, "shared") == 3 * 2 * per_route
    assert report.ext_flops(3, s, "full") == 3 * 2 * per_route + 2 * 3 * 8 * 64
    assert report.ext_flops(3, report.Shape("g", 64, 32, 8, 2, shared=1), "full") == 3 * per_route


# -- targets ---------------------------------------------------------------------------------------
def test_ext_target_arithmetic():
    # 2 MB at 1000 GB/s = 2 us; bound = 1.15 · (40 + 2) = 48.3 us
    t = targets.ext_target(40.0, 48.0, 2_000_000, 1000.0)
    assert math.isclose(t["ext_us"], 2.0) and math.isclose(t["bound_us"], 48.3)
    assert t["ok"] is True and math.isclose(t["ratio"], 48.0 / 48.3)
    assert targets.ext_target(40.0, 48.4, 2_000_000, 1000.0)["ok"] is False
    assert targets.ext_target(40.0, 48.3, 2_000_000, 1000.0)["ok"] is True  # <= : the bound itself passes
    assert targets.ext_target(40.0, 48.0, 2_000_000, None)["ok"] is None
    assert targets.ext_target(None, 48.0, 2_000_000, 1000.0)["ok"] is None
    line = targets.format_target(t)
    for s in ("48.0 <= 1.15*(40.0 + 2.0 for 2.00 MB) = 48.3 us", "ratio 0.994", "PASS"):
        assert s in line, line
    assert "MISS" in targets.format_target(targets.ext_target(40.0, 60.0, 0, 1000.0))
    assert "not measured" in targets.format_target(targets.ext_target(40.0, 48.0, 0, None))


def _pt(bits, T, graph_us, pct, bs=128, **kw):
    """A point; ``bits`` a pair of widths (int codes) or a format name (its own widths)."""
    fmt, bits = ("int", bits) if isinstance(bits, tuple) else (bits, {"fp8_e4m3": (8, 8)}.get(bits, (4, 4)))
    return dict(shape="s", dtype="bfloat16", format=fmt, bits=list(bits), T=T, graph_us=graph_us, pct_floor=pct,
                block_size=bs, variant="routed", **kw)


def test_fp8_targets_arithmetic():
    pts = [_pt((8, 8), 1, 30.0, 50.0), _pt((8, 8), 4096, 1000.0, 40.0),
           _pt("fp8_e4m3", 1, 40.0, 40.0), _pt("fp8_e4m3", 4096, 1200.0, 30.0),  # 80 % exactly, 1.2x exactly
           _pt("fp8_e4m3", 1, 50.0, 39.9, bs=0), _pt("fp8_e4m3", 4096, 1201.0, 30.0, bs=0),
           _pt((4, 4), 1, 20.0, 99.0), _pt("fp8_e4m3", 4096, 1.0, 99.0, error="boom"),  # errors never count
           _pt("mxfp4", 1, 5.0, 99.0)]  # FP4 codes are no int8 (nor FP8) point
    t = {(x["scales"], x["kind"]): x for x in targets.fp8_targets(pts)}
    assert set(t) == {("block 128", "fp8_decode"), ("block 128", "fp8_prefill"), ("global", "fp8_decode"),
                      ("global", "fp8_prefill")}
    dec, pre = t["block 128", "fp8_decode"], t["block 128", "fp8_prefill"]
    assert (dec["fp8"], dec["int8"], dec["ok"]) == (40.0, 50.0, True) and math.isclose(dec["ratio"], 0.8)
    assert (pre["fp8"], pre["int8"], pre["ok"]) == (1200.0, 1000.0, True) and math.isclose(pre["ratio"], 1.2)
    assert t["global", "fp8_decode"]["ok"] is False and t["global", "fp8_prefill"]["ok"] is False
    lines = [targets.format_target(x) for x in targets.fp8_targets(pts)]  # global (block 0) first
    assert lines[2] == "fp8 target s bfloat16 fp8 block 128: decode T=1 %floor fp8 >= 80% of int8: 40.0 vs 50.0 = 80% PASS"
    assert "prefill T=4096 time fp8 <= 1.2x int8: 1200.0 vs 1000.0 us = 1.20x PASS" in lines[3], lines
    assert lines[0].endswith("MISS") and lines[1].endswith("MISS") and "fp8 global" in lines[0]


def test_fp8_targets_missing_points():
    assert targets.fp8_targets([_pt((8, 8), 1, 30.0, 50.0)]) == []  # no FP8 point: nothing to report
    only = targets.fp8_targets([_pt("fp8_e4m3", 1, 40.0, 45.0), _pt((8, 8), 4096, 1000.0, 40.0),
                              dict(_pt((8, 8), 1, 30.0, 50.0), variant="full")])
    assert [x["ok"] for x in only] == [None, None]  # int8 at T=1 only as a 'full' variant; no FP8 at 4096
    assert all("not measured (needs --format int,fp8_e4m3 with --bits 8 and the fp8 form at --tokens"
               in targets.format_target(x) for x in only)


def test_near_tie_rows():
    lg = np.array([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 2.0 - 1e-4, 0.0], [5.0, 5.0, 0.0, 0.0], [9.0, 4.0, 3.98, 0]],
                  np.float32)
    assert report.near_tie_rows(lg, 2).tolist() == [False, True, False, False]  # row 3: gap 0.02 > 1e-3·9
    assert report.near_tie_rows(lg, 1).tolist() == [False, False, True, False]
    assert report.near_tie_rows(lg, 4).tolist() == [False] * 4  # k = E: nothing is left out


def test_format_row_variants_and_width():
    p = dict(shape="qwen3-next-80b-a3b", dtype="bfloat16", format="fp8_e4m3", bits=[8, 8], T=1, graph_us=10.0,
             floor_us=5.0, bound="bytes", floor_bytes=1e6, pct_floor=50.0, rel_err=1e-3, ok=True, variant="full",
             block_size=0)
    shapes = [report.BENCH_SHAPES[n] for n in NEW] + [report.BENCH_SHAPES["ort-2048"]]
    w = report.label_width(shapes)
    assert w == len("qwen3-next-80b-a3b/shared") and report.label_width([report.BENCH_SHAPES["ort-2048"]]) == 16
    assert report.label_width(shapes, ["routed", "full"]) == len("qwen3-next-80b-a3b/full")
    row, head = report.format_row(p, w), report.table_header(w)
    assert row.startswith("qwen3-next-80b-a3b/full ") and " fp8_e4m3    0 " in row
    assert row.index("|") == head.index("|") and len(row) == len(head)
    assert report.format_row(dict(p, variant="routed"), w).startswith("qwen3-next-80b-a3b  ")
    assert report.table_header() == report.table_header(16) and report.table_header(20).startswith("shape" + " " * 16)


# -- random extension tensors ----------------------------------------------------------------------
@pytest.mark.parametrize("gate,bias,dt", [(True, False, "float16"), (False, True, "bfloat16"), (True, True, "float32")])
def test_random_layer_extensions_pass_contract_and_reference(rng, gate, bias, dt):
    E, H, I, k = 8, 64, 32, 2
    seed = int(rng.integers(1 << 30))
    kw = dict(E=E, H=H, I=I, k=k, bits=4, block_size=32, dtype=dt, normalize_routing_weights=1)
    w, attrs = random_layer(np.random.default_rng(seed), **kw, shared=2, shared_gate=gate, router_gemm=True,
                            router_bias=bias)
    plain, attrs0 = random_layer(np.random.default_rng(seed), **kw)
    assert attrs == attrs0
    for n in plain:  # the [ext] tensors are drawn after the routed ones
        np.testing.assert_array_equal(w[n], plain[n])
    ext = {n: a for n, a in w.items() if n in EXT_INPUTS}
    assert ext["shared_fc1_experts_weights"].shape == (2, 2 * I, H // 2) and ext["router_weight"].shape == (E, H)
    assert ("shared_gate_weight" in ext) == gate and ("router_bias" in ext) == bias
    a = QMoEAttributes.from_kwargs(**attrs)
    spec = describe_extensions(ext, a, describe_layer(plain, a))
    assert (spec.S, spec.gate, spec.router, spec.router_bias) == (2, gate, True, bias)
    x, _, _ = random_inputs(rng, 5, H, E, dt)
    full = reference(x, None, **w, **attrs)
    # what the bench's routed / shared layers are given: the router GEMM's logits, so all variants route alike
    lg = router_logits(x, ext["router_weight"], ext.get("router_bias"))
    routed = reference(x, lg, **plain, **attrs)
    sh = {n: a for n, a in ext.items() if n.startswith("shared_")}
    np.testing.assert_array_equal(reference(x, lg, **plain, **sh, **attrs), full)
    sw = {n.removeprefix("shared_"): a for n, a in sh.items() if n != "shared_gate_weight"}
    part = shared_part(x.astype(np.float64), spec.shared, sw, a, ext.get("shared_gate_weight"))
    assert np.abs(part).max() > 0.1
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dt]
    assert report.rel_err(full, routed.astype(np.float64) + part) < tol  # full = routed + shared, one rounding
    assert report.rel_err(routed, full) > 10 * tol
    assert np.isfinite(full.astype(np.float32)).all() and 0.1 < np.abs(full.astype(np.float32)).mean() < 10


def test_random_layer_fp8(rng):
    w, attrs = random_layer(rng, E=4, H=64, I=32, k=2, format="fp8_e4m3", block_size=0, router_gemm=True)
    assert attrs["quant_type"] == "fp8" and w["fc1_global_scale"].shape == (4,) and "router_weight" in w
    x, _, _ = random_inputs(rng, 3, 64, 4)
    assert np.isfinite(reference(x, None, **w, **attrs).astype(np.float32)).all()
    ws, a2 = random_layer(rng, E=4, H=64, I=32, format="fp8_e4m3", shared=1)  # FP8 shared experts, global scales
    assert ws["shared_fc1_global_scale"].shape == (1,) and ws["shared_fc1_experts_weights"].dtype == np.uint8
    x2, lg2, _ = random_inputs(rng, 3, 64, 4)
    assert np.isfinite(reference(x2, lg2, **ws, **a2).astype(np.float32)).all()


# -- a whole run on the CPU ------------------------------------------------------------------------
class _FakeExtQMoE(_FakeQMoE):
    """The executor's surface that bench uses, computed by the reference (extension inputs included),
    with no injected failure."""

    fail_rows = None


def test_main_on_cpu_with_extensions_and_fp8(monkeypatch, tmp_path, capsys):
    from test_bench import _fake_cupy

    import qmoe_rtc.executor

    cp = _fake_cupy()
    cp.asarray = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(qmoe_rtc.executor, "QMoE", _FakeExtQMoE)
    monkeypatch.setattr(run, "_d2d", lambda dst, src: np.copyto(dst, src))
    monkeypatch.setattr(run, "FLUSH_BYTES", 1 << 10)
    monkeypatch.setattr(run, "COPY_BYTES", 1 << 16)
    monkeypatch.setattr(run, "MATMUL_N", 32)
    monkeypatch.setitem(report.BENCH_SHAPES, "tiny-next", report.Shape("tiny-next", 64, 32, 8, 2, block_size=32,
                                                                     shared=1, shared_gate=True, router=True))
    path = tmp_path / "b.json"
    argv = ["--preset", "tiny-next", "--tokens", "1,3", "--bits", "8", "--format", "int,fp8_e4m3,fp8_e4m3:0",
            "--dtype", "bfloat16", "--iters", "50", "--warmup", "1", "--json", str(path)]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("tiny-next")]
    assert len(rows) == 2 * 3 + 2 + 2, out  # int8: 3 variants x 2 T; FP8 with block and global scales: routed only
    assert sum(r.startswith("tiny-next/full ") for r in rows) == 2 and not any("ERR" in r or "FAIL" in r for r in rows)
    assert out.count("  target full <= 1.15*(routed + ext bytes/copy): ") == 2 and "ratio " in out
    assert "fp8 target tiny-next bfloat16 fp8 block 32: decode T=1" in out
    assert "fp8 target tiny-next bfloat16 fp8 global: prefill T=4096 time fp8 <= 1.2x int8: not measured" in out
    assert "[fp8_e4m3: routed layer only" in out and "10 points, 0 failed; targets " in out
    doc = json.loads(path.read_text())
    pts = doc["points"]
    assert {p["variant"] for p in pts} == {"routed", "shared", "full"} and all(p["rel_err"] == 0.0 for p in pts)
    r, s, f = (next(p for p in pts if p["T"] == 3 and p["variant"] == v and p["format"] == "int")
               for v in ("routed", "shared", "full"))
    isz = 2
    shared, router = report.extension_bytes(report.BENCH_SHAPES["tiny-next"], (8, 8), 32, False, isz, isz)
    assert (shared, router) == (report.expert_bytes(64, 32, (8, 8), 32, False, 2) + 64 * 2, 8 * 64 * 2)
    assert r["unique_experts"] == s["unique_experts"] == f["unique_experts"]  # the same routing in every variant
    assert s["floor_bytes"] == r["floor_bytes"] + shared and f["floor_bytes"] == r["floor_bytes"] + shared + router
    assert f["flops"] == r["flops"] + report.ext_flops(3, report.BENCH_SHAPES["tiny-next"], "full")
    assert f["target"]["ext_bytes"] == shared + router and f["target"]["routed_us"] == r["graph_us"]
    assert f["tie_rows_skipped"] >= 0 and "tie_rows_skipped" not in r
    g = next(p for p in pts if p["format"] == "fp8_e4m3" and p["block_size"] == 0 and p["T"] == 1)
    assert (g["bits"], g["variant"]) == ([8, 8], "routed")
    assert g["floor_bytes"] == g["unique_experts"] * (64 * 64 + 4 + 64 * 32 + 4) + 2 * 64 * 2 + 8 * 4
    kinds = [t["kind"] for t in doc["targets"]]
    assert kinds.count("ext") == 2 and kinds.count("fp8_decode") == 2 and kinds.count("fp8_prefill") == 2
    assert doc["config"]["shapes"][0]["shared"] == 1 and doc["config"]["variants"] == ["routed", "shared", "full"]


def test_decode_targets_arithmetic():
    """Issue 13: int4 %floor against the shape's target at T 1-8, int2 <= 0.65x int4 at T 1 (mixtral,
    gpt-oss), only from points of the shape's own block size; other shapes have none."""
    from qmoe_rtc.bench.targets import DECODE_PCT, decode_targets

    def pt(bits, T, us, pct, bs=128, shape="mixtral-8x7b", **kw):
        return dict(_pt(bits, T, us, pct, bs=bs, **kw), shape=shape)

    pts = [pt((4, 4), 1, 70.0, 60.0), pt((4, 4), 2, 150.0, 59.9), pt((4, 4), 8, 300.0, 61.0),
           pt((4, 4), 4, 1.0, 99.0, bs=64), pt((4, 4), 4, 1.0, 99.0, error="boom"),  # other block, error: skipped
           pt((2, 2), 1, 45.5, 40.0)]
    t = {(x["kind"], x["T"]): x for x in decode_targets(pts)}
    assert set(t) == {("decode", 1), ("decode", 2), ("decode", 8), ("int2", 1)}
    assert t["decode", 1]["ok"] is True and t["decode", 2]["ok"] is False and t["decode", 8]["ok"] is True
    assert DECODE_PCT["mixtral-8x7b"] == t["decode", 1]["want"] == 60.0
    assert math.isclose(t["int2", 1]["ratio"], 0.65) and t["int2", 1]["ok"] is True  # <= : the bound passes
    assert decode_targets([pt((2, 2), 1, 46.0, 40.0), pt((4, 4), 1, 70.0, 60.0)])[-1]["ok"] is False
    line = targets.format_target(t["decode", 2])
    assert "T=2" in line and "59.9 % of the bytes floor (>= 60 %)" in line and "MISS" in line, line
    assert "int2 45.5 us vs int4 70.0 us = 0.65x (<= 0.65x) PASS" in targets.format_target(t["int2", 1])
    # qwen3 has no int2 target; deepseek no decode target at all
    q = decode_targets([pt((4, 4), 1, 30.0, 15.0, shape="qwen3-30b-a3b"), pt((2, 2), 1, 10.0, 20.0, shape="qwen3-30b-a3b")])
    assert [(x["kind"], x["ok"]) for x in q] == [("decode", False)]
    assert decode_targets([pt((4, 4), 1, 30.0, 99.0, shape="deepseek-v3-tp8")]) == []
