"""What the expert families (gemv, gemm, mma_decode, mma_prefill) share: the layout fields that shape
their code, the layout -> template-argument mapping, the expert-tensor argument specs, and the limits
of the tensor-core engines."""

from __future__ import annotations

from ..jit import Ptr, Scalar, Struct
from ..specialize import CPP_ACT, CPP_GATE, CPP_TYPES, CPP_ZP, ModelConfig, ModuleSpec
from ..tiled.transform import fc1_fusion
from .arch import FP8_MIN_CC

#: Layout fields that shape the expert kernels. A projection's format and zero-point mode reach the code as one
#: decode trait (Layout.decode_trait), the module spec's ``fcN_zp`` parameter: see :func:`expert_spec`.
EXPERT_FIELDS = ("dtype", "scale_dtype", "fc1_bits", "fc2_bits", "fc3_bits", "block_size", "fc1_zp", "fc2_zp",
                 "fc3_zp", "fc1_format", "fc2_format", "fc3_format", "activation", "swiglu_fusion", "has_fc3", "aligned")
#: The projections' format fields, which the spec folds into their ``fcN_zp`` decode traits.
_FORMAT_FIELDS = ("fc1_format", "fc2_format", "fc3_format")

# The argument structs of the expert kernels mirror cuda_src/core/args.cuh member by member (checked by
# tests/kernels/test_kernel_args.py). Values bind to the leaf names, so structs change no caller.

#: The activation's scalar attributes, as every FC1 kernel takes them (struct ActParams).
ACT_PARAMS_ARG = Struct("ap", "ActParams", (Scalar("alpha", "float32"), Scalar("beta", "float32"),
                                            Scalar("limit", "float32"), Scalar("limit_after", "int32")))
#: What the grouping step produces and the grouped GEMMs read (struct RouteGroups).
ROUTE_GROUPS_ARG = Struct("rg", "RouteGroups", (Ptr("sorted", "int32"), Ptr("offsets", "int32"),
                                                Ptr("tile_offsets", "int32")))


def expert_spec(family: str, config: ModelConfig, **extra) -> ModuleSpec:
    """The module spec of an expert family: every EXPERT_FIELDS value of the layout, but each projection's format
    and zero-point mode as one parameter ``fcN_zp`` holding their device decode trait (a key of ``CPP_ZP``: the
    ``Z1`` / ``Z2`` / ``Z3`` template argument; MXFP4 and NVFP4 share one, their block sizes differ), plus ``extra`` (the
    tensor-core families add ``tiled=True`` for a layer whose codes are tiled: :func:`tiled_spec`)."""
    layout = getattr(config, "layout", config)
    params = {f: getattr(layout, f) for f in EXPERT_FIELDS if f not in _FORMAT_FIELDS}
    params.update({f"{p}_zp": layout.decode_trait(p) if p in layout.projections else "none"
                   for p in ("fc1", "fc2", "fc3")})
    return ModuleSpec.make(family, **params, **extra)


def tiled_spec(config: ModelConfig) -> dict:
    """``{"tiled": True}`` when the layer's codes are in the tiled layout (:mod:`qmoe_rtc.tiled.transform`), else
    nothing: a contract-layout module keeps the key it had before the tiled layout existed."""
    return {"tiled": True} if getattr(config, "layout", config).tiled else {}


def tiled_meta(spec: ModuleSpec) -> bool:
    """Whether the module reads scales and zero points as tiled meta records (:func:`qmoe_rtc.tiled.transform.pack_meta`):
    tiled integer and FP4 codes (FP8's square scale blocks keep their contract layout)."""
    return bool(spec.get("tiled")) and "fp8" not in (spec["fc1_zp"], spec["fc2_zp"], spec["fc3_zp"])


def tiled_define(spec: ModuleSpec) -> tuple[str, ...]:
    """The compiler defines that make ``cuda_src/core/codes.cuh`` address the tiled layout and
    ``core/dequant.cuh`` the tiled meta records."""
    if not spec.get("tiled"):
        return ()
    return ("-DQMOE_TILED=1", "-DQMOE_TILED_META=1") if tiled_meta(spec) else ("-DQMOE_TILED=1",)


def tiled_unsupported(config: ModelConfig) -> str | None:
    """Why a SIMT family cannot run ``config``: it reads the contract layout, not tiled codes."""
    if getattr(config, "layout", config).tiled:
        return ("the layer's codes are prepacked in the tensor-core engines' tiled layout, which the SIMT "
                "engines do not read (QMoE(prepack=False) keeps the contract layout)")
    return None


def gate_of(spec: ModuleSpec) -> str:
    """Where the kernels find FC1's gate and linear rows (CPP_GATE). Tiled codes of ``swiglu_fusion=2`` are
    tiled in fusion 1's order (:func:`qmoe_rtc.tiled.transform.fc1_fusion`; its bias moved with them), so they
    compile as fusion 1, but for FP8 codes, which keep their rows."""
    fusion = spec["swiglu_fusion"]
    if fusion == 2 and spec.get("tiled") and fc1_fusion(2, spec["fc1_zp"] == "fp8"):
        fusion = 1  # tiled gate / linear rows interleaved, bias in fusion 1's order
    if fusion:
        return "fused1" if fusion == 1 else "fused2"
    return "fc3" if spec["has_fc3"] else "none"


def template_types(spec: ModuleSpec) -> dict[str, str]:
    """C++ template arguments by name: T, S, B1, Z1, B2, Z2, B3, Z3, BLOCK, ACT, GATE, ALIGNED."""
    fc3 = spec["has_fc3"]
    return {
        "T": CPP_TYPES[spec["dtype"]],
        "S": CPP_TYPES[spec["scale_dtype"]],
        "B1": str(spec["fc1_bits"]), "Z1": CPP_ZP[spec["fc1_zp"]],
        "B2": str(spec["fc2_bits"]), "Z2": CPP_ZP[spec["fc2_zp"]],
        # without FC3 its template slots repeat FC1's (never read), so no extra instantiation exists
        "B3": str(spec["fc3_bits"] if fc3 else spec["fc1_bits"]), "Z3": CPP_ZP[spec["fc3_zp"] if fc3 else spec["fc1_zp"]],
        "BLOCK": str(spec["block_size"]),
        "ACT": CPP_ACT[spec["activation"]],
        "GATE": CPP_GATE[gate_of(spec)],
        "ALIGNED": "true" if spec["aligned"] else "false",
    }


def proj_struct(p: str, scale_dtype: str, nullable: bool = False) -> Struct:
    """struct Proj of projection ``p`` ('fc1', 'shared_fc2' ...): w, scales, zp, bias."""
    return Struct(p, "Proj", (Ptr(f"{p}_w", "uint8", nullable), Ptr(f"{p}_scales", scale_dtype, nullable),
                              Ptr(f"{p}_zp", "uint8", nullable=True), Ptr(f"{p}_bias", "float32", nullable=True)))


def fc1_weights(scale_dtype: str) -> Struct:
    """struct Fc1Weights: fc1, fc3, E_routed, shared_fc1 (all NULL without shared experts), zp_offset."""
    return Struct("wt", "Fc1Weights", (proj_struct("fc1", scale_dtype), proj_struct("fc3", scale_dtype),
                                       Scalar("E_routed", "int32"), proj_struct("shared_fc1", scale_dtype, True),
                                       Scalar("zp_offset", "float32")))


def fc2_weights(scale_dtype: str) -> Struct:
    """struct Fc2Weights: fc2, E_routed, shared_fc2 (all NULL without shared experts), zp_offset."""
    return Struct("wt", "Fc2Weights", (proj_struct("fc2", scale_dtype), Scalar("E_routed", "int32"),
                                       proj_struct("shared_fc2", scale_dtype, True), Scalar("zp_offset", "float32")))


def meta_words(bits: int, scale_bytes: int, block_size: int, zp_packed: bool, tiled_meta: bool = False) -> int:
    """4-byte meta words a tensor-core lane stages per row segment of 32 codes (core/lane_meta.cuh
    MetaLayout::kWords). Contract layout: the scale word(s) — two float32 scales when the segment spans
    two blocks of 16 — then the zero-point word(s) when packed, two for 3-bit codes (a 3-bit zero point
    may straddle two words). Tiled meta: one record per scale block the segment spans
    (:func:`qmoe_rtc.tiled.transform.meta_record_bytes`)."""
    if tiled_meta:
        from ..tiled.transform import meta_record_bytes

        return (2 if block_size == 16 else 1) * meta_record_bytes(scale_bytes, zp_packed) // 4
    scale = 2 if block_size == 16 and scale_bytes == 4 else 1
    return scale + ((2 if bits == 3 else 1) if zp_packed else 0)


def tensor_core_unsupported(config: ModelConfig, problem=None) -> str | None:
    """Why the tensor-core engines (mma_decode, mma_prefill, wgmma_prefill) cannot run ``config`` (None: they
    can). With a ``problem`` whose ``arch`` is known, FP8 weights also need sm_89+ (an unknown arch, as in
    module listing, is assumed to have it)."""
    layout = getattr(config, "layout", config)
    if layout.dtype not in ("float16", "bfloat16"):
        return (f"{layout.dtype} activations (the tensor-core engines compute in float16/bfloat16; TF32, with its "
                "10-bit mantissa, would miss the float32 tolerance of 1e-5)")
    bits = [layout.bits(p) for p in layout.projections]
    if layout.has_fc3 and layout.fc3_bits != layout.fc1_bits:
        return "FC3 bit width differs from FC1's"
    if "offset" in [layout.zp(p) for p in layout.projections]:
        return "a zero_point_offset (not exact in float16/bfloat16)"
    if layout.block_size == 16 and 1 in bits:
        return "1-bit weights with block_size 16"
    if not layout.aligned:
        hidden, inter = getattr(config, "hidden", "?"), getattr(config, "inter", "?")
        return f"hidden_size {hidden} / inter_size {inter} not multiples of 32"
    if "fp8" in [layout.decode_trait(p) for p in layout.projections] and problem is not None and not problem.device.fp8_mma:
        return (f"FP8 (e4m3fn) weights need sm_{FP8_MIN_CC}+ for the tensor-core engines' e4m3 conversion "
                f"(this device: {problem.arch}); the SIMT engines decode them in software")
    return None
