"""A validated layer as the engines see it: its :class:`~qmoe_rtc.specialize.ModelConfig`, whether this
build runs it on the GPU, and its constant tensors on the device with the binding table.

Shared experts [ext] run as S more routes per token in the routed experts' launches
(``cuda_src/core/experts.cuh``), so on the GPU they must have the routed layout: the same bit widths,
zero-point modes, block size and intermediate size, and no FC3 on the routed side. The router GEMM
[ext] adds a logits step before routing (``kernels/pipelines.py``). Everything here is GPU-free
except :func:`upload_layer`.
"""

from __future__ import annotations

from ..errors import QMoEUnsupportedError
from ..kernels import choose
from ..specialize import Layout, ModelConfig
from .tensors import layer_scale_dtype, layer_table, upload_extras, upload_projections

__all__ = ["check_supported", "layer_config", "shared_unsupported", "upload_layer"]


def layer_config(layer, dtype: str, scale_dtype: str, ext=None) -> ModelConfig:
    """The :class:`~qmoe_rtc.specialize.ModelConfig` of a validated layer (:class:`~qmoe_rtc.contract.LayerSpec`,
    with its :class:`~qmoe_rtc.extensions.ExtensionSpec` ``ext``) called with activation dtype ``dtype``,
    its scales held as ``scale_dtype`` (GPU-free)."""
    L, a = layer, layer.attrs
    layout = Layout(
        dtype=dtype, scale_dtype=scale_dtype if scale_dtype in ("float32", dtype) else "float32",
        fc1_bits=L.fc1.bits, fc2_bits=L.fc2.bits, fc3_bits=L.fc3.bits if L.fc3 else 0, block_size=a.block_size,
        fc1_zp=L.fc1.zp_mode, fc2_zp=L.fc2.zp_mode, fc3_zp=L.fc3.zp_mode if L.fc3 else "none",
        activation=a.activation_type, swiglu_fusion=a.swiglu_fusion, has_fc3=L.fc3 is not None)
    S = ext.S if ext is not None else 0
    router = ext.router_dtype if ext is not None and ext.router else ""
    return ModelConfig(hidden=L.H, inter=L.I, experts=L.E, k=a.k, layout=layout, use_sparse_mixer=bool(a.use_sparse_mixer),
                       normalize_routing_weights=bool(a.normalize_routing_weights), shared=S,
                       shared_gate=bool(S and ext.gate), router_gemm=router)


def shared_unsupported(layer, ext) -> str | None:
    """Why the GPU engines cannot run ``ext``'s shared experts beside ``layer``'s routed ones (None: they can)."""
    sh = ext.shared if ext is not None else None
    if sh is None:
        return None
    if layer.fc3 is not None:
        return "shared experts beside routed experts with fc3 (they run in the routed launches, which gate from fc3)"
    if sh.I != layer.I:
        return (f"a shared intermediate size {sh.I} other than the routed {layer.I} (the shared experts run in the "
                "routed experts' launches)")
    for r, s in ((layer.fc1, sh.fc1), (layer.fc2, sh.fc2)):
        if (r.bits, r.zp_mode, r.quant) != (s.bits, s.zp_mode, s.quant):
            return (f"shared {s.name} with {s.bits}-bit / zero points '{s.zp_mode}' / {s.quant} weights, the routed "
                    f"{r.bits}-bit / '{r.zp_mode}' / {r.quant} (the shared experts run in the routed launches)")
    if sh.attrs.block_size != layer.attrs.block_size:
        return f"shared_block_size {sh.attrs.block_size} other than the routed block_size {layer.attrs.block_size}"
    return None


def check_supported(layer, ext=None) -> None:
    """:class:`QMoEUnsupportedError` naming the limit when no pipeline of a path runs the layer at any
    activation dtype it can be called with (e.g. more than 512 experts, k above 32: the routing
    kernel's limits; docs/contract.md, "Limits of this build"), or its shared experts cannot run in
    the routed launches. GPU-free."""
    L = layer
    why = shared_unsupported(layer, ext)
    if why:
        raise QMoEUnsupportedError(f"the GPU engines of this build do not run {why}; qmoe_rtc.reference.qmoe "
                                   "computes such layers")
    sdt = layer_scale_dtype(layer)
    dtypes = (layer.dtype,) if layer.dtype else ("float32", "float16", "bfloat16")
    for path in ("decode", "prefill"):
        first = None
        for dt in dtypes:
            try:
                choose(layer_config(layer, dt, sdt, ext), None, path)
                break
            except QMoEUnsupportedError as exc:
                first = first or exc
        else:
            raise QMoEUnsupportedError(f"this build cannot run the layer (E={L.E}, H={L.H}, I={L.I}, k={L.attrs.k}): "
                                       f"{first}") from None


def upload_layer(cp, weights: dict, layer, ext, device_id: int):
    """(scale dtype, routed projections, binding table) of a validated layer whose arrays ``weights``
    (by input name, extension inputs included) are already CuPy arrays on ``device_id``."""
    scale_dtype, proj = upload_projections(cp, weights, layer, device_id)
    shared = None
    if ext is not None and ext.shared is not None:
        sw = {n.removeprefix("shared_"): a for n, a in weights.items() if n.startswith("shared_fc")}
        _, shared = upload_projections(cp, sw, ext.shared, device_id, scale_dtype=scale_dtype)
    extras = upload_extras(cp, weights, device_id)
    return scale_dtype, proj, layer_table(proj, layer.attrs, shared=shared, extras=extras)

