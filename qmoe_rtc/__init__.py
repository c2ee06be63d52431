"""qmoe_rtc: quantized mixture-of-experts layers (ONNX Runtime ``com.microsoft::QMoE`` contract) on
NVIDIA GPUs, with kernels specialised per layout and compiled at run time by NVRTC.

Importing the package does no work: submodules (and CuPy, NVRTC) load on first use. The top level holds the
public core (:class:`QMoE` in :mod:`.executor`, :func:`qmoe`, :mod:`.distributed`, :mod:`.errors`); the rest is in
folders named for what they hold: :mod:`.contract` (attributes, checks, the float64 reference), :mod:`.formats`
(the weight formats ``int``, ``fp8_e4m3``, ``mxfp4``, ``nvfp4`` and the quantizer), :mod:`.tiled` (the tensor-core
engines' code layout), :mod:`.settings` (the knobs), :mod:`.specialize`, :mod:`.jit`, :mod:`.kernels`,
:mod:`.runtime`, :mod:`.checkpoints`, :mod:`.cli` and :mod:`.bench` (docs/runtime-compilation.md, "Layout of the
code"); :mod:`.torch` (the custom op ``qmoe_rtc::moe`` for torch.compile; needs PyTorch) loads only by
``import qmoe_rtc.torch``, :mod:`.hf` (a transformers model's MoE blocks replaced by layers from its quantized
checkpoint; needs PyTorch and transformers) only by ``import qmoe_rtc.hf``. Some public submodules keep a short
name here: ``qmoe_rtc.reference``, ``.extensions`` and ``.random_layer`` are in :mod:`.contract`,
``qmoe_rtc.quantize`` and ``.fp8`` in :mod:`.formats`, ``qmoe_rtc.knobs`` in :mod:`.settings`, ``qmoe_rtc.presets``
in :mod:`.specialize` (as attributes of ``qmoe_rtc``; an import names where they live: ``from
qmoe_rtc.contract.reference import qmoe``).

    import qmoe_rtc
    moe = qmoe_rtc.QMoE(fc1_experts_weights=w1, fc1_scales=s1, fc2_experts_weights=w2, fc2_scales=s2, k=2)
    y = moe(x, logits)                        # CuPy / torch CUDA arrays
    ref = qmoe_rtc.reference.qmoe(x, logits, w1, s1, None, w2, s2, k=2)   # float64 CPU reference
"""

from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

_SUBMODULES = ("contract", "errors", "executor", "extensions", "formats", "fp8", "jit", "kernels", "knobs", "oneshot",
               "presets", "quantize", "random_layer", "reference", "specialize", "tiled")
#: Public submodules by their short name -> where they live (see the docstring).
_MOVED = {"fp8": "formats.fp8", "quantize": "formats.quantize", "knobs": "settings.knobs",
          "extensions": "contract.extensions", "random_layer": "contract.random_layer",
          "reference": "contract.reference", "presets": "specialize.presets"}
_EXPORTS = {
    "QMoEAttributes": "contract.attributes",
    "QMoEError": "errors",
    "QMoEInputError": "errors",
    "QMoEAttributeError": "errors",
    "QMoEUnsupportedError": "errors",
    "CompileError": "errors",
    "CacheError": "errors",
    "CacheMissError": "errors",
    "CacheCorruptError": "errors",
    "CacheLocationError": "errors",
    "DeviceError": "errors",
    "CaptureError": "errors",
    "QuantizedWeights": "formats.axis",
    "KnobError": "errors",
    "WeightFormatError": "errors",
    "QMoE": "executor",
    "QMoEGraph": "executor",
    "qmoe": "oneshot",
}

__all__ = ["__version__", *_SUBMODULES, *_EXPORTS]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES, _MOVED)
