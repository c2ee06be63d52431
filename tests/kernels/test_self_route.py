"""The decode kernels' own routing (engines/self_route.cuh) on the CPU: which calls take it (kernels/route.py
routes_in_decode), and that the decode pipeline then drops its routing step and passes the kernels ``self_route``. The
GPU half (the same outputs bit for bit as the routing launch): test_self_route_gpu.py."""

from __future__ import annotations

import pytest

from qmoe_rtc.errors import KnobError, QMoEUnsupportedError
from qmoe_rtc.kernels import PIPELINES, Problem, get_family
from qmoe_rtc.kernels.route import SELF_ROUTE_MAX_ROUTES, SELF_ROUTE_ROWS, routes_in_decode, routes_inside
from qmoe_rtc.settings import knobs


def _problem(rows: int, **kw) -> Problem:
    base = dict(E=128, H=2048, I=768, k=8, dtype="bfloat16", arch="sm_90a", sms=132)
    base.update(kw)
    return Problem(rows=rows, **base)


@pytest.fixture
def own_routing():
    """The knob on (it is off by default until the GPU tests and timings have run)."""
    with knobs.scope(route_in_decode="auto"):
        yield


def test_the_host_hands_the_device_its_limits():
    """The route bound the device's FC2 sizes its weights by comes from the host (the generated unit), and the rows a
    block routes are its warps."""
    from qmoe_rtc.kernels import mma_decode
    from qmoe_rtc.specialize.presets import get_preset

    fam = get_family("mma_decode")
    lines = fam.decisions(fam.spec(get_preset("qwen3-30b-a3b").config(bits=4)))
    assert f"#define QMOE_SELF_ROUTE_MAX_ROUTES {SELF_ROUTE_MAX_ROUTES}" in lines
    assert SELF_ROUTE_ROWS == mma_decode.WARPS


def test_off_by_default():
    assert knobs.get("route_in_decode") == "off" and not routes_in_decode(_problem(1))


def test_the_rule_takes_calls_of_a_few_rows_routed_a_warp_a_row(own_routing):
    assert [routes_in_decode(_problem(r)) for r in range(1, 7)] == [True] * SELF_ROUTE_ROWS + [False] * 2
    assert SELF_ROUTE_ROWS == 4 and SELF_ROUTE_MAX_ROUTES == 64
    assert routes_in_decode(_problem(2, k=32, E=64)) and not routes_in_decode(_problem(3, k=32, E=64))  # 64 / 96 routes
    assert routes_in_decode(_problem(2, shared=1))  # shared experts without a gate: slots of their own
    assert not routes_in_decode(_problem(0))
    for other in (dict(sparse=True, k=2, E=16), dict(shared=1, shared_gate=True), dict(sigmoid_routing=True),
                  dict(router_gemm="bfloat16"), dict(expert_counts=True), dict(E=300),
                  dict(router_weights_dtype="float32"), dict(router_dtype="float16")):
        assert not routes_in_decode(_problem(1, **other)), other
    with knobs.scope(route_in_decode="on"):
        assert routes_in_decode(_problem(4)) and not routes_in_decode(_problem(5))
    with knobs.scope(route_in_decode="off"):
        assert not routes_in_decode(_problem(1))
    with pytest.raises(KnobError, match="route_in_decode"), knobs.scope(route_in_decode="maybe"):
        routes_in_decode(_problem(1))
    with pytest.raises(QMoEUnsupportedError, match="fc2"):
        routes_inside("fc2", _problem(1))


@pytest.mark.parametrize("rows", [1, 4, 5])
def test_the_decode_pipeline_drops_its_routing_step_and_tells_the_kernels(rows, own_routing):
    from qmoe_rtc.specialize.presets import get_preset

    cfg = get_preset("qwen3-30b-a3b").config(bits=4)
    p = _problem(rows, dtype=cfg.layout.dtype)
    own = routes_in_decode(p)
    assert own is (rows <= 4)
    fam = get_family("mma_decode")
    spec = fam.spec(cfg)
    call = fam.configure(spec, p)
    assert call.self_route is own and call.br == 8
    for pipe in PIPELINES:
        if pipe.path != "decode":
            continue
        roles = [s.role for s in pipe.steps_for(cfg, p)]
        full = [s.role for s in pipe.steps_for(cfg)]
        assert full[0] == "route"
        assert roles == (full[1:] if own and pipe.name == "decode-mma" else full), pipe.name  # the SIMT engine routes apart
    for role in ("fc1", "fc2"):
        args = dict(fam.launch(spec, role, p, call).args)
        assert args["self_route"] == int(own) and args["logits_f32"] == 1, (role, args)
        assert {"topk_ids", "topk_w"} <= set(fam.scratch(spec, "fc1", p, call))  # bound by name with no routing step
    with knobs.scope(route_in_decode="off"):
        assert [s.role for s in PIPELINES[0].steps_for(cfg, p)][0] == "route"
        assert dict(fam.launch(spec, "fc1", p, fam.configure(spec, p)).args)["self_route"] == 0
    bf16 = _problem(rows, dtype=cfg.layout.dtype, router_dtype="bfloat16")
    assert dict(fam.launch(spec, "fc2", bf16, fam.configure(spec, bf16)).args)["logits_f32"] == 0


def test_an_executor_plan_starts_with_fc1_where_the_kernels_route(own_routing):
    """The executor's plan (CPU: the module's kernels not loaded, only the steps and their launches): no routing launch,
    FC1 first, so runtime/plan.py never launches it overlapped."""
    from qmoe_rtc.kernels.pipelines import choose
    from qmoe_rtc.specialize.presets import get_preset

    cfg = get_preset("mixtral-8x7b").config(bits=4)
    p = _problem(1, E=8, H=4096, I=14336, k=2, dtype=cfg.layout.dtype)
    pipe = choose(cfg, p, "decode").pipeline
    steps = pipe.steps_for(cfg, p)
    assert pipe.name == "decode-mma" and [(s.family, s.role) for s in steps] == [("mma_decode", "fc1"),
                                                                                ("mma_decode", "fc2")]
