"""Tiled codes as an artifact: a layer's codes made once in the tiled layout of :mod:`qmoe_rtc.tiled.transform`,
stored, and handed back to ``QMoE(prepack='given')``, which uploads them as they are (no re-tiling)::

    tw = tiled_weights(weights, **attrs)          # the same dict, every *_experts_weights tiled
    numpy.save("fc1.npy", tw["fc1_experts_weights"])   # [E, N/8, ceil(K/128), 8, 4, 4·b] u8
    moe = QMoE(**tw, **attrs, prepack="given")

or ``QMoE(..., prepack='on').tiled_weights()`` for the codes a layer made at upload. The tiled layout is
qmoe_rtc's own (not ONNX Runtime's) and is versioned by :data:`qmoe_rtc.tiled.transform.LAYOUT_VERSION`: store
the version with the arrays and make them again from the contract codes when it changes.

A tiled array ``[E, N8, NCH, 8, 4, 4·b]`` holds N = 8·N8 rows (tiling needs N a multiple of 8) and
NCH = ceil(K/128) chunks, so K comes from the other projection: FC1's and FC3's K is H = FC2's N, FC2's
K is I = FC1's N / F (F = 2 with fused gate and linear rows).
:func:`qmoe_rtc.runtime.given_codes.contract_metas` checks the tiled shapes that way and gives each one the metadata
of its contract shape ``[E, N, ceil(K·b/8)]`` (FP8: ``[E, N, K]``), so :func:`~qmoe_rtc.contract.describe_layer`
checks the rest as for any layer. Nothing here touches the GPU except :func:`tiled_weights` on CuPy arrays.
"""

from __future__ import annotations

from .._arrays import array_module, is_torch
from ..contract.attributes import QMoEAttributes
from ..errors import QMoEInputError, QMoEUnsupportedError
from ..runtime.given_codes import CODE_INPUTS
from ..runtime.layer import check_supported, describe_gpu_layer, tiling_config, tiling_unsupported
from .transform import fc1_fusion, pack

__all__ = ["CODE_INPUTS", "tiled_weights"]

def tiled_weights(weights: dict, *, expert_range=None, expert_map=None, num_experts=None, **attributes) -> dict:
    """``weights`` (a layer's tensors by ONNX Runtime input name, contract layout, NumPy or CuPy) with every
    ``*_experts_weights`` (routed and [ext] ``shared_*``) replaced by its tiled codes, exactly what a tiled
    layer uploads (:func:`qmoe_rtc.tiled.transform.pack`)::

        fc1_experts_weights [E, F·I/8, ceil(H/128), 8, 4, 4·b1] u8
        fc2_experts_weights [E, H/8, ceil(I/128), 8, 4, 4·b2] u8     (fc3 / shared_fc*: likewise)

    The other tensors are the given arrays themselves. ``attributes``: the layer's QMoE attributes
    (``expert_weight_bits``, ``swiglu_fusion``, ``quant_type`` ...) and expert-slice arguments, as for
    :class:`~qmoe_rtc.executor.QMoE`. Pass the result to ``QMoE(..., prepack='given')``. The layout is
    qmoe_rtc's own, versioned by :data:`qmoe_rtc.tiled.transform.LAYOUT_VERSION`. The layer is validated first
    (``QMoEInputError`` / ``QMoEAttributeError``), and one whose codes the engines cannot read tiled is
    refused (``QMoEUnsupportedError`` with the reason). NumPy in, NumPy out; CuPy arrays are tiled on
    their GPU (temporaries as :func:`~qmoe_rtc.tiled.transform.pack` says).
    """
    for n in CODE_INPUTS:
        if weights.get(n) is not None and is_torch(weights[n]):
            raise QMoEInputError(n, "a NumPy or CuPy array", "a torch tensor (cupy.asarray(t) or t.cpu().numpy())")
    attrs = QMoEAttributes.from_kwargs(**attributes)
    g = describe_gpu_layer(weights, attrs, dict(expert_range=expert_range, expert_map=expert_map,
                                                num_experts=num_experts))
    all_experts = g.slice.num_experts if g.slice is not None else 0
    check_supported(g.layer, g.ext, all_experts)
    why = tiling_unsupported(tiling_config(g.layer, g.ext, all_experts))
    if why:
        raise QMoEUnsupportedError(f"the layer's codes cannot be tiled (no tensor-core engine would run them): {why}")
    out = dict(weights)
    groups = [("", g.layer)] + ([("shared_", g.ext.shared)] if g.ext.shared is not None else [])
    for prefix, spec in groups:
        for p in spec.projections():
            name = f"{prefix}{p.name}_experts_weights"
            w = weights[name]
            xp = array_module(w)
            codes = w.view(xp.uint8)  # FP8 codes are bytes too
            fusion = fc1_fusion(attrs.swiglu_fusion, p.weight_format.scale.square) if p.name == "fc1" else 0
            out[name] = pack(xp, codes, p.K, p.bits, fusion, name)
    return out
