"""The QMoE contract (ONNX Runtime's ``com.microsoft::QMoE``, docs/contract.md) on the host, no GPU needed: what a
layer is and what it computes.

- :mod:`.attributes`: :class:`QMoEAttributes`, ONNX Runtime's attribute names and defaults as a frozen value;
- :mod:`.checks`: the input checks (``describe_layer``, ``check_call``, ``check_content``) and every derived size
  (:class:`LayerSpec`, :class:`CallSpec`);
- :mod:`.extensions`: the [ext] inputs (shared experts, router GEMM) and their checks;
- :mod:`.slices`: expert slices (a layer holding some of the experts);
- :mod:`.reference`: the float64 reference of the contract (``qmoe``), which every kernel is tested against;
- :mod:`.random_layer`: random layers and inputs that meet the contract (tests, the demo, the benchmark).

``qmoe_rtc.contract`` exports the names of :mod:`.checks` (``from qmoe_rtc.contract import describe_layer``) and
its submodules by name. Importing the package does no work: each loads on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_SUBMODULES = ("attributes", "checks", "extensions", "random_layer", "reference", "slices")
_EXPORTS = {
    "ACTIVATIONS": "checks",
    "GLU_ACTIVATIONS": "checks",
    "INPUT_NAMES": "checks",
    "WEIGHT_INPUTS": "checks",
    "GLOBAL_SCALE_INPUTS": "checks",
    "LAYER_INPUTS": "checks",
    "QMoEAttributes": "attributes",
    "ProjectionSpec": "checks",
    "LayerSpec": "checks",
    "CallSpec": "checks",
    "describe_layer": "checks",
    "check_call": "checks",
    "check_content": "checks",
}

__all__ = [*_EXPORTS, *_SUBMODULES]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)
