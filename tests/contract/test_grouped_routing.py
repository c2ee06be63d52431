"""Grouped sigmoid routing [ext] (DeepSeek-V3, Kimi-K2, GLM-4.5): the float64 reference against a token-by-token
transcription of the rule written here from docs/contract.md, the tie rule, every validation error, and the
GPU layer planning it with the grouped routing kernel (CPU only; the kernel on the GPU:
tests/kernels/test_route_grouped_gpu.py, tests/runtime/test_grouped_layer_gpu.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import qmoe_rtc
from qmoe_rtc import errors
from qmoe_rtc.contract import QMoEAttributes, describe_layer
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import expert_mlp, qmoe, route

# ---- an independent transcription: one token at a time, plain Python ------------------------------------


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v > -700 else 0.0


def naive_route(logits_row, k, n_group=0, topk_group=0, bias=None, normalize=0, scale=1.0, weights_row=None):
    """One token: sigmoid scores; choice scores = scores + bias; groups ranked by the sum of their two best
    choice scores, the topk_group best kept; top k of the kept experts by choice score (ties: lower index
    first, lower group first); weights = the unbiased scores (or ``weights_row``) at the chosen experts,
    divided by their sum when normalising, times ``scale``."""
    E = len(logits_row)
    score = [_sigmoid(float(np.float32(v))) for v in logits_row]
    choice = [score[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
    candidates = list(range(E))
    if n_group > 1:
        size = E // n_group
        group_score = []
        for g in range(n_group):
            best = sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]
            group_score.append(sum(best))
        keep = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group or n_group]
        candidates = [e for e in range(E) if e // size in keep]
    chosen = sorted(candidates, key=lambda e: (-choice[e], e))[:k]
    w = [score[e] if weights_row is None else float(np.float32(weights_row[e])) for e in chosen]
    if normalize:
        total = 0.0
        for v in w:
            total += v
        w = [v / total if total != 0 else 0.0 for v in w]
    return chosen, [v * scale for v in w]


def _attrs(**kw) -> QMoEAttributes:
    return QMoEAttributes.from_kwargs(scoring_func="sigmoid", **kw)


# (E, k, n_group, topk_group): DeepSeek-V3 (256, 8, 8, 4), Kimi-K2 (384, 8, 1, 1), group size 1, topk_group 0
SHAPES = [(8, 2, 0, 0), (8, 3, 4, 2), (8, 2, 8, 3), (64, 6, 8, 3), (64, 10, 1, 1), (64, 8, 2, 1),
          (256, 8, 8, 4), (256, 10, 4, 0), (384, 8, 1, 1), (384, 8, 8, 4)]


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("normalize", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("E, k, n_group, topk_group", SHAPES)
def test_reference_matches_the_token_by_token_rule(rng, E, k, n_group, topk_group, with_bias, normalize, scale):
    logits = (2.0 * rng.standard_normal((12, E))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
    a = _attrs(k=k, n_group=n_group, topk_group=topk_group, normalize_routing_weights=normalize,
               routed_scaling_factor=scale)
    idx, w = route(logits, a, score_bias=bias)
    assert idx.shape == (12, k) and w.shape == (12, k) and idx.dtype == np.int64
    for r in range(logits.shape[0]):
        chosen, weights = naive_route(logits[r], k, n_group, topk_group, bias, normalize, scale)
        assert idx[r].tolist() == chosen
        np.testing.assert_allclose(w[r], weights, rtol=1e-13, atol=0)
    if normalize:
        np.testing.assert_allclose(w.sum(axis=-1), scale, rtol=1e-13)


@pytest.mark.parametrize("normalize", [0, 1])
def test_router_weights_replace_the_scores_as_weights(rng, normalize):
    E, k = 64, 6
    logits, rw = rng.standard_normal((8, E)).astype(np.float32), rng.random((8, E)).astype(np.float32)
    bias = (0.2 * rng.standard_normal(E)).astype(np.float32)
    a = _attrs(k=k, n_group=8, topk_group=2, normalize_routing_weights=normalize, routed_scaling_factor=1.5)
    idx, w = route(logits, a, rw, score_bias=bias)
    for r in range(8):
        chosen, weights = naive_route(logits[r], k, 8, 2, bias, normalize, 1.5, weights_row=rw[r])
        assert idx[r].tolist() == chosen
        np.testing.assert_allclose(w[r], weights, rtol=1e-13)


def test_the_bias_chooses_but_does_not_weigh():
    logits = np.zeros((1, 4), np.float32)
    logits[0, 0] = 1.0
    bias = np.array([0.0, 0.0, 0.0, 1.0], np.float32)  # expert 3 wins the choice with score 0.5 + 1
    idx, w = route(logits, _attrs(k=2), score_bias=bias)
    assert idx.tolist() == [[3, 0]]
    np.testing.assert_allclose(w, [[0.5, 1 / (1 + math.exp(-1.0))]], rtol=1e-15)


def test_ties_go_to_the_lower_expert_and_the_lower_group():
    E = 16
    flat = np.zeros((1, E), np.float32)
    idx, w = route(flat, _attrs(k=3, n_group=4, topk_group=2))  # all equal: groups 0, 1; experts 0, 1, 2
    assert idx.tolist() == [[0, 1, 2]] and np.all(w == 0.5)
    idx, _ = route(np.array([[0.0, -0.0, -0.0, 0.0]], np.float32), _attrs(k=4))  # −0 and +0 score alike
    assert idx.tolist() == [[0, 1, 2, 3]]
    bias = np.zeros(E, np.float32)
    bias[[5, 9]] = 0.25  # experts 5 (group 1) and 9 (group 2) tie on choice; groups 1 and 2 tie on their sums
    idx, _ = route(flat, _attrs(k=2, n_group=4, topk_group=1), score_bias=bias)
    assert idx.tolist() == [[5, 4]]  # group 1 beats group 2; inside it expert 5, then the lowest of the rest
    idx, _ = route(flat, _attrs(k=2, n_group=4, topk_group=2), score_bias=bias)
    assert idx.tolist() == [[5, 9]]


def test_groups_are_ranked_by_their_two_best_scores():
    # group 0 holds the single best expert, group 1 the better pair: with topk_group 1 group 1 wins
    logits = np.array([[4.0, -4.0, -4.0, -4.0, 1.5, 1.5, -4.0, -4.0]], np.float32)
    idx, _ = route(logits, _attrs(k=2, n_group=2, topk_group=1))
    assert idx.tolist() == [[4, 5]]
    idx, _ = route(logits, _attrs(k=2))  # no groups: the two best overall
    assert idx.tolist() == [[0, 4]]


def test_softmax_scaling_factor_scales_the_weights(rng):
    logits = rng.standard_normal((6, 16)).astype(np.float32)
    base = QMoEAttributes.from_kwargs(k=4, normalize_routing_weights=1)
    scaled = QMoEAttributes.from_kwargs(k=4, normalize_routing_weights=1, routed_scaling_factor=2.5)
    (i0, w0), (i1, w1) = route(logits, base), route(logits, scaled)
    assert np.array_equal(i0, i1)
    np.testing.assert_array_equal(w1, w0 * 2.5)


@pytest.mark.parametrize("slices", [False, True])
def test_layer_output_is_the_weighted_sum_of_the_chosen_experts(rng, slices):
    E, H, I, k = 16, 64, 32, 4
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype="float32", shared=1)
    a.update(scoring_func="sigmoid", n_group=4, topk_group=2, normalize_routing_weights=1, routed_scaling_factor=2.5)
    x, logits, _ = random_inputs(rng, 5, H, E, dtype="float32")
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    out = qmoe(x, logits, **w, **a, router_score_bias=bias)
    routed = {n: v for n, v in w.items() if not n.startswith("shared_")}
    layer = describe_layer(routed, QMoEAttributes.from_kwargs(**a))
    no_shared = qmoe(x, logits, **routed, **a, router_score_bias=bias)
    want = np.zeros((5, H))
    for r in range(5):
        chosen, weights = naive_route(logits[r], k, 4, 2, bias, 1, 2.5)
        for e, wt in zip(chosen, weights):
            want[r] += wt * expert_mlp(x[r:r + 1].astype(np.float64), layer, routed, layer.attrs, e)[0]
    np.testing.assert_allclose(no_shared, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, no_shared)  # the shared expert is added on top
    if slices:  # two expert slices sum to the whole layer: routing runs over all E logits in both
        halves = []
        for e0, e1 in ((0, 8), (8, 16)):
            part = {n: (v[e0:e1] if n.startswith("fc") else v) for n, v in routed.items()}
            halves.append(qmoe(x, logits, **part, **a, router_score_bias=bias, expert_range=(e0, e1), num_experts=E))
        np.testing.assert_allclose(halves[0] + halves[1], no_shared, rtol=1e-5, atol=1e-6)


# ---- validation: every refusal names the attribute or input -------------------------------------------

BAD_ATTRS = [
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(scoring_func=3), "scoring_func"),
    (dict(n_group=-1), "n_group"),
    (dict(n_group=2.0), "n_group"),
    (dict(n_group=4, scoring_func="softmax"), "n_group"),
    (dict(scoring_func="sigmoid", n_group=4, topk_group=5), "topk_group"),
    (dict(scoring_func="sigmoid", n_group=4, topk_group=-1), "topk_group"),
    (dict(topk_group=2), "topk_group"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(routed_scaling_factor=-2.5), "routed_scaling_factor"),
    (dict(routed_scaling_factor=math.inf), "routed_scaling_factor"),
    (dict(routed_scaling_factor=math.nan), "routed_scaling_factor"),
    (dict(routed_scaling_factor="big"), "routed_scaling_factor"),
    (dict(k=2, use_sparse_mixer=1, scoring_func="sigmoid"), "scoring_func"),
    (dict(k=2, use_sparse_mixer=1, routed_scaling_factor=2.0), "routed_scaling_factor"),
]


@pytest.mark.parametrize("kw, name", BAD_ATTRS)
def test_bad_routing_attributes_are_refused_by_name(kw, name):
    with pytest.raises(errors.QMoEAttributeError) as ei:
        QMoEAttributes.from_kwargs(**kw)
    assert ei.value.name == name and ei.value.expected and ei.value.actual


def test_default_equivalent_values_parse():
    a = QMoEAttributes.from_kwargs(scoring_func="SIGMOID", n_group=1, topk_group=1, routed_scaling_factor=1)
    assert a.scoring_func == "sigmoid" and not a.grouped and a.groups_kept == 1
    assert QMoEAttributes.from_kwargs(n_group=1, topk_group=1).default_routing
    assert QMoEAttributes.from_kwargs(scoring_func="sigmoid", n_group=8).groups_kept == 8  # topk_group 0: every group


def _layer(rng, E=8, k=2, **kw):
    w, a = random_layer(rng, E=E, H=64, I=32, k=k, dtype="float32")
    a.update(kw)
    x, logits, _ = random_inputs(rng, 3, 64, E, dtype="float32")
    return w, a, x, logits


BAD_LAYERS = {  # what only the layer can tell: name, expected fragment
    "groups do not divide E": (dict(E=12, scoring_func="sigmoid", n_group=8), {}, "n_group", "divisor of the E = 12"),
    "k above the kept experts": (dict(E=8, k=3, scoring_func="sigmoid", n_group=4, topk_group=1), {}, "k",
                                 "at most the 2 experts"),
    "k above E": (dict(E=8, k=9, scoring_func="sigmoid"), {}, "k", "1 <= k <= E = 8"),
    "bias without sigmoid": (dict(), dict(router_score_bias=np.zeros(8, np.float32)), "router_score_bias",
                             "scoring_func='sigmoid'"),
    "bias of another shape": (dict(scoring_func="sigmoid"), dict(router_score_bias=np.zeros(7, np.float32)),
                              "router_score_bias", "shape [8]"),
    "bias in float16": (dict(scoring_func="sigmoid"), dict(router_score_bias=np.zeros(8, np.float16)),
                        "router_score_bias", "float32"),
}


@pytest.mark.parametrize("what", sorted(BAD_LAYERS))
def test_layer_refusals_name_the_attribute_or_input(rng, what):
    kw, ext, name, expected = BAD_LAYERS[what]
    w, a, x, logits = _layer(rng, **kw)
    with pytest.raises(errors.QMoEInputError) as ei:
        qmoe(x, logits, **w, **a, **ext)
    assert ei.value.name == name and expected in ei.value.expected, str(ei.value)


# ---- the GPU layer: planned with the grouped routing kernel; softmax scores with a scaling factor refused ----

GPU_TAKEN = {
    "sigmoid": (dict(scoring_func="sigmoid"), {}),
    "groups": (dict(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5), {}),
    "bias": (dict(scoring_func="sigmoid"), dict(router_score_bias=np.zeros(8, np.float32))),
    "defaults": (dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, scoring_func="softmax"), {}),
}


@pytest.mark.parametrize("what", sorted(GPU_TAKEN))
def test_gpu_layer_takes_grouped_sigmoid_routing(machine, rng, what):
    machine(lib=False)  # validation passes; the next thing is the driver, which is missing here
    kw, ext = GPU_TAKEN[what]
    w, a, _, _ = _layer(rng, **kw)
    with pytest.raises(errors.DeviceError):
        qmoe_rtc.QMoE(**w, **a, **ext)


def test_gpu_layer_refuses_a_softmax_scaling_factor_before_the_gpu(machine, rng):
    calls = machine(lib=False)  # no driver: any GPU access would be a DeviceError, not this
    w, a, _, _ = _layer(rng, routed_scaling_factor=2.5)
    with pytest.raises(errors.QMoEUnsupportedError, match="routed_scaling_factor=2.5 with softmax") as ei:
        qmoe_rtc.QMoE(**w, **a)
    assert "reference" in str(ei.value) and calls == []
    with pytest.raises(errors.QMoEUnsupportedError, match="routed_scaling_factor=2.5"):
        qmoe_rtc.tiled.given.tiled_weights(w, **a)


@pytest.mark.parametrize("n_group", [0, 4])
def test_gpu_planning_routes_by_the_grouped_kernel(rng, n_group):
    from qmoe_rtc.kernels import PIPELINES, get_family
    from qmoe_rtc.kernels.pipelines import choose
    from qmoe_rtc.runtime.layer import describe_gpu_layer, layer_config, routing_unsupported

    w, a, _, _ = _layer(rng, scoring_func="sigmoid", n_group=n_group, topk_group=2 if n_group else 0)
    g = describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {})
    assert routing_unsupported(g.layer.attrs) is None
    cfg = layer_config(g.layer, "float16", "float32", g.ext)
    assert (cfg.scoring_func, cfg.n_group) == ("sigmoid", n_group)
    route = get_family("route")
    assert route.spec(cfg).get("sigmoid") == 1 and route.spec(cfg).get("warp") is None
    for path in ("decode", "prefill"):
        assert choose(cfg, None, path).pipeline in PIPELINES
