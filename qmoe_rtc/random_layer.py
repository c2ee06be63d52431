"""Random QMoE layers and inputs for tests, the demo and the benchmark (NumPy on the host).

``random_layer`` draws float experts, quantizes them with :func:`qmoe_rtc.quantize.quantize` and
returns the ONNX Runtime-named weight tensors plus the attributes that describe them.
"""

from __future__ import annotations

import numpy as np

from ._arrays import np_dtype
from .contract import GLU_ACTIVATIONS
from .quantize import quantize

__all__ = ["random_layer", "random_inputs"]


def random_layer(
    rng: np.random.Generator,
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
    **attributes,
) -> tuple[dict, dict]:
    """A random layer: ``(weights by ONNX Runtime input name, attributes)``.

    ``bits`` and ``zero_points`` may be given per projection (fc1, fc2, fc3). GLU activations default
    to ``swiglu_fusion=1`` unless ``fc3`` is asked for. Weight magnitudes are scaled by 1/sqrt(K) so
    outputs stay O(1) at any size. ``progress(projection, experts done, E)``, when given, is called as
    the experts are drawn and quantized (a few at a time; the values are the same either way).
    ``format="fp8_e4m3"``: FP8 experts (``quant_type="fp8"``; ``bits`` and ``zero_points`` are ignored):
    float32 ``fc*_global_scale`` with block_size 0, else square block scales in ``fc*_scales``.
    """
    fp8 = format == "fp8_e4m3"
    if fp8:
        bits, zero_points = 8, False
    b1, b2, b3 = (bits,) * 3 if isinstance(bits, int) else tuple(bits)
    z1, z2, z3 = (zero_points,) * 3 if isinstance(zero_points, bool) else tuple(zero_points)
    glu = activation_type in GLU_ACTIVATIONS
    if swiglu_fusion is None:
        swiglu_fusion = 1 if glu and not fc3 else 0
    F = 2 if glu and swiglu_fusion else 1
    sdt = np_dtype(scale_dtype or dtype)
    bdt = np_dtype(dtype)

    def proj(name, N, K, b, zp):
        step = E if progress is None else max(1, min(E, (1 << 23) // max(1, N * K)))  # ~32 MiB of floats at a time
        parts = []
        for e0 in range(0, E, step):  # the generator fills experts in order: chunks draw the same values
            w = rng.standard_normal((min(step, E - e0), N, K), dtype=np.float32)
            w *= np.float32(1.0 / np.sqrt(K))
            if fp8:
                parts.append(quantize(w, None, block_size, scale_dtype=sdt if block_size else np.float32, format=format))
            else:
                parts.append(quantize(w, b, block_size, symmetric=not zp, scale_dtype=sdt))
            if progress is not None:
                progress(name, min(E, e0 + step), E)
        q = parts[0] if len(parts) == 1 else type(parts[0])(
            *(None if parts[0][i] is None else np.concatenate([p[i] for p in parts]) for i in range(3)))
        out = {f"{name}_experts_weights": q.packed,
               f"{name}_global_scale" if fp8 and not block_size else f"{name}_scales": q.scales}
        if zp:
            out[f"{name}_zero_points"] = q.zero_points
        if bias:
            out[f"{name}_experts_bias"] = (0.1 * rng.standard_normal((E, N))).astype(bdt)
        return out

    weights = {}
    weights.update(proj("fc1", F * I, H, b1, z1))
    weights.update(proj("fc2", H, I, b2, z2))
    if fc3:
        weights.update(proj("fc3", I, H, b3, z3))
    attrs = dict(k=k, activation_type=activation_type, block_size=block_size, expert_weight_bits=b1,
                 swiglu_fusion=swiglu_fusion, **attributes)
    if fp8:
        attrs["quant_type"] = "fp8"
    if b2 != b1:
        attrs["fc2_expert_weight_bits"] = b2
    if fc3 and b3 != b1:
        attrs["fc3_expert_weight_bits"] = b3
    return weights, attrs


def random_inputs(rng: np.random.Generator, rows, H: int, E: int, dtype: str = "float16",
                  router_dtype: str = "float32", router_weights: bool = False):
    """``(input [rows, H] or [B, S, H], router_probs [rows, E], router_weights or None)``.

    Logits are continuous random values, so ties have probability zero.
    """
    shape = tuple(rows) if isinstance(rows, (tuple, list)) else (int(rows),)
    n = int(np.prod(shape))
    x = rng.standard_normal((*shape, H)).astype(np_dtype(dtype))
    logits = (2.0 * rng.standard_normal((n, E))).astype(np_dtype(router_dtype))
    rw = rng.random((n, E)).astype(np_dtype(router_dtype)) if router_weights else None
    return x, logits, rw
