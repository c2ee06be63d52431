"""Grouped sigmoid routing [ext] for the GPU suites: which rows' choice the float32 kernel may make otherwise than
the float64 reference (:func:`near_tie_rows`), and the check of one routing launch's ids and weights against the
reference (:func:`check_grouped_routes`).

The kernel chooses by s + bias with s = 1 / (1 + e^-l) in float32 (``expf``), the reference in float64: two
choices (or two groups' values) closer than a few float32 ulps may come out in either order. Such rows are
named here from the reference's own values, so every other row must match exactly; exact ties (equal values in
both precisions: the same logits and bias) are not near ties, they must go to the lower index on both sides.
"""

from __future__ import annotations

import numpy as np

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.reference import route as reference_route

#: how close (absolute, choices are O(1)) two float64 values must be for float32 rounding to swap them
NEAR = 2e-6


def _ambiguous(sorted_desc: np.ndarray, upto: int, tol: float) -> np.ndarray:
    """[rows] bool: among the first ``upto + 1`` values of each row (descending), two neighbours that differ by
    less than ``tol`` but are not equal."""
    head = sorted_desc[:, : upto + 1]
    gap = head[:, :-1] - head[:, 1:]
    return ((gap > 0) & (gap < tol)).any(axis=-1)


def choices(logits: np.ndarray, bias) -> tuple[np.ndarray, np.ndarray]:
    """(scores s [rows, E], choices s + bias [rows, E]) in float64 from float32-exact logits."""
    s = 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float32).astype(np.float64)))
    return s, s if bias is None else s + np.asarray(bias, dtype=np.float64)


def near_tie_rows(logits: np.ndarray, bias, attrs: QMoEAttributes, tol: float = NEAR) -> np.ndarray:
    """[rows] bool: rows whose kept groups or whose k picks (or their order) float32 rounding may change: two
    candidates closer than ``tol`` (larger where the logits themselves carry rounding: a router GEMM's)."""
    _, c = choices(logits, bias)
    rows, E = c.shape
    near = np.zeros(rows, dtype=bool)
    allowed = np.ones(c.shape, dtype=bool)
    if attrs.grouped:
        G = attrs.n_group
        per = np.sort(c.reshape(rows, G, E // G), axis=-1)[..., ::-1]
        value = per[..., :2].sum(axis=-1)  # [rows, G]
        near |= _ambiguous(np.sort(value, axis=-1)[:, ::-1], attrs.groups_kept if attrs.groups_kept < G else 0, tol)
        order = np.argsort(-value, axis=-1, kind="stable")  # descending, equal values to the lower group
        groups = np.zeros((rows, G), dtype=bool)
        np.put_along_axis(groups, order[:, : attrs.groups_kept], True, axis=-1)
        allowed = np.repeat(groups, E // G, axis=-1)
    masked = np.where(allowed, c, -np.inf)
    near |= _ambiguous(np.sort(masked, axis=-1)[:, ::-1], min(attrs.k, E - 1), tol)
    return near


def check_grouped_routes(ids, w, logits, bias, attrs: QMoEAttributes, router_weights=None, max_near: float = 0.05):
    """One routing launch's slots 0..k-1 (``ids``, ``w`` [rows, k]) against the reference: the same experts in the
    same slots on every row but near ties (at most ``max_near`` of the rows), and on every row the weights that the
    kernel's own picks call for (sigmoid scores or router_weights, normalised, scaled) within float32 rounding."""
    k = attrs.k
    ids, w = np.asarray(ids)[:, :k], np.asarray(w)[:, :k]
    want_ids, _ = reference_route(logits, attrs, router_weights, score_bias=bias)
    near = near_tie_rows(logits, bias, attrs)
    allowed = max(1, int(max_near * near.size))  # one row of a few is chance, not coarse data
    assert near.sum() <= allowed, f"{near.sum()} of {near.size} rows have near ties: the test data are too coarse"
    bad = ~near & (ids != want_ids).any(axis=-1)
    assert not bad.any(), f"rows {np.flatnonzero(bad)[:8]}: ids {ids[bad][:2]} != reference {want_ids[bad][:2]}"
    E = np.asarray(logits).shape[1]
    assert ((ids >= 0) & (ids < E)).all() and all(len(set(r)) == k for r in ids.tolist())  # k distinct experts
    s, _ = choices(logits, bias)
    src = s if router_weights is None else np.asarray(router_weights).astype(np.float32).astype(np.float64)
    v = np.take_along_axis(src, ids.astype(np.int64), axis=-1)
    if attrs.normalize_routing_weights:
        tot = v.sum(axis=-1, keepdims=True)
        v = np.where(tot != 0, v / np.where(tot != 0, tot, 1.0), 0.0)
    v = v * attrs.routed_scaling_factor
    np.testing.assert_allclose(w, v, rtol=2e-5, atol=1e-7)
    return int(near.sum())
