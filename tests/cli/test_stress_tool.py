"""The contention stress check's CPU side (``python -m qmoe_rtc stress``): the case matrix, the engine
each case forces, the options a worker gets, and the verdict over the workers' reports."""

import json

import numpy as np
import pytest

from qmoe_rtc.cli import stress
from qmoe_rtc.cli.stress_gpu import engine_scope, ran_engine
from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.kernels import Problem, choose
from qmoe_rtc.runtime.layer import describe_gpu_layer, layer_config
from qmoe_rtc.runtime.tensors import layer_scale_dtype
from qmoe_rtc.settings import knobs


def test_matrix_covers_what_the_check_promises():
    kws = [lay[1] for lay in stress.LAYOUTS]
    bits = {b for kw in kws for b in (kw.get("bits", 8) if isinstance(kw.get("bits", 8), tuple) else (kw.get("bits", 8),))}
    assert {1, 2, 3, 4, 8} <= bits
    assert {kw.get("format") for kw in kws} >= {"fp8_e4m3", "mxfp4", "nvfp4"}
    assert {kw["block_size"] == 0 for kw in kws} == {True, False}
    assert any(kw.get("zero_points") for kw in kws) and any("zero_point_offset" in kw for kw in kws)
    assert {kw["activation_type"] for kw in kws} >= {"swiglu", "geglu", "silu", "gelu", "relu"}
    assert {lay[5] for lay in stress.LAYOUTS} == {"float16", "bfloat16", "float32"}
    assert any(kw.get("shared") and kw.get("router_gemm") for kw in kws)
    assert {eng for _, eng in stress.cases()} == set(stress.ENGINES)
    assert "prefill-wgmma" not in {eng for _, eng in stress.cases(wgmma=False)}
    # the layer of the race found under contention comes first
    assert stress.LAYOUTS[0][:1] == ("bf16-b8-row-silu",) and stress.LAYOUTS[0][2:] == (16, 256, 128, "bfloat16")


def test_issue23_layout_is_there_and_valid():
    """Issue 23's exact layer is a named layout: bf16, int8 row-wise symmetric (no zero points), silu, k 2,
    E 16, H 256, I 128, routing weights normalised; the tensor-core engines run it, at 1000 rows on the
    prefill ones, and ``--layouts`` takes its name."""
    lay = {lay[0]: lay for lay in stress.LAYOUTS}[stress.RACE_LAYOUT]
    name, kw, E, H, I, dtype = lay
    assert (E, H, I, dtype) == (16, 256, 128, "bfloat16")
    assert kw == dict(bits=8, block_size=0, activation_type="silu", k=2, normalize_routing_weights=1)
    assert len({lay[0] for lay in stress.LAYOUTS}) == len(stress.LAYOUTS)  # names are unique
    kw = dict(kw)
    w, a = random_layer(np.random.default_rng(0), E=E, H=H, I=I, k=kw.pop("k"), dtype=dtype, **kw)
    attrs = QMoEAttributes.from_kwargs(**a)
    assert attrs.normalize_routing_weights == 1 and attrs.k == 2 and attrs.activation_type == "silu"
    assert "fc1_zero_points" not in w and "fc2_zero_points" not in w
    cfg = stress.model_config(lay)
    assert cfg.experts == 16 and cfg.hidden == 256 and cfg.inter == 128 and cfg.k == 2
    selected = stress.cases([name])
    assert {eng for _, eng in selected} == set(stress.TENSOR_CORE_ENGINES)
    for case in selected:
        if case[1].startswith("prefill"):
            assert stress.rows_for(case, [1000]) == [1000] and 1000 in stress.rows_for(case)
            p = Problem(rows=1000, E=E, H=H, I=I, k=2, dtype=dtype, arch="sm_90a")
            with engine_scope(case[1]):
                assert choose(cfg, p, "prefill").pipeline.name == case[1]
    args = stress.build_parser().parse_args(["--layouts", name, "--rows", "1000"])
    assert args.layouts == [name] and args.rows == [1000]


def test_a_layout_takes_the_wgmma_fc2_in_parts():
    """One layout's wgmma case runs FC2's K in parts (kernels/wgmma_geometry.py fc2_parts) at some of the rows it draws
    on a 132-SM sm_90a device, and whole tiles at others, so the stress covers both forms of the combine."""
    import dataclasses

    from qmoe_rtc.kernels import get_family

    fam = get_family("wgmma_prefill")
    parts = {}
    for case in stress.cases():
        if case[1] != "prefill-wgmma":
            continue
        cfg = stress.model_config(case[0])
        spec = fam.spec(cfg)
        for rows in stress.rows_for(case):
            p = Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=case[0][5], arch="sm_90a")
            parts[(case[0][0], rows)] = fam.configure(spec, dataclasses.replace(p, sms=132)).fc2_parts
    taken = {name for (name, _), n in parts.items() if n > 1}
    assert taken == {"bf16-b4-bs128-swiglu-longK"}, taken
    assert {n for (name, _), n in parts.items() if name in taken} >= {1, 2}


@pytest.mark.parametrize("case", stress.cases(), ids=lambda c: f"{c[0][0]}-{c[1]}")
def test_each_case_runs_the_engine_it_names(case):
    """What the worker forces (decode_max_routes, tuning knob prefill_engine) picks the named pipeline at
    every row count it draws, on an sm_90a device."""
    (name, kw, E, H, I, dtype), engine = case
    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(np.random.default_rng(0), E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    g = describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {})
    cfg = layer_config(g.layer, dtype, layer_scale_dtype(g.layer), g.ext)
    path = engine.partition("-")[0]
    for rows in stress.rows_for(case):
        p = Problem(rows=rows, E=E, H=H, I=I, k=k, dtype=dtype, arch="sm_90a", shared=g.ext.S,
                    shared_gate=bool(g.ext.S and g.ext.gate), router_gemm=g.ext.router_dtype if g.ext.router else "")
        with engine_scope(engine):
            assert choose(cfg, p, path).pipeline.name == engine, rows


def test_the_wgmma_engine_is_forced_and_reported_by_its_pipeline_name():
    """prefill-wgmma forces the wgmma engine, is reported under the pipeline's name, and its modules are among those
    precompiled."""
    from types import SimpleNamespace

    moe = SimpleNamespace(engine_for=lambda rows, dtype: SimpleNamespace(pipeline=SimpleNamespace(name="prefill-wgmma")))
    with engine_scope("prefill-wgmma"):
        assert knobs.get("prefill_engine") == "wgmma" and ran_engine(moe, 64, "bfloat16") == "prefill-wgmma"
    names = {s.name for s, _ in stress.modules(stress.cases(engines=["prefill-wgmma"]), "sm_90a")}
    assert any(n.startswith("wgmma_prefill") for n in names)

def test_decode_rows_stay_within_the_decode_engine():
    for case in stress.cases(engines=["decode-mma", "decode-gemv"]):
        slots = case[0][1]["k"] + case[0][1].get("shared", 0)
        assert all(r * slots <= 512 for r in stress.rows_for(case))
    assert stress.rows_for(stress.cases(engines=["prefill-mma"])[0], [64, 1000]) == [64, 1000]
    assert max(stress.rows_for(stress.cases(engines=["prefill-mma"])[0])) == 4096


def test_modules_to_compile_cover_every_family():
    todo = stress.modules(stress.cases(), "sm_90a")
    assert {s.family for s, _ in todo} == {"route", "mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill", "gemv",
                                           "gemm"}
    assert len(todo) == len(set(todo))


def test_worker_argv_round_trips_through_the_parser():
    args = stress.build_parser().parse_args(["--procs", "4", "--seconds", "5", "--layouts", "f32-b3-row-relu",
                                             "--rows", "3,64", "--no-smem-poison", "--diagnose", "--torch", "--json",
                                             "x.json", "--fresh", "2", "--hog", "3"])
    back = stress.build_parser().parse_args(stress.worker_argv(args))
    for f in ("procs", "seconds", "layouts", "rows", "poison_smem", "diagnose", "torch", "seed", "inputs",
              "rows_per_layer"):
        assert getattr(back, f) == getattr(args, f), f
    assert back.json is None and back.hog == 0 and back.fresh == 0  # the parent's own business


@pytest.mark.parametrize("bad", [["--engines", "decode-fast"], ["--layouts", "nope"], ["--procs", "0"],
                                 ["--rows", "a,b"]])
def test_bad_options_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as e:
        stress.build_parser().parse_args(bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected" in err or "unknown" in err


def _summary(engines, errors=0):
    return json.dumps(dict(event="summary", seed=0, engines=engines, errors=errors))


def test_verdict_needs_every_engine_its_runs_and_no_difference():
    run = {"runs": 600, "diff": 0, "ref_fail": 0, "worst": 1e-3}
    lines = [_summary({"decode-mma": run, "prefill-mma": run}), _summary({"decode-mma": run}), "not json"]
    res = stress.aggregate(lines)
    assert res["workers"] == 2 and res["engines"]["decode-mma"]["runs"] == 1200
    text, ok = stress.table(res, ["decode-mma", "prefill-mma"], 1000)
    assert not ok and "fewer than --min-runs" in text  # prefill-mma has 600
    assert stress.table(res, ["decode-mma"], 1000)[1]
    assert not stress.table(res, ["decode-mma", "prefill-wgmma"], 1)[1]  # an engine that never ran
    bad = stress.aggregate(lines + [_summary({"decode-mma": dict(run, diff=1)})])
    assert not stress.table(bad, ["decode-mma"], 1)[1]
    failure = json.dumps(dict(event="failure", engine="decode-mma", diff=True))
    err = json.dumps(dict(event="error", error="boom"))
    res = stress.aggregate(lines + [failure, err])
    assert len(res["failures"]) == 1 and len(res["errors"]) == 1
    assert not stress.table(res, ["decode-mma"], 1)[1]


def test_without_a_gpu_it_is_one_line_naming_what_is_missing():
    import subprocess
    import sys

    from conftest import gpu_available

    if gpu_available()[0]:
        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "stress", "--seconds", "1"], capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "DeviceError" in lines[0] and "Traceback" not in r.stderr


def test_bench_stress_is_the_same_command():
    """``python -m qmoe_rtc bench stress`` delegates to ``python -m qmoe_rtc stress``: the same parser, the
    same usage errors and the same one line without a GPU."""
    import subprocess
    import sys

    from conftest import gpu_available

    from qmoe_rtc.bench import cli

    assert cli.SUBCOMMANDS["stress"][0] == stress.__name__
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "bench", "stress", "--engines", "decode-fast"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown engine decode-fast" in r.stderr and "Traceback" not in r.stderr, r.stderr
    if gpu_available()[0]:
        return
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "bench", "stress", "--seconds", "1"], capture_output=True,
                       text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "DeviceError" in lines[0] and "Traceback" not in r.stderr
