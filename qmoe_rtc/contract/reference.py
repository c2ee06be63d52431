"""Float64 NumPy reference of the QMoE contract (docs/contract.md), the ground truth for every kernel.

``qmoe(...)`` takes ONNX Runtime's inputs in ONNX Runtime's order (0–16) and its attributes as
keywords, computes in float64 from the float32-dequantized weights (each weight format's own
dequantization: :mod:`qmoe_rtc.formats`), and rounds once to the input's dtype. The [ext] inputs (shared
experts, router GEMM) are keywords. CuPy inputs are copied to the host. It is meant to be obviously right, not fast.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .._arrays import is_cupy, np_dtype
from ..formats.activations import fake_quantize
from .checks import QMoEAttributes, check_content, describe_layer
from .extensions import EXT_INPUTS, check_ext_call, describe_extensions, shared_weights
from .slices import describe_slice

__all__ = ["qmoe", "route", "activate", "order_key", "expert_mlp", "gemm_input", "router_logits", "shared_part"]

_SPARSE_MIXER_EPS = 0.01
_GELU_C = 0.7978845608028654  # sqrt(2/pi)


def _host(a):
    if a is None:
        return None
    return a.get() if is_cupy(a) else np.asarray(a)


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def order_key(logits) -> np.ndarray:
    """A total-order int64 key on the float32 bits: −0 < +0, +NaN above +inf, −NaN below −inf."""
    bits = np.ascontiguousarray(np.asarray(logits, dtype=np.float32)).view(np.uint32).astype(np.int64)
    neg = (bits & 0x80000000) != 0
    return np.where(neg, 0xFFFFFFFF - bits, bits | 0x80000000)


def _top_k(logits32: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits per row, ties to the lower index. ``[rows, k]`` int64."""
    key = order_key(logits32)
    order = np.argsort(-key, axis=-1, kind="stable")  # stable: equal keys keep ascending index
    return order[:, :k]


def _softmax(l: np.ndarray) -> np.ndarray:
    m = np.max(l, axis=-1, keepdims=True)
    e = np.exp(l - m)
    return e / e.sum(axis=-1, keepdims=True)


def _sparse_mixer(l: np.ndarray):
    """Phi-3.5-MoE sparse mixer (k = 2, jitter 0.01): two argmax picks, each with its own masked softmax."""
    rows, E = l.shape
    idx = np.zeros((rows, 2), dtype=np.int64)
    wts = np.zeros((rows, 2), dtype=np.float64)
    eps2 = 2.0 * _SPARSE_MIXER_EPS
    keys = order_key(l.astype(np.float32))
    for r in range(rows):
        lr = l[r]
        e1 = int(np.argmax(keys[r]))  # argmax returns the first (lowest) index among equal keys
        m1 = lr[e1]
        mask1 = (m1 - lr) > eps2 * np.maximum(np.abs(lr), m1)
        g1 = np.where(mask1, -np.inf, lr)
        w1 = _softmax(g1[None])[0][e1]
        k2 = keys[r].copy()
        k2[e1] = -1
        e2 = int(np.argmax(k2))
        m2 = lr[e2]
        mask2 = ((m2 - lr) > eps2 * np.maximum(np.abs(lr), m2))
        mask2[e1] = True
        g2 = np.where(mask2, -np.inf, lr)
        w2 = _softmax(g2[None])[0][e2]
        idx[r] = (e1, e2)
        wts[r] = (w1, w2)
    return idx, wts


def _ranked(score: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """Column indices of ``score`` ``[rows, n]`` (float64) from best to worst per row: allowed columns first,
    then NaN, then by descending value, equal values (−0 and +0 too) to the lower index. ``[rows, n]`` int64."""
    nan = np.isnan(score)
    keys = (-np.where(nan, 0.0, score), ~nan) + (() if allowed is None else (~allowed,))
    return np.lexsort(keys, axis=-1)  # the last key is the primary one; lexsort is stable: ties keep index order


def _grouped_sigmoid_top_k(l: np.ndarray, attrs: QMoEAttributes, score_bias) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3-style choice [ext]: ``(experts [rows, k] int64, their sigmoid scores [rows, k] float64)``.
    Experts are chosen by sigmoid(l) + bias, inside the ``topk_group`` groups whose two best biased scores
    sum highest; the scores returned are the unbiased ones."""
    scores = _sigmoid(l)  # [rows, E]
    choice = scores if score_bias is None else scores + _f64(score_bias)  # [rows, E]
    allowed = None
    if attrs.grouped:
        rows, E = l.shape
        G = attrs.n_group
        per_group = choice.reshape(rows * G, E // G)  # [rows·G, E/G]
        best = np.take_along_axis(per_group, _ranked(per_group)[:, :2], axis=-1)  # [rows·G, min(2, E/G)]
        group_score = best.sum(axis=-1).reshape(rows, G)  # [rows, G]
        kept = _ranked(group_score)[:, :attrs.groups_kept]  # [rows, groups kept]
        in_kept = np.zeros((rows, G), dtype=bool)
        np.put_along_axis(in_kept, kept, True, axis=-1)
        allowed = np.repeat(in_kept, E // G, axis=-1)  # [rows, E]
    idx = _ranked(choice, allowed)[:, :attrs.k]
    return idx, np.take_along_axis(scores, idx, axis=-1)


def route(router_probs, attrs: QMoEAttributes, router_weights=None, score_bias=None):
    """Routing per docs/contract.md: returns ``(experts [rows, k] int64, weights [rows, k] float64)``.
    ``score_bias``: the ``router_score_bias`` [E] [ext] of grouped sigmoid routing (``scoring_func='sigmoid'``)."""
    logits32 = np.asarray(router_probs).astype(np.float32)  # exact for float16/bfloat16 logits
    l = logits32.astype(np.float64)
    if attrs.use_sparse_mixer:
        return _sparse_mixer(l)
    if attrs.scoring_func == "sigmoid":
        idx, w = _grouped_sigmoid_top_k(l, attrs, score_bias)
    else:
        idx = _top_k(logits32, attrs.k)
        w = None if router_weights is not None else np.take_along_axis(_softmax(l), idx, axis=-1)
    if router_weights is not None:
        w = np.take_along_axis(np.asarray(router_weights).astype(np.float32).astype(np.float64), idx, axis=-1)
    if attrs.normalize_routing_weights:
        s = w.sum(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            w = np.where(s != 0, w / np.where(s != 0, s, 1.0), 0.0)
    if attrs.routed_scaling_factor != 1.0:
        w = w * attrs.routed_scaling_factor
    return idx, w


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + 0.044715 * x**3)))


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def activate(h: np.ndarray, attrs: QMoEAttributes, F: int, u: np.ndarray | None = None) -> np.ndarray:
    """The intermediate activation ``[n, I]`` from FC1 output ``h`` ``[n, F·I]`` (and FC3 output ``u``)."""
    act = attrs.activation_type
    if act in ("swiglu", "geglu"):
        if attrs.swiglu_fusion == 1:
            g, lin = h[:, 0::2], h[:, 1::2]
        elif attrs.swiglu_fusion == 2:
            half = h.shape[1] // 2
            g, lin = h[:, :half], h[:, half:]
        else:
            g, lin = h, u
        if act == "geglu":
            return _gelu(g) * lin
        limit, alpha, beta = attrs.swiglu_limit, attrs.activation_alpha, attrs.activation_beta
        L = np.clip(lin, -limit, limit)
        if attrs.swiglu_limit_after_activation:
            return np.minimum(g * _sigmoid(alpha * g), limit) * (L + beta)
        G = np.minimum(g, limit)
        return G * _sigmoid(alpha * G) * (L + beta)
    if act == "relu":
        a = np.maximum(h, 0.0)
    elif act == "gelu":
        a = _gelu(h)
    elif act == "silu":
        a = h * _sigmoid(h)
    elif act == "identity":
        a = h
    elif act == "relu2":
        a = np.maximum(h, 0.0) ** 2
    else:  # pragma: no cover - attributes are validated before
        raise ValueError(act)
    return a * u if u is not None else a


def _dequantized(weights: dict, p, attrs: QMoEAttributes, e: int) -> np.ndarray:
    """Expert e of projection p (a :class:`~qmoe_rtc.contract.ProjectionSpec`), dequantized in float32 by its
    weight format (:meth:`qmoe_rtc.formats.axis.WeightFormat.reference_weights`), as float64 ``[N, K]``."""
    return p.weight_format.reference_weights(weights, p, e, attrs.zero_point_offset).astype(np.float64)


def gemm_input(v: np.ndarray, attrs: QMoEAttributes) -> np.ndarray:
    """What a GEMM multiplies for input rows ``v`` ``[n, K]``: ``v`` itself, or with FP8 activations [ext] its
    e4m3fn values times their scales (:func:`qmoe_rtc.formats.activations.fake_quantize`, from ``v`` in float32)."""
    if attrs.activation_quant == "fp8_e4m3":
        return fake_quantize(v, attrs.activation_quant_group)
    return v


def expert_mlp(x: np.ndarray, layer, weights: dict, attrs: QMoEAttributes, e: int) -> np.ndarray:
    """Expert e of a layer on rows ``x`` ``[n, H]`` (float64): ``act(x·W1ᵀ + b1) · W2ᵀ + b2`` ``[n, H]``, both GEMMs'
    inputs as :func:`gemm_input` gives them."""
    b1, b2, b3 = (_f64(weights.get(f"fc{i}_experts_bias")) for i in (1, 2, 3))
    xq = gemm_input(x, attrs)  # [n, H]
    h = xq @ _dequantized(weights, layer.fc1, attrs, e).T + (b1[e] if b1 is not None else 0.0)  # [n, F·I]
    u = None
    if layer.fc3 is not None:
        u = xq @ _dequantized(weights, layer.fc3, attrs, e).T + (b3[e] if b3 is not None else 0.0)  # [n, I]
    a = gemm_input(activate(h, attrs, layer.F, u), attrs)  # [n, I]
    return a @ _dequantized(weights, layer.fc2, attrs, e).T + (b2[e] if b2 is not None else 0.0)  # [n, H]


def router_logits(x: np.ndarray, router_weight, router_bias=None) -> np.ndarray:
    """The router GEMM [ext]: float32 logits ``[rows, E]`` = ``x·Wᵀ + b`` computed in float64 from
    ``x`` ``[rows, H]``, ``router_weight`` ``[E, H]`` and ``router_bias`` ``[E]``, rounded once."""
    lg = np.asarray(x).astype(np.float64) @ _f64(router_weight).T  # [rows, E]
    if router_bias is not None:
        lg = lg + _f64(router_bias)
    return lg.astype(np.float32)


def shared_part(x: np.ndarray, shared, weights: dict, attrs: QMoEAttributes, gate_weight=None) -> np.ndarray:
    """The shared experts' contribution [ext] ``[rows, H]`` (float64): ``Σ_s shared_s(x)``, times
    ``sigmoid(x·g)`` per row when ``gate_weight`` ``[H]`` is given. ``weights`` uses the routed names."""
    sattrs = attrs.shared_attrs()
    total = np.zeros_like(x)
    for s in range(shared.E):
        total += expert_mlp(x, shared, weights, sattrs, s)
    if gate_weight is not None:
        total *= _sigmoid(x @ _f64(gate_weight))[:, None]
    return total


def qmoe(
    input,
    router_probs,
    fc1_experts_weights,
    fc1_scales=None,
    fc1_experts_bias=None,
    fc2_experts_weights=None,
    fc2_scales=None,
    fc2_experts_bias=None,
    fc3_experts_weights=None,
    fc3_scales=None,
    fc3_experts_bias=None,
    fc1_zero_points=None,
    fc2_zero_points=None,
    fc3_zero_points=None,
    router_weights=None,
    fc1_global_scale=None,
    fc2_global_scale=None,
    *,
    validate_content: bool = False,
    **attributes,
):
    """Run one QMoE layer on the CPU in float64; returns an array of the input's shape and dtype.

    Arguments are ONNX Runtime's QMoE inputs, in its order (0–16: 15 and 16 are the FP8 global
    scales); attributes (``k``, ``activation_type``, ``block_size`` ...) are keywords with ONNX
    Runtime's names and defaults. The extension inputs [ext] are keywords too (names in
    :data:`qmoe_rtc.contract.extensions.EXT_INPUTS`): shared experts ``shared_fc1_experts_weights`` ...
    ``shared_fc2_experts_bias`` with an optional ``shared_gate_weight`` [H], and the router GEMM
    ``router_weight`` [E, H] / ``router_bias`` [E], with which ``router_probs`` is None, and the grouped
    sigmoid routing's ``router_score_bias`` [E] float32 (with ``scoring_func='sigmoid'``).
    ``validate_content``: also check what :class:`~qmoe_rtc.executor.QMoE` checks with the same flag
    (finite non-negative scales, finite biases, zero-point padding, no NaN FP8 codes), raising the
    same ``QMoEInputError``. Expert slices [ext] (``expert_range`` + ``num_experts``, or
    ``expert_map``; :mod:`qmoe_rtc.contract.slices`): the weights hold the slice's experts, routing runs over
    all E logits and the result is the slice's partial output.
    """
    ext_in = {n: _host(attributes.pop(n)) for n in EXT_INPUTS if n in attributes}
    slice_args = {n: attributes.pop(n, None) for n in ("expert_range", "expert_map", "num_experts")}
    attrs = QMoEAttributes.from_kwargs(**attributes)
    given = dict(fc1_experts_weights=fc1_experts_weights, fc1_scales=fc1_scales, fc1_experts_bias=fc1_experts_bias,
                 fc2_experts_weights=fc2_experts_weights, fc2_scales=fc2_scales, fc2_experts_bias=fc2_experts_bias,
                 fc3_experts_weights=fc3_experts_weights, fc3_scales=fc3_scales, fc3_experts_bias=fc3_experts_bias,
                 fc1_zero_points=fc1_zero_points, fc2_zero_points=fc2_zero_points, fc3_zero_points=fc3_zero_points,
                 fc1_global_scale=fc1_global_scale, fc2_global_scale=fc2_global_scale)
    weights = {n: _host(a) for n, a in given.items()}
    sl = describe_slice(**slice_args)
    layer = describe_layer(weights, attrs, routed_experts=sl.num_experts if sl is not None else None)
    if sl is not None:
        sl.check_local(layer.E)
    routed = replace(layer, E=sl.num_experts) if sl is not None else layer  # routing sees all E experts
    ext = describe_extensions(ext_in, attrs, routed)
    sw = shared_weights(ext_in)
    if validate_content:
        check_content(weights, layer)
        if ext.shared is not None:
            check_content(sw, ext.shared)
    x_in, logits, rw = _host(input), _host(router_probs), _host(router_weights)
    call = check_ext_call(routed, ext, x_in, logits, rw)
    out_dtype = np_dtype(call.dtype)
    if call.rows == 0:
        return np.zeros(call.input_shape, dtype=out_dtype)

    x = x_in.astype(np.float64).reshape(call.rows, layer.H)
    if ext.router:
        logits = router_logits(x, ext_in["router_weight"], ext_in.get("router_bias"))
    experts, route_w = route(logits, attrs, rw, ext_in.get("router_score_bias"))  # [rows, k]
    out = np.zeros((call.rows, layer.H), dtype=np.float64)
    local = sl.global_to_local() if sl is not None else np.arange(layer.E)
    for e in np.unique(experts):
        if local[e] < 0:  # an expert this slice does not hold: contributes nothing here
            continue
        r, j = np.nonzero(experts == e)
        y = expert_mlp(x[r], layer, weights, attrs, int(local[e]))  # [n, H]
        np.add.at(out, r, route_w[r, j][:, None] * y)
    if ext.shared is not None:
        out += shared_part(x, ext.shared, sw, attrs, ext_in.get("shared_gate_weight"))
    return out.reshape(call.input_shape).astype(out_dtype)
