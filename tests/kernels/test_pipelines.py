"""Pipelines as data (CPU only): every argument of every kernel a pipeline launches is bound by name
from the executor's table, the scratch the pipeline declares, its launch scalars or the per-call
arrays; every pipeline step names a kernel its module has; the engine choice and its reasons."""

from __future__ import annotations

import dataclasses

import pytest

from qmoe_rtc.kernels import PIPELINES, Problem, choose, decode_limit, get_family
from qmoe_rtc.kernels.arch import ArchSpec
from qmoe_rtc.specialize import Layout, ModelConfig

from support.bindings import check_every_argument_bound

L = Layout
CONFIGS = [
    ModelConfig(hidden=2048, inter=768, experts=128, k=8,
                layout=L(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)),
    ModelConfig(hidden=256, inter=128, experts=8, k=2,
                layout=L(dtype="float16", fc1_bits=2, fc2_bits=8, fc3_bits=2, has_fc3=True, block_size=16,
                         activation="silu", fc1_zp="packed", fc3_zp="packed")),
    ModelConfig(hidden=256, inter=128, experts=16, k=4,
                layout=L(dtype="float32", fc1_bits=3, fc2_bits=4, block_size=0, activation="geglu", swiglu_fusion=2,
                         fc2_zp="offset")),
    ModelConfig(hidden=100, inter=36, experts=8, k=2, layout=L(dtype="float16", fc1_bits=4, fc2_bits=4, activation="relu")),
    # [ext] shared experts with the gate and the router GEMM; shared only; router GEMM in float32 on float32
    ModelConfig(hidden=2048, inter=512, experts=512, k=10, shared=1, shared_gate=True, router_gemm="bfloat16",
                layout=L(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)),
    ModelConfig(hidden=256, inter=128, experts=8, k=2, shared=2,
                layout=L(dtype="float16", fc1_bits=8, fc2_bits=8, activation="gelu", fc1_zp="packed", fc2_zp="packed")),
    ModelConfig(hidden=256, inter=128, experts=16, k=4, router_gemm="float32",
                layout=L(dtype="float32", fc1_bits=4, fc2_bits=4, activation="silu")),
    # [ext] an expert slice (4 of 16 experts held) with a shared expert and the router GEMM
    ModelConfig(hidden=256, inter=128, experts=4, k=6, all_experts=16, shared=1, router_gemm="float16",
                layout=L(dtype="float16", fc1_bits=4, fc2_bits=4, block_size=64, activation="swiglu", swiglu_fusion=1)),
]
ROWS = (1, 7, 64, 1000)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.layout.name for c in CONFIGS])
@pytest.mark.parametrize("rows", ROWS)
def test_every_kernel_argument_is_bound_by_name(cfg, rows):
    check_every_argument_bound(cfg, rows)


def test_choice_prefers_tensor_cores_and_says_why_not():
    tc = CONFIGS[0]
    assert choose(tc, None, "decode").pipeline.name == "decode-mma"
    assert choose(tc, None, "prefill").pipeline.name == "prefill-wgmma"  # the first that runs it (device unknown)
    many = Problem(rows=100, E=tc.experts, H=tc.hidden, I=tc.inter, k=tc.k, dtype="bfloat16")
    c = choose(tc, many, "decode")  # 800 routes: more than one decode block scans
    assert c.pipeline.name == "decode-gemv" and "800 routes" in c.skipped[0][1]
    simt = choose(CONFIGS[2], None, "prefill")
    assert simt.pipeline.name == "prefill-simt" and "float32" in simt.skipped[0][1]
    odd = choose(CONFIGS[3], None, "decode")
    assert odd.pipeline.name == "decode-gemv" and "multiples of 32" in odd.skipped[0][1]


def test_decode_limit_is_the_measured_crossover():
    """Tensor-core layers: 4 tokens (the batched-decode engine is faster from 8, docs/performance-log.md
    session 11); SIMT-only layers: 8 tokens for experts up to ~12 MB, 16 for mixtral's 88 MB ones."""
    lay = CONFIGS[0].layout
    assert decode_limit(CONFIGS[0]) == 4 * 8  # qwen3-30b-a3b: k 8
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=lay)
    assert decode_limit(mixtral) == 4 * 2
    assert decode_limit(dataclasses.replace(mixtral, k=64, experts=256)) == 256
    assert decode_limit(dataclasses.replace(mixtral, k=200, experts=256)) == 512  # what one decode block scans
    simt = dataclasses.replace(mixtral, layout=dataclasses.replace(lay, dtype="float32", scale_dtype="float32"))
    assert decode_limit(simt) == 16 * 2
    assert decode_limit(dataclasses.replace(simt, inter=2048)) == 8 * 2


def _problem(cfg, rows, arch="sm_90a"):
    return Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype, arch=arch)


def test_prefill_engine_by_device_and_size():
    """On a device whose arch has no measured crossovers (here: unknown), wgmma from MIN_ROUTES_PER_EXPERT routes
    per expert, whatever the block size (no warning below: it is a measured preference); below it the
    batched-decode engine up to its own bound, then mma.sync; mma.sync on other devices (a warning: a limit);
    the knob forces either. sm_90a's measured rule: tests/kernels/test_engine_choice.py."""
    from qmoe_rtc.settings import knobs
    MIN_ROUTES_PER_EXPERT = ArchSpec().tuning.wgmma_min_routes  # an unknown device's table (the default)

    tc = CONFIGS[0]  # 128 experts, k 8: rows r give r / 16 routes per expert
    for block in (0, 32, 128):
        cfg = dataclasses.replace(tc, layout=dataclasses.replace(tc.layout, block_size=block))
        for rows in (16 * MIN_ROUTES_PER_EXPERT, 4096):
            for arch in ("", "sm_90a"):
                c = choose(cfg, _problem(cfg, rows, arch), "prefill")
                assert c.pipeline.name == "prefill-wgmma" and not c.skipped and not c.passed, (block, rows, arch)
    below = choose(tc, _problem(tc, 16 * (MIN_ROUTES_PER_EXPERT - 1), ""), "prefill")
    assert below.pipeline.name != "prefill-wgmma" and f"(< {MIN_ROUTES_PER_EXPERT}:" in dict(below.passed)["prefill-wgmma"]
    small_rows = 16 * 4
    small = choose(tc, _problem(tc, small_rows), "prefill")
    assert small.pipeline.name == "prefill-batched" and not small.skipped
    assert [n for n, _ in small.passed] == ["prefill-wgmma"]
    a100 = choose(tc, _problem(tc, 4096, "sm_80"), "prefill")
    assert a100.pipeline.name == "prefill-mma" and "sm_90a" in a100.skipped[0][1]
    assert [n for n, _ in a100.passed] == ["prefill-batched"] and "routes per expert" in a100.passed[0][1]
    with knobs.scope(prefill_engine="wgmma"):
        assert choose(tc, _problem(tc, small_rows), "prefill").pipeline.name == "prefill-wgmma"
    with knobs.scope(prefill_engine="mma"):
        assert choose(tc, _problem(tc, 4096), "prefill").pipeline.name == "prefill-mma"
    with knobs.scope(prefill_engine="batched"):
        assert choose(tc, _problem(tc, 4096), "prefill").pipeline.name == "prefill-batched"


def test_batched_engine_by_routes_per_expert():
    """The batched-decode engine runs up to 6 routes per expert on layers whose routes reach many
    experts, up to 12 on layers of few experts (measured, session 11); with two row tiles per warp (tiled
    codes, a scale per chunk) up to 8 / 16 (session 12); a pass holds twice the average routes."""
    from qmoe_rtc.kernels.mma_batched import row_tiles, tile_routes

    fam = get_family("mma_batched")
    qwen3 = CONFIGS[0]  # 128 experts, k 8: rows r give r / 16 routes per expert
    assert fam.slower(qwen3, _problem(qwen3, 96)) is None  # 6 per expert
    assert "routes per expert" in fam.slower(qwen3, _problem(qwen3, 128))  # 8
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=qwen3.layout)  # rows r: r / 4
    assert fam.slower(mixtral, _problem(mixtral, 48)) is None  # 12 per expert
    assert fam.slower(mixtral, _problem(mixtral, 64)) is not None
    # on a device of no measured crossovers; on sm_90a mixtral's large experts take wgmma (test_engine_choice.py)
    assert choose(mixtral, _problem(mixtral, 8, ""), "prefill").pipeline.name == "prefill-batched"
    assert choose(mixtral, _problem(mixtral, 8), "prefill").pipeline.name == "prefill-wgmma"
    tiled = dataclasses.replace(qwen3.layout, tiled=True)
    assert (row_tiles(True, 128), row_tiles(True, 0), row_tiles(True, 32), row_tiles(False, 128)) == (2, 2, 1, 1)
    qwen3_t, mixtral_t = (dataclasses.replace(c, layout=tiled) for c in (qwen3, mixtral))
    assert fam.spec(qwen3_t)["row_tiles"] == 2 and fam.spec(qwen3)["row_tiles"] == 1
    assert fam.slower(qwen3_t, _problem(qwen3_t, 128)) is None  # 8 per expert
    assert fam.slower(qwen3_t, _problem(qwen3_t, 144)) is not None  # 9
    assert fam.slower(mixtral_t, _problem(mixtral_t, 64)) is None  # 16
    assert fam.slower(mixtral_t, _problem(mixtral_t, 68)) is not None  # 17
    # BR: the fewest of 8, 16, 32 routes per pass >= 2 × the average routes per expert
    assert [tile_routes(_problem(mixtral, r)) for r in (8, 16, 17, 32, 33, 64, 512)] == [8, 8, 16, 16, 32, 32, 32]


@pytest.mark.parametrize("arch", ["", "sm_90a"])
def test_prefill_engine_counts_only_a_slices_own_routes(arch):
    """An expert slice [ext] computes only the routes to its experts (the rest are skipped), so the
    wgmma / batched crossover counts its expected share: a slice of 64 of 128 experts sees the same
    routes per expert as the whole layer at the same rows (counting every route would double it). Unknown
    device: MIN_ROUTES_PER_EXPERT (8) routes per expert; sm_90a: the measured 4.5 (kernels/engine_choice.py)."""
    MIN_ROUTES_PER_EXPERT = ArchSpec().tuning.wgmma_min_routes  # an unknown device's table (the default)

    tc = CONFIGS[0]  # 128 experts, k 8
    below, at = (16 * (MIN_ROUTES_PER_EXPERT - 1), 16 * MIN_ROUTES_PER_EXPERT) if not arch else (64, 80)  # 4.07 / 5.0
    half = dataclasses.replace(_problem(tc, below, arch), E=64, all_experts=128)
    assert get_family("wgmma_prefill").slower(tc, half) is not None
    assert get_family("wgmma_prefill").slower(tc, dataclasses.replace(half, rows=at)) is None
    # the whole layer at the same rows: the same routes per expert, the same answer
    assert get_family("wgmma_prefill").slower(tc, _problem(tc, below, arch)) is not None
    assert get_family("wgmma_prefill").slower(tc, _problem(tc, at, arch)) is None


def test_warm_modules_cover_both_prefill_engines():
    """The wgmma family runs only at some sizes: the warm tool also gets the mma.sync modules after it,
    and on a non-Hopper arch only those."""
    from qmoe_rtc.kernels import modules_for

    fams = {s.family for s in modules_for(CONFIGS[0], ("prefill",))}
    assert {"wgmma_prefill", "mma_prefill"} <= fams and "gemm" not in fams
    assert "wgmma_prefill" not in {s.family for s in modules_for(CONFIGS[0], ("prefill",), arch="sm_80")}
    for arch in ("sm_90", "sm_90a"):  # the same target
        assert "wgmma_prefill" in {s.family for s in modules_for(CONFIGS[0], ("prefill",), arch=arch)}


def test_the_readme_engine_table_is_the_one_pipelines_give():
    """README.md's engine table is generated from PIPELINES (``python -m qmoe_rtc info --engines`` prints it, to paste
    between the markers): one source, so a pipeline added or changed shows in the table or fails here."""
    import subprocess
    import sys
    from pathlib import Path

    from qmoe_rtc.kernels.pipelines import engine_table

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    table = engine_table()
    begin, end = "<!-- engine table: python -m qmoe_rtc info --engines -->\n", "<!-- end of engine table -->\n"
    assert begin + table + end in readme, "paste `python -m qmoe_rtc info --engines` between the README's markers"
    assert all(f"`{p.name}`" in table and p.engine and p.takes for p in PIPELINES)
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "info", "--engines"], capture_output=True, text=True,
                       cwd=root, timeout=60)
    assert r.returncode == 0 and r.stdout == table, r.stderr


#: A layer with the router GEMM, routed a warp a row (mixtral-8x7b's shape), and one routed a block a row (512 experts,
#: a gated shared expert): the families that make per-call choices, at token counts from decode to prefill.
CALL_CONFIGS = {"mixtral rgemm": ModelConfig(hidden=4096, inter=14336, experts=8, k=2, router_gemm="bfloat16",
                                             layout=CONFIGS[0].layout), "shared gate": CONFIGS[4]}
CALL_PIPELINES = ("decode-mma", "prefill-batched", "prefill-mma", "prefill-wgmma")


class _Kernels(dict):
    """A loaded module stand-in for Plan.build: each kernel as its key."""

    def __missing__(self, key):
        return key


@pytest.mark.parametrize("name", CALL_CONFIGS)
@pytest.mark.parametrize("pipeline_name", CALL_PIPELINES)
@pytest.mark.parametrize("rows", [1, 4, 64, 512, 4096])
def test_a_plan_makes_each_familys_call_choices_once(monkeypatch, name, pipeline_name, rows):
    """launched() and Plan.build each ask each family's configure once per call and hand the result to kernel_for /
    launch / scratch, which give with it what they give computing it themselves (every step of the routing, decode,
    batched, mma.sync and wgmma pipelines)."""
    from qmoe_rtc.runtime.plan import Plan, launched

    cfg = CALL_CONFIGS[name]
    p = dataclasses.replace(_problem(cfg, rows), sms=132, shared=cfg.shared, shared_gate=cfg.shared_gate,
                            router_gemm=cfg.router_gemm)
    pipeline = next(pl for pl in PIPELINES if pl.name == pipeline_name)
    if any(get_family(f).supports(cfg, p) for f in pipeline.families):
        assert pipeline_name == "decode-mma" and p.routes > 512  # one decode block scans at most 512 routes
        return
    specs = {f: get_family(f).spec(cfg) for f in pipeline.families}
    real = {f: type(get_family(f)).configure for f in pipeline.families}
    calls = {f: real[f](get_family(f), specs[f], p) for f in pipeline.families}
    assert all(c is not None for c in calls.values())  # each of these families has choices to share
    counted = []
    for f in pipeline.families:
        monkeypatch.setattr(type(get_family(f)), "configure",
                            lambda self, s, q, f=f: counted.append(f) or real[f](self, s, q))
    keys = launched(pipeline, specs, cfg, p)
    assert sorted(counted) == sorted(pipeline.families) and all(keys.values())
    plan = Plan.build(cfg, p, pipeline, specs, {spec: _Kernels() for spec in specs.values()})
    assert sorted(counted) == sorted(2 * pipeline.families)
    for st, built in zip(pipeline.steps_for(cfg), plan.steps, strict=True):
        fam, spec, call = get_family(st.family), specs[st.family], calls[st.family]
        assert fam.kernel_for(spec, st.role, p, call) == fam.kernel_for(spec, st.role, p) == built.kernel
        assert fam.launch(spec, st.role, p, call) == fam.launch(spec, st.role, p) == built.launch
        assert fam.scratch(spec, st.role, p, call) == fam.scratch(spec, st.role, p) == built.scratch
