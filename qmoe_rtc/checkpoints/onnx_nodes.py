"""``com.microsoft::QMoE`` nodes of an ONNX model (as ONNX Runtime GenAI's builder writes them) as layer
inputs: each node's weight inputs 2–13 (and FP8's global scales, 15–16) read from the model's
initializers, external data included, and its attributes, so ``QMoE(**node.weights, **node.attributes)``
is the node's layer. The per-call inputs (``input``, ``router_probs``, ``router_weights``) are the
tensor names the node reads at run time (``node.inputs``). ONNX Runtime's own layouts (``quant_type``
"fp4" and "nvfp4", ``weights_prepacked``, CUDA-prepacked integer codes) are turned into the contract's
by :mod:`qmoe_rtc.checkpoints.onnx_layouts`, or refused by name. Needs the ``onnx`` package."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..contract.checks import GLOBAL_SCALE_INPUTS, INPUT_NAMES, WEIGHT_INPUTS
from ..errors import QMoEInputError, QMoEUnsupportedError
from .onnx_layouts import ACT_SCALE_INPUTS, to_contract

__all__ = ["OnnxQMoE", "qmoe_nodes"]

#: The node's input names by position: ONNX Runtime's 0–14, the global scales 15–16, the FP8 activation
#: scales 17–20 (refused when given).
NODE_INPUTS = INPUT_NAMES + GLOBAL_SCALE_INPUTS + ACT_SCALE_INPUTS
#: Inputs read at every call (not part of the layer).
CALL_INPUTS = ("input", "router_probs", "router_weights")


@dataclass
class OnnxQMoE:
    """One QMoE node: ``weights`` (NumPy arrays by input name, in the contract's layout), ``attributes``
    (ONNX Runtime's names and the contract's values: ``quant_type`` "fp4" reads as "mxfp4", and
    ``weights_prepacked`` / ``accuracy_level`` are consumed), ``inputs`` (per-call input -> the graph
    tensor the node reads it from) and ``layout`` (how the node's codes were stored)."""

    name: str
    weights: dict
    attributes: dict
    inputs: dict
    layout: str = "raw"


def _onnx():
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError as exc:
        raise QMoEUnsupportedError("reading ONNX models needs the onnx package (pip install onnx)") from exc
    return onnx, helper, numpy_helper


def _load(onnx, p: Path):
    """The ModelProto at ``p``; a file that is not one raises ``QMoEInputError`` naming it (one line)."""
    if not p.is_file():
        raise QMoEInputError("model", "an existing .onnx file", str(p))
    if p.stat().st_size == 0:
        raise QMoEInputError("model", "an ONNX model", f"'{p}', an empty file")
    try:
        model = onnx.load(str(p), load_external_data=True)
    except Exception as exc:  # protobuf's DecodeError, a missing external-data file, ...
        first = (str(exc).splitlines() or [""])[0][:200]
        raise QMoEInputError("model", "an ONNX model", f"'{p}', unreadable ({type(exc).__name__}: {first})") from None
    if not model.HasField("graph") or model.ir_version <= 0:
        raise QMoEInputError("model", "an ONNX model (a ModelProto with a graph)", f"'{p}', no ONNX graph in it")
    return model


def qmoe_nodes(path, int_layout: str = "auto") -> list[OnnxQMoE]:
    """Every ``com.microsoft::QMoE`` node of the ONNX model at ``path``, in graph order (external data
    is read from beside the model), in the contract's layout. Raises ``QMoEInputError`` naming the node and
    input whose weight is not an initializer (a graph input or another node's output has no value in the
    model), and ``QMoEUnsupportedError`` / ``QMoEInputError`` naming the node and attribute or input of a
    layout that cannot be read exactly. ``int_layout`` ("auto", "raw" or "cuda") says how 4/8-bit integer
    nodes without ``weights_prepacked`` are stored: "auto" reads their shapes and refuses a node whose raw
    and CUDA-prepacked shapes coincide."""
    onnx, helper, numpy_helper = _onnx()
    model = _load(onnx, Path(path))
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
        layout = to_contract(label, weights, attrs, int_layout)
        out.append(OnnxQMoE(label, {n: weights[n] for n in (*WEIGHT_INPUTS, *GLOBAL_SCALE_INPUTS) if n in weights},
                            attrs, inputs, layout))
    return out
