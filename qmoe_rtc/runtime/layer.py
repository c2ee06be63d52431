"""A validated layer as the engines see it: its :class:`~qmoe_rtc.specialize.ModelConfig`, whether this
build runs it on the GPU, and its constant tensors on the device with the binding table.

Shared experts [ext] run as S more routes per token in the routed experts' launches
(``cuda_src/core/experts.cuh``), so on the GPU they must have the routed layout: the same bit widths,
zero-point modes, block size and intermediate size, and no FC3 on the routed side. The router GEMM
[ext] adds a logits step before routing (``kernels/pipelines.py``). Everything here is GPU-free
except :func:`upload_layer`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..contract.checks import LAYER_INPUTS, describe_layer
from ..contract.extensions import EXT_INPUTS, describe_extensions
from ..contract.slices import describe_slice
from ..errors import QMoEAttributeError, QMoEInputError, QMoEUnsupportedError
from ..kernels import choose
from ..specialize import Layout, ModelConfig
from .given_codes import contract_metas, given_hint
from .tensors import layer_scale_dtype, layer_table, upload_extras, upload_projections

__all__ = ["PREPACK_SETTINGS", "GpuLayer", "check_supported", "describe_gpu_layer", "executor_config", "layer_config",
           "prepack_choice", "attrs_unsupported", "routing_unsupported", "shared_unsupported", "tile_codes", "tiling_config",
           "tiling_unsupported", "upload_layer", "use_tiled"]

log = logging.getLogger("qmoe_rtc")


@dataclass(frozen=True)
class GpuLayer:
    """A described layer: the experts it holds (``layer``), the view routing and the calls are checked
    against (``routing``: E = all the experts of a slice's layer), its extensions and its slice."""

    layer: object  #: :class:`~qmoe_rtc.contract.LayerSpec` of the held experts
    routing: object  #: the same with E = the whole layer's experts (``layer`` itself without a slice)
    ext: object  #: :class:`~qmoe_rtc.contract.extensions.ExtensionSpec`
    slice: object  #: :class:`~qmoe_rtc.contract.slices.ExpertSlice` or None


def describe_gpu_layer(arrays: dict, attrs, slice_args: dict, given: bool = False) -> GpuLayer:
    """Validate a layer's arrays (or their metadata) by input name, its extensions and its expert slice
    (``slice_args``: ``expert_range`` / ``expert_map`` / ``num_experts``, :mod:`qmoe_rtc.contract.slices`).
    ``given``: the code tensors are tiled (``prepack='given'``), checked as their contract shapes
    (:func:`qmoe_rtc.runtime.given_codes.contract_metas`); else tiled ones are refused."""
    arrays = contract_metas(arrays, attrs, given)
    if not given:
        return _describe(arrays, attrs, slice_args)
    try:
        return _describe(arrays, attrs, slice_args)
    except QMoEInputError as exc:
        raise given_hint(exc) from None


def _describe(arrays: dict, attrs, slice_args: dict) -> GpuLayer:
    sl = describe_slice(**slice_args)
    layer = describe_layer({n: a for n, a in arrays.items() if n in LAYER_INPUTS}, attrs,
                           routed_experts=sl.num_experts if sl is not None else None)
    if sl is not None:
        sl.check_local(layer.E)
    routing = replace(layer, E=sl.num_experts) if sl is not None else layer
    ext = describe_extensions({n: a for n, a in arrays.items() if n in EXT_INPUTS}, attrs, routing)
    return GpuLayer(layer, routing, ext, sl)


def layer_config(layer, dtype: str, scale_dtype: str, ext=None, all_experts: int = 0, tiled: bool = False,
                 expert_counts: bool = False) -> ModelConfig:
    """The :class:`~qmoe_rtc.specialize.ModelConfig` of a validated layer (:class:`~qmoe_rtc.contract.LayerSpec`,
    with its :class:`~qmoe_rtc.contract.extensions.ExtensionSpec` ``ext``; ``all_experts``: the whole layer's E
    when it is an expert slice) called with activation dtype ``dtype``, its scales held as
    ``scale_dtype``, its codes ``tiled`` or not, its routing counting each expert's routes or not
    (``expert_counts``; GPU-free). A routing or an activation precision no kernel computes
    (:func:`attrs_unsupported`) is :class:`QMoEUnsupportedError`, so nothing plans a layer that would compute another
    layer."""
    _refuse_attrs(layer)
    L, a = layer, layer.attrs
    layout = Layout(
        dtype=dtype, scale_dtype=scale_dtype if scale_dtype in ("float32", dtype) else "float32",
        fc1_bits=L.fc1.bits, fc2_bits=L.fc2.bits, fc3_bits=L.fc3.bits if L.fc3 else 0, block_size=a.block_size,
        fc1_zp=L.fc1.zp_mode, fc2_zp=L.fc2.zp_mode, fc3_zp=L.fc3.zp_mode if L.fc3 else "none",
        fc1_format=L.fc1.format, fc2_format=L.fc2.format, fc3_format=L.fc3.format if L.fc3 else "int",
        activation=a.activation_type, swiglu_fusion=a.swiglu_fusion, has_fc3=L.fc3 is not None, tiled=tiled)
    S = ext.S if ext is not None else 0
    router = ext.router_dtype if ext is not None and ext.router else ""
    return ModelConfig(hidden=L.H, inter=L.I, experts=L.E, k=a.k, layout=layout, use_sparse_mixer=bool(a.use_sparse_mixer),
                       normalize_routing_weights=bool(a.normalize_routing_weights), shared=S,
                       shared_gate=bool(S and ext.gate), router_gemm=router, all_experts=all_experts,
                       scoring_func=a.scoring_func, n_group=a.n_group if a.grouped else 0, expert_counts=expert_counts)


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
        if (r.bits, r.zp_mode, r.format) != (s.bits, s.zp_mode, s.format):
            return (f"shared {s.name} with {s.bits}-bit / zero points '{s.zp_mode}' / {s.format} weights, the routed "
                    f"{r.bits}-bit / '{r.zp_mode}' / {r.format} (the shared experts run in the routed launches)")
    if sh.attrs.block_size != layer.attrs.block_size:
        return f"shared_block_size {sh.attrs.block_size} other than the routed block_size {layer.attrs.block_size}"
    return None


def routing_unsupported(attrs) -> str | None:
    """Why the GPU routing kernels cannot route a layer with ``attrs`` (None: they can): a routed scaling factor
    [ext] with the contract's softmax scores (routing/route_grouped.cuh scales sigmoid-scored weights only)."""
    if attrs.scoring_func == "softmax" and attrs.routed_scaling_factor != 1.0:
        return (f"routed_scaling_factor={attrs.routed_scaling_factor!r} with softmax scores (the GPU routing scales "
                "the weights of scoring_func='sigmoid' only)")
    return None


def attrs_unsupported(attrs) -> str | None:
    """Why no GPU engine of this build runs a layer with ``attrs`` (None: one can): its routing
    (:func:`routing_unsupported`), or FP8 activations [ext] (``activation_quant``), which only the float64 reference
    computes so far."""
    why = routing_unsupported(attrs)
    if why is None and attrs.activation_quant != "none":
        why = (f"activation_quant='{attrs.activation_quant}' (FP8 activations: no engine of this build quantizes its "
               "GEMM inputs)")
    return why


def _refuse_attrs(layer) -> None:
    why = attrs_unsupported(layer.attrs)
    if why:
        raise QMoEUnsupportedError(f"the GPU engines of this build do not run {why}; qmoe_rtc.contract.reference.qmoe "
                                   "computes such layers")


def check_supported(layer, ext=None, all_experts: int = 0) -> None:
    """:class:`QMoEUnsupportedError` naming the limit when no pipeline of a path runs the layer at any
    activation dtype it can be called with (e.g. more than 512 experts, k above 32: the routing
    kernel's limits; docs/contract.md, "Limits of this build"), or its shared experts cannot run in
    the routed launches, or its routing or activation precision is one no GPU kernel computes
    (:func:`attrs_unsupported`). GPU-free."""
    L = layer
    _refuse_attrs(layer)
    why = shared_unsupported(layer, ext)
    if why:
        raise QMoEUnsupportedError(f"the GPU engines of this build do not run {why}; qmoe_rtc.contract.reference.qmoe "
                                   "computes such layers")
    sdt = layer_scale_dtype(layer)
    dtypes = (layer.dtype,) if layer.dtype else ("float32", "float16", "bfloat16")
    for path in ("decode", "prefill"):
        first = None
        for dt in dtypes:
            try:
                choose(layer_config(layer, dt, sdt, ext, all_experts), None, path)
                break
            except QMoEUnsupportedError as exc:
                first = first or exc
        else:
            raise QMoEUnsupportedError(f"this build cannot run the layer (E={L.E}, H={L.H}, I={L.I}, k={L.attrs.k}): "
                                       f"{first}") from None


#: QMoE(prepack=...) values (the ``prepack`` knob's but 'given', which says what one layer's arrays are):
#: see :func:`use_tiled`.
PREPACK_SETTINGS = ("auto", "on", "off", "given")
_TENSOR_CORE_DTYPES = ("float16", "bfloat16")


def _tiled(config: ModelConfig) -> ModelConfig:
    return replace(config, layout=replace(config.layout, tiled=True))


def tiling_unsupported(config: ModelConfig) -> str | None:
    """Why ``config``'s codes cannot be tiled (None: they can): with tiled codes every path must still
    have a pipeline that runs the layer, and only the tensor-core engines read the tiled layout."""
    cfg = _tiled(config)
    for path in ("decode", "prefill"):
        try:
            choose(cfg, None, path)
        except QMoEUnsupportedError as exc:
            return str(exc)
    return None


def use_tiled(config: ModelConfig, setting, dtype_known: bool) -> bool:
    """Whether a layer of ``config`` holds its codes tiled (:mod:`qmoe_rtc.tiled.transform`). ``setting``: 'auto',
    'on', 'off', 'given' or a bool (None: the ``prepack`` knob); ``dtype_known``: the layer's scales or
    biases fix its activations to float16/bfloat16. 'auto' tiles when the layout allows it and the dtype
    is known (float32 calls would need the contract layout); 'on' and 'given' (codes passed tiled:
    :mod:`qmoe_rtc.tiled.given`) refuse a layout that cannot be tiled. FP4 layers count as float16/bfloat16 ones
    (their scales are float32 by format, and FP4 serves LLMs in half precision): see :func:`prepack_choice`."""
    from ..settings import knobs

    s = knobs.get("prepack") if setting is None else setting
    s = {True: "on", False: "off"}.get(s, s) if isinstance(s, bool) else s
    if s not in PREPACK_SETTINGS or (setting is None and s == "given"):
        raise QMoEAttributeError("prepack", f"a bool or one of {list(PREPACK_SETTINGS)} ('given' as QMoE(prepack=...) "
                                 "only, not from QMOE_RTC_PREPACK)", repr(s))
    if s == "off":
        return False
    why = tiling_unsupported(config)
    if s in ("on", "given") and why:
        raise QMoEUnsupportedError(f"prepack={s!r} needs tensor-core engines for every path: {why}")
    return why is None and (s in ("on", "given") or dtype_known)


def tiling_config(layer, ext=None, all_experts: int = 0) -> ModelConfig:
    """The config whether to tile a validated layer is judged by: its activation dtype where its scales
    or biases fix one, else float16 (GPU-free)."""
    return layer_config(layer, layer.dtype or "float16", layer_scale_dtype(layer), ext, all_experts)


def prepack_choice(setting, layer, ext, all_experts: int) -> bool:
    """Whether a validated layer's codes are tiled (:func:`use_tiled`); says so when 'auto' keeps the
    contract layout of a layer the tensor-core engines could read tiled."""
    from ..settings import knobs

    known = layer.dtype in _TENSOR_CORE_DTYPES or any(p.weight_format.scale.device == "float32"
                                                      for p in layer.projections())
    cfg = tiling_config(layer, ext, all_experts)
    tiled = use_tiled(cfg, setting, known)
    asked = knobs.get("prepack") if setting is None else setting
    if not tiled and not known and asked == "auto" and tiling_unsupported(cfg) is None:
        log.warning("qmoe_rtc: codes kept in the contract layout, not tiled for the tensor-core engines: the "
                    "scales and biases are float32, so the layer may be called with float32 activations, which "
                    "only the SIMT engines run; pass prepack='on' for a layer called with float16/bfloat16 only")
    return tiled


def executor_config(config: ModelConfig, setting=None) -> ModelConfig:
    """The config the executor runs a layer of ``config`` with (warm / precompile use it): its codes
    tiled where :func:`use_tiled` would tile them, taking the activation dtype as known when the
    scales are in it or the codes are FP4 (as :func:`prepack_choice` does)."""
    lay = config.layout
    by_format = any(lay.format(p).scale.device == "float32" for p in lay.projections)  # FP4: float32 scales
    known = lay.dtype in _TENSOR_CORE_DTYPES and (lay.scale_dtype == lay.dtype or by_format)
    return _tiled(config) if not lay.tiled and use_tiled(config, setting, known) else config


def tile_codes(cp, proj: dict, layer, given: bool = False) -> dict:
    """``proj`` (:func:`upload_projections`) with every projection's codes in the tiled layout
    (:func:`qmoe_rtc.tiled.transform.pack`, on the GPU; the contract codes are not kept; ``given``: they are tiled
    already, ``prepack='given'``, and are kept as they are, as bytes) and, for integer and FP4 codes, its scales and
    zero points as meta records (:func:`qmoe_rtc.tiled.transform.pack_meta`) in the scales' slot (viewed as the
    scale dtype; the zero-point slot then empty: the records hold them). FC1 rows of ``swiglu_fusion`` 1 or 2
    are tiled interleaved (:func:`qmoe_rtc.tiled.transform.fc1_fusion`); with 2, FC1's bias moves to fusion 1's order."""
    from ..tiled.transform import fc1_fusion, fusion1_order, pack, pack_meta

    out = {}
    for p in layer.projections():
        w, s, z, b = proj[p.name]
        square = p.weight_format.scale.square
        fusion = fc1_fusion(layer.attrs.swiglu_fusion, square) if p.name == "fc1" else 0
        codes = w.view(cp.uint8)  # FP8 codes are bytes too
        if not given:
            codes = pack(cp, codes, p.K, p.bits, fusion, f"{p.name}_experts_weights")
        if not square:  # integer and FP4 codes: records (FP8's square blocks keep their layout)
            # [E, ceil(N/16), nb, 8, R] u8; row-wise zero points are packed along N, whatever the scales' rank
            meta = pack_meta(cp, s, z, p.N, p.bits, fusion, p.scale_input, row_wise=not p.block_size)
            s, z = meta.view(s.dtype), None
        if fusion == 2 and b is not None:
            b = fusion1_order(cp, b)  # [E, 2I] f32: gate 2o, linear 2o + 1
        out[p.name] = (codes, s, z, b)  # codes [E, N/8, ceil(K/128), 8, 4, 4·b] u8
    return out


def upload_layer(cp, weights: dict, layer, ext, device_id: int, expert_slice=None, tiled: bool = False,
                 given: bool = False):
    """(scale dtype, routed projections, binding table) of a validated layer whose arrays ``weights``
    (by input name, extension inputs included) are already CuPy arrays on ``device_id``; an expert
    slice adds ``expert_map`` (int32 [all experts]: local index or -1) for routing; ``tiled``: the
    codes (routed and shared) are tiled for the tensor-core engines (:mod:`qmoe_rtc.tiled.transform`);
    ``given``: they were passed tiled (``prepack='given'``), so they are used as they are."""
    scale_dtype, proj = upload_projections(cp, weights, layer, device_id)
    tiled = tiled or given
    if tiled:
        with cp.cuda.Device(device_id):
            proj = tile_codes(cp, proj, layer, given)
    shared = None
    if ext is not None and ext.shared is not None:
        sw = {n.removeprefix("shared_"): a for n, a in weights.items() if n.startswith("shared_fc")}
        _, shared = upload_projections(cp, sw, ext.shared, device_id, scale_dtype=scale_dtype)
        if tiled:
            with cp.cuda.Device(device_id):
                shared = tile_codes(cp, shared, ext.shared, given)
    extras = upload_extras(cp, weights, device_id)
    if expert_slice is not None:
        with cp.cuda.Device(device_id):
            extras["expert_map"] = cp.asarray(expert_slice.global_to_local())  # [E] i32
    return scale_dtype, proj, layer_table(proj, layer.attrs, shared=shared, extras=extras)

