"""A layer's constant tensors on the device, and the binding table every kernel argument is found in.

The table maps argument names (``fc1_w``, ``fc1_scales``, ``fc1_zp``, ``fc1_bias``, ... ``zp_offset``,
``alpha``, ``beta``, ``limit``, ``limit_after``, ``normalize``, grouped routing's ``n_group``, ``groups_kept``,
``routed_scaling``) to layer tensors and attribute values;
the plan adds problem sizes, launch scalars, scratch addresses and the per-call arrays.
"""

from __future__ import annotations

import logging

from .._arrays import dtype_name

__all__ = ["EXTRA_TENSORS", "layer_scale_dtype", "layer_table", "upload_extras", "upload_projections"]

log = logging.getLogger("qmoe_rtc")


def _word_readable(cp, a, name: str):
    """``a`` itself when it starts on a 16-byte boundary and its size is whole 4-byte words, else a
    padded aligned copy (made once): the tensor-core kernels copy scales and zero points as the
    aligned 4-byte words that hold them, which must lie inside the array."""
    if a.data.ptr % 16 == 0 and a.nbytes % 4 == 0:
        return a
    log.info("qmoe_rtc: %s is not 16-byte aligned or not whole 4-byte words; copied once", name)
    buf = cp.zeros(((a.nbytes + 15) // 16) * 16, dtype=cp.uint8)
    buf[: a.nbytes] = cp.ascontiguousarray(a).view(cp.uint8).ravel()
    return buf[: a.nbytes].view(a.dtype).reshape(a.shape)


def layer_scale_dtype(layer) -> str:
    """The dtype the layer's scales are held in on the device: theirs when every projection agrees,
    else float32."""
    sdts = {p.scale_dtype for p in layer.projections()}
    return sdts.pop() if len(sdts) == 1 else "float32"


def upload_projections(cp, w: dict, layer, device_id: int, scale_dtype: str | None = None):
    """(scale dtype of the layer, {projection: (weights, scales, zero points, bias)}) on the device.

    Scales share one dtype (float32 when the projections disagree; ``scale_dtype`` when given: the
    shared experts take the routed ones'); weights not 16-byte aligned are copied once (the kernels
    read them with 16-byte loads); biases become float32. FP8 projections hold e4m3fn codes [E, N, K]
    (uint8) and their scales are ``fc*_global_scale`` [E] (block_size 0) or the square blocks in
    ``fc*_scales`` (:attr:`~qmoe_rtc.contract.ProjectionSpec.scale_input`). FP4 projections hold e2m1
    codes [E, N, K/2] and float32 block scales [E, N, K/bs] (:func:`qmoe_rtc.formats.fp4.engine_scales`).
    """
    scale_dtype = scale_dtype or layer_scale_dtype(layer)
    if len({p.scale_dtype for p in layer.projections()}) > 1:
        log.info("qmoe_rtc: projections have scales of different dtypes; converted to float32 once")
    proj = {}
    with cp.cuda.Device(device_id):
        for p in layer.projections():
            wt = w[f"{p.name}_experts_weights"]
            if wt.data.ptr % 16:
                log.info("qmoe_rtc: %s_experts_weights is not 16-byte aligned; copied once", p.name)
                wt = wt.copy()
            s = w[p.scale_input]
            # as the engines hold them: FP4's e8m0 / e4m3 bytes (and NVFP4's global scale) become float32 per block
            s = p.weight_format.device_scales(s, w.get(f"{p.name}_global_scale"))
            if dtype_name(s) != scale_dtype:
                s = s.astype(cp.float32)
            b = w.get(f"{p.name}_experts_bias")
            z = w.get(f"{p.name}_zero_points")
            proj[p.name] = (
                wt,  # [E, N, ceil(K·b/8)] u8
                _word_readable(cp, cp.ascontiguousarray(s), p.scale_input),  # [E, N] / [E, N, nb]; FP8 [E] / blocks
                None if z is None else _word_readable(cp, z, f"{p.name}_zero_points"),  # packed u8
                None if b is None else cp.ascontiguousarray(b.astype(cp.float32)),  # [E, N] f32
            )
    return scale_dtype, proj


#: Extension tensors [ext] other than the shared experts' projections, by input (= argument) name,
#: and whether they are held in float32 (small vectors) or as given (router_weight: float32 or T).
EXTRA_TENSORS = {"shared_gate_weight": True, "router_weight": False, "router_bias": True, "router_score_bias": True}


def upload_extras(cp, w: dict, device_id: int) -> dict:
    """The layer's :data:`EXTRA_TENSORS` on the device (absent ones left out): shared_gate_weight [H]
    f32, router_weight [E, H] as given, router_bias [E] f32, router_score_bias [E] f32."""
    out = {}
    with cp.cuda.Device(device_id):
        for name, f32 in EXTRA_TENSORS.items():
            a = w.get(name)
            if a is not None:
                a = cp.ascontiguousarray(a.astype(cp.float32) if f32 else a)
                if a.data.ptr % 16:  # the router GEMM reads router_weight rows with 16-byte loads
                    a = a.copy()
                out[name] = a
    return out


def layer_table(proj: dict, attrs, shared: dict | None = None, extras: dict | None = None) -> dict:
    """Argument name -> value for everything constant in a layer. Without FC3 its arguments hold FC1's
    tensors (the kernels never read them then); the shared experts' projections [ext] are
    ``shared_fc1_w`` ... (NULL without them), the other extension tensors their input names."""
    t = {}
    for p in ("fc1", "fc2", "fc3"):
        w, s, z, b = proj.get(p) or proj["fc1"]
        t.update({f"{p}_w": w, f"{p}_scales": s, f"{p}_zp": z, f"{p}_bias": b})
    for p in ("fc1", "fc2"):
        w, s, z, b = (shared or {}).get(p) or (None,) * 4
        t.update({f"shared_{p}_w": w, f"shared_{p}_scales": s, f"shared_{p}_zp": z, f"shared_{p}_bias": b})
    # expert_map: slices [ext]; expert_counts [E] i64: expert statistics [ext] (QMoE(expert_counts=True))
    t.update({n: (extras or {}).get(n) for n in (*EXTRA_TENSORS, "expert_map", "expert_counts")})
    t.update(zp_offset=float(attrs.zero_point_offset or 0.0), alpha=float(attrs.activation_alpha),
             beta=float(attrs.activation_beta), limit=float(attrs.swiglu_limit),
             limit_after=int(attrs.swiglu_limit_after_activation), normalize=int(attrs.normalize_routing_weights),
             n_group=int(attrs.n_group), groups_kept=int(attrs.groups_kept),
             routed_scaling=float(attrs.routed_scaling_factor))  # grouped sigmoid routing [ext]
    return t
