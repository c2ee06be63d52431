"""qmoe_rtc: quantized mixture-of-experts layers (ONNX Runtime ``com.microsoft::QMoE`` contract) on
NVIDIA GPUs, with kernels specialised per layout and compiled at run time by NVRTC.

Importing the package does no work: submodules (and CuPy, NVRTC) load on first use. The weight formats
(``int``, ``fp8_e4m3``, ``mxfp4``, ``nvfp4``) are :mod:`qmoe_rtc.formats`; ``qmoe_rtc.fp8`` is
:mod:`qmoe_rtc.formats.fp8`, where the FP8 codec lives.

    import qmoe_rtc
    moe = qmoe_rtc.QMoE(fc1_experts_weights=w1, fc1_scales=s1, fc2_experts_weights=w2, fc2_scales=s2, k=2)
    y = moe(x, logits)                        # CuPy / torch CUDA arrays
    ref = qmoe_rtc.reference.qmoe(x, logits, w1, s1, None, w2, s2, k=2)   # float64 CPU reference
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("contract", "errors", "executor", "extensions", "formats", "fp8", "jit", "kernels", "knobs", "oneshot",
               "presets", "quantize", "random_layer", "reference", "specialize", "tiled")
#: Public submodules that live in a folder: ``qmoe_rtc.fp8`` and ``qmoe_rtc.quantize`` are the FP8 codec and the
#: quantizer of the weight formats, ``qmoe_rtc.knobs`` the knobs of :mod:`qmoe_rtc.settings`, ``qmoe_rtc.reference``
#: (and ``extensions``, ``random_layer``) part of :mod:`qmoe_rtc.contract`, ``qmoe_rtc.presets`` of the
#: specialization values.
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


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{_MOVED.get(name, name)}", __name__)
    mod = _EXPORTS.get(name)
    if mod is not None:
        return getattr(importlib.import_module(f".{mod}", __name__), name)
    raise AttributeError(f"module 'qmoe_rtc' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(__all__))
