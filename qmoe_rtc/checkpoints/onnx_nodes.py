"""``com.microsoft::QMoE`` nodes of an ONNX model (as ONNX Runtime GenAI's builder writes them) as layer
inputs: each node's weight inputs 2–13 (and FP8's global scales, 15–16) read from the model's
initializers, external data included, and its attributes, so ``QMoE(**node.weights, **node.attributes)``
is the node's layer. The per-call inputs (``input``, ``router_probs``, ``router_weights``) are the
tensor names the node reads at run time (``node.inputs``). Needs the ``onnx`` package."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..contract import GLOBAL_SCALE_INPUTS, INPUT_NAMES, WEIGHT_INPUTS
from ..errors import QMoEInputError, QMoEUnsupportedError

__all__ = ["OnnxQMoE", "qmoe_nodes"]

#: The node's input names by position: ONNX Runtime's 0–14, then FP8's global scales 15–16.
NODE_INPUTS = INPUT_NAMES + GLOBAL_SCALE_INPUTS
#: Inputs read at every call (not part of the layer).
CALL_INPUTS = ("input", "router_probs", "router_weights")


@dataclass
class OnnxQMoE:
    """One QMoE node: ``weights`` (NumPy arrays by input name), ``attributes`` (by ONNX Runtime's names)
    and ``inputs`` (per-call input -> the graph tensor the node reads it from)."""

    name: str
    weights: dict
    attributes: dict
    inputs: dict


def _onnx():
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError as exc:
        raise QMoEUnsupportedError("reading ONNX models needs the onnx package (pip install onnx)") from exc
    return onnx, helper, numpy_helper


def qmoe_nodes(path) -> list[OnnxQMoE]:
    """Every ``com.microsoft::QMoE`` node of the ONNX model at ``path``, in graph order (external data
    is read from beside the model). Raises ``QMoEInputError`` naming the node and input whose weight is
    not an initializer (a graph input or another node's output has no value in the model)."""
    onnx, helper, numpy_helper = _onnx()
    p = Path(path)
    if not p.is_file():
        raise QMoEInputError("model", "an existing .onnx file", str(p))
    model = onnx.load(str(p), load_external_data=True)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    out = []
    for i, node in enumerate(graph.node):
        if node.op_type != "QMoE" or node.domain != "com.microsoft":
            continue
        label = node.name or f"QMoE node {i}"
        if len(node.input) > len(NODE_INPUTS):
            raise QMoEInputError(f"{label} inputs", f"at most {len(NODE_INPUTS)}", str(len(node.input)))
        weights, inputs = {}, {}
        for slot, tensor in zip(NODE_INPUTS, node.input):
            if not tensor:
                continue  # an omitted optional input
            if slot in CALL_INPUTS:
                inputs[slot] = tensor
                continue
            if tensor not in inits:
                where = "a graph input" if any(v.name == tensor for v in graph.input) else "another node's output"
                raise QMoEInputError(f"{label} {slot}", "an initializer (the layer's weights must be in the model)",
                                     f"'{tensor}', {where}")
            weights[slot] = numpy_helper.to_array(inits[tensor])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        missing = [n for n in ("fc1_experts_weights", "fc2_experts_weights") if n not in weights]
        if missing:
            raise QMoEInputError(f"{label} {missing[0]}", "an initializer", "absent")
        out.append(OnnxQMoE(label, {n: weights[n] for n in (*WEIGHT_INPUTS, *GLOBAL_SCALE_INPUTS) if n in weights},
                            attrs, inputs))
    return out
