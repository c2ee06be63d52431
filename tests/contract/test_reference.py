"""The parts of the contract ONNX Runtime cannot check: hand-computed cases, an independent
brute-force implementation written from docs/contract.md with scalar loops, and invariants."""

import math

import ml_dtypes
import numpy as np
import pytest

from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe, route
from qmoe_rtc.formats.quantize import pack_codes

BF16 = np.dtype(ml_dtypes.bfloat16)


# ---- an independent, deliberately naive implementation ----------------------------------------------

def _code(row_bytes, k, b):
    v = 0
    for t in range(b):
        pos = k * b + t
        v |= ((int(row_bytes[pos // 8]) >> (pos % 8)) & 1) << t
    return v


def _w(weights, p, a, e, n, kk, K):
    b = a.bits(p)
    q = _code(weights[f"{p}_experts_weights"][e, n], kk, b)
    bs = a.block_size
    s = weights[f"{p}_scales"]
    scale = float(s.reshape(s.shape[0], s.shape[1], -1)[e, n, kk // bs if bs else 0])
    z = weights.get(f"{p}_zero_points")
    if z is not None:
        zp = _code(z[e, n], kk // bs, b) if bs else _code(z[e], n, b)
    elif a.zero_point_offset is not None:
        zp = a.zero_point_offset
    else:
        zp = 2 ** (b - 1)
    return float(np.float32(np.float32(q - zp) * np.float32(scale)))


def brute(x, logits, weights, rw=None, **attrs):
    a = QMoEAttributes.from_kwargs(**attrs)
    rows, H = x.reshape(-1, x.shape[-1]).shape
    x = x.reshape(rows, H).astype(np.float64)
    E = weights["fc1_experts_weights"].shape[0]
    out = np.zeros((rows, H))
    def sig(v):
        return 1 / (1 + math.exp(-v))

    def gelu(v):
        return 0.5 * v * (1 + math.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
    for r in range(rows):
        l = [float(np.float32(v)) for v in logits[r]]
        if a.use_sparse_mixer:
            picks = []
            masked_prev = set()
            for _ in range(2):
                cand = [j for j in range(E) if j not in masked_prev]
                e = max(cand, key=lambda j: (l[j], -j))
                m = l[e]
                keep = [j for j in range(E) if j not in masked_prev and not (m - l[j]) > 0.02 * max(abs(l[j]), m)]
                den = sum(math.exp(l[j] - m) for j in keep)
                picks.append((e, 1.0 / den))
                masked_prev.add(e)
        else:
            order = sorted(range(E), key=lambda j: (-l[j], j))[: a.k]
            mx = max(l)
            z = sum(math.exp(v - mx) for v in l)
            if rw is not None:
                ws = [float(np.float32(rw[r][j])) for j in order]
            else:
                ws = [math.exp(l[j] - mx) / z for j in order]
            if a.normalize_routing_weights:
                s = sum(ws)
                ws = [w / s if s != 0 else 0.0 for w in ws]
            picks = list(zip(order, ws))
        I = weights["fc2_experts_weights"].shape[2] * 8 // a.bits("fc2")
        F1 = weights["fc1_experts_weights"].shape[1]
        I = F1 // 2 if (a.activation_type in ("swiglu", "geglu") and a.swiglu_fusion) else F1
        for e, wt in picks:
            def fc(p, N, bias):
                hb = weights.get(f"{p}_experts_bias")
                return [sum(_w(weights, p, a, e, n, kk, H) * x[r, kk] for kk in range(H))
                        + (float(hb[e, n]) if hb is not None else 0.0) for n in range(N)]
            h = fc("fc1", F1, True)
            u = fc("fc3", I, True) if "fc3_experts_weights" in weights else None
            act = a.activation_type
            inter = []
            for i in range(I):
                if act in ("swiglu", "geglu"):
                    if a.swiglu_fusion == 1:
                        g, lin = h[2 * i], h[2 * i + 1]
                    elif a.swiglu_fusion == 2:
                        g, lin = h[i], h[I + i]
                    else:
                        g, lin = h[i], u[i]
                    if act == "geglu":
                        inter.append(gelu(g) * lin)
                        continue
                    lim = a.swiglu_limit
                    L = min(max(lin, -lim), lim)
                    if a.swiglu_limit_after_activation:
                        inter.append(min(g * sig(a.activation_alpha * g), lim) * (L + a.activation_beta))
                    else:
                        G = min(g, lim)
                        inter.append(G * sig(a.activation_alpha * G) * (L + a.activation_beta))
                    continue
                v = h[i]
                v = {"relu": max(v, 0.0), "gelu": gelu(v), "silu": v * sig(v), "identity": v,
                     "relu2": max(v, 0.0) ** 2}[act]
                inter.append(v * u[i] if u is not None else v)
            b2 = weights.get("fc2_experts_bias")
            for n in range(H):
                y = sum(_w(weights, "fc2", a, e, n, i, I) * inter[i] for i in range(I))
                out[r, n] += wt * (y + (float(b2[e, n]) if b2 is not None else 0.0))
    return out


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


CASES = [
    dict(bits=1, activation_type="relu"),
    dict(bits=3, activation_type="gelu", block_size=16),
    dict(bits=(3, 1, 2), activation_type="silu", fc3=True, zero_points=(True, False, True)),
    dict(bits=(8, 2, 4), activation_type="swiglu", swiglu_fusion=0, fc3=True, block_size=16, bias=True),
    dict(bits=2, activation_type="swiglu", swiglu_fusion=2, swiglu_limit=0.5, activation_alpha=1.702,
         activation_beta=1.0),
    dict(bits=4, activation_type="swiglu", swiglu_fusion=1, swiglu_limit=0.3, swiglu_limit_after_activation=1,
         activation_alpha=0.7, activation_beta=0.5, zero_points=True, block_size=16),
    dict(bits=4, activation_type="geglu", swiglu_fusion=2, bias=True),
    dict(bits=3, activation_type="geglu", swiglu_fusion=0, fc3=True, zero_points=True),
    dict(bits=2, activation_type="relu2", zero_point_offset=1.5),
    dict(bits=1, activation_type="identity", zero_point_offset=0.5, block_size=16, k=3, normalize_routing_weights=1),
    dict(bits=4, activation_type="silu", use_sparse_mixer=1, k=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_reference_matches_brute_force(rng, case):
    case = dict(case)
    k = case.pop("k", 2)
    w, a = random_layer(rng, E=5, H=16, I=16, k=k, dtype="float32", **case)
    x, lg, _ = random_inputs(rng, 3, 16, 5, "float32")
    got = qmoe(x, lg, **w, **a)
    want = brute(x, lg, w, **a)
    assert rel(got, want) < 1e-6


def test_router_weights_brute_force(rng):
    for norm in (0, 1):
        w, a = random_layer(rng, E=6, H=16, I=16, k=3, dtype="float32", activation_type="relu",
                            normalize_routing_weights=norm)
        x, lg, rw = random_inputs(rng, 4, 16, 6, "float32", router_weights=True)
        rw = rw - 0.3  # negative weights are applied as given when normalize=0
        got = qmoe(x, lg, router_weights=rw, **w, **a)
        assert rel(got, brute(x, lg, w, rw=rw, **a)) < 1e-6


# ---- routing by hand ---------------------------------------------------------------------------------

def test_ties_go_to_lower_index():
    a = QMoEAttributes.from_kwargs(k=2)
    idx, w = route(np.array([[1.0, 3.0, 3.0, 3.0, 0.0]], np.float32), a)
    assert idx.tolist() == [[1, 2]]
    p = np.exp(3.0) / (np.exp(1.0) + 3 * np.exp(3.0) + 1.0)
    np.testing.assert_allclose(w, [[p, p]])
    # -0 and +0 are ordered (+0 wins), NaN sorts above +inf
    idx, _ = route(np.array([[-0.0, 0.0, -1.0]], np.float32), QMoEAttributes.from_kwargs(k=1))
    assert idx.tolist() == [[1]]
    idx, _ = route(np.array([[np.inf, np.nan, 1.0]], np.float32), QMoEAttributes.from_kwargs(k=1))
    assert idx.tolist() == [[1]]


def test_normalize_zero_uses_softmax_probabilities():
    l = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    p = np.exp(l[0].astype(np.float64)) / np.exp(l[0].astype(np.float64)).sum()
    idx, w = route(l, QMoEAttributes.from_kwargs(k=2, normalize_routing_weights=0))
    assert idx.tolist() == [[3, 2]]
    np.testing.assert_allclose(w[0], [p[3], p[2]])
    _, w = route(l, QMoEAttributes.from_kwargs(k=2, normalize_routing_weights=1))
    np.testing.assert_allclose(w[0], [p[3] / (p[3] + p[2]), p[2] / (p[3] + p[2])])


def test_router_weights_zero_sum_normalizes_to_zero():
    l = np.array([[0.0, 1.0, 2.0]], np.float32)
    rw = np.array([[5.0, 1.0, -1.0]], np.float32)
    _, w = route(l, QMoEAttributes.from_kwargs(k=2, normalize_routing_weights=1), rw)
    np.testing.assert_array_equal(w, [[0.0, 0.0]])
    _, w = route(l, QMoEAttributes.from_kwargs(k=2, normalize_routing_weights=0), rw)
    np.testing.assert_array_equal(w, [[-1.0, 1.0]])


def test_sparse_mixer_by_hand():
    # logits: e1 = 0 (2.0); threshold 2ε·max(|l|, m) = 0.04: 1.97 stays, 1.5 and -3 are masked
    l = np.array([[2.0, 1.97, 1.5, -3.0]], np.float32)
    idx, w = route(l, QMoEAttributes.from_kwargs(k=2, use_sparse_mixer=1))
    l64 = l[0].astype(np.float64)
    w1 = 1.0 / (1.0 + np.exp(l64[1] - l64[0]))
    # second pick: e2 = 1 (1.97); mask e1 and j with (1.97 − l_j) > 0.02·2·max(|l_j|, 1.97): 1.5 masked too
    assert idx.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [[w1, 1.0]], rtol=1e-12)


# ---- invariants --------------------------------------------------------------------------------------

def test_fusion_1_equals_fusion_2_on_permuted_rows(rng):
    w, a = random_layer(rng, E=4, H=32, I=16, k=2, bits=3, block_size=16, zero_points=True, bias=True,
                        activation_type="swiglu", swiglu_fusion=1, swiglu_limit=1.0, activation_alpha=1.702,
                        activation_beta=1.0, dtype="float32")
    x, lg, _ = random_inputs(rng, 5, 32, 4, "float32")
    perm = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])  # interleaved → [g | l]
    w2 = dict(w)
    for n in ("fc1_experts_weights", "fc1_scales", "fc1_experts_bias", "fc1_zero_points"):
        w2[n] = np.ascontiguousarray(w[n][:, perm])
    a2 = dict(a, swiglu_fusion=2)
    np.testing.assert_array_equal(qmoe(x, lg, **w, **a), qmoe(x, lg, **w2, **a2))


def test_fusion_2_equals_fc3(rng):
    w, a = random_layer(rng, E=4, H=32, I=16, k=2, bits=4, activation_type="geglu", swiglu_fusion=2,
                        bias=True, dtype="float32")
    x, lg, _ = random_inputs(rng, 5, 32, 4, "float32")
    w3 = {}
    for n, v in w.items():
        if n.startswith("fc1"):
            w3[n] = np.ascontiguousarray(v[:, :16])
            w3[n.replace("fc1", "fc3")] = np.ascontiguousarray(v[:, 16:])
        else:
            w3[n] = v
    a3 = dict(a, swiglu_fusion=0)
    np.testing.assert_allclose(qmoe(x, lg, **w, **a), qmoe(x, lg, **w3, **a3), rtol=1e-6)


def test_integer_offset_equals_zero_point_tensor(rng):
    w, a = random_layer(rng, E=3, H=32, I=16, k=1, bits=2, block_size=16, activation_type="relu", dtype="float32")
    x, lg, _ = random_inputs(rng, 4, 32, 3, "float32")
    wz = dict(w)
    wz["fc1_zero_points"] = pack_codes(np.full((3, 16, 2), 1, np.uint8), 2)
    wz["fc2_zero_points"] = pack_codes(np.full((3, 32, 1), 1, np.uint8), 2)
    np.testing.assert_array_equal(qmoe(x, lg, **w, **a, zero_point_offset=1.0), qmoe(x, lg, **wz, **a))


def test_one_bit_hand_case():
    # E=1, H=8, I=1, identity, k=1: fc1 row codes 1,0,1,0,... → (q−1)·s = 0 or −s
    codes1 = np.array([[[1, 0, 1, 0, 0, 1, 1, 1]]], np.uint8)
    w1 = pack_codes(codes1, 1)
    s1 = np.array([[2.0]], np.float32)
    w2 = pack_codes(np.zeros((1, 8, 1), np.uint8), 1)  # every fc2 weight = (0−1)·s
    s2 = np.full((1, 8), 0.5, np.float32)
    x = np.arange(1, 9, dtype=np.float32)[None]
    y = qmoe(x, np.zeros((1, 1), np.float32), w1, s1, None, w2, s2, k=1, activation_type="identity",
             expert_weight_bits=1)
    h = -2.0 * (2 + 4 + 5)  # zero codes at k = 1, 3, 4 (x = 2, 4, 5)
    np.testing.assert_array_equal(y, np.full((1, 8), -0.5 * h, np.float32))


def test_bfloat16_output_is_one_rounding_of_float32_path(rng):
    w, a = random_layer(rng, E=4, H=32, I=32, k=2, bits=4, block_size=32, activation_type="silu", dtype="bfloat16")
    x, lg, _ = random_inputs(rng, 6, 32, 4, "bfloat16", router_dtype="bfloat16")
    y = qmoe(x, lg, **w, **a)
    assert y.dtype == BF16
    wf = {n: (v.astype(np.float32) if v.dtype == BF16 else v) for n, v in w.items()}
    yf = qmoe(x.astype(np.float32), lg.astype(np.float32), **wf, **a)
    np.testing.assert_array_equal(y, yf.astype(np.float64).astype(BF16))


def test_large_expert_count_and_k10(rng):
    w, a = random_layer(rng, E=512, H=16, I=16, k=10, bits=2, activation_type="relu", dtype="float32")
    x, lg, _ = random_inputs(rng, 2, 16, 512, "float32")
    assert rel(qmoe(x, lg, **w, **a), brute(x, lg, w, **a)) < 1e-6


def test_empty_and_3d(rng):
    w, a = random_layer(rng, E=3, H=16, I=16, k=2, activation_type="gelu", dtype="float16")
    y = qmoe(np.zeros((0, 16), np.float16), np.zeros((0, 3), np.float32), **w, **a)
    assert y.shape == (0, 16) and y.dtype == np.float16
    x, lg, _ = random_inputs(rng, (2, 3), 16, 3, "float16")
    y3 = qmoe(x, lg, **w, **a)
    y2 = qmoe(x.reshape(6, 16), lg, **w, **a)
    assert y3.shape == (2, 3, 16) and y3.dtype == np.float16
    np.testing.assert_array_equal(y3.reshape(6, 16), y2)
