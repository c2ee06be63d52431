"""The tiled code layout the tensor-core engines read (qmoe_rtc's own, not ONNX Runtime's), in two parts:

- :mod:`.transform`: the layout itself and the transform between it and the contract layout, both ways
  (:func:`pack` / :func:`unpack` for codes, :func:`pack_meta` / :func:`unpack_meta` for the scales and zero
  points of integer codes, :data:`LAYOUT_VERSION`). A layer tiled at upload (``QMoE(prepack='on' | 'auto')``)
  runs it on the GPU; it knows no layer, and the kernel families read its shapes.
- :mod:`.given`: a layer's codes tiled ahead of time, for a layer built from them
  (:func:`tiled_weights`, then ``QMoE(..., prepack='given')``, which uploads them as they are).

::

    from qmoe_rtc.tiled import LAYOUT_VERSION, tiled_weights
    tw = tiled_weights(weights, **attrs)      # the same dict, every *_experts_weights tiled
    moe = QMoE(**tw, **attrs, prepack="given")

Importing the package does no work: each name loads its module on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_SUBMODULES = ("given", "transform")
_EXPORTS = {
    **dict.fromkeys(("CHUNK", "GROUP", "LAYOUT_VERSION", "META_ROWS", "fc1_fusion", "fusion1_order", "meta_record_bytes",
                     "meta_shape", "pack", "pack_meta", "pair_order", "segment_order", "tile", "tile_rows", "tiled_offset",
                     "tiled_shape", "unpack", "unpack_meta", "untile"), "transform"),
    "CODE_INPUTS": "given",
    "tiled_weights": "given",
}

__all__ = [*_EXPORTS, *_SUBMODULES]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)
