"""What the executor's kernel families share: the layout → template-argument mapping, and the
expert-tensor argument specs (one projection = packed weights, scales, zero points, bias)."""

from __future__ import annotations

from typing import Any

from ..errors import QMoEAttributeError
from ..jit.family import CPP_TYPES, Ptr
from ..specialize import ModuleSpec

ZP_ENUM = {"none": "qmoe::ZP_NONE", "packed": "qmoe::ZP_PACKED", "offset": "qmoe::ZP_OFFSET"}
ACT_ENUM = {"relu": "qmoe::ACT_RELU", "gelu": "qmoe::ACT_GELU", "silu": "qmoe::ACT_SILU",
            "identity": "qmoe::ACT_IDENTITY", "relu2": "qmoe::ACT_RELU2", "swiglu": "qmoe::ACT_SWIGLU",
            "geglu": "qmoe::ACT_GEGLU"}

#: Layout fields that shape the expert kernels (GEMV and GEMM families).
EXPERT_FIELDS = ("dtype", "scale_dtype", "fc1_bits", "fc2_bits", "fc3_bits", "block_size", "fc1_zp", "fc2_zp",
                 "fc3_zp", "activation", "swiglu_fusion", "has_fc3")


def expert_spec(family: str, config: Any) -> ModuleSpec:
    """The module spec of an expert family for a ModelConfig (or a bare Layout).

    ``aligned`` (H % 32 == 0 and I % 32 == 0: every packed row is whole 32-code chunks, so with
    16-byte aligned tensors the kernels use 16-byte loads) comes from the config's shapes. A bare
    Layout has no shapes and is taken as aligned (the executor and the warm tool pass a ModelConfig).
    """
    layout = getattr(config, "layout", config)
    hidden = getattr(config, "hidden", None)
    inter = getattr(config, "inter", None)
    aligned = True if hidden is None else (hidden % 32 == 0 and inter % 32 == 0)
    return ModuleSpec.make(family, aligned=bool(aligned), **{f: getattr(layout, f) for f in EXPERT_FIELDS})


def gate_mode(spec: ModuleSpec) -> str:
    if spec["swiglu_fusion"] == 1:
        return "qmoe::GATE_FUSED1"
    if spec["swiglu_fusion"] == 2:
        return "qmoe::GATE_FUSED2"
    if spec["has_fc3"]:
        return "qmoe::GATE_FC3"
    return "qmoe::GATE_NONE"


def template_types(spec: ModuleSpec) -> dict[str, str]:
    """C++ template arguments by name: T, S, B1, Z1, B2, Z2, B3, Z3, BLOCK, ACT, GATE, ALIGNED."""
    if spec["activation"] not in ACT_ENUM:
        raise QMoEAttributeError("activation", f"one of {list(ACT_ENUM)}", repr(spec["activation"]))
    fc3 = spec["has_fc3"]
    return {
        "T": CPP_TYPES[spec["dtype"]],
        "S": CPP_TYPES[spec["scale_dtype"]],
        "B1": str(spec["fc1_bits"]), "Z1": ZP_ENUM[spec["fc1_zp"]],
        "B2": str(spec["fc2_bits"]), "Z2": ZP_ENUM[spec["fc2_zp"]],
        # without FC3 its template slots repeat FC1's (never read), so no extra instantiation exists
        "B3": str(spec["fc3_bits"] if fc3 else spec["fc1_bits"]), "Z3": ZP_ENUM[spec["fc3_zp"] if fc3 else spec["fc1_zp"]],
        "BLOCK": str(spec["block_size"]),
        "ACT": ACT_ENUM[spec["activation"]],
        "GATE": gate_mode(spec),
        "ALIGNED": "true" if spec["aligned"] else "false",
    }


def projection_args(p: str, scale_dtype: str) -> tuple:
    """w [E, N, ceil(K·b/8)] u8, scales [E, N(, nb)], zero points (packed, nullable), bias [E, N] f32 (nullable)."""
    return (Ptr(f"{p}_w", "uint8"), Ptr(f"{p}_scales", scale_dtype), Ptr(f"{p}_zp", "uint8", nullable=True),
            Ptr(f"{p}_bias", "float32", nullable=True))
