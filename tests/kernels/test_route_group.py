"""Routing inside the grouping's launch (routing/route_group.cuh) on the CPU: which calls take it
(kernels/route.py routes_in_group), which steps the pipelines then drop, what the families launch instead, and that the
kernels compile. The GPU half (the same outputs bit for bit as the separate launches): test_route_group_gpu.py."""

from __future__ import annotations

import pytest

from qmoe_rtc.errors import KnobError
from qmoe_rtc.jit import CompileUnit, get_cubins
from qmoe_rtc.kernels import PIPELINES, Problem, get_family
from qmoe_rtc.kernels._grouped import group_key, grouped_scratch, lead_kernels
from qmoe_rtc.kernels.route import LEAD_MAX_ROUTES, LEAD_ROUTES, routes_in_group
from qmoe_rtc.settings import knobs
from qmoe_rtc.specialize import ModuleSpec


def _problem(rows: int, **kw) -> Problem:
    base = dict(E=128, H=2048, I=768, k=8, dtype="bfloat16", arch="sm_90a", sms=132)
    base.update(kw)
    return Problem(rows=rows, **base)


def test_the_rule_takes_calls_of_few_routes_routed_a_warp_a_row():
    assert routes_in_group(_problem(8)) and not routes_in_group(_problem(9))  # 64 / 72 routes
    assert LEAD_ROUTES == 64 and routes_in_group(_problem(32, k=2, E=8))
    for other in (dict(sparse=True, k=2, E=16), dict(shared=1, shared_gate=True), dict(sigmoid_routing=True),
                  dict(router_gemm="bfloat16"), dict(expert_counts=True), dict(E=300),
                  dict(router_weights_dtype="float32"), dict(router_dtype="float16")):
        assert not routes_in_group(_problem(2, **other)), other
    with knobs.scope(route_in_group="on"):
        assert routes_in_group(_problem(LEAD_MAX_ROUTES // 8)) and not routes_in_group(_problem(LEAD_MAX_ROUTES // 8 + 1))
    with knobs.scope(route_in_group="off"):
        assert not routes_in_group(_problem(1))
    with pytest.raises(KnobError, match="route_in_group"), knobs.scope(route_in_group="maybe"):
        routes_in_group(_problem(1))


@pytest.mark.parametrize("rows", [4, 64])
def test_prefill_pipelines_drop_the_steps_the_group_launch_does(rows):
    from qmoe_rtc.specialize.presets import get_preset

    cfg = get_preset("qwen3-30b-a3b").config(bits=4)
    p = _problem(rows, dtype=cfg.layout.dtype)
    lead = routes_in_group(p)
    assert lead is (rows == 4)
    for pipe in PIPELINES:
        roles = [s.role for s in pipe.steps_for(cfg, p)]
        full = [s.role for s in pipe.steps_for(cfg)]
        if pipe.path == "decode" or not lead:  # (route_in_decode is off by default: test_self_route.py)
            assert roles == full, pipe.name
        else:
            assert roles == [r for r in full if r not in ("route", "permute")], pipe.name
            fam = next(s.family for s in pipe.steps if s.role == "group")
            key = get_family(fam).kernel_for(get_family(fam).spec(cfg), "group", p)
            assert key == group_key(p, "wg_route_group" if fam == "wgmma_prefill" else "route_group"), (fam, key)
            assert {"topk_ids", "topk_w"} <= set(grouped_scratch("group", p, 2))


def test_the_wgmma_lead_launch_adds_the_permute_work_to_block_zero():
    from qmoe_rtc.specialize.presets import get_preset

    cfg = get_preset("gpt-oss-120b").config(bits=4)
    fam = get_family("wgmma_prefill")
    spec, p = fam.spec(cfg), _problem(8, E=128, H=2880, I=2880, k=4, dtype=cfg.layout.dtype)
    lead, permute = fam.launch(spec, "group", p), fam.launch(spec, "permute", p)
    assert lead.block == (1024, 1, 1) and lead.grid[0] == 1 + -(-permute.grid[0] * 256 // 1024)
    assert dict(lead.args) == dict(permute.args)
    assert {"xp", "tile_info", "tile_rows", "topk_ids", "sorted"} <= set(fam.scratch(spec, "group", p))
    assert not fam.configure(spec, p).pair


def test_the_lead_kernels_compile():
    spec = ModuleSpec.make("route_group_test", dtype="bfloat16")
    kernels = lead_kernels(spec)
    assert [k.key for k in kernels] == ["route_group_float32", "route_group_bfloat16"]  # one per logits dtype
    unit = CompileUnit("route_group_test", '#include "routing/route_group.cuh"\n', kernels)
    assert all(m.cubin for m in get_cubins(unit, "sm_90a"))
