"""The frozen specialization values: :class:`Layout` (one QMoE layer's code-shaping fields),
:class:`ModuleSpec` (what one compiled module depends on) and :class:`ModelConfig`.

Anything that changes generated code is a field. Bits, block size and zero-point mode become C++
template parameters (compile-time constants), never runtime kernel arguments.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from ..errors import QMoEAttributeError

__all__ = [
    "DTYPES",
    "BITS",
    "ZP_MODES",
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "Layout",
    "ModuleSpec",
    "ModelConfig",
    "dtype_abbrev",
]

DTYPES = ("float32", "float16", "bfloat16")
BITS = (1, 2, 3, 4, 8)
ZP_MODES = ("none", "packed", "offset")  # mirrors enum qmoe::ZpMode in cuda_src/dequant.cuh
ACTIVATIONS = ("relu", "gelu", "silu", "identity", "relu2", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")  # need a gate and a linear half (fused FC1 or FC3)

_DT_ABBREV = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def dtype_abbrev(dtype: str) -> str:
    return _DT_ABBREV[dtype]


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _check(name: str, value: Any, allowed, what: str | None = None) -> None:
    if value not in allowed:
        raise QMoEAttributeError(name, what or f"one of {list(allowed)}", repr(value))


@dataclass(frozen=True)
class Layout:
    """Everything about one QMoE layer that shapes generated code.

    ``scale_dtype=""`` means "same as ``dtype``" and is normalised, so equal layouts compare equal.
    ``fc3_bits`` / ``fc3_zp`` must be 0 / 'none' unless ``has_fc3``.
    ``tiles`` holds extra tile/launch parameters as sorted ``(name, int)`` pairs (e.g.
    ``(("gemv.rows", 4),)``); use :meth:`tile` to read one with a default.
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
    activation: str = "relu"
    swiglu_fusion: int = 0
    has_fc3: bool = False
    threads: int = 256
    tiles: tuple = ()

    def __post_init__(self) -> None:
        _check("dtype", self.dtype, DTYPES)
        if self.scale_dtype == "":
            object.__setattr__(self, "scale_dtype", self.dtype)
        _check("scale_dtype", self.scale_dtype, ("float32", self.dtype), f"float32 or the activation dtype {self.dtype}")
        _check("fc1_bits", self.fc1_bits, BITS)
        _check("fc2_bits", self.fc2_bits, BITS)
        for p in ("fc1_zp", "fc2_zp", "fc3_zp"):
            _check(p, getattr(self, p), ZP_MODES)
        if type(self.has_fc3) is not bool:
            raise QMoEAttributeError("has_fc3", "a bool", repr(self.has_fc3))
        if self.has_fc3:
            _check("fc3_bits", self.fc3_bits, BITS, f"one of {list(BITS)} (has_fc3=True)")
        else:
            _check("fc3_bits", self.fc3_bits, (0,), "0 (has_fc3=False)")
            _check("fc3_zp", self.fc3_zp, ("none",), "'none' (has_fc3=False)")
        bs = self.block_size
        if not (isinstance(bs, int) and (bs == 0 or (bs >= 16 and bs & (bs - 1) == 0))):
            raise QMoEAttributeError("block_size", "0 (row-wise) or a power of two >= 16", repr(bs))
        _check("activation", self.activation, ACTIVATIONS)
        _check("swiglu_fusion", self.swiglu_fusion, (0, 1, 2))
        if self.swiglu_fusion and self.activation not in GATED_ACTIVATIONS:
            raise QMoEAttributeError("swiglu_fusion", f"0 for activation {self.activation!r}", repr(self.swiglu_fusion))
        if self.activation in GATED_ACTIVATIONS and self.swiglu_fusion == 0 and not self.has_fc3:
            raise QMoEAttributeError("has_fc3", f"True for {self.activation} with swiglu_fusion=0 (linear half from FC3)", "False")
        if self.has_fc3 and self.swiglu_fusion:
            raise QMoEAttributeError("has_fc3", "False when swiglu_fusion fuses gate and linear into FC1", "True")
        if not (isinstance(self.threads, int) and 32 <= self.threads <= 1024 and self.threads % 32 == 0):
            raise QMoEAttributeError("threads", "a multiple of 32 in [32, 1024]", repr(self.threads))
        try:
            tiles = tuple(sorted((str(k), int(v)) for k, v in dict(self.tiles).items()))
        except (TypeError, ValueError):
            raise QMoEAttributeError("tiles", "(name, int) pairs", repr(self.tiles)) from None
        object.__setattr__(self, "tiles", tiles)

    # -- projections -------------------------------------------------------------------------
    @property
    def projections(self) -> tuple[str, ...]:
        return ("fc1", "fc2", "fc3") if self.has_fc3 else ("fc1", "fc2")

    def bits(self, proj: str) -> int:
        return getattr(self, f"{proj}_bits")

    def zp(self, proj: str) -> str:
        return getattr(self, f"{proj}_zp")

    def tile(self, name: str, default: int) -> int:
        return dict(self.tiles).get(name, default)

    # -- identity ------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tiles"] = [list(t) for t in self.tiles]
        return d

    @property
    def digest(self) -> str:
        return _digest(self.as_dict())

    @property
    def name(self) -> str:
        """Readable name, e.g. ``swiglu-f1_fc1-b4-zpP_fc2-b4-zpN_bs128_f16_s-f32_t256``."""
        zp = {"none": "N", "packed": "P", "offset": "O"}
        act = self.activation + (f"-f{self.swiglu_fusion}" if self.swiglu_fusion else "")
        parts = [act] + [f"{p}-b{self.bits(p)}-zp{zp[self.zp(p)]}" for p in self.projections]
        parts += [f"bs{self.block_size}", dtype_abbrev(self.dtype), "s-" + dtype_abbrev(self.scale_dtype), f"t{self.threads}"]
        parts += [f"{k}{v}" for k, v in self.tiles]
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
    "activation": lambda v: str(v),
    "swiglu_fusion": lambda v: f"sf{v}",
}


@dataclass(frozen=True)
class ModuleSpec:
    """What one compiled module depends on: a kernel family and its parameters.

    ``params`` are sorted ``(name, value)`` pairs of JSON scalars; :meth:`make` builds one from
    keywords. Layers that differ only in fields a family ignores produce equal specs and share
    one module. ``name`` is readable (``dequant_b4_bs128_zp-packed_f16_s-f32_t256``); ``digest``
    hashes family + params.
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
    def make(cls, family: str, **params: Any) -> "ModuleSpec":
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

    def render_name(self, order: tuple[str, ...] = ()) -> str:
        """Readable name with ``order`` params first, then the rest alphabetically."""
        d = dict(self.params)
        keys = [k for k in order if k in d] + [k for k in sorted(d) if k not in order]
        parts = [self.family]
        for k in keys:
            form = _NAME_FORMS.get(k)
            parts.append(form(d[k]) if form else f"{k}{d[k]}")
        return "_".join(str(p).replace(" ", "") for p in parts)

    @property
    def name(self) -> str:
        return self.render_name(("bits", "block_size", "zp", "dtype", "scale_dtype"))


@dataclass(frozen=True)
class ModelConfig:
    """A model's MoE layer: shapes plus its :class:`Layout` (presets build these)."""

    hidden: int
    inter: int
    experts: int
    k: int
    layout: Layout
    use_sparse_mixer: bool = False
    normalize_routing_weights: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("hidden", "inter", "experts", "k"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise QMoEAttributeError(f, "a positive int", repr(v))
        if self.k > self.experts:
            raise QMoEAttributeError("k", f"<= experts ({self.experts})", repr(self.k))
        if self.use_sparse_mixer and self.k != 2:
            raise QMoEAttributeError("k", "2 with use_sparse_mixer", repr(self.k))
        bs = self.layout.block_size
        if bs:
            for what, K in (("hidden", self.hidden), ("inter", self.inter)):
                if K % bs:
                    raise QMoEAttributeError("block_size", f"a divisor of {what}={K}", repr(bs))

    def with_layout(self, **changes: Any) -> "ModelConfig":
        from dataclasses import replace

        return replace(self, layout=replace(self.layout, **changes))


def layout_from_mapping(values: Mapping[str, Any]) -> Layout:
    return Layout(**dict(values))
