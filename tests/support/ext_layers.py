"""[ext] layers for the GPU suites: :func:`build` (routed weights plus shared experts, their gate and the router
weight), :func:`to_dev` (the arrays given onto the GPU) and :func:`engines` (each engine that runs a dtype here)."""

from __future__ import annotations

import math

import numpy as np

from qmoe_rtc._arrays import np_dtype
from qmoe_rtc.contract.random_layer import random_layer


def build(rng, *, E, H, I, k, dtype, S=1, gate=False, router=None, router_bias=False, **kw):  # noqa: E741
    """(routed weights, attributes, extension inputs): S shared experts in the routed layout."""
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    ext = {}
    if S:
        sw, _ = random_layer(rng, E=S, H=H, I=I, k=1, dtype=dtype, **kw)
        ext = {f"shared_{n}": v for n, v in sw.items() if n.startswith(("fc1_", "fc2_")) and v is not None}
    if gate:
        ext["shared_gate_weight"] = (rng.standard_normal(H) / math.sqrt(H)).astype(np.float32)
    if router:
        rdt = np.float32 if router == "float32" else np_dtype(dtype)
        ext["router_weight"] = (2 * rng.standard_normal((E, H)) / math.sqrt(H)).astype(rdt)
        if router_bias:
            ext["router_bias"] = rng.standard_normal(E).astype(np.float32)
    return w, a, ext


def to_dev(d):
    import cupy as cp

    return {n: cp.asarray(v) for n, v in d.items() if v is not None}


def engines(dtype):
    """(path, knob settings, pipeline the plan must pick) for each engine that runs ``dtype`` here."""
    import cupy as cp

    if dtype == "float32":
        return [("decode", {}, "decode-gemv"), ("prefill", {}, "prefill-simt")]
    out = [("decode", {}, "decode-mma"), ("prefill", dict(prefill_engine="mma"), "prefill-mma")]
    if cp.cuda.Device().compute_capability == "90":
        out.append(("prefill", dict(prefill_engine="wgmma"), "prefill-wgmma"))
    return out
