"""What a checkpoint loader returns for one layer (:class:`LoadedLayer`): every loader of this package builds one."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["LoadedLayer"]


@dataclass
class LoadedLayer:
    """A layer's contract inputs: ``QMoE(**weights, **attributes)``. The scales keep their stored dtype
    (GPTQ: float16; a bfloat16 model's llm-compressor scales: bfloat16), which fixes the dtype the layer is
    called with. ``router_weight`` [E, H] (the gate's linear, in its stored dtype) is left out of
    ``weights``: pass it as ``router_weight=`` for logits computed in the layer, in the dtype you call the
    layer with; ``router_bias`` [E] likewise (gpt-oss's router has one; None for the others). A grouped
    sigmoid router's (DeepSeek-V3, Kimi-K2, GLM-4.5, dots.llm1) score-correction bias is in ``weights`` as
    ``router_score_bias`` [E] float32, beside ``scoring_func``, ``n_group``, ``topk_group`` and
    ``routed_scaling_factor`` in ``attributes``: the layer routes as the model does with no other argument.
    ``source`` says which checkpoint tensors each input came from, ``model_type`` config.json's."""

    weights: dict
    attributes: dict
    router_weight: np.ndarray | None
    source: dict = field(default_factory=dict)  # contract input -> checkpoint tensors it came from
    router_bias: np.ndarray | None = None
    model_type: str | None = None
