"""QMoE attributes: ONNX Runtime's names and defaults parsed into one frozen, validated value
(plus ``zero_point_offset``, ``shared_expert_weight_bits`` and ``shared_block_size`` [ext]).
:mod:`qmoe_rtc.contract` re-exports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .errors import QMoEAttributeError
from .fp4 import FP4_BLOCK
from .quantize import SUPPORTED_BITS
from .specialize.vocab import ACTIVATIONS, GLU_ACTIVATIONS

__all__ = ["QUANT_TYPES", "QMoEAttributes"]

#: quant_type values: ONNX Runtime's 'int' and 'fp8', and the FP4 formats [ext] (qmoe_rtc.fp4).
QUANT_TYPES = ("int", "fp8", *FP4_BLOCK)


def _as_int(name, value, allowed=None):
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        hasattr(value, "__index__") and not isinstance(value, float)
    ):
        raise QMoEAttributeError(name, "an integer", repr(value))
    v = int(value)
    if allowed is not None and v not in allowed:
        raise QMoEAttributeError(name, f"one of {tuple(allowed)}", repr(v))
    return v


def _as_float(name, value, finite: bool = False):
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise QMoEAttributeError(name, "a number", repr(value)) from None
    if math.isnan(v):
        raise QMoEAttributeError(name, "a number (not NaN)", "nan")
    if finite and not math.isfinite(v):
        raise QMoEAttributeError(name, "a finite number", str(v))
    return v


def _block_size(name, value, fp8: bool = False, fp4: int = 0) -> int:
    """0 (row-wise) or a power of two >= 16; with quant_type='fp8' any value <= 0 means per-expert
    global scales, as ONNX Runtime reads it, and is normalized to 0; with an FP4 quant_type the
    format's block (``fp4``: 32 for mxfp4, 16 for nvfp4), 0 meaning that block."""
    bs = _as_int(name, value)
    if fp4:
        if bs not in (0, fp4):
            raise QMoEAttributeError(name, f"{fp4} (or 0, meaning {fp4}): the format's scale block", str(bs))
        return fp4
    if fp8 and bs < 0:
        return 0
    if bs != 0 and (bs < 16 or bs & (bs - 1)):
        raise QMoEAttributeError(name, "0 (row-wise) or a power of two >= 16" + (" (or <= 0 for global scales)" if fp8 else ""),
                                 str(bs))
    return bs


@dataclass(frozen=True)
class QMoEAttributes:
    """QMoE attributes with ONNX Runtime's names and defaults (plus the [ext] ones: ``zero_point_offset``,
    and ``shared_expert_weight_bits`` / ``shared_block_size`` for shared experts, unset = the routed ones)."""

    k: int = 1
    activation_type: str = "relu"
    normalize_routing_weights: int = 0
    use_sparse_mixer: int = 0
    expert_weight_bits: int = 4
    fc1_expert_weight_bits: int | None = None
    fc2_expert_weight_bits: int | None = None
    fc3_expert_weight_bits: int | None = None
    block_size: int = 0
    swiglu_fusion: int = 0
    swiglu_limit: float = math.inf
    activation_alpha: float = 1.0
    activation_beta: float = 0.0
    swiglu_limit_after_activation: int = 0
    quant_type: str = "int"
    zero_point_offset: float | None = None
    shared_expert_weight_bits: int | None = None
    shared_block_size: int | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, **attrs) -> QMoEAttributes:
        """Parse and validate attributes; unknown names and bad values raise ``QMoEAttributeError``."""
        known = cls.names()
        for name in attrs:
            if name not in known:
                raise QMoEAttributeError(name, f"one of the QMoE attributes {known}", "an unknown name")
        a = dict(attrs)
        out = {}
        out["k"] = _as_int("k", a.get("k", 1))
        if out["k"] < 1:  # k <= E is checked with the weights (contract.describe_layer)
            raise QMoEAttributeError("k", "1 <= k <= E", str(out["k"]))
        act = a.get("activation_type", "relu")
        if isinstance(act, bytes):
            act = act.decode()
        if not isinstance(act, str) or act.lower() not in ACTIVATIONS:
            raise QMoEAttributeError("activation_type", f"one of {ACTIVATIONS}", repr(act))
        out["activation_type"] = act.lower()
        out["normalize_routing_weights"] = _as_int("normalize_routing_weights", a.get("normalize_routing_weights", 0), (0, 1))
        out["use_sparse_mixer"] = _as_int("use_sparse_mixer", a.get("use_sparse_mixer", 0), (0, 1))
        out["expert_weight_bits"] = _as_int("expert_weight_bits", a.get("expert_weight_bits", 4), SUPPORTED_BITS)
        for p in ("fc1", "fc2", "fc3"):
            n = f"{p}_expert_weight_bits"
            v = a.get(n)
            out[n] = None if v is None else _as_int(n, v, SUPPORTED_BITS)
        qt = a.get("quant_type", "int")
        if isinstance(qt, bytes):
            qt = qt.decode()
        if qt not in QUANT_TYPES:
            raise QMoEAttributeError("quant_type", f"one of {QUANT_TYPES} (the quantizations this build implements)",
                                     repr(qt))
        out["quant_type"] = qt
        fp4 = FP4_BLOCK.get(qt, 0)
        out["block_size"] = _block_size("block_size", a.get("block_size", 0), fp8=qt == "fp8", fp4=fp4)
        sb = a.get("shared_expert_weight_bits")
        out["shared_expert_weight_bits"] = None if sb is None else _as_int("shared_expert_weight_bits", sb, SUPPORTED_BITS)
        sbs = a.get("shared_block_size")
        out["shared_block_size"] = None if sbs is None else _block_size("shared_block_size", sbs, fp8=qt == "fp8", fp4=fp4)
        out["swiglu_fusion"] = _as_int("swiglu_fusion", a.get("swiglu_fusion", 0), (0, 1, 2))
        out["swiglu_limit"] = _as_float("swiglu_limit", a.get("swiglu_limit", math.inf))
        if out["swiglu_limit"] <= 0:
            raise QMoEAttributeError("swiglu_limit", "a positive number (or +inf for no limit)", str(out["swiglu_limit"]))
        out["activation_alpha"] = _as_float("activation_alpha", a.get("activation_alpha", 1.0), finite=True)
        out["activation_beta"] = _as_float("activation_beta", a.get("activation_beta", 0.0), finite=True)
        out["swiglu_limit_after_activation"] = _as_int(
            "swiglu_limit_after_activation", a.get("swiglu_limit_after_activation", 0), (0, 1)
        )
        zpo = a.get("zero_point_offset")
        if zpo is not None:
            zpo = _as_float("zero_point_offset", zpo, finite=True)
        out["zero_point_offset"] = zpo
        attrs_obj = cls(**out)
        attrs_obj._check_combinations()
        return attrs_obj

    def _check_combinations(self):
        if self.quant_type == "fp8":
            for n in ("expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits"):
                v = getattr(self, n)
                if v is not None and v != 8:
                    raise QMoEAttributeError(n, "8 with quant_type='fp8' (one float8e4m3fn byte per weight)", str(v))
            if self.zero_point_offset is not None:
                raise QMoEAttributeError("zero_point_offset", "unset with quant_type='fp8' (e4m3fn has no zero point)",
                                         str(self.zero_point_offset))
        if self.quant_type in FP4_BLOCK:
            for n in ("expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits",
                      "shared_expert_weight_bits"):
                v = getattr(self, n)
                if v is not None and v != 4:
                    raise QMoEAttributeError(n, f"4 with quant_type='{self.quant_type}' (one e2m1 nibble per weight)",
                                             str(v))
            if self.zero_point_offset is not None:
                raise QMoEAttributeError("zero_point_offset", f"unset with quant_type='{self.quant_type}' (e2m1 has no "
                                         "zero point)", str(self.zero_point_offset))
        if self.use_sparse_mixer and self.k != 2:
            raise QMoEAttributeError("k", "2 when use_sparse_mixer=1 (Phi-3.5-MoE sparse mixer)", str(self.k))
        if self.swiglu_fusion and self.activation_type not in GLU_ACTIVATIONS:
            raise QMoEAttributeError(
                "swiglu_fusion", f"0 unless activation_type is one of {GLU_ACTIVATIONS}",
                f"{self.swiglu_fusion} with activation_type '{self.activation_type}'",
            )

    def bits(self, projection: str) -> int:
        """Bits of ``fc1`` / ``fc2`` / ``fc3`` (their own attribute, else ``expert_weight_bits``)."""
        v = getattr(self, f"{projection}_expert_weight_bits")
        return self.expert_weight_bits if v is None else v

    def shared_attrs(self) -> QMoEAttributes:
        """The attributes the shared experts are read with: their own bits and block size where set (else
        the routed ones, per projection), the routed quantization (integer codes, or FP8 like the routed
        experts), one 'route' per shared expert."""
        sb = self.shared_expert_weight_bits
        per = {f"{p}_expert_weight_bits": sb if sb is not None else self.bits(p) for p in ("fc1", "fc2")}
        bs = self.block_size if self.shared_block_size is None else self.shared_block_size
        return replace(self, k=1, use_sparse_mixer=0, **per, fc3_expert_weight_bits=None, block_size=bs,
                       shared_expert_weight_bits=None, shared_block_size=None)

    @property
    def is_glu(self) -> bool:
        return self.activation_type in GLU_ACTIVATIONS
