"""The one-shot form, ``qmoe_rtc.qmoe(...)``: ONNX Runtime's input order and attribute names, a
:class:`~qmoe_rtc.executor.QMoE` built for the call, and every input (the per-call ones included)
checked from its metadata before the driver is asked for a GPU."""

from __future__ import annotations

from dataclasses import replace

from .contract.checks import LAYER_INPUTS, QMoEAttributes, check_call
from .contract.extensions import EXT_INPUTS, check_ext_call
from .executor import QMoE
from .runtime.interop import array_meta
from .runtime.layer import describe_gpu_layer

__all__ = ["qmoe"]


def qmoe(input, router_probs, fc1_experts_weights, fc1_scales, fc1_experts_bias=None, fc2_experts_weights=None,
         fc2_scales=None, fc2_experts_bias=None, fc3_experts_weights=None, fc3_scales=None, fc3_experts_bias=None,
         fc1_zero_points=None, fc2_zero_points=None, fc3_zero_points=None, router_weights=None, **attributes):
    """One-shot QMoE on the GPU with ONNX Runtime's input order (0–14) and attribute names.

    Builds a :class:`QMoE` each call (modules stay cached); keep a layer object for repeated use. Other
    layer tensors (FP8 ``fc*_global_scale``, the [ext] inputs) are keywords, as for :class:`QMoE`. Every
    input, the per-call ones included, is checked from its metadata before the driver is asked for a GPU.
    """
    weights = {n: attributes.pop(n) for n in list(attributes) if n in LAYER_INPUTS + EXT_INPUTS}
    weights.update(fc1_experts_weights=fc1_experts_weights, fc1_scales=fc1_scales, fc1_experts_bias=fc1_experts_bias,
                   fc2_experts_weights=fc2_experts_weights, fc2_scales=fc2_scales, fc2_experts_bias=fc2_experts_bias,
                   fc3_experts_weights=fc3_experts_weights, fc3_scales=fc3_scales, fc3_experts_bias=fc3_experts_bias,
                   fc1_zero_points=fc1_zero_points, fc2_zero_points=fc2_zero_points, fc3_zero_points=fc3_zero_points)
    _check_call_metadata(weights, attributes, input, router_probs, router_weights)
    layer = QMoE(**weights, **attributes)
    return layer(input, router_probs, router_weights)


def _check_call_metadata(weights: dict, attributes: dict, input, router_probs, router_weights) -> None:
    """The per-call inputs against the layer, from metadata alone (where the arrays live is the layer's
    concern once it is on the GPU)."""
    slice_args = {n: attributes.get(n) for n in _SLICE_ARGS}
    attrs = QMoEAttributes.from_kwargs(**{n: v for n, v in attributes.items() if n not in _LAYER_PARAMS + _SLICE_ARGS})
    metas = {n: array_meta(n, a) for n, a in weights.items()}
    g = describe_gpu_layer({n: m if m is None else replace(m, device=None) for n, m in metas.items()}, attrs, slice_args,
                           attributes.get("prepack") == "given")
    calls = [None if a is None else replace(array_meta(n, a), device=None)
             for n, a in (("input", input), ("router_probs", router_probs), ("router_weights", router_weights))]
    if g.ext.used:
        check_ext_call(g.routing, g.ext, *calls)
    else:
        check_call(g.routing, *calls)


#: QMoE() keywords that are neither tensors nor attributes: its own parameters and the expert slice [ext].
_LAYER_PARAMS = ("decode_max_routes", "validate_content", "device", "prepack")
_SLICE_ARGS = ("expert_range", "expert_map", "num_experts")
