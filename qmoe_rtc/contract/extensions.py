"""Contract extensions [ext] beyond ONNX Runtime's QMoE: shared experts (with an optional sigmoid gate),
the router GEMM inside the layer and the score bias of grouped sigmoid routing (docs/contract.md, "Shared
experts", "Router GEMM", "Grouped sigmoid routing").

``describe_extensions(inputs, attrs, layer)`` validates the extension tensors against an already
described routed layer and returns an :class:`ExtensionSpec`; ``check_ext_call`` validates a call's
inputs when the layer may compute its own logits. The float64 reference implements them, the GPU
engines too (shared experts in the routed layout: :mod:`qmoe_rtc.runtime.layer`), but for the grouped
sigmoid routing, which they refuse.

Shared experts use the routed layout with a leading S (the number of shared experts) and their own
intermediate size, so they are validated by :func:`qmoe_rtc.contract.describe_layer` itself on the
``shared_``-less names, and any refusal is re-raised naming the ``shared_`` input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .._arrays import ArrayMeta, device_of, dtype_name, shape_str
from ..errors import DeviceError, QMoEAttributeError, QMoEInputError
from ..formats.projection import require
from ..specialize.vocab import DTYPES as FLOAT_DTYPES
from ..specialize.vocab import GLU_ACTIVATIONS
from .attributes import QMoEAttributes
from .checks import LayerSpec, _infer_dtype, check_call, describe_layer

__all__ = ["SHARED_INPUTS", "EXT_INPUTS", "ExtensionSpec", "describe_extensions", "check_ext_call", "shared_weights"]

#: The shared experts' tensors: the routed fc1/fc2 inputs with ``shared_`` in front, leading dim S
#: (FP8 shared experts with block_size 0: their per-expert ``shared_fc*_global_scale`` [S]).
SHARED_INPUTS = tuple(f"shared_{p}_{t}" for p in ("fc1", "fc2")
                      for t in ("experts_weights", "scales", "zero_points", "experts_bias")) + \
    ("shared_fc1_global_scale", "shared_fc2_global_scale")
#: Every extension input (all constant across calls: passed with the weights).
EXT_INPUTS = SHARED_INPUTS + ("shared_gate_weight", "router_weight", "router_bias", "router_score_bias")


@dataclass(frozen=True)
class ExtensionSpec:
    """What the extension inputs of one layer add to it."""

    shared: LayerSpec | None  #: the shared experts as a layer: E = S, I = their intermediate size
    gate: bool  #: a ``shared_gate_weight`` [H] scales the shared sum by sigmoid(x·g)
    router: bool  #: a ``router_weight`` [E, H] (and maybe ``router_bias`` [E]): logits come from the input
    router_bias: bool
    dtype: str | None  #: the activation dtype T that the extension tensors imply (None: all float32)
    router_dtype: str = ""  #: router_weight's dtype ('' without the router GEMM)
    score_bias: bool = False  #: a ``router_score_bias`` [E] float32 is added to the sigmoid scores to choose experts

    @property
    def S(self) -> int:
        """Number of shared experts (0 without)."""
        return self.shared.E if self.shared is not None else 0

    @property
    def used(self) -> tuple[str, ...]:
        """The extensions in use, in words (empty: a plain ONNX Runtime QMoE layer)."""
        out = []
        if self.shared is not None:
            out.append(f"{self.S} shared expert(s)" + (" with a sigmoid gate" if self.gate else ""))
        if self.router:
            out.append("the router GEMM (router_weight)")
        if self.score_bias:
            out.append("a router score bias (router_score_bias)")
        return tuple(out)


def shared_weights(inputs: dict) -> dict:
    """The shared tensors under the routed names (``shared_fc1_scales`` -> ``fc1_scales``)."""
    return {n.removeprefix("shared_"): inputs.get(n) for n in SHARED_INPUTS if inputs.get(n) is not None}


_ROUTED_NAME = re.compile(r"(?<![\w])(fc[123]_(?:experts_weights|scales|zero_points|experts_bias|global_scale)|block_size|"
                          r"expert_weight_bits|fc[123]_expert_weight_bits)\b")


def _shared_name(text: str) -> str:
    """A routed input or attribute name in a message, as the shared experts call it."""
    def repl(m):
        g = m.group(1)
        return "shared_expert_weight_bits" if g.endswith("expert_weight_bits") else "shared_" + g

    return _ROUTED_NAME.sub(repl, text)


def _describe_shared(inputs: dict, attrs: QMoEAttributes, layer: LayerSpec) -> LayerSpec:
    if attrs.activation_type in GLU_ACTIVATIONS and not attrs.swiglu_fusion:
        raise QMoEAttributeError("swiglu_fusion", f"1 or 2 when shared experts are given with '{attrs.activation_type}'"
                                 " (they have no fc3 to take the linear half from)", "0")
    w2 = inputs.get("shared_fc2_experts_weights")
    if w2 is not None and len(getattr(w2, "shape", ())) == 3 and int(w2.shape[1]) != layer.H:
        raise QMoEInputError("shared_fc2_experts_weights", f"H = {layer.H} rows in dim 1 (as fc2_experts_weights)",
                             f"shape {shape_str(w2.shape)}")
    try:
        spec = describe_layer(shared_weights(inputs), attrs.shared_attrs())
    except QMoEInputError as exc:  # the same check, named as the caller named the tensors
        raise type(exc)(_shared_name(exc.name), _shared_name(exc.expected), _shared_name(exc.actual),
                        _shared_name(exc.hint) if exc.hint else None) from None
    if layer.dtype and spec.dtype and spec.dtype != layer.dtype:
        raise QMoEInputError("shared_fc1_scales", f"float32 or the routed experts' dtype ({layer.dtype})",
                             f"dtype {spec.dtype}")
    return spec


def describe_extensions(inputs: dict, attrs: QMoEAttributes, layer: LayerSpec) -> ExtensionSpec:
    """Validate the extension inputs (names in :data:`EXT_INPUTS`; missing or None = not given) of a
    layer already described by :func:`~qmoe_rtc.contract.describe_layer`."""
    unknown = sorted(set(inputs) - set(EXT_INPUTS))
    if unknown:
        raise QMoEInputError(unknown[0], f"one of {EXT_INPUTS}", "an unknown input name")
    x = {n: inputs.get(n) for n in EXT_INPUTS}
    for n, a in x.items():
        if a is not None and device_of(a) != layer.device_id:
            want = "host" if layer.device_id is None else f"cuda:{layer.device_id}"
            got = "host" if device_of(a) is None else f"cuda:{device_of(a)}"
            raise DeviceError(f"input '{n}': expected {want} (where fc1_experts_weights is), got {got}")
    has_shared = any(x[n] is not None for n in SHARED_INPUTS)
    if not has_shared:
        if x["shared_gate_weight"] is not None:
            raise QMoEInputError("shared_gate_weight", "absent when there are no shared experts "
                                 "(shared_fc1_experts_weights ...)", "an array")
        for n in ("shared_expert_weight_bits", "shared_block_size"):
            if getattr(attrs, n) is not None:
                raise QMoEAttributeError(n, "unset when there are no shared experts", str(getattr(attrs, n)))
    shared = _describe_shared(x, attrs, layer) if has_shared else None
    if x["shared_gate_weight"] is not None:
        require("shared_gate_weight", x["shared_gate_weight"], shape=(layer.H,), dtypes=FLOAT_DTYPES,
                 where="[H]: the shared experts' sum is scaled by sigmoid(x·g)")
    if x["router_weight"] is not None:
        require("router_weight", x["router_weight"], shape=(layer.E, layer.H), dtypes=FLOAT_DTYPES,
                 where="[E, H]: logits = x·router_weightᵀ + router_bias")
    if x["router_bias"] is not None:
        if x["router_weight"] is None:
            raise QMoEInputError("router_bias", "absent when router_weight is absent", "an array")
        require("router_bias", x["router_bias"], shape=(layer.E,), dtypes=FLOAT_DTYPES)
    if x["router_score_bias"] is not None:
        if attrs.scoring_func != "sigmoid":
            raise QMoEInputError("router_score_bias", "absent unless scoring_func='sigmoid' (it corrects the sigmoid "
                                 "scores experts are chosen by)", f"an array with scoring_func='{attrs.scoring_func}'")
        require("router_score_bias", x["router_score_bias"], shape=(layer.E,), dtypes=("float32",),
                where="[E]: added to the sigmoid scores to choose experts, not to their weights")
    implied = {"the layer's scales/biases": ArrayMeta((), layer.dtype, True, None)} if layer.dtype else {}
    if shared is not None and shared.dtype:
        implied["shared_fc1_scales"] = ArrayMeta((), shared.dtype, True, None)
    dtype = _infer_dtype({**implied, **{n: x[n] for n in ("shared_gate_weight", "router_weight", "router_bias")}})
    return ExtensionSpec(shared=shared, gate=x["shared_gate_weight"] is not None, router=x["router_weight"] is not None,
                         router_bias=x["router_bias"] is not None, dtype=dtype,
                         router_dtype=dtype_name(x["router_weight"]) if x["router_weight"] is not None else "",
                         score_bias=x["router_score_bias"] is not None)


def check_ext_call(layer: LayerSpec, ext: ExtensionSpec, input, router_probs, router_weights=None):
    """:func:`~qmoe_rtc.contract.check_call` for a layer with extensions: with the router GEMM
    ``router_probs`` must be None (the layer computes the logits), else it is required as usual."""
    if ext.router:
        if router_probs is not None:
            raise QMoEInputError("router_probs", "None when the layer has router_weight (it computes the logits "
                                 "from the input)", "an array")
        shape = tuple(int(d) for d in getattr(input, "shape", ()))
        rows = 1
        for d in shape[:-1]:
            rows *= d
        router_probs = ArrayMeta((rows, layer.E), "float32", True, layer.device_id)  # what the GEMM produces
    call = check_call(layer, input, router_probs, router_weights)
    if ext.dtype is not None and call.dtype != ext.dtype:
        raise QMoEInputError("input", f"dtype {ext.dtype} (the dtype of the layer's extension tensors)",
                             f"dtype {call.dtype}")
    return call

