"""The benchmark's layers (:mod:`qmoe_rtc.bench.run`): random quantized experts on the GPU with the shape's
[ext] tensors (shared experts, gate, router weight), one :class:`~qmoe_rtc.QMoE` per variant (routed /
shared / full), the inputs per token count and the float64 reference rows per variant.

Everything takes the array module ``cp`` as an argument (CuPy on the GPU; the CPU tests pass NumPy).
"""

from __future__ import annotations

import time

import numpy as np

from ..formats.axis import INT, weight_format
from .report import LayerQuant, Shape, _reason, check_rows, expert_bytes, extension_bytes

__all__ = ["build_layer", "prepare_layer", "uniform_codes", "uniform_scales"]


def build_layer(cp, rs, shape: Shape, dtype: str, bits, block_size: int, zero_points: bool, shared: bool = False,
                codes: str = "quantized", swiglu_fusion: int = 1, format: str = "int"):
    """Random quantized experts on the GPU (drawn and quantized ~32 MiB of floats at a time) with
    :func:`qmoe_rtc.contract.random_layer.random_layer`: (weights by ORT name, attributes). ``format`` 'fp8_e4m3':
    e4m3 codes with float32 scales; 'mxfp4' / 'nvfp4': e2m1 codes in that format (``bits`` is then the
    format's). The shape's router weight [E, H] comes along when it has a router GEMM, its shared experts
    (and gate) with ``shared`` (int experts only: the FP8 and FP4 points time routed layers).

    ``codes="uniform"`` (int experts without zero points): the routed experts' codes drawn uniformly over the
    bit width's range and their scales as (U(0, 1) + 0.5) / (std of those codes · sqrt(K)), as the peers'
    benchmark draws them, in place of Gaussian weights quantized (whose codes crowd the middle of the range).
    The GEMMs' time depends on it where the GPU runs at its power limit (mixtral-8x7b at 4096 tokens: 3.5 %
    slower with uniform codes, H200, docs/performance-log.md). ``swiglu_fusion``: 1 (FC1 rows gate
    and linear interleaved) or 2 ([gate | linear] halves, the peers' benchmark's)."""
    from ..contract.random_layer import random_layer

    fmt = weight_format(format)
    float_codes = fmt is not INT
    sh = shared and not float_codes
    layer = random_layer(rs, E=shape.E, H=shape.H, I=shape.I, k=shape.k,
                        bits=fmt.bits[0] if float_codes else (*bits, bits[0]),
                        block_size=block_size, zero_points=bool(zero_points) and not float_codes, dtype=dtype,
                        scale_dtype="float32" if float_codes else None, activation_type="swiglu",
                        swiglu_fusion=swiglu_fusion, normalize_routing_weights=1, format=fmt.name,
                        progress=lambda *_: None, shared=shape.shared if sh else 0,
                        shared_gate=sh and shape.shared_gate, router_gemm=shape.router)
    if codes == "uniform":
        if float_codes or zero_points:
            raise ValueError("codes='uniform': int experts without zero points only")
        w, a = layer
        for proj, b, k in (("fc1", bits[0], shape.H), ("fc2", bits[1], shape.I)):
            w[f"{proj}_experts_weights"] = uniform_codes(cp, rs, w[f"{proj}_experts_weights"].shape)
            w[f"{proj}_scales"] = uniform_scales(cp, rs, w[f"{proj}_scales"], b, k)
    elif codes != "quantized":
        raise ValueError(f"codes: 'quantized' or 'uniform', got {codes!r}")
    return layer


def uniform_codes(cp, rs, shape) -> object:
    """Packed codes [.., K·b/8] u8 whose every bit is uniform: so is every b-bit code."""
    return rs.randint(0, 256, size=shape, dtype=cp.int32).astype(cp.uint8)


def uniform_scales(cp, rs, like, bits: int, k: int) -> object:
    """Scales shaped and typed as ``like``: (U(0, 1) + 0.5) / (std of uniform b-bit codes · sqrt(K))."""
    std = (((1 << bits) ** 2 - 1) / 12.0) ** 0.5
    return ((rs.random_sample(like.shape) + 0.5) / (std * k ** 0.5)).astype(like.dtype)


def prepare_layer(cp, rs, args, shape, dtype, q: LayerQuant, bs, variants):
    """Layers per variant (an error string where one cannot be built), inputs per T (device and host)
    and the reference rows per variant and T (one reference call per variant over the checked rows), for
    the layer quantized as ``q`` with block size ``bs``."""
    from .._arrays import np_dtype
    from ..contract.extensions import EXT_INPUTS
    from ..contract.reference import qmoe as reference
    from ..contract.reference import router_logits
    from ..executor import QMoE

    t0 = time.perf_counter()
    bits, zp = q.bits, args.zero_points and not q.float_codes
    weights, attrs = build_layer(cp, rs, shape, dtype, bits, bs, zp, shared=variants != ["routed"], format=q.format)
    ext = {n: weights.pop(n) for n in list(weights) if n in EXT_INPUTS}
    per_variant = {"routed": {}, "shared": {n: a for n, a in ext.items() if n.startswith("shared_")}, "full": ext}
    extra = {} if args.decode_max_routes is None else {"decode_max_routes": args.decode_max_routes}
    layers = {}
    for v in variants:
        try:
            layers[v] = QMoE(**weights, **per_variant[v], **attrs, **extra)
        except Exception as exc:  # e.g. a build whose GPU engines refuse shared experts: that variant's rows say so
            layers[v] = "layer: " + _reason(exc)
    isz = np_dtype(dtype).itemsize
    per_expert = sum(int(v.nbytes) for v in weights.values()) // shape.E
    calc = expert_bytes(shape.H, shape.I, bits, bs, zp, isz, q.format)
    got_ext = (sum(int(a.nbytes) for n, a in ext.items() if n != "router_weight"),
               int(ext["router_weight"].nbytes) if "router_weight" in ext else 0)
    want_ext = extension_bytes(shape, bits, bs, zp, isz, isz, q.format)
    if calc != per_expert or (variants != ["routed"] and got_ext != want_ext):
        print(f"  warning: bytes per expert {per_expert}, shared/router {got_ext} (arrays) != {calc}, {want_ext} "
              "(formula)", flush=True)
    host_ext = {n: cp.asnumpy(a) for n, a in ext.items()}
    inputs = {}
    for T in args.tokens:
        x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype(dtype))
        xh = cp.asnumpy(x)
        if shape.router:  # the routed layers get the logits the router GEMM makes: every variant routes alike
            lh = router_logits(xh.astype(np.float32), host_ext["router_weight"])
            logits = cp.asarray(lh)
        else:
            logits = 2 * rs.standard_normal((T, shape.E), dtype=cp.float32)
            lh = cp.asnumpy(logits)
        inputs[T] = (x, logits, xh, lh, check_rows(T, args.check_rows))
    t1 = time.perf_counter()
    host_w = {n: cp.asnumpy(v) for n, v in weights.items()}  # rows are independent: one call covers every T
    X = np.concatenate([xh[r] for _, _, xh, _, r in inputs.values()])
    L = np.concatenate([lh[r] for _, _, _, lh, r in inputs.values()])
    ends = np.cumsum([len(r) for *_, r in inputs.values()])[:-1]
    refs = {}
    for v in variants:
        if isinstance(layers[v], str):
            continue
        hx = {n: host_ext[n] for n in per_variant[v]}
        ref = reference(X, None if "router_weight" in hx else L, **host_w, **hx, **attrs)
        refs[v] = dict(zip(inputs, np.split(ref, ends)))
    ext_bytes = {"routed": 0, "shared": want_ext[0], "full": sum(want_ext)}
    codes = f"bits {','.join(map(str, bits))}" if not q.float_codes else q.format
    print(f"  [{shape.name} {dtype} {codes} block {bs}: built on GPU in {t1 - t0:.1f} s, CPU "
          f"reference over {len(X)} rows ({'/'.join(refs)}) in {time.perf_counter() - t1:.1f} s]", flush=True)
    return weights, layers, per_expert, ext_bytes, inputs, refs
