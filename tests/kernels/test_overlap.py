"""Programmatic dependent launch (CPU only): which launches may overlap their predecessor, that their
device code waits before it reads what an earlier launch wrote, and that the bound launches overlap
all but the first step, only on sm_90+ and only while the ``pdl`` knob is on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_pipelines import CONFIGS

from qmoe_rtc.jit import Launch, driver
from qmoe_rtc.kernels import PIPELINES, Problem, get_family
from qmoe_rtc.runtime.plan import BoundLaunches, overlap_allowed
from qmoe_rtc.settings import knobs

SRC = Path(__file__).resolve().parents[2] / "qmoe_rtc" / "cuda_src"
# (family, role) -> (template file, kernel function, or the body both forms of a kernel run) of every launch that
# declares overlap
OVERLAPPED = {("route", "route"): ("routing/route.cuh", "route_topk"),
              ("mma_decode", "fc1"): ("engines/mma_decode.cuh", "fc1_mma"),
              ("mma_decode", "fc2"): ("engines/mma_decode.cuh", "fc2_mma_combine"),
              ("wgmma_prefill", "group"): ("routing/group.cuh", "group_by_expert"),
              ("wgmma_prefill", "permute"): ("engines/wgmma_prefill.cuh", "wg_prepare"),
              ("wgmma_prefill", "fc1"): ("engines/wgmma_prefill.cuh", "fc1_body"),
              ("wgmma_prefill", "fc2"): ("engines/wgmma_prefill.cuh", "fc2_body"),
              ("wgmma_prefill", "combine"): ("epilogue/combine.cuh", "combine_routes")}


@pytest.mark.parametrize("arch, want", [("sm_80", False), ("sm_86", False), ("sm_89", False), ("sm_90", True),
                                        ("sm_90a", True), ("sm_100a", True), ("", False)])
def test_overlap_only_on_sm90_and_newer(arch, want):
    assert overlap_allowed(arch) is want
    with knobs.scope(pdl=False):
        assert overlap_allowed(arch) is False


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.layout.name for c in CONFIGS])
@pytest.mark.parametrize("rows", (1, 8, 300))
def test_only_launches_whose_kernels_wait_declare_overlap(cfg, rows):
    problem = Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype,
                      shared=cfg.shared, shared_gate=cfg.shared_gate, router_gemm=cfg.router_gemm,
                      all_experts=cfg.all_experts)
    for pipeline in PIPELINES:
        if any(get_family(f).supports(cfg, problem) for f in pipeline.families):
            continue
        for st in pipeline.steps_for(cfg):
            fam = get_family(st.family)
            launch = fam.launch(fam.spec(cfg), st.role, problem)
            assert launch.overlap == ((st.family, st.role) in OVERLAPPED), (pipeline.name, st)


def _body(text: str, fn: str) -> str:
    """The source of ``__global__`` (or ``__device__``) function ``fn``: from its name to the next function (or the end)."""
    start = re.search(rf"__(global|device)__[^{{;]*?\b{fn}\(", text)
    assert start, fn
    rest = text[start.end():]
    nxt = re.search(r"__global__|__device__", rest)
    return rest[: nxt.start()] if nxt else rest


#: kernels that wait in a helper they call first: the helper, and the call that stands for its wait
WAITS_IN = {"route_topk": "route_row_start", "route_grouped": "route_row_start"}


def test_the_routing_row_start_releases_only_after_its_wait():
    body = _body((SRC / "routing/route.cuh").read_text(), "route_row_start")
    assert body.index("pdl_wait();") < body.index("pdl_release();") < body.index("topk_ids[")


@pytest.mark.parametrize("where", sorted([*OVERLAPPED.values(), ("routing/route_warp.cuh", "route_topk_warp"),
                                           ("routing/route_grouped.cuh", "route_grouped"),
                                           ("routing/route_group.cuh", "route_group"),
                                           ("engines/wgmma_prefill.cuh", "wg_route_group"),
                                           ("engines/wgmma_prefill.cuh", "wg_prepare_image")]))
def test_overlapped_kernels_wait_before_reading_earlier_outputs(where):
    path, fn = where
    body = _body((SRC / path).read_text(), fn)
    wait = body.index(f"{WAITS_IN[fn]}<" if fn in WAITS_IN else "pdl_wait();")
    # what each kernel reads that the launch before it writes: logits, ids (FC1), act (FC2); the wgmma prefill's:
    # the routes' ids (grouping), the grouping (wg_prepare's tile table), the tile table (FC1), act_sorted (FC2's
    # main loop; its tile lookup before the wait reads only what was complete when FC1's wait returned), y (combine)
    first_read = {"route_topk": r"l\[e\]", "route_topk_warp": r"route_row_warp<", "route_group": r"route_and_group<",
                      "wg_route_group": r"wg_permute_rows<|route_and_group<", "route_grouped": r"l\[e\]",
                  "fc1_mma": r"ids\[blockIdx\.y\]",
                  "fc2_mma_combine": r"collect_routes\(", "group_by_expert": r"group_routes\(",
                  "wg_prepare": r"build_tile_table\(", "wg_prepare_image": r"build_tile_table\(", "fc1_body": r"pf_tile_table<",
                  "fc2_body": r"wg_tile<",
                  "combine_routes": r"ids\[r\]"}[fn]
    assert wait < re.search(first_read, body).start(), fn
    if "pdl_release();" in body:  # release only after the wait: the next kernel may then read our inputs
        assert body.index("pdl_release();") > wait, fn


class _Kernel:
    function = "fn"

    def pack(self, values):
        return type("Params", (), {"names": (), "values": [], "address": 0})()

    def reserve_dynamic_smem(self, nbytes):
        pass


class _Pool:
    bufs: dict = {}
    generation = 0

    def address(self, name):
        return 0


def _bound(arch: str, overlaps: tuple[bool, ...], monkeypatch) -> tuple:
    monkeypatch.setattr(driver, "launch_config", lambda g, b, smem, overlap: ("cfg", overlap))
    steps = [type("Step", (), {"kernel": _Kernel(), "launch": Launch((1, 1, 1), (32, 1, 1), 0, overlap=o)})()
             for o in overlaps]
    plan = type("Plan", (), {"problem": Problem(rows=1, E=8, H=64, I=32, k=2, dtype="float16", arch=arch),
                             "steps": steps})()
    return BoundLaunches(plan, _Pool(), {}).overlapped


def test_bound_launches_overlap_all_but_the_first(monkeypatch):
    assert _bound("sm_90a", (True, True, True), monkeypatch) == (None, ("cfg", True), ("cfg", True))
    assert _bound("sm_90a", (True, False, True), monkeypatch) == (None, None, ("cfg", True))
    assert _bound("sm_89", (True, True, True), monkeypatch) == (None, None, None)
    with knobs.scope(pdl=False):
        assert _bound("sm_90a", (True, True, True), monkeypatch) == (None, None, None)


def test_info_says_whether_launches_overlap():
    from qmoe_rtc.__main__ import _overlap_note

    assert _overlap_note(90) == ", overlapped launches on"
    assert _overlap_note(86) == ", overlapped launches off (sm_90+ only)"
    with knobs.scope(pdl=False):
        assert _overlap_note(100) == ", overlapped launches off"
