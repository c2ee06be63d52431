"""Random QMoE layers and inputs for tests, the demo and the benchmark.

``random_layer`` draws float experts, quantizes them with :func:`qmoe_rtc.formats.quantize.quantize` and
returns the ONNX Runtime-named weight tensors (plus the [ext] shared experts, gate and router weight
when asked for) and the attributes that describe them. It runs on NumPy with a
``numpy.random.Generator``, and on the GPU with a ``cupy.random.RandomState`` (anything whose
``standard_normal(size, dtype=...)`` returns arrays that :func:`~qmoe_rtc.formats.quantize.quantize` takes).
"""

from __future__ import annotations

import numpy as np

from .._arrays import array_module, np_dtype
from ..formats.axis import INT, weight_format
from ..formats.quantize import quantize
from .checks import GLU_ACTIVATIONS

__all__ = ["random_layer", "random_inputs"]


def random_layer(
    rng,
    *,
    E: int,
    H: int,
    I: int,
    k: int = 2,
    bits: int | tuple[int, int, int] = 4,
    block_size: int = 0,
    zero_points: bool | tuple[bool, bool, bool] = False,
    dtype: str = "float16",
    scale_dtype: str | None = None,
    activation_type: str = "swiglu",
    swiglu_fusion: int | None = None,
    fc3: bool = False,
    bias: bool = False,
    progress=None,
    format: str = "int",
    shared: int = 0,
    shared_inter: int | None = None,
    shared_gate: bool = False,
    router_gemm: bool = False,
    router_bias: bool = False,
    **attributes,
) -> tuple[dict, dict]:
    """A random layer: ``(weights by ONNX Runtime input name, attributes)``.

    ``bits`` and ``zero_points`` may be given per projection (fc1, fc2, fc3). GLU activations default
    to ``swiglu_fusion=1`` unless ``fc3`` is asked for. Weight magnitudes are scaled by 1/sqrt(K) so
    outputs stay O(1) at any size. ``progress(projection, experts done, E)``, when given, is called as
    the experts are drawn and quantized (a few at a time; the values are the same either way).
    ``format`` (:mod:`qmoe_rtc.formats`): 'int', or a float format, whose code width is its own and which
    has no zero points (``bits`` and ``zero_points`` are ignored; the attributes get its ``quant_type``):
    'fp8_e4m3' (``quant_type="fp8"``): float32 ``fc*_global_scale`` with block_size 0, else square block
    scales in ``fc*_scales``; 'mxfp4' / 'nvfp4' [ext]: ``scale_dtype`` is ignored, ``block_size`` becomes
    the format's.

    [ext] ``shared`` = S shared experts (intermediate size ``shared_inter``, default I), quantized like
    the routed FC1/FC2 (``shared_fc*_...``; with ``bias`` their biases too); ``shared_gate``: a
    ``shared_gate_weight`` [H]; ``router_gemm``: a ``router_weight`` [E, H] (and with ``router_bias``
    a ``router_bias`` [E]), with which the call passes ``router_probs=None``. These are drawn after
    the routed experts, so the routed tensors are the same with or without them. Gate and router
    weights are in the activation dtype: N(0, 1)/sqrt(H) for the gate, 2·N(0, 1)/sqrt(H) for the
    router (logits of about 2·N(0, 1) for unit inputs, like :func:`random_inputs`).
    """
    fmt = weight_format(format)
    if fmt is not INT:  # the format's own width, no zero points (an FP4 format also its own block)
        bits, zero_points, block_size = fmt.bits[0], False, fmt.scale.block or block_size
    b1, b2, b3 = (bits,) * 3 if isinstance(bits, int) else tuple(bits)
    z1, z2, z3 = (zero_points,) * 3 if isinstance(zero_points, bool) else tuple(zero_points)
    glu = activation_type in GLU_ACTIVATIONS
    if swiglu_fusion is None:
        swiglu_fusion = 1 if glu and not fc3 else 0
    F = 2 if glu and swiglu_fusion else 1
    sdt = np_dtype(scale_dtype or dtype)
    bdt = np_dtype(dtype)

    def draw(shape, K):
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= np.float32(1.0 / np.sqrt(K))
        return w

    def proj(name, n_experts, N, K, b, zp):
        step = n_experts if progress is None else max(1, min(n_experts, (1 << 23) // max(1, N * K)))  # ~32 MiB floats
        parts = []
        for e0 in range(0, n_experts, step):  # the generator fills experts in order: chunks draw the same values
            w = draw((min(step, n_experts - e0), N, K), K)
            if fmt is INT:
                parts.append(quantize(w, b, block_size, symmetric=not zp, scale_dtype=sdt))
            else:  # FP8 global scales are float32; FP4 scales are the format's bytes
                parts.append(quantize(w, None, block_size, format=fmt.name,
                                      scale_dtype=sdt if block_size and not fmt.scale.block else np.float32))
            del w
            if progress is not None:
                progress(name, min(n_experts, e0 + step), n_experts)
        xp = array_module(parts[0].packed)
        q = parts[0] if len(parts) == 1 else type(parts[0])(
            *(None if parts[0][i] is None else xp.concatenate([p[i] for p in parts]) for i in range(3)))
        per_expert = fmt.scale.global_scale == "per-expert" and not block_size  # FP8: the scale is the global one
        out = {f"{name}_experts_weights": q.packed, f"{name}_global_scale" if per_expert else f"{name}_scales": q.scales}
        if fmt.scale.global_scale == "always":  # NVFP4: block scales and a global scale
            out[f"{name}_global_scale"] = q.global_scale
        if zp:
            out[f"{name}_zero_points"] = q.zero_points
        if bias:
            out[f"{name}_experts_bias"] = (0.1 * rng.standard_normal((n_experts, N))).astype(bdt)
        return out

    weights = {}
    weights.update(proj("fc1", E, F * I, H, b1, z1))
    weights.update(proj("fc2", E, H, I, b2, z2))
    if fc3:
        weights.update(proj("fc3", E, I, H, b3, z3))
    if shared:
        Is = I if shared_inter is None else shared_inter
        weights.update(proj("shared_fc1", shared, F * Is, H, b1, z1))
        weights.update(proj("shared_fc2", shared, H, Is, b2, z2))
    if shared_gate:
        weights["shared_gate_weight"] = draw((H,), H).astype(bdt)
    if router_gemm:
        weights["router_weight"] = (2 * draw((E, H), H)).astype(bdt)
        if router_bias:
            weights["router_bias"] = (0.1 * rng.standard_normal((E,))).astype(bdt)
    attrs = dict(k=k, activation_type=activation_type, block_size=block_size, expert_weight_bits=b1,
                 swiglu_fusion=swiglu_fusion, **attributes)
    if fmt is not INT:
        attrs["quant_type"] = fmt.quant_type
    if b2 != b1:
        attrs["fc2_expert_weight_bits"] = b2
    if fc3 and b3 != b1:
        attrs["fc3_expert_weight_bits"] = b3
    return weights, attrs


def random_inputs(rng: np.random.Generator, rows, H: int, E: int, dtype: str = "float16",
                  router_dtype: str = "float32", router_weights: bool = False):
    """``(input [rows, H] or [B, S, H], router_probs [rows, E], router_weights or None)``.

    Logits are continuous random values, so ties have probability zero. (A layer with a router GEMM
    takes ``router_probs=None`` instead.)
    """
    shape = tuple(rows) if isinstance(rows, (tuple, list)) else (int(rows),)
    n = int(np.prod(shape))
    x = rng.standard_normal((*shape, H)).astype(np_dtype(dtype))
    logits = (2.0 * rng.standard_normal((n, E))).astype(np_dtype(router_dtype))
    rw = rng.random((n, E)).astype(np_dtype(router_dtype)) if router_weights else None
    return x, logits, rw
