"""The QMoE contract: attributes, input validation, and every derived size in one place.

``QMoEAttributes.from_kwargs(**attrs)`` parses ONNX Runtime's attribute names and defaults into a
frozen value. ``describe_layer(weights, attrs)`` validates the expert tensors (inputs 2–13, and the FP8 global
scales 15–16) once, each projection by its weight format's checks (:mod:`qmoe_rtc.formats`), and
returns a :class:`LayerSpec` with everything the kernels need (H, I, E, fused width, blocks per row,
packed row bytes, formats and zero-point modes, dtypes). ``check_call(layer, input, router_probs,
router_weights)`` validates the per-call tensors (inputs 0, 1, 14) and returns a :class:`CallSpec`.

Every refusal raises :class:`~qmoe_rtc.errors.QMoEInputError` / ``QMoEAttributeError`` naming the
input, the expected and the actual value.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._arrays import device_of, dtype_name, is_cupy, shape_str
from ..errors import DeviceError, QMoEInputError
from ..formats.projection import ProjectionSpec, require
from ..specialize.vocab import ACTIVATIONS, GATEABLE_ACTIVATIONS, GLU_ACTIVATIONS
from ..specialize.vocab import DTYPES as FLOAT_DTYPES
from .attributes import QMoEAttributes

__all__ = [
    "ACTIVATIONS",
    "GLU_ACTIVATIONS",
    "INPUT_NAMES",
    "WEIGHT_INPUTS",
    "GLOBAL_SCALE_INPUTS",
    "LAYER_INPUTS",
    "QMoEAttributes",
    "ProjectionSpec",
    "LayerSpec",
    "CallSpec",
    "describe_layer",
    "check_call",
    "check_content",
]

#: ONNX Runtime's input order (indices 0–14).
INPUT_NAMES = (
    "input",
    "router_probs",
    "fc1_experts_weights",
    "fc1_scales",
    "fc1_experts_bias",
    "fc2_experts_weights",
    "fc2_scales",
    "fc2_experts_bias",
    "fc3_experts_weights",
    "fc3_scales",
    "fc3_experts_bias",
    "fc1_zero_points",
    "fc2_zero_points",
    "fc3_zero_points",
    "router_weights",
)
#: The inputs that describe the layer (constant across calls).
WEIGHT_INPUTS = INPUT_NAMES[2:14]
#: ONNX Runtime's inputs 15 and 16: the per-expert float32 scales of FP8 experts with block_size 0.
GLOBAL_SCALE_INPUTS = ("fc1_global_scale", "fc2_global_scale")
#: Every routed-expert input :func:`describe_layer` reads.
LAYER_INPUTS = WEIGHT_INPUTS + GLOBAL_SCALE_INPUTS

@dataclass(frozen=True)
class LayerSpec:
    """Everything derived from the weights and attributes of one QMoE layer."""

    attrs: QMoEAttributes
    E: int  #: experts
    H: int  #: hidden size
    I: int  #: intermediate size
    F: int  #: 2 when FC1 holds fused gate+linear rows (swiglu/geglu with swiglu_fusion 1|2), else 1
    fc1: ProjectionSpec  #: [E, F·I, ceil(H·b1/8)]
    fc2: ProjectionSpec  #: [E, H, ceil(I·b2/8)]
    fc3: ProjectionSpec | None  #: [E, I, ceil(H·b3/8)]
    dtype: str | None  #: activation dtype T implied by the weights (scales/biases in T), None if all float32
    on_gpu: bool
    device_id: int | None

    @property
    def fused_width(self) -> int:
        return self.F * self.I

    @property
    def gated(self) -> bool:
        """True when the intermediate is act(gate)·linear (GLU or FC3-gated silu/gelu)."""
        return self.F == 2 or self.fc3 is not None

    def projections(self):
        return tuple(p for p in (self.fc1, self.fc2, self.fc3) if p is not None)


@dataclass(frozen=True)
class CallSpec:
    """Per-call sizes: ``rows`` = tokens (B·S for 3-D input)."""

    rows: int
    input_shape: tuple
    dtype: str  #: activation dtype T
    router_dtype: str
    router_weights_dtype: str | None


def _device_of(a):
    return device_of(a)


def _infer_dtype(tensors) -> str | None:
    """The activation dtype implied by non-float32 scales/biases, refusing a mix of two."""
    seen = {}
    for name, a in tensors.items():
        if a is None:
            continue
        d = dtype_name(a)
        if d in FLOAT_DTYPES and d != "float32":  # other dtypes are refused by the per-input checks
            seen.setdefault(d, name)
    if len(seen) > 1:
        (d1, n1), (d2, n2) = list(seen.items())[:2]
        raise QMoEInputError(n2, f"float32 or the same dtype as '{n1}' ({d1})", f"dtype {d2}")
    return next(iter(seen), None)


def describe_layer(weights: dict, attrs: QMoEAttributes, routed_experts: int | None = None) -> LayerSpec:
    """Validate the expert tensors (``fc1_experts_weights`` … ``fc3_zero_points``) and derive sizes.

    ``weights`` maps ONNX Runtime input names to arrays (missing or None = not given).
    ``routed_experts``: the experts routing picks from when the weights hold only a slice of them
    (:mod:`qmoe_rtc.contract.slices`; k is checked against it).
    """
    w = {n: weights.get(n) for n in LAYER_INPUTS}
    unknown = set(weights) - set(LAYER_INPUTS)
    if unknown:
        raise QMoEInputError(sorted(unknown)[0], f"one of {LAYER_INPUTS}", "an unknown input name")

    # --- devices: everything on one side (all NumPy, or all CuPy on one device)
    given = {n: a for n, a in w.items() if a is not None}
    devs = {n: _device_of(a) for n, a in given.items()}
    on_gpu = any(d is not None for d in devs.values())
    ref = "fc1_experts_weights"
    ref_dev = devs.get(ref)
    for n, d in devs.items():
        if d != ref_dev:
            raise DeviceError(
                f"input '{n}': expected the same device as '{ref}' "
                f"({'host' if ref_dev is None else f'cuda:{ref_dev}'}), got {'host' if d is None else f'cuda:{d}'}"
            )

    fmt = attrs.weight_format
    require("fc1_experts_weights", w["fc1_experts_weights"], rank=3, dtypes=fmt.code_dtypes)
    require("fc2_experts_weights", w["fc2_experts_weights"], rank=3, dtypes=fmt.code_dtypes)
    E = int(w["fc1_experts_weights"].shape[0])
    if E < 1:  # what one build can run (E <= 512 ...) is the executor's check: QMoEUnsupportedError
        raise QMoEInputError("fc1_experts_weights", "at least 1 expert (dim 0)", f"E = {E}")
    if int(w["fc2_experts_weights"].shape[0]) != E:
        raise QMoEInputError("fc2_experts_weights", f"{E} experts in dim 0 (as fc1_experts_weights)",
                             f"shape {shape_str(w['fc2_experts_weights'].shape)}")
    attrs.check_routed_experts(routed_experts or E)  # k <= E; the expert groups [ext] divide E and hold k

    has_fc3 = w["fc3_experts_weights"] is not None
    act = attrs.activation_type
    if act in GLU_ACTIVATIONS:
        F = 2 if attrs.swiglu_fusion else 1
        if attrs.swiglu_fusion and has_fc3:
            raise QMoEInputError("fc3_experts_weights", f"absent with swiglu_fusion={attrs.swiglu_fusion} "
                                 "(gate and linear both come from fc1)", "an array")
        if not attrs.swiglu_fusion and not has_fc3:
            raise QMoEInputError("fc3_experts_weights", f"an array: {act} with swiglu_fusion=0 takes the linear "
                                 "half from fc3", "None")
    else:
        F = 1
        if has_fc3 and act not in GATEABLE_ACTIVATIONS:
            raise QMoEInputError("fc3_experts_weights", f"absent: activation '{act}' does not use fc3 "
                                 f"(only {GATEABLE_ACTIVATIONS + GLU_ACTIVATIONS} do)", "an array")
    for n in ("fc3_scales", "fc3_experts_bias", "fc3_zero_points"):
        if w[n] is not None and not has_fc3:
            raise QMoEInputError(n, "absent when fc3_experts_weights is absent", "an array")
    fmt.check_layer(w, attrs, has_fc3)  # the format's rules: which FC3 and global-scale inputs it takes

    fused = int(w["fc1_experts_weights"].shape[1])
    if fused % F:
        raise QMoEInputError("fc1_experts_weights", "an even number of rows F·I in dim 1 (fused gate+linear)",
                             f"shape {shape_str(w['fc1_experts_weights'].shape)}")
    I = fused // F
    H = int(w["fc2_experts_weights"].shape[1])
    if I < 1 or H < 1:
        raise QMoEInputError("fc1_experts_weights", "non-empty experts (H, I >= 1)", f"H = {H}, I = {I}")

    dtype = _infer_dtype({n: w[n] for n in ("fc1_scales", "fc2_scales", "fc3_scales",
                                            "fc1_experts_bias", "fc2_experts_bias", "fc3_experts_bias")})

    fc1 = fmt.projection(w, attrs, "fc1", E, F * I, H)  # each projection by its format's checks
    fc2 = fmt.projection(w, attrs, "fc2", E, H, I)
    fc3 = fmt.projection(w, attrs, "fc3", E, I, H) if has_fc3 else None
    return LayerSpec(attrs=attrs, E=E, H=H, I=I, F=F, fc1=fc1, fc2=fc2, fc3=fc3, dtype=dtype, on_gpu=on_gpu,
                     device_id=ref_dev)


def check_call(layer: LayerSpec, input, router_probs, router_weights=None) -> CallSpec:
    """Validate the per-call inputs (``input``, ``router_probs``, ``router_weights``) against a layer."""
    require("input", input, rank=(2, 3), dtypes=FLOAT_DTYPES)
    T = dtype_name(input)
    if layer.dtype is not None and T != layer.dtype:
        raise QMoEInputError("input", f"dtype {layer.dtype} (the dtype of the layer's scales/biases)", f"dtype {T}")
    H = int(input.shape[-1])
    if H != layer.H:
        raise QMoEInputError("input", f"last dim H = {layer.H} (fc2_experts_weights dim 1)",
                             f"shape {shape_str(input.shape)}")
    rows = 1
    for d in input.shape[:-1]:
        rows *= int(d)
    require("router_probs", router_probs, shape=(rows, layer.E), dtypes=("float32", T),
             where="[rows, E] logits, rows = B·S for 3-D input")
    rw_dtype = None
    if router_weights is not None:
        if layer.attrs.use_sparse_mixer:
            raise QMoEInputError("router_weights", "None with use_sparse_mixer=1 (the sparse mixer computes its "
                                 "own weights)", "an array")
        require("router_weights", router_weights, shape=(rows, layer.E), dtypes=("float32", T))
        rw_dtype = dtype_name(router_weights)
    want_dev = layer.device_id
    for n, a in (("input", input), ("router_probs", router_probs), ("router_weights", router_weights)):
        if a is None:
            continue
        d = _device_of(a)
        if d != want_dev:
            raise DeviceError(f"input '{n}': expected {'host' if want_dev is None else f'cuda:{want_dev}'} "
                              f"(where the weights are), got {'host' if d is None else f'cuda:{d}'}")
    return CallSpec(rows=rows, input_shape=tuple(int(d) for d in input.shape), dtype=T,
                    router_dtype=dtype_name(router_probs), router_weights_dtype=rw_dtype)


def check_content(weights: dict, layer: LayerSpec) -> None:
    """Opt-in content checks: finite non-negative scales, finite biases, clean zero-point padding.

    Reads the whole tensors (a device→host copy for CuPy arrays): call it once per layer, not per step.
    """
    import numpy as np

    def host(a):
        return a.get() if is_cupy(a) else np.asarray(a)

    for p in layer.projections():
        p.weight_format.check_content(weights, p, host)  # NaN codes or scales, zero-point padding bits
        s = host(weights[p.scale_input]).astype(np.float32)  # FP4: bytes, never negative or non-finite
        bad = ~np.isfinite(s) | (s < 0)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise QMoEInputError(p.scale_input, "finite, non-negative scales", f"{s[idx]} at index {list(idx)}")
        b = weights.get(f"{p.name}_experts_bias")
        if b is not None:
            bh = host(b).astype(np.float32)
            if not np.isfinite(bh).all():
                idx = tuple(int(i) for i in np.argwhere(~np.isfinite(bh))[0])
                raise QMoEInputError(f"{p.name}_experts_bias", "finite biases", f"{bh[idx]} at index {list(idx)}")
