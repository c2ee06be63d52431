"""Shared memory per block as an input of planning (CPU only): for the opt-in limits of sm_86 / sm_89 (99 KiB),
sm_80 (163 KiB) and sm_90 (227 KiB), every layout of the layout matrix at every row count gets a plan whose
kernels each ask for at most that much dynamic shared memory; a family whose smallest configuration does not fit
refuses the device in ``supports`` (the pipeline choice then warns and runs the next engine), and the wgmma
engine's device code takes its ring budget from the host."""

from __future__ import annotations

import itertools

import pytest

from qmoe_rtc.errors import CompileError, QMoEAttributeError, QMoEUnsupportedError
from qmoe_rtc.kernels import Problem, choose, decode_limit, get_family
from qmoe_rtc.kernels.arch import DEFAULT_SMEM, ArchSpec
from qmoe_rtc.settings import knobs
from qmoe_rtc.specialize import Layout, ModelConfig


def smem_optin(arch: str) -> int:
    """The budget a problem on target ``arch`` plans for (kernels/arch.py)."""
    return ArchSpec(arch).smem_limit


#: (target, its opt-in dynamic shared memory per block): the budgets the test plans for.
TARGETS = (("sm_86", 99 * 1024), ("sm_89", 99 * 1024), ("sm_80", 163 * 1024), ("sm_90a", 227 * 1024))
#: The matrix plans for sm_89 (99 KiB; FP8 on the tensor cores, where sm_86 runs it on the SIMT engines, which take
#: no dynamic shared memory), sm_80 and sm_90a.
MATRIX_TARGETS = TARGETS[1:]
ROWS = (1, 8, 64, 300, 2048, 4096)
#: (E, k, H, I): routes per expert from 1/16 to 256, past the largest route tile of every engine (shared memory
#: depends on the layout and the route tile, not on H or I).
SHAPES = ((64, 4, 2048, 768),)
GATES = ({"activation": "relu"}, {"activation": "swiglu", "swiglu_fusion": 1}, {"activation": "swiglu", "swiglu_fusion": 2},
         {"activation": "silu", "has_fc3": True})


def _codes():
    """(bits, weight format, zero-point mode, forced block size or None, scale dtype or '') of every code format."""
    for bits in (1, 2, 3, 4, 8):
        for zp in ("none", "packed"):
            yield bits, "int", zp, None, ""
    yield 8, "fp8_e4m3", "none", None, "float32"  # FP8 (e4m3fn), square blocks
    yield 4, "mxfp4", "none", 32, "float32"
    yield 4, "nvfp4", "none", 16, "float32"


def layouts() -> list[Layout]:
    """The layout matrix: every code format × block size × activation dtype × gate × tiled or not (the valid ones)."""
    out = []
    for (bits, fmt, zp, forced, sdt), block, dtype, gate, tiled in itertools.product(
            _codes(), (0, 16, 32, 64, 128), ("float16", "bfloat16", "float32"), GATES, (False, True)):
        if forced is not None and block != forced:
            continue
        fc3 = {"fc3_bits": bits, "fc3_zp": zp, "fc3_format": fmt} if gate.get("has_fc3") else {}
        try:
            out.append(Layout(dtype=dtype, scale_dtype=sdt, fc1_bits=bits, fc2_bits=bits, block_size=block, fc1_zp=zp,
                              fc2_zp=zp, fc1_format=fmt, fc2_format=fmt, tiled=tiled, **gate, **fc3))
        except QMoEAttributeError:
            continue  # not a layout (e.g. FP8 codes with an FC3)
    return out


def test_the_budget_table():
    assert [smem_optin(a) for a, _ in TARGETS] == [b for _, b in TARGETS]
    assert smem_optin("sm_90") == smem_optin("sm_90a") == 232448 and smem_optin("sm_80") == 166912
    assert smem_optin("sm_86") == smem_optin("sm_89") == 101376
    assert smem_optin("") == DEFAULT_SMEM == 232448  # unknown device: the H200's, where the rules were measured
    assert smem_optin("sm_99") == 101376  # a target the table does not list: the smallest listed
    p = Problem(rows=1, E=8, H=64, I=32, k=2, dtype="float16", arch="sm_86")
    assert p.smem_limit == 101376 and Problem(**{**p.__dict__, "smem": 5000}).smem_limit == 5000


@pytest.mark.parametrize("arch, budget", MATRIX_TARGETS)
def test_every_layout_gets_a_plan_that_fits(arch, budget):
    """Each path's chosen pipeline asks no block for more dynamic shared memory than the device allows (no launch
    would fail); a layout no pipeline runs is refused for reasons other than shared memory."""
    checked = 0
    for lay in layouts():
        for E, k, H, I in SHAPES:  # noqa: E741
            cfg = ModelConfig(hidden=H, inter=I, experts=E, k=k, layout=lay)
            specs: dict = {}
            for rows in ROWS:
                p = Problem(rows=rows, E=E, H=H, I=I, k=k, dtype=lay.dtype, arch=arch, smem=budget)
                for path in ("decode", "prefill"):
                    if path == "decode" and rows * k > max(decode_limit(cfg), 512):
                        continue
                    try:
                        chosen = choose(cfg, p, path).pipeline
                    except QMoEUnsupportedError as exc:
                        assert "shared memory" not in str(exc), (lay.name, rows, path, str(exc))
                        continue
                    for st in chosen.steps_for(cfg):
                        fam = get_family(st.family)
                        spec = specs.setdefault(st.family, fam.spec(cfg))
                        smem = fam.launch(spec, st.role, p).shared_mem
                        checked += 1
                        assert smem <= budget, (lay.name, E, rows, chosen.name, st.role, smem)
    assert checked > 10000


def _int8(tiled: bool = False, **kw) -> ModelConfig:
    return ModelConfig(hidden=2048, inter=768, experts=64, k=4,
                       layout=Layout(dtype="bfloat16", fc1_bits=8, fc2_bits=8, block_size=128, activation="swiglu",
                                     swiglu_fusion=1, tiled=tiled, **kw))


def test_int8_prefill_takes_a_smaller_route_tile_on_99_kib():
    """mma.sync prefill at 256 routes per expert: 64-route tiles of int8 take 104 KiB on three stages; on sm_86 the
    call takes 32-route tiles (kernel, grouping and launch agree), on sm_80 it keeps 64."""
    fam, cfg = get_family("mma_prefill"), _int8()
    spec = fam.spec(cfg)
    for arch, br in (("sm_86", 32), ("sm_80", 64)):
        p = Problem(rows=4096, E=64, H=2048, I=768, k=4, dtype="bfloat16", arch=arch)
        assert fam.supports(cfg, p) is None
        assert fam.kernel_for(spec, "fc1", p) == f"fc1_br{br}" and fam.kernel_for(spec, "fc2", p) == f"fc2_br{br}"
        assert dict(fam.launch(spec, "group", p).args)["BR"] == br
        assert max(fam.launch(spec, r, p).shared_mem for r in ("fc1", "fc2")) <= smem_optin(arch)


def test_a_family_that_cannot_fit_is_refused_and_the_choice_warns():
    """Tuning knobs that make every configuration too large: the family refuses the device naming the limit, and the
    choice runs the next engine (its reason is what the executor warns with)."""
    p = Problem(rows=4096, E=64, H=2048, I=768, k=4, dtype="bfloat16", arch="sm_86")
    with knobs.scope(prefill_stages=4, prefill_warps=8):  # 16-route tiles of int8: 180 KiB
        why = get_family("mma_prefill").supports(_int8(), p)
        assert why and "101376" in why and "opt-in" in why
        c = choose(_int8(), p, "prefill")
        assert c.pipeline.name == "prefill-simt" and "101376" in dict(c.skipped)["prefill-mma"]
        # tiled codes, which the SIMT engine does not read: the batched engine, passed over as slower, still runs
        t = choose(_int8(tiled=True), p, "prefill")
        assert t.pipeline.name == "prefill-batched" and "prefill-simt" not in dict(t.skipped)
        assert get_family("mma_prefill").supports(_int8(), Problem(**{**p.__dict__, "arch": "sm_90a"})) is None
    with knobs.scope(prefill_stages=6, prefill_warps=8):  # 240 KiB: too large for sm_90 too (it used to launch)
        assert "232448" in get_family("mma_prefill").supports(_int8(), Problem(**{**p.__dict__, "arch": "sm_90a"}))
    rows8 = Problem(rows=8, E=64, H=2048, I=768, k=4, dtype="bfloat16", arch="sm_86")
    with knobs.scope(batched_stages=6):  # two row tiles of int8: 108 KiB of rings
        why = get_family("mma_batched").supports(_int8(tiled=True), rows8)
        assert why and "101376" in why and "QMOE_RTC_TUNE=batched_stages" in why
        assert get_family("mma_batched").supports(_int8(tiled=True), Problem(**{**rows8.__dict__, "arch": "sm_90a"})) is None


def test_wgmma_needs_its_budget():
    """The wgmma engine's rings are sized for sm_90a's 227 KiB; a device that allows less is refused."""
    cfg, fam = _int8(), get_family("wgmma_prefill")
    p = Problem(rows=4096, E=64, H=2048, I=768, k=4, dtype="bfloat16", arch="sm_90a")
    assert fam.supports(cfg, p) is None
    assert "opt-in" in fam.supports(cfg, Problem(**{**p.__dict__, "smem": 101376}))


def test_wgmma_device_takes_the_budget_from_the_host():
    """wg_mainloop.cuh does not restate the budget nor decide a ring: the module's defines carry the host's budget, its
    generated unit the host's rings, and the header refuses to compile without them."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.kernels.wgmma_geometry import SMEM_BUDGET

    fam = get_family("wgmma_prefill")
    spec = fam.spec(_int8())
    assert f"-DQMOE_WG_STAGE_BUDGET={SMEM_BUDGET}" in fam.defines(spec)
    assert "#define QMOE_WG_RINGS" in fam.source(spec) and "#define QMOE_WG_FC1_BOUNDS" in fam.source(spec)
    with pytest.raises(CompileError, match="QMOE_WG_RINGS"):
        compiler.compile_unit("budget_missing", '#include "engines/wg_mainloop.cuh"\n', {}, "sm_90",
                              compiler.base_options("sm_90", fam.defines(spec)))
