"""The plans the executor makes for the presets (CPU only, tests/support/plan_walk.py): on every supported arch no launch asks
a block for more dynamic shared memory than the arch allows, and on sm_90 every decision is the one recorded before
the thresholds became per-arch tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qmoe_rtc.kernels.arch import ArchSpec

from support import plan_walk

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "plan_decisions_sm90.json"


@pytest.mark.parametrize("target", sorted(plan_walk.SMS))
def test_every_launch_fits_the_arch(target):
    """Every preset's default layout (tiled and contract codes) at 1..64, 128, 512 and 4096 tokens: each launch of
    the plan asks for at most the arch's opt-in shared memory per block (kernels/arch.py SMEM_OPTIN)."""
    limit = ArchSpec(target).smem_limit
    worst = 0
    for name, cfg in plan_walk.configs().items():
        for rows in plan_walk.TOKENS:
            plan = plan_walk.plan_of(cfg, rows, target)
            for family, role, kernel, _grid, _block, smem, *_ in plan["steps"]:
                assert smem <= limit, (target, name, rows, plan["pipeline"], family, role, kernel, smem, limit)
                worst = max(worst, smem)
    assert worst > 0  # the walk reached the ring engines


def test_sm90_decisions_are_the_recorded_ones():
    """sm_90a (132 SMs, 227 KiB): the path, pipeline, each family's configure() result and every launch (kernel,
    grid, block, shared memory, scalars, overlap, scratch) of every preset's plan at every recorded token count equal
    those of tests/data/plan_decisions_sm90.json, written by tests/support/plan_walk.py (``PYTHONPATH=. python
    tests/support/plan_walk.py tests/data/plan_decisions_sm90.json``). The launches are those of the code before the per-arch
    tables (commit 552a74d); the scratch was added to the record at commit 37f0bd1's code, which still gave those
    launches. Rewritten when the wgmma FC2 could run K in parts: every grouped plan's combine gained its planes' scalars
    (parts, plane) and the wgmma FC2 its plane stride (YS); with those left out, the plans were those before but at the
    calls the parts rule takes (mixtral-8x7b at 3-4 tokens, ort-2048 at 18-64: 2 parts). Rewritten when the batched
    engine's blocks could stage their activations: every batched plan's configure() gained the choice (xb); with the
    knob batched_x_block off the launches were those before; on by its rule, the _xb kernels and their shared memory
    in one GEMM or both at the calls where the stages fit (qwen3-30b-a3b and deepseek-v3-tp8 at 3-64 tokens,
    qwen3-next-80b-a3b at 3-64 and 128, ort-2048 at 3-17). Rewritten when the batched engine took a ring of 4 stages
    with registers for 4 blocks an SM on layers of 64 experts or more: the batched plans of qwen3-30b-a3b,
    qwen3-next-80b-a3b and deepseek-v3-tp8 (their rings' bytes and, with them, which GEMMs take the x stages). A change
    that only changes what a family's configure() returns rewrites the last digest of each entry, never the one before
    it. Rewritten when the grouped engines could route in their group launch (kernels/route.py routes_in_group): with
    the knob route_in_group off every launch was the one before (the wgmma configure() gained ``lead``); on by its rule
    (up to 64 routes) the routing and wgmma's permute steps gone and the group step's lead kernel at qwen3-30b-a3b 3-8
    tokens, mixtral-8x7b and ort-2048 3-32, gpt-oss-20b 4-16, gpt-oss-120b 7-16. Rewritten when the decode kernels could
    route a call themselves (kernels/route.py routes_in_decode): every decode plan's two GEMMs gained the scalars
    ``self_route`` (0: the knob route_in_decode is off by default) and ``logits_f32`` and configure() its choice; at the
    same time the walk (tests/support/plan_walk.py) began to drop the steps a call routes inside, as Plan.build does, so
    the grouped plans the route_in_group rule takes lost their routing (and wgmma's permute) steps here too.
    """
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["target"] == "sm_90a" and tuple(fixture["tokens"]) == plan_walk.TOKENS
    now = plan_walk.decisions("sm_90a")
    assert set(now) == set(fixture["plans"])
    changed = [(name, rows, was, plan_walk.plan_of(plan_walk.configs()[name], rows, "sm_90a"))
               for name in now for rows, was, got in zip(plan_walk.TOKENS, fixture["plans"][name], now[name])
               if was != got]
    assert not changed, changed[:3]
