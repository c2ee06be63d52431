"""One validation of a layer before anything touches a GPU: what ``QMoE(...)`` refuses from its arrays'
metadata (shapes, dtypes, attributes, extensions, the expert slice, this build's limits, the tiled
layout's), and, when asked, their contents. ``QMoE()`` and ``python -m qmoe_rtc checkpoint`` both call
:func:`check_layer`, so a checkpoint the command approves is one ``QMoE()`` takes. GPU-free."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..contract.checks import check_content
from ..contract.extensions import shared_weights
from ..errors import DeviceError
from .interop import array_meta, is_host_array, to_cupy
from .layer import GpuLayer, check_supported, describe_gpu_layer, prepack_choice

__all__ = ["CheckedLayer", "check_layer"]


@dataclass(frozen=True)
class CheckedLayer:
    """A layer that passed :func:`check_layer`: its description and whether it runs tiled."""

    gpu: GpuLayer
    tiled: bool


def check_layer(weights: dict, attrs, slice_args: dict | None = None, prepack=None, validate_content: bool = False,
                want_device: int | None = None, device_text=None) -> CheckedLayer:
    """Validate ``weights`` (arrays by input name: NumPy, CuPy or torch) with ``attrs``
    (:class:`~qmoe_rtc.contract.QMoEAttributes`), an expert slice (``slice_args``), ``prepack`` and, with
    ``validate_content``, the values (finite scales, clean zero-point padding, ...; reads the arrays).
    ``want_device``: the device asked for (a ``DeviceError`` when the weights live on another). Raises
    what ``QMoE()`` raises for the same layer, in the same order."""
    slice_args = slice_args or {}
    metas = {n: array_meta(n, a) for n, a in weights.items()}
    on_dev = next((m.device for m in metas.values() if m is not None and m.device is not None), None)
    metas = {n: m if m is None or m.device is not None else replace(m, device=on_dev) for n, m in metas.items()}
    given = prepack == "given"  # codes passed tiled: checked as their contract shapes
    g = describe_gpu_layer(metas, attrs, slice_args, given)
    layer, ext = g.layer, g.ext
    if want_device is not None and layer.device_id is not None and layer.device_id != want_device:
        raise DeviceError(f"weights live on cuda:{layer.device_id}, device={device_text!r} was asked for")
    all_experts = g.slice.num_experts if g.slice else 0
    check_supported(layer, ext, all_experts)
    tiled = prepack_choice(prepack, layer, ext, all_experts)
    if validate_content:  # host arrays are read where they are; device arrays through a zero-copy view
        views = {n: a if is_host_array(a) else to_cupy(n, a, 0) for n, a in weights.items()}
        check_content(views, layer)
        if ext.shared is not None:  # the shared experts' tensors by their routed names
            check_content(shared_weights(views), ext.shared)
    return CheckedLayer(g, tiled)
