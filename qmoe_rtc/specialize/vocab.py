"""The one vocabulary of the package: dtypes, bit widths, zero-point modes, device decode traits, activations,
gate sources, and their C++ spellings in the device templates. The contract, the layouts and the kernel
families all read these names from here; the weight formats and their zero points are the axis of
:mod:`qmoe_rtc.formats.axis`.
"""

from __future__ import annotations

from ..formats.axis import ZERO_POINT_MODES

__all__ = [
    "ACTIVATIONS",
    "BITS",
    "CPP_ACT",
    "CPP_GATE",
    "CPP_TYPES",
    "CPP_ZP",
    "DECODE_TRAITS",
    "DTYPES",
    "GATEABLE_ACTIVATIONS",
    "GATES",
    "GLU_ACTIVATIONS",
    "ZP_LETTERS",
    "ZP_MODES",
    "dtype_abbrev",
    "gate_source",
]

#: Activation (and scale) dtypes.
DTYPES = ("float32", "float16", "bfloat16")
#: Weight code widths the device templates take (every weight format's widths are among them).
BITS = (1, 2, 3, 4, 8)
#: Zero-point modes of a projection of integer codes: implicit 2^(b-1), a packed uint8 tensor, a float offset
#: [ext] (a float weight format takes 'none').
ZP_MODES = ZERO_POINT_MODES
#: Activations; the GLU ones need a gate and a linear half (fused FC1 rows or FC3).
ACTIVATIONS = ("relu", "gelu", "silu", "identity", "relu2", "swiglu", "geglu")
GLU_ACTIVATIONS = ("swiglu", "geglu")
#: Activations that become the gated ``act(fc1) · fc3`` when FC3 is given.
GATEABLE_ACTIVATIONS = ("silu", "gelu")
#: Where an FC1 output's gate and linear halves come from.
GATES = ("none", "fused1", "fused2", "fc3")

#: C++ spellings (cuda_src/core/types.cuh, dequant.cuh, epilogue/act.cuh).
CPP_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "uint8": "qmoe::u8",
             "int32": "qmoe::i32", "int64": "qmoe::i64", "uint32": "qmoe::u32"}
#: By device decode trait (the ZP template parameter): integer codes decode by their zero-point mode, 'fp8' is
#: float8 e4m3fn codes (w = e4m3(q)·s), 'fp4' e2m1 codes with float32 block scales (MXFP4 and NVFP4 alike). A
#: projection's format and zero points fold into one (qmoe_rtc.formats.axis.WeightFormat.decode_trait).
CPP_ZP = {"none": "qmoe::ZP_NONE", "packed": "qmoe::ZP_PACKED", "offset": "qmoe::ZP_OFFSET", "fp8": "qmoe::ZP_FP8",
          "fp4": "qmoe::ZP_FP4"}
#: The device decode traits.
DECODE_TRAITS = tuple(CPP_ZP)
#: A decode trait's letter in layout and module names (``fc1-b4-zpP``; module specs carry the trait as ``fcN_zp``).
ZP_LETTERS = {"none": "N", "packed": "P", "offset": "O", "fp8": "F", "fp4": "E"}
CPP_ACT = {"relu": "qmoe::ACT_RELU", "gelu": "qmoe::ACT_GELU", "silu": "qmoe::ACT_SILU",
           "identity": "qmoe::ACT_IDENTITY", "relu2": "qmoe::ACT_RELU2", "swiglu": "qmoe::ACT_SWIGLU",
           "geglu": "qmoe::ACT_GEGLU"}
CPP_GATE = {"none": "qmoe::GATE_NONE", "fused1": "qmoe::GATE_FUSED1", "fused2": "qmoe::GATE_FUSED2",
            "fc3": "qmoe::GATE_FC3"}

_DT_ABBREV = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def dtype_abbrev(dtype: str) -> str:
    return _DT_ABBREV[dtype]


def gate_source(activation: str, swiglu_fusion: int, has_fc3: bool) -> tuple[str | None, str]:
    """``(gate, "")`` for a valid combination, else ``(None, why)``: the one rule of which
    activation / swiglu_fusion / FC3 combinations exist (docs/contract.md, "What each route computes":
    where the gate and linear halves come from)."""
    glu = activation in GLU_ACTIVATIONS
    if swiglu_fusion not in (0, 1, 2):
        return None, f"swiglu_fusion {swiglu_fusion!r} is not 0, 1 or 2"
    if swiglu_fusion and not glu:
        return None, f"swiglu_fusion={swiglu_fusion} needs a GLU activation {GLU_ACTIVATIONS}, not {activation!r}"
    if swiglu_fusion and has_fc3:
        return None, f"FC3 with swiglu_fusion={swiglu_fusion} (gate and linear both come from FC1)"
    if swiglu_fusion:
        return ("fused1" if swiglu_fusion == 1 else "fused2"), ""
    if glu and not has_fc3:
        return None, f"{activation} with swiglu_fusion=0 takes its linear half from FC3, which is absent"
    if has_fc3 and not (glu or activation in GATEABLE_ACTIVATIONS):
        return None, f"FC3 with activation {activation!r} (only {GATEABLE_ACTIVATIONS + GLU_ACTIVATIONS} use FC3)"
    return ("fc3" if has_fc3 else "none"), ""
