"""ONNX Runtime CPU ``com.microsoft::QMoE`` oracle: one QMoE node, every tensor a graph input.

What onnxruntime 1.32.0's CPU QMoE accepts, found by experiment (tests/contract/test_ort_oracle.py relies on it):

- Activations T: float32 and float16. bfloat16 is refused when the session is created ("CPU
  bfloat16 QMoE requires a shared layout", i.e. only the 3-bit profile). float16 output differs from
  the float64 reference by output rounding only (~1e-4): the kernel computes in float32 inside.
- router_probs and router_weights are bound to T: float32 logits next to a float16 input is a
  type error. Scales (T2) may be float32 or float16 independently of T; both match.
- Input 2-D [rows, H] or 3-D [B, S, H]; the output keeps the shape.
- expert_weight_bits 2, 3, 4, 8 (1 refused). 3-bit needs the INT3 profile (weights_prepacked=0,
  swiglu, block_size >= 32) and is not used here. Mixed fc1/fc2 widths: NOT_IMPLEMENTED on CPU.
- block_size 0 (also accepted explicitly), 16, 32, 64, 128 match for 4 and 8 bits. 2-bit matches
  with 0 and 16 only: 32/64 give relative error ~5e-3, 128 ~1.2e-2 (a lower-precision path).
- Zero points (inputs 11/12) for 2/4/8 bits, row-wise [E, ceil(N*b/8)] ([E, N] for 8-bit) and
  block-wise [E, N, ceil(nb*b/8)], packed LSB first: match.
- Biases optional (omitted with "" when a later input is present). FC3 (inputs 8-10):
  NOT_IMPLEMENTED on CPU. router_weights (input 14): accepted; selection stays on router_probs and
  the gathered weights are renormalised.
- activation_type relu, gelu (tanh form), silu, identity, swiglu. swiglu only with swiglu_fusion=1
  (0 and 2 refused at session creation); activation_alpha/beta and swiglu_limit honoured.
- normalize_routing_weights=0 still renormalises over the top k; use_sparse_mixer=1 is ignored
  (plain top-k); k > E is refused at run time.
- Weights as *initializers* change the numerics: block-wise 8-bit then runs with int8 activations
  (relative error ~6.6e-3). Fed as graph inputs, as here, it is exact to float32 rounding.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

INPUT_NAMES = (
    "input", "router_probs",
    "fc1_experts_weights", "fc1_scales", "fc1_experts_bias",
    "fc2_experts_weights", "fc2_scales", "fc2_experts_bias",
    "fc3_experts_weights", "fc3_scales", "fc3_experts_bias",
    "fc1_zero_points", "fc2_zero_points", "fc3_zero_points",
    "router_weights",
)


def _elem_type(a: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(a.dtype)


def build_qmoe_model(feeds: dict, output_dtype, output_rank: int, **attrs) -> onnx.ModelProto:
    """One QMoE node; every non-None entry of ``feeds`` becomes a graph input."""
    unknown = set(feeds) - set(INPUT_NAMES)
    if unknown:
        raise KeyError(f"unknown QMoE inputs: {sorted(unknown)}")
    present = [n for n in INPUT_NAMES if feeds.get(n) is not None]
    last = max(INPUT_NAMES.index(n) for n in present)
    node_inputs = [n if feeds.get(n) is not None else "" for n in INPUT_NAMES[: last + 1]]
    graph_inputs = [
        helper.make_tensor_value_info(n, _elem_type(feeds[n]), list(feeds[n].shape)) for n in present
    ]
    out = helper.make_tensor_value_info(
        "output", helper.np_dtype_to_tensor_dtype(np.dtype(output_dtype)), [None] * output_rank
    )
    node = helper.make_node("QMoE", node_inputs, ["output"], domain="com.microsoft",
                            **{k: v for k, v in attrs.items() if v is not None})
    graph = helper.make_graph([node], "qmoe_oracle", graph_inputs, [out])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 8
    return model


def run_ort_qmoe(feeds: dict, **attrs) -> np.ndarray:
    import onnxruntime as ort

    x = feeds["input"]
    model = build_qmoe_model(feeds, x.dtype, x.ndim, **attrs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {n: a for n, a in feeds.items() if a is not None})[0]
