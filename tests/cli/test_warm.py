"""The warm tool end to end on a temporary cache dir (CPU only: explicit --arch)."""

from __future__ import annotations

from qmoe_rtc.cli import warm
from qmoe_rtc.errors import CompileError
from qmoe_rtc.jit import check_arch, disk_entry_dir
from qmoe_rtc.kernels import modules_for, spec_unit
from qmoe_rtc.runtime.layer import executor_config
from qmoe_rtc.settings import knobs
from qmoe_rtc.specialize.presets import PRESETS


def test_warm_preset_end_to_end(cache, capsys):
    argv = ["--preset", "gpt-oss-20b", "--arch", "sm_80", "--dtype", "float16,bfloat16", "--bits", "4",
            "--zero-points", "none,packed", "--jobs", "2", "--no-progress"]
    preset = PRESETS["gpt-oss-20b"]
    want = {s for dt in ("float16", "bfloat16") for zp in ("none", "packed")
            for s in modules_for(executor_config(preset.config(bits=4, zero_points=zp, dtype=dt)), arch="sm_80")}
    n = len(want)
    assert n == 4 * 3 + 2  # per layout: the decode, batched-decode and mma.sync prefill engines; per dtype: routing
    assert all(s.get("tiled") for s in want if s.family != "route")  # scales in T: the executor tiles the codes
    assert warm.main(argv) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("sm_80 ")]
    assert len(lines) == n and all(" stored " in l for l in lines)
    assert f"{n} stored, 0 hits, 0 failed" in out
    pieces = sum(len(spec_unit(s).pieces()) for s in want)  # a tensor-core module: one entry per part
    assert pieces > n and len(list(disk_entry_dir("sm_80").glob("*.json"))) == pieces
    # second run: every module is a hit; strict mode is then satisfied
    with knobs.scope(strict=True):
        assert warm.main(argv) == 0
    assert f"0 stored, {n} hits, 0 failed" in capsys.readouterr().out


def test_warm_plan_uses_modules_for(cache, capsys):
    cfg = PRESETS["qwen3-30b-a3b"].config(bits=2, zero_points="offset", dtype="bfloat16")
    assert warm.main(["--preset", "qwen3-30b-a3b", "--bits", "2", "--zero-points", "offset", "--dtype", "bfloat16",
                      "--arch", "sm_90", "--arch", "sm_80", "--list"]) == 0
    out = capsys.readouterr().out
    for arch in (check_arch("sm_90"), "sm_80"):  # 'sm_90' names the target it is compiled as
        for spec in modules_for(cfg, arch=arch):
            assert f"{arch} {spec.name}" in out
    assert not any(cache.iterdir())  # --list compiles nothing


def test_warm_explicit_model_mixed_bits_in_process(cache, capsys):
    argv = ["--hidden", "256", "--inter", "128", "--experts", "4", "--k", "2", "--fc1-bits", "3", "--fc2-bits", "8",
            "--block-size", "32", "--activation", "silu", "--fc3", "--fc3-bits", "2", "--arch", "sm_80", "--jobs", "1"]
    assert warm.main(argv) == 0
    out = capsys.readouterr().out
    for fam in ("gemv", "gemm"):  # 3-bit: the SIMT engines
        assert f"{fam}_silu_fc1-b3-zpN_fc2-b8-zpN_fc3-b2-zpN_bs32_f16" in out


def test_warm_failure_exits_nonzero(cache, capsys, monkeypatch):
    def boom(spec, arch):
        raise CompileError(spec.name, "error: simulated", ("-arch=" + arch,), "int x\n")

    monkeypatch.setattr(warm, "_build", boom)
    n = len(modules_for(PRESETS["mixtral-8x7b"].config()))
    assert warm.main(["--preset", "mixtral-8x7b", "--arch", "sm_90", "--jobs", "1"]) == 1
    captured = capsys.readouterr()
    assert "FAILED CompileError" in captured.out and f"{n} failed" in captured.out
    assert "1 | int x" in captured.err


def test_warm_bad_arguments(cache, capsys):
    assert warm.main(["--hidden", "64", "--arch", "sm_90"]) == 2
    assert warm.main(["--preset", "gpt-oss-20b", "--arch", "compute_90"]) == 2
    assert warm.main(["--preset", "gpt-oss-20b", "--block-size", "48", "--arch", "sm_90"]) == 2


def test_warm_names_the_routing_module_a_layer_gets(cache, capsys):
    """Grouped sigmoid routing and expert counts have routing modules of their own: the DeepSeek presets route as the
    model (and list that module), and the flags give them to any model; a warmed cache then holds what the layer
    loads (the executor's config of a loaded DeepSeek-V3 layer has the same routing)."""
    assert warm.main(["--preset", "deepseek-v3-tp8", "--dtype", "bfloat16", "--arch", "sm_90", "--list"]) == 0
    out = capsys.readouterr().out
    assert "sm_90a route_bf16_rgemm1_sigmoid1\n" in out and "sigmoid routing (8 groups)" in out
    assert warm.main(["--preset", "qwen3-30b-a3b", "--dtype", "bfloat16", "--arch", "sm_90", "--scoring-func", "sigmoid",
                      "--n-group", "4", "--expert-counts", "--list"]) == 0
    out = capsys.readouterr().out
    assert "sm_90a route_bf16_counts1_sigmoid1\n" in out and "expert counts" in out
    cfg = PRESETS["qwen3-30b-a3b"].config(dtype="bfloat16", scoring_func="sigmoid", n_group=4, expert_counts=True)
    assert {s.name for s in modules_for(cfg, arch="sm_90a") if s.family == "route"} == {"route_bf16_counts1_sigmoid1"}
    assert warm.main(["--preset", "qwen3-30b-a3b", "--dtype", "bfloat16", "--arch", "sm_90", "--list"]) == 0
    assert "route_bf16_warp1\n" in capsys.readouterr().out  # softmax, no counts: the warp module as before
