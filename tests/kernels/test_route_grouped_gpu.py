"""GPU: grouped sigmoid routing [ext] (routing/route_grouped.cuh) launched directly, against the float64 reference
(skipped without a GPU).

E up to 384, k up to 10, groups up to 8 (and one expert a group), with and without the score bias, router_weights,
normalisation, the routed scaling factor, shared slots with and without the gate, an expert slice's map; exact ties
(equal logits and bias: the lower index, the lower group) and fresh random logits (rows the float32 kernel may order
otherwise than the float64 reference, near ties, are named by tests/support/grouped_routing.py and must be few).
Outputs are poisoned before each launch.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_route_ext_gpu import NP, dev, sigmoid_gate, step

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.reference import route as reference_route
from qmoe_rtc.kernels import Problem, get_family
from qmoe_rtc.kernels import route as rt
from qmoe_rtc.specialize import ModuleSpec

from support.grouped_routing import check_grouped_routes

pytestmark = pytest.mark.gpu

FAM = get_family("route")


def module(dtype: str, gate: bool):
    from qmoe_rtc.jit import load_module

    spec = ModuleSpec.make("route", dtype=dtype, sigmoid=1, **({"gate": 1} if gate else {}))
    return spec, load_module(FAM.unit(spec))


def run_grouped(attrs: QMoEAttributes, dtype: str, lt: str, logits, bias=None, rw=None, S=0, gate=False, H=256,
                expert_map=None, rng=None):
    """(ids [rows, k + S], weights [rows, k + S], gate inputs) of one grouped routing launch."""
    import cupy as cp

    rows, E = logits.shape
    k = attrs.k
    spec, mod = module(dtype, gate)
    x = rng.standard_normal((rows, H)).astype(np.float32).astype(NP[dtype]) if gate else None
    g = (rng.standard_normal(H) / np.sqrt(H)).astype(np.float32) if gate else None
    ids = cp.full(rows * (k + S), -7, dtype=cp.int32)
    w = cp.full(rows * (k + S), np.nan, dtype=cp.float32)
    rw_dt = None if rw is None else next(n for n, d in NP.items() if d == rw.dtype)
    p = Problem(rows=rows, E=E, H=H, I=32, k=k, dtype=dtype, router_dtype=lt, router_weights_dtype=rw_dt, shared=S,
                shared_gate=gate, sigmoid_routing=True)
    assert FAM.kernel_for(spec, "route", p).startswith("grouped_")
    step(mod, spec, "route", p, logits=dev(logits.astype(NP[lt])), router_weights=dev(rw),
         normalize=int(attrs.normalize_routing_weights), x=dev(x), shared_gate_weight=dev(g),
         expert_map=None if expert_map is None else cp.asarray(expert_map.astype(np.int32)),
         router_score_bias=dev(bias), n_group=attrs.n_group, groups_kept=attrs.groups_kept,
         routed_scaling=attrs.routed_scaling_factor, topk_ids=ids, topk_w=w)
    return ids.get().reshape(rows, k + S), w.get().reshape(rows, k + S), (x, g)


# rows, E, k, n_group, topk_group, bias, normalize, routed_scaling_factor
CASES = [
    (64, 256, 8, 8, 4, True, True, 2.5),  # DeepSeek-V3's routing (E = 256 per the model, k = 8, 8 groups keep 4)
    (33, 160, 6, 8, 3, False, True, 16.0),  # DeepSeek-V2's (softmax there; sigmoid here, its group shape)
    (17, 384, 8, 1, 0, True, True, 2.827),  # Kimi-K2's (384 experts, one group)
    (40, 160, 8, 1, 1, True, True, 2.5),  # GLM-4.5's (one group)
    (9, 384, 10, 8, 2, True, False, 1.0),  # k = 10 from 2 groups of 48
    (300, 64, 4, 4, 2, True, True, 1.0),
    (5, 16, 3, 16, 3, True, True, 1.5),  # one expert a group: a group's value is its one choice
    (12, 512, 32, 8, 8, False, False, 1.0),  # the kernel's limits: E 512, k 32, every group kept
    (7, 120, 5, 6, 2, True, True, 1.0),  # groups of 20: not a power of two
]


@pytest.mark.parametrize("dtype,lt", [("bfloat16", "float32"), ("float16", "float16"), ("float32", "float32"),
                                      ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}-E{}-k{}-G{}-kg{}-b{:d}-n{:d}-s{}".format(*c))
def test_grouped_routing_vs_reference(rng, dtype, lt, case):
    rows, E, k, G, kg, has_bias, normalize, rsf = case
    attrs = QMoEAttributes.from_kwargs(k=k, scoring_func="sigmoid", n_group=G, topk_group=kg,
                                       routed_scaling_factor=rsf, normalize_routing_weights=int(normalize))
    logits = (2.0 * rng.standard_normal((rows, E))).astype(np.float32).astype(NP[lt]).astype(np.float32)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32) if has_bias else None
    ids, w, _ = run_grouped(attrs, dtype, lt, logits, bias, rng=rng)
    near = check_grouped_routes(ids, w, logits, bias, attrs)
    print(f"{case}: {near} near-tie rows of {rows}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_exact_ties_go_to_the_lower_expert_and_group(rng, dtype):
    """Logits from 5 values (no two pairs of them with the same sum) and one bias: many equal choices and equal
    groups. The kernel must pick what the reference picks (ties to the lower index) on every row; none is a
    near tie."""
    rows, E, k = 48, 256, 8
    attrs = QMoEAttributes.from_kwargs(k=k, scoring_func="sigmoid", n_group=8, topk_group=3,
                                       normalize_routing_weights=1, routed_scaling_factor=2.5)
    logits = rng.choice(np.array([-1.5, 0.0, 0.5, 1.0, 2.0], np.float32), (rows, E))
    logits[::3, 32:64] = logits[::3, 0:32]  # groups 0 and 1 equal: their values tie exactly
    bias = np.full(E, 0.25, np.float32)
    ids, w, _ = run_grouped(attrs, dtype, "float32", logits, bias, rng=rng)
    assert check_grouped_routes(ids, w, logits, bias, attrs, max_near=0.0) == 0
    want, _ = reference_route(logits, attrs, score_bias=bias)
    np.testing.assert_array_equal(ids[:, :k], want)


@pytest.mark.parametrize("rw_dt", ["float32", "bfloat16"])
def test_router_weights_are_gathered_at_the_picks(rng, rw_dt):
    rows, E = 21, 128
    attrs = QMoEAttributes.from_kwargs(k=6, scoring_func="sigmoid", n_group=4, topk_group=2,
                                       normalize_routing_weights=1, routed_scaling_factor=1.75)
    logits = (2.0 * rng.standard_normal((rows, E))).astype(np.float32)
    rw = rng.uniform(0.05, 1.0, (rows, E)).astype(np.float32).astype(NP[rw_dt])
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
    ids, w, _ = run_grouped(attrs, "bfloat16", "float32", logits, bias, rw=rw, rng=rng)
    check_grouped_routes(ids, w, logits, bias, attrs, router_weights=rw)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_slots_and_the_expert_map(rng, gate):
    """Shared experts [ext] in the last S slots (weight 1, or the gate, never scaled); an expert slice's map
    rewrites the routed ids (-1 where not held) and nothing else."""
    rows, E, k, S, H = 19, 256, 8, 2, 512
    attrs = QMoEAttributes.from_kwargs(k=k, scoring_func="sigmoid", n_group=8, topk_group=4,
                                       normalize_routing_weights=1, routed_scaling_factor=2.5)
    logits = (2.0 * rng.standard_normal((rows, E))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
    ids, w, (x, g) = run_grouped(attrs, "bfloat16", "float32", logits, bias, S=S, gate=gate, H=H, rng=rng)
    check_grouped_routes(ids, w, logits, bias, attrs)
    np.testing.assert_array_equal(ids[:, k:], np.broadcast_to(E + np.arange(S), (rows, S)))
    if gate:
        np.testing.assert_allclose(w[:, k:], np.broadcast_to(sigmoid_gate(x, g)[:, None], (rows, S)), rtol=1e-5)
    else:
        assert (w[:, k:] == 1.0).all()
    emap = np.where(np.arange(E) % 3 == 0, -1, np.arange(E) // 2).astype(np.int32)
    ids_m, w_m, _ = run_grouped(attrs, "bfloat16", "float32", logits, bias, S=S, gate=gate, H=H, expert_map=emap,
                                rng=rng)
    np.testing.assert_array_equal(ids_m[:, :k], emap[ids[:, :k]])
    np.testing.assert_array_equal(w_m[:, :k].view(np.uint32), w[:, :k].view(np.uint32))


def test_the_bias_changes_the_choice_not_the_weights(rng):
    """A bias that lifts experts 0..7 above every other: they are picked; their weights are their unbiased
    sigmoid scores."""
    rows, E, k = 8, 64, 8
    attrs = QMoEAttributes.from_kwargs(k=k, scoring_func="sigmoid", n_group=1)
    logits = (2.0 * rng.standard_normal((rows, E))).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[:8] = 4.0
    ids, w, _ = run_grouped(attrs, "float16", "float32", logits, bias, rng=rng)
    assert (np.sort(ids[:, :k], axis=-1) == np.arange(8)).all()
    np.testing.assert_allclose(w, 1.0 / (1.0 + np.exp(-np.take_along_axis(logits, ids, -1).astype(np.float64))),
                               rtol=2e-6)
    assert rt.routes_by_warp(E, False, False, sigmoid=True) is False
