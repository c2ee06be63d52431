"""The frozen specialization values: :class:`Layout` (one layer's code-shaping fields), :class:`ModuleSpec`
(what one compiled module is made from: a family and its parameters) and :class:`ModelConfig`.

Anything that changes generated code is a field. Bits, block size, weight format and zero-point mode, gate
source and alignment become C++ template parameters (compile-time constants), never runtime kernel arguments:
a projection's format and zero-point mode fold into one decode trait, the ``ZP`` template argument
(:meth:`Layout.decode_trait`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import QMoEAttributeError
from ..formats.axis import WeightFormat, weight_format
from .vocab import ACTIVATIONS, DTYPES, ZP_LETTERS, ZP_MODES, dtype_abbrev, gate_source

__all__ = ["Layout", "ModelConfig", "ModuleSpec"]


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _check(name: str, value: Any, allowed, what: str | None = None) -> None:
    if value not in allowed or type(value) is bool and not any(type(a) is bool for a in allowed):
        raise QMoEAttributeError(name, what or f"one of {list(allowed)}", repr(value))


@dataclass(frozen=True)
class Layout:
    """Everything about one QMoE layer that shapes generated code.

    ``scale_dtype=""`` means "same as ``dtype``" and is normalised, so equal layouts compare equal.
    ``fcN_format``: the projection's weight format (:mod:`qmoe_rtc.formats`: 'int', 'fp8_e4m3', 'mxfp4',
    'nvfp4'), validated against its rules: its code widths, zero points only where it has them (``fcN_zp``
    'none' / 'packed' / 'offset'), its own scale block (MXFP4 32, NVFP4 16) and scale dtype (FP4: float32,
    as the engines hold them); FP8's square scale blocks may be partial (no divisibility rule, see
    :class:`ModelConfig`). ``fc3_bits`` / ``fc3_zp`` / ``fc3_format`` must be 0 / 'none' / 'int' unless
    ``has_fc3``. ``aligned``: every packed row is
    whole 32-code chunks (H and I multiples of 32), which lets kernels use 16-byte loads;
    :class:`ModelConfig` derives it from the shapes. ``tiled``: the codes are held in the tiled layout
    the tensor-core engines read (:mod:`qmoe_rtc.tiled.transform`), not the contract's rows.
    """

    dtype: str = "float16"
    scale_dtype: str = ""
    fc1_bits: int = 4
    fc2_bits: int = 4
    fc3_bits: int = 0
    block_size: int = 0
    fc1_zp: str = "none"
    fc2_zp: str = "none"
    fc3_zp: str = "none"
    fc1_format: str = "int"
    fc2_format: str = "int"
    fc3_format: str = "int"
    activation: str = "relu"
    swiglu_fusion: int = 0
    has_fc3: bool = False
    aligned: bool = True
    tiled: bool = False

    def __post_init__(self) -> None:
        _check("dtype", self.dtype, DTYPES)
        if self.scale_dtype == "":
            object.__setattr__(self, "scale_dtype", self.dtype)
        _check("scale_dtype", self.scale_dtype, ("float32", self.dtype), f"float32 or the activation dtype {self.dtype}")
        for b in ("has_fc3", "aligned", "tiled"):
            if type(getattr(self, b)) is not bool:
                raise QMoEAttributeError(b, "a bool", repr(getattr(self, b)))
        for f in ("fc1_format", "fc2_format", "fc3_format"):  # a WeightFormat given is held by its name
            if isinstance(getattr(self, f), WeightFormat):
                object.__setattr__(self, f, getattr(self, f).name)
        if not self.has_fc3:
            _check("fc3_bits", self.fc3_bits, (0,), "0 (has_fc3=False)")
            _check("fc3_zp", self.fc3_zp, ("none",), "'none' (has_fc3=False)")
            _check("fc3_format", self.fc3_format, ("int",), "'int' (has_fc3=False)")
        bs = self.block_size
        if not (type(bs) is int and (bs == 0 or (bs >= 16 and bs & (bs - 1) == 0))):
            raise QMoEAttributeError("block_size", "0 (row-wise) or a power of two >= 16", repr(bs))
        for p in self.projections:
            fmt = weight_format(getattr(self, f"{p}_format"), f"{p}_format")
            fmt.check_bits(getattr(self, f"{p}_bits"), f"{p}_bits")
            _check(f"{p}_zp", getattr(self, f"{p}_zp"), ZP_MODES)
            fmt.decode_trait(getattr(self, f"{p}_zp"), f"{p}_zp")  # zero points only where the format has them
            fmt.check_block_size(self.block_size)
            if fmt.scale.device and self.scale_dtype != fmt.scale.device:
                _check("scale_dtype", self.scale_dtype, (fmt.scale.device,),
                       f"{fmt.scale.device} with {p}_format={fmt.name!r} (the engines hold its scales so)")
        _check("activation", self.activation, ACTIVATIONS)
        gate, why = gate_source(self.activation, self.swiglu_fusion, self.has_fc3)
        if gate is None:
            raise QMoEAttributeError("swiglu_fusion / has_fc3", "a valid gate source", why)

    # -- projections -------------------------------------------------------------------------
    @property
    def projections(self) -> tuple[str, ...]:
        return ("fc1", "fc2", "fc3") if self.has_fc3 else ("fc1", "fc2")

    def bits(self, proj: str) -> int:
        return getattr(self, f"{proj}_bits")

    def zp(self, proj: str) -> str:
        return getattr(self, f"{proj}_zp")

    def format(self, proj: str) -> WeightFormat:
        return weight_format(getattr(self, f"{proj}_format"))

    def decode_trait(self, proj: str) -> str:
        """How the device decodes ``proj``'s codes (a key of ``CPP_ZP``, the ZP template argument): its format and
        zero-point mode folded into one (:meth:`qmoe_rtc.formats.axis.WeightFormat.decode_trait`)."""
        return self.format(proj).decode_trait(self.zp(proj))

    @property
    def gate(self) -> str:
        """'none' | 'fused1' | 'fused2' | 'fc3': where FC1's gate and linear halves come from."""
        return gate_source(self.activation, self.swiglu_fusion, self.has_fc3)[0]

    @property
    def gated(self) -> bool:
        return self.gate != "none"

    # -- identity ------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return _digest(self.as_dict())

    @property
    def name(self) -> str:
        """Readable name, e.g. ``swiglu-f1_fc1-b4-zpP_fc2-b4-zpN_bs128_f16_s-f32``: a projection's letter is its
        decode trait's (``ZP_LETTERS``)."""
        zp = ZP_LETTERS
        act = self.activation + (f"-f{self.swiglu_fusion}" if self.swiglu_fusion else "")
        parts = [act] + [f"{p}-b{self.bits(p)}-zp{zp[self.decode_trait(p)]}" for p in self.projections]
        parts += [f"bs{self.block_size}", dtype_abbrev(self.dtype), "s-" + dtype_abbrev(self.scale_dtype)]
        if not self.aligned:
            parts.append("unaligned")
        if self.tiled:
            parts.append("tiled")
        return "_".join(parts)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


_NAME_FORMS = {
    "bits": lambda v: f"b{v}",
    "block_size": lambda v: f"bs{v}",
    "zp": lambda v: f"zp-{v}",
    "dtype": lambda v: dtype_abbrev(v),
    "scale_dtype": lambda v: "s-" + dtype_abbrev(v),
    "threads": lambda v: f"t{v}",
    "stages": lambda v: f"st{v}",
    "aligned": lambda v: "" if v else "unaligned",
    "tiled": lambda v: "tiled" if v else "",
}


def _spec_name(family: str, d: dict) -> str:
    """family, then (expert families) activation and per-projection bits / zero points, then block size,
    dtypes and the rest: ``mma_decode_swiglu-f1_fc1-b4-zpN_fc2-b4-zpN_bs128_bf16_s-bf16_st3``."""
    d = dict(d)
    parts = [family]
    if "activation" in d:
        fusion = d.pop("swiglu_fusion", 0)
        parts.append(d.pop("activation") + (f"-f{fusion}" if fusion else ""))
    has_fc3 = d.pop("has_fc3", False)
    for p in ("fc1", "fc2", "fc3"):
        if f"{p}_bits" in d:
            bits, zp = d.pop(f"{p}_bits"), d.pop(f"{p}_zp", "none")
            if p != "fc3" or has_fc3:
                parts.append(f"{p}-b{bits}-zp{ZP_LETTERS[zp]}")
    order = ("bits", "block_size", "zp", "dtype", "scale_dtype")
    for k in [k for k in order if k in d] + [k for k in sorted(d) if k not in order]:
        form = _NAME_FORMS.get(k)
        parts.append(form(d[k]) if form else f"{k}{d[k]}")
    return "_".join(str(p).replace(" ", "") for p in parts if p != "")


@dataclass(frozen=True)
class ModuleSpec:
    """What one compiled module is made from: a kernel family and its parameters.

    ``params`` are sorted ``(name, value)`` pairs of JSON scalars; :meth:`make` builds one from
    keywords. Layers that differ only in fields a family ignores produce equal specs and share one
    module. ``name`` is readable (``dequant_b4_bs128_zp-packed_f16_s-f32_t256``).
    """

    family: str
    params: tuple = field(default=())

    def __post_init__(self) -> None:
        items = dict(self.params)
        for k, v in items.items():
            if not isinstance(v, (bool, int, float, str)):
                raise QMoEAttributeError(f"{self.family}.{k}", "a bool/int/float/str", f"{type(v).__name__} {v!r}")
        object.__setattr__(self, "params", tuple(sorted(items.items())))

    @classmethod
    def make(cls, family: str, **params: Any) -> ModuleSpec:
        return cls(family, tuple(params.items()))

    def __getitem__(self, name: str) -> Any:
        for k, v in self.params:
            if k == name:
                return v
        raise KeyError(f"module spec {self.family!r} has no parameter {name!r} (has {[k for k, _ in self.params]})")

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def digest(self) -> str:
        return _digest({"family": self.family, "params": [list(p) for p in self.params]})

    @property
    def name(self) -> str:
        """Readable name built from every parameter (see ``_spec_name``)."""
        return _spec_name(self.family, dict(self.params))


@dataclass(frozen=True)
class ModelConfig:
    """A model's MoE layer: shapes plus its :class:`Layout` (presets and the executor build these).
    The layout's ``aligned`` is derived from the shapes here.

    [ext] ``shared``: S shared experts in the routed layout (same intermediate size), run as S more
    routes per token; ``shared_gate``: their sum is scaled by sigmoid(x·g); ``router_gemm``: the
    dtype of ``router_weight`` when the layer computes its logits ('' : the call passes them);
    ``all_experts``: an expert slice [ext] holds ``experts`` of this many (0: not a slice);
    ``scoring_func`` 'sigmoid' and ``n_group``: grouped sigmoid routing [ext] (its other attributes are
    per-layer scalars, not code); ``expert_counts``: routing adds each routed pick to the layer's
    per-expert counts (expert statistics [ext]).
    """

    hidden: int
    inter: int
    experts: int
    k: int
    layout: Layout
    use_sparse_mixer: bool = False
    normalize_routing_weights: bool = True
    name: str = ""
    shared: int = 0
    shared_gate: bool = False
    router_gemm: str = ""
    all_experts: int = 0
    scoring_func: str = "softmax"
    n_group: int = 0
    expert_counts: bool = False

    def __post_init__(self) -> None:
        for f in ("hidden", "inter", "experts", "k"):
            v = getattr(self, f)
            if not (type(v) is int and v >= 1):
                raise QMoEAttributeError(f, "a positive int", repr(v))
        if not (type(self.shared) is int and self.shared >= 0):
            raise QMoEAttributeError("shared", "a non-negative int", repr(self.shared))
        if self.shared_gate and not self.shared:
            raise QMoEAttributeError("shared_gate", "False without shared experts", repr(self.shared_gate))
        _check("router_gemm", self.router_gemm, ("", *DTYPES), f"'' or one of {list(DTYPES)}")
        if not (type(self.all_experts) is int and (self.all_experts == 0 or self.all_experts >= self.experts)):
            raise QMoEAttributeError("all_experts", f"0 or at least experts ({self.experts})", repr(self.all_experts))
        if self.k > (self.all_experts or self.experts):
            raise QMoEAttributeError("k", f"<= experts ({self.all_experts or self.experts})", repr(self.k))
        _check("scoring_func", self.scoring_func, ("softmax", "sigmoid"), "'softmax' or 'sigmoid'")
        if self.use_sparse_mixer and self.k != 2:
            raise QMoEAttributeError("k", "2 with use_sparse_mixer", repr(self.k))
        bs, lay = self.layout.block_size, self.layout
        if bs:  # square blocks (FP8) may be partial: no rule for such projections
            for p in lay.projections:
                what, K = ("inter", self.inter) if p == "fc2" else ("hidden", self.hidden)
                if K % bs and not lay.format(p).scale.square:
                    raise QMoEAttributeError("block_size", f"a divisor of {what}={K}", repr(bs))
        aligned = self.hidden % 32 == 0 and self.inter % 32 == 0
        if self.layout.aligned != aligned:
            object.__setattr__(self, "layout", replace(self.layout, aligned=aligned))
