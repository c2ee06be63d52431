"""QMoE attributes: ONNX Runtime's names and defaults parsed into one frozen, validated value
(plus ``zero_point_offset``, ``shared_expert_weight_bits``, ``shared_block_size`` and the grouped sigmoid
routing's ``scoring_func``, ``n_group``, ``topk_group`` and ``routed_scaling_factor``, and FP8 activations
``activation_quant`` / ``activation_quant_group`` [ext]).
:mod:`qmoe_rtc.contract` re-exports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..errors import QMoEAttributeError
from ..formats.activations import ACTIVATION_QUANTS
from ..formats.axis import INT, QUANT_TYPES, WeightFormat, format_of_quant_type
from ..specialize.vocab import ACTIVATIONS, GLU_ACTIVATIONS

__all__ = ["QUANT_TYPES", "QMoEAttributes"]

#: Code widths the bit-width attributes take (the ``int`` format's; a float format fixes its own).
SUPPORTED_BITS = INT.bits
#: What ``scoring_func`` [ext] takes: the contract's softmax, or sigmoid scores (DeepSeek-V3-style routing).
SCORING_FUNCS = ("softmax", "sigmoid")


def _as_int(name, value, allowed=None):
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        hasattr(value, "__index__") and not isinstance(value, float)
    ):
        raise QMoEAttributeError(name, "an integer", repr(value))
    v = int(value)
    if allowed is not None and v not in allowed:
        raise QMoEAttributeError(name, f"one of {tuple(allowed)}", repr(v))
    return v


def _as_word(name, value, allowed):
    """A string attribute (ONNX may hand it over as bytes), lower-cased, one of ``allowed``."""
    if isinstance(value, bytes):
        value = value.decode()
    if not isinstance(value, str) or value.lower() not in allowed:
        raise QMoEAttributeError(name, f"one of {allowed}", repr(value))
    return value.lower()


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


def _block_size(name, value, fmt: WeightFormat) -> int:
    """The block size attribute as ``fmt`` reads it (:meth:`~qmoe_rtc.formats.axis.WeightFormat.attribute_block_size`:
    FP8 takes any value <= 0 as per-expert global scales, an FP4 format its own block)."""
    return fmt.attribute_block_size(_as_int(name, value), name)


def _routing(a: dict) -> dict:
    """The grouped sigmoid routing attributes [ext], parsed and checked against each other."""
    out = {}
    out["scoring_func"] = _as_word("scoring_func", a.get("scoring_func", "softmax"), SCORING_FUNCS)
    out["n_group"] = _as_int("n_group", a.get("n_group", 0))
    if out["n_group"] < 0:
        raise QMoEAttributeError("n_group", "0 or 1 (no groups) or the number of expert groups", str(out["n_group"]))
    out["topk_group"] = _as_int("topk_group", a.get("topk_group", 0))
    most = max(out["n_group"], 1)
    if not 0 <= out["topk_group"] <= most:
        raise QMoEAttributeError("topk_group", f"0 (every group) to n_group = {out['n_group']}" if most > 1 else
                                 f"0 or 1 with n_group = {out['n_group']} (no groups)", str(out["topk_group"]))
    if out["n_group"] > 1 and out["scoring_func"] != "sigmoid":
        raise QMoEAttributeError("n_group", "0 or 1 unless scoring_func='sigmoid' (groups are scored by the sum of "
                                 "their two best biased sigmoid scores)", f"{out['n_group']} with scoring_func="
                                 f"'{out['scoring_func']}'")
    rsf = _as_float("routed_scaling_factor", a.get("routed_scaling_factor", 1.0), finite=True)
    if rsf <= 0:
        raise QMoEAttributeError("routed_scaling_factor", "a positive finite number", str(rsf))
    out["routed_scaling_factor"] = rsf
    return out


def _activation_quant(a: dict) -> dict:
    """FP8 activations [ext]: ``activation_quant`` and its scale group along K (0: a scale a row)."""
    quant = _as_word("activation_quant", a.get("activation_quant", "none"), ACTIVATION_QUANTS)
    group = _as_int("activation_quant_group", a.get("activation_quant_group", 0))
    if group < 0:
        raise QMoEAttributeError("activation_quant_group", "0 (a scale a row) or a positive group size along K",
                                 str(group))
    if group and quant == "none":
        raise QMoEAttributeError("activation_quant_group", "0 unless activation_quant='fp8_e4m3'",
                                 f"{group} with activation_quant='none'")
    return {"activation_quant": quant, "activation_quant_group": group}


@dataclass(frozen=True)
class QMoEAttributes:
    """QMoE attributes with ONNX Runtime's names and defaults (plus the [ext] ones: ``zero_point_offset``,
    ``shared_expert_weight_bits`` / ``shared_block_size`` for shared experts, unset = the routed ones, and the
    grouped sigmoid routing: ``scoring_func``, ``n_group`` (0 or 1: no groups), ``topk_group`` (0: every
    group) and ``routed_scaling_factor``; docs/contract.md, "Grouped sigmoid routing"; FP8 activations:
    ``activation_quant`` ('none' or 'fp8_e4m3') and ``activation_quant_group`` (0: a scale a row, else values a scale
    along K); docs/contract.md, "FP8 activations")."""

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
    scoring_func: str = "softmax"
    n_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    activation_quant: str = "none"
    activation_quant_group: int = 0

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
        out["activation_type"] = _as_word("activation_type", a.get("activation_type", "relu"), ACTIVATIONS)
        out["normalize_routing_weights"] = _as_int("normalize_routing_weights", a.get("normalize_routing_weights", 0), (0, 1))
        out["use_sparse_mixer"] = _as_int("use_sparse_mixer", a.get("use_sparse_mixer", 0), (0, 1))
        out["expert_weight_bits"] = _as_int("expert_weight_bits", a.get("expert_weight_bits", 4), SUPPORTED_BITS)
        for p in ("fc1", "fc2", "fc3"):
            n = f"{p}_expert_weight_bits"
            v = a.get(n)
            out[n] = None if v is None else _as_int(n, v, SUPPORTED_BITS)
        fmt = format_of_quant_type(a.get("quant_type", "int"))  # the contract's quant_type -> the weight format
        out["quant_type"] = fmt.quant_type
        out["block_size"] = _block_size("block_size", a.get("block_size", 0), fmt)
        sb = a.get("shared_expert_weight_bits")
        out["shared_expert_weight_bits"] = None if sb is None else _as_int("shared_expert_weight_bits", sb, SUPPORTED_BITS)
        sbs = a.get("shared_block_size")
        out["shared_block_size"] = None if sbs is None else _block_size("shared_block_size", sbs, fmt)
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
        out.update(_routing(a))
        out.update(_activation_quant(a))
        attrs_obj = cls(**out)
        attrs_obj._check_combinations()
        return attrs_obj

    def _check_combinations(self):
        fmt = self.weight_format
        if fmt is not INT:  # a float format: its own code width, no zero point
            for n in ("expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits",
                      "shared_expert_weight_bits"):  # the shared experts have the routed format
                v = getattr(self, n)
                if v is not None and v not in fmt.bits:
                    raise QMoEAttributeError(n, f"{fmt.bits[0]} with quant_type='{self.quant_type}' ({fmt.summary})",
                                             str(v))
            if self.zero_point_offset is not None:
                raise QMoEAttributeError("zero_point_offset", f"unset with quant_type='{self.quant_type}' "
                                         f"({fmt.summary}: no zero point)", str(self.zero_point_offset))
        if self.use_sparse_mixer and self.k != 2:
            raise QMoEAttributeError("k", "2 when use_sparse_mixer=1 (Phi-3.5-MoE sparse mixer)", str(self.k))
        if self.use_sparse_mixer:  # the sparse mixer has its own scores and weights
            for n, default in (("scoring_func", "softmax"), ("n_group", 0), ("routed_scaling_factor", 1.0)):
                v = getattr(self, n)
                if v != default and not (n == "n_group" and v == 1):
                    raise QMoEAttributeError(n, f"{default!r} with use_sparse_mixer=1 (the sparse mixer computes its "
                                             "own scores and weights)", repr(v))
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
                       shared_expert_weight_bits=None, shared_block_size=None, scoring_func="softmax", n_group=0,
                       topk_group=0, routed_scaling_factor=1.0)

    @property
    def grouped(self) -> bool:
        """Whether routing first keeps ``topk_group`` of ``n_group`` expert groups (n_group >= 2)."""
        return self.n_group > 1

    @property
    def groups_kept(self) -> int:
        """How many groups routing keeps (``topk_group``, 0 meaning all ``n_group``; 1 without groups)."""
        if not self.grouped:
            return 1
        return self.topk_group or self.n_group

    @property
    def default_routing(self) -> bool:
        """True for the contract's routing (softmax scores, no groups, scaling 1), the one the GPU routing
        kernel computes; False when any grouped sigmoid routing attribute [ext] is set otherwise."""
        return self.scoring_func == "softmax" and not self.grouped and self.routed_scaling_factor == 1.0

    def check_routed_experts(self, E: int) -> None:
        """Refuse ``k`` and the groups for a layer whose routing picks from E experts: ``k <= E``, E divisible
        by ``n_group``, and k no more than the experts of the ``topk_group`` groups kept."""
        if self.k > E:
            raise QMoEAttributeError("k", f"1 <= k <= E = {E}", str(self.k))
        if not self.grouped:
            return
        if E % self.n_group:
            raise QMoEAttributeError("n_group", f"a divisor of the E = {E} experts (groups of equal size)",
                                     str(self.n_group))
        kept = self.groups_kept * (E // self.n_group)
        if self.k > kept:
            raise QMoEAttributeError("k", f"at most the {kept} experts of the {self.groups_kept} groups kept "
                                     f"(topk_group {self.groups_kept} x E/n_group = {E // self.n_group})", str(self.k))

    @property
    def weight_format(self) -> WeightFormat:
        """The weight format of the experts (:func:`qmoe_rtc.formats.format_of_quant_type` of ``quant_type``)."""
        return format_of_quant_type(self.quant_type)

    @property
    def is_glu(self) -> bool:
        return self.activation_type in GLU_ACTIVATIONS
