"""Grouped sigmoid routing [ext] in the route family (CPU and NVRTC, no GPU): the module a sigmoid layer gets,
its kernels' keys and arguments, every argument bound by name in the plan, the limits, every variant compiling;
and the near-tie rule of the GPU tests (tests/support/grouped_routing.py) checked on a float32 NumPy transcription
of routing/route_grouped.cuh, so that a kernel computing the rule in float32 passes it and a wrong one does not."""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.errors import QMoEUnsupportedError
from qmoe_rtc.jit import get_cubin
from qmoe_rtc.kernels import PIPELINES, Problem, get_family, spec_unit
from qmoe_rtc.runtime.plan import PER_CALL, problem_scalars
from qmoe_rtc.specialize import Layout, ModelConfig, ModuleSpec

from support.grouped_routing import check_grouped_routes

FAM = get_family("route")
GROUPED_ARGS = ("logits", "router_weights", "rows", "E_logits", "k_routed", "S", "H", "normalize", "x",
                "shared_gate_weight", "E_routed", "expert_map", "router_score_bias", "n_group", "groups_kept",
                "routed_scaling", "topk_ids", "topk_w", "expert_counts")


def cfg(dtype="bfloat16", E=256, k=8, S=0, gate=False, rgemm="", n_group=8, scoring="sigmoid"):
    lay = Layout(dtype=dtype, fc1_bits=4, fc2_bits=4, block_size=0, activation="swiglu", swiglu_fusion=1)
    return ModelConfig(hidden=2048, inter=256, experts=E, k=k, layout=lay, shared=S, shared_gate=gate, router_gemm=rgemm,
                       scoring_func=scoring, n_group=n_group)


def problem(c: ModelConfig, rows=4, rw=None) -> Problem:
    return Problem(rows=rows, E=c.experts, H=c.hidden, I=c.inter, k=c.k, dtype=c.layout.dtype, router_weights_dtype=rw,
                   shared=c.shared, shared_gate=c.shared_gate, router_gemm=c.router_gemm,
                   sigmoid_routing=c.scoring_func == "sigmoid")


@pytest.mark.parametrize("E", [64, 256, 512])
def test_a_sigmoid_layer_gets_a_module_of_grouped_kernels_only(E):
    spec = FAM.spec(cfg(E=E))
    assert spec.get("sigmoid") == 1 and spec.get("warp") is None  # one block a row, whatever E
    kds = {k.key: k for k in FAM.kernels(spec)}
    assert set(kds) == {f"grouped_{lt}" + rw for lt in ("float32", "bfloat16")
                        for rw in ("", "_rw_float32", "_rw_bfloat16")}
    for kd in kds.values():
        assert kd.arg_names() == GROUPED_ARGS and "qmoe::route_grouped<" in kd.name_expr
        by = {a.name: a for a in kd.args}
        assert by["router_score_bias"].nullable and by["router_score_bias"].dtype == "float32"
        assert by["routed_scaling"].ctype == "float32"
    assert FAM.spec(cfg(scoring="softmax", n_group=0)).get("sigmoid") is None


@pytest.mark.parametrize("c, kw, key", [
    (cfg(), {}, "grouped_float32"),
    (cfg(S=2, gate=True), {"rw": "bfloat16"}, "grouped_float32_rw_bfloat16_gate"),
    (cfg(rgemm="bfloat16", S=1), {}, "grouped_gemm"),
    (cfg(E=64, n_group=0), {}, "grouped_float32"),  # few experts and no groups: still the block kernel
], ids=["plain", "gated rw", "gemm", "one group"])
def test_kernel_for_and_launch(c, kw, key):
    spec, p = FAM.spec(c), problem(c, rows=37, **kw)
    assert FAM.kernel_for(spec, "route", p) == key
    launch = FAM.launch(spec, "route", p)
    assert launch.grid == (37, 1, 1) and launch.block == (128, 1, 1)


def test_spec_and_problem_must_agree():
    spec = FAM.spec(cfg())
    with pytest.raises(QMoEUnsupportedError, match="sigmoid routing"):
        FAM.kernel_for(spec, "route", problem(cfg(scoring="softmax", n_group=0)))
    with pytest.raises(QMoEUnsupportedError, match="sigmoid routing"):
        FAM.kernel_for(FAM.spec(cfg(scoring="softmax", n_group=0)), "route", problem(cfg()))


def test_limits():
    assert FAM.supports(cfg(E=512, n_group=128, k=4)) is None
    assert "n_group = 256" in FAM.supports(cfg(E=512, n_group=256, k=2))
    assert "513 experts" in FAM.supports(cfg(E=513, n_group=0))


@pytest.mark.parametrize("c", [cfg(), cfg(S=2, gate=True, rgemm="float32"), cfg("float32", rgemm="float32")],
                         ids=["plain", "gated gemm", "f32 gemm"])
def test_routing_steps_bind_every_argument(c):
    from qmoe_rtc.runtime.tensors import EXTRA_TENSORS, layer_table

    attrs = QMoEAttributes.from_kwargs(k=c.k, scoring_func="sigmoid", n_group=8, topk_group=4)
    table = set(layer_table({p: (object(), object(), None, None) for p in ("fc1", "fc2")}, attrs))
    assert {"router_score_bias", "n_group", "groups_kept", "routed_scaling"} <= table and "router_score_bias" in EXTRA_TENSORS
    p, spec = problem(c, 7), FAM.spec(c)
    steps = [st for st in PIPELINES[0].steps_for(c) if st.family == "route"]
    scratch = set().union(*(FAM.scratch(spec, st.role, p) for st in steps))
    bound = table | set(problem_scalars(p)) | scratch | set(PER_CALL)
    kds = {k.key: k for k in FAM.kernels(spec)}
    for st in steps:
        kd = kds[FAM.kernel_for(spec, st.role, p)]
        assert not [a.name for a in kd.args if a.name not in bound], kd.key


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("params", [dict(dtype=d, sigmoid=1, **ext) for d in ("float32", "float16", "bfloat16")
                                    for ext in ({}, {"gate": 1, "rgemm": 1})],
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_every_variant_compiles(cache, arch, params):
    spec = ModuleSpec.make("route", **params)
    mod = get_cubin(spec_unit(spec), arch)
    assert mod.cubin[:4] == b"\x7fELF" and set(mod.lowered) == {k.key for k in FAM.kernels(spec)}


# ---- the GPU tests' near-tie rule, on a float32 transcription of the kernel ------------------------------

def kernel_in_float32(logits, bias, attrs: QMoEAttributes, swap_groups: bool = False):
    """routing/route_grouped.cuh step by step in float32 (``swap_groups``: keep the wrong groups, a broken
    kernel): (ids [rows, k], weights [rows, k])."""
    l32 = np.asarray(logits, np.float32)
    s = (np.float32(1) / (np.float32(1) + np.exp(-l32))).astype(np.float32)
    c = s if bias is None else (s + np.asarray(bias, np.float32)).astype(np.float32)
    rows, E = c.shape
    allowed = np.ones((rows, E), bool)
    if attrs.grouped:
        G = attrs.n_group
        top2 = -np.sort(-c.reshape(rows, G, E // G), axis=-1)[..., :2]
        value = top2.sum(axis=-1, dtype=np.float32) if E // G > 1 else top2[..., 0]
        order = np.argsort(-value, axis=-1, kind="stable")
        keep = order[:, ::-1] if swap_groups else order
        groups = np.zeros((rows, G), bool)
        np.put_along_axis(groups, keep[:, : attrs.groups_kept], True, axis=-1)
        allowed = np.repeat(groups, E // G, axis=-1)
    ids = np.argsort(np.where(allowed, -c, np.inf), axis=-1, kind="stable")[:, : attrs.k]
    w = np.take_along_axis(s, ids, axis=-1)
    if attrs.normalize_routing_weights:
        w = w / w.sum(axis=-1, keepdims=True, dtype=np.float32)
    return ids, (w * np.float32(attrs.routed_scaling_factor)).astype(np.float32)


@pytest.mark.parametrize("E, k, G, kg", [(256, 8, 8, 4), (384, 10, 8, 2), (16, 3, 16, 3), (160, 8, 1, 0)])
def test_a_float32_kernel_passes_the_gpu_check_and_a_wrong_one_fails(rng, E, k, G, kg):
    attrs = QMoEAttributes.from_kwargs(k=k, scoring_func="sigmoid", n_group=G, topk_group=kg,
                                       normalize_routing_weights=1, routed_scaling_factor=2.5)
    logits = (2.0 * rng.standard_normal((400, E))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
    ids, w = kernel_in_float32(logits, bias, attrs)
    check_grouped_routes(ids, w, logits, bias, attrs)
    with pytest.raises(AssertionError):
        check_grouped_routes(ids, w * np.float32(1.001), logits, bias, attrs)  # weights off by 0.1 %
    with pytest.raises(AssertionError):
        check_grouped_routes(*kernel_in_float32(logits, None, attrs), logits, bias, attrs)  # bias ignored
    if attrs.grouped and attrs.groups_kept < G:
        with pytest.raises(AssertionError):
            check_grouped_routes(*kernel_in_float32(logits, bias, attrs, swap_groups=True), logits, bias, attrs)
