"""Quantized MoE checkpoints into QMoE layers: GPTQ (v1 / v2 zero points, 2/4/8-bit, per-group or
per-channel), AWQ (GEMM, 4-bit), compressed-tensors ``pack-quantized`` (1/2/4/8-bit, symmetric or
not, group or channel), FP8 with square block scales and NVIDIA ModelOpt NVFP4 (``quant_method:
modelopt``, ``quant_algo: NVFP4``; or an ``hf_quant_config.json``) safetensors checkpoints of
Mixtral-style and ``mlp.experts`` (Qwen-MoE, OLMoE, DeepSeek routed experts) models, and gpt-oss's
MXFP4 experts (``quant_method: mxfp4``, fused ``mlp.experts.gate_up_proj_blocks``; the router's bias in
``LoadedLayer.router_bias``), converted losslessly into the contract layout. DeepSeek-V3, Kimi-K2,
GLM-4.5 / GLM-4.5V and dots.llm1 layers carry the grouped sigmoid routing [ext]: its attributes in
``attributes``, the router's score-correction bias as ``weights['router_score_bias']``
(:mod:`qmoe_rtc.checkpoints.model_config`)::

    from qmoe_rtc.checkpoints import load_layer, moe_layers
    layer = load_layer("Qwen3-30B-A3B-GPTQ-Int4/", 0)            # LoadedLayer
    moe = qmoe_rtc.QMoE(**layer.weights, **layer.attributes)     # logits passed at each call
    with Checkpoint("Qwen3-30B-A3B-GPTQ-Int4/") as ckpt:         # many layers: each file opened once
        layers = [load_layer(ckpt, L) for L in moe_layers(ckpt)]
    # or: QMoE(**layer.weights, **layer.attributes, router_weight=layer.router_weight.astype(...))

Needs the ``safetensors`` package (``pip install qmoe_rtc[checkpoints]``). The formats' storage is in
:mod:`qmoe_rtc.checkpoints.formats` (gpt-oss's in :mod:`qmoe_rtc.checkpoints.gpt_oss`), the naming
schemes in :mod:`qmoe_rtc.checkpoints.layer`.

ONNX models with ``com.microsoft::QMoE`` nodes (ONNX Runtime GenAI's builder writes them)::

    for node in qmoe_nodes("model.onnx"):                     # OnnxQMoE, external data read too
        moe = qmoe_rtc.QMoE(**node.weights, **node.attributes)

(:mod:`qmoe_rtc.checkpoints.onnx_nodes`; needs the ``onnx`` package).
"""

from __future__ import annotations

__all__ = ["Checkpoint", "LoadedLayer", "OnnxQMoE", "load_layer", "moe_layers", "qmoe_nodes"]


def __getattr__(name):  # no work at import time: the submodules load on first use
    if name in ("OnnxQMoE", "qmoe_nodes"):
        from . import onnx_nodes

        return getattr(onnx_nodes, name)
    if name == "Checkpoint":
        from .source import Checkpoint

        return Checkpoint
    if name in __all__:
        from . import layer

        return getattr(layer, name)
    raise AttributeError(name)
