"""Compile-only (NVRTC, no GPU): every executor module family instantiates for a representative set of
layouts — every bit width, mixed widths, all zero-point modes, block sizes, dtypes, activations and
gate sources — for sm_80 and sm_90. A template that stops compiling for some layout fails here, in CI."""

from __future__ import annotations

import dataclasses

import pytest

from qmoe_rtc.errors import CompileError
from qmoe_rtc.jit import get_cubins
from qmoe_rtc.kernels import get_family, modules_for, spec_unit
from qmoe_rtc.kernels._expert import tensor_core_unsupported
from qmoe_rtc.specialize import Layout, ModelConfig

from support.kernel_signatures import mismatches
from support.side_by_side import compile_specs


def unsupported_reason(layout, hidden=256, inter=128):
    return tensor_core_unsupported(ModelConfig(hidden=hidden, inter=inter, experts=8, k=2, layout=layout))

L = Layout
LAYOUTS = [
    # (layout, hidden, inter)
    (L(dtype="float16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1), 2048, 768),
    (L(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=32, activation="swiglu", swiglu_fusion=2,
       fc1_zp="packed", fc2_zp="packed"), 2880, 2880),
    (L(dtype="float32", fc1_bits=8, fc2_bits=8, block_size=0, activation="relu"), 256, 128),
    (L(dtype="float16", scale_dtype="float32", fc1_bits=3, fc2_bits=3, block_size=16, activation="geglu",
       swiglu_fusion=1, fc1_zp="offset", fc2_zp="offset"), 256, 128),
    (L(dtype="bfloat16", fc1_bits=2, fc2_bits=1, fc3_bits=3, has_fc3=True, block_size=64, activation="silu",
       fc1_zp="packed", fc3_zp="offset"), 512, 256),
    (L(dtype="float16", fc1_bits=1, fc2_bits=2, fc3_bits=8, has_fc3=True, block_size=0, activation="swiglu",
       fc3_zp="packed"), 256, 128),
    (L(dtype="float32", fc1_bits=3, fc2_bits=4, block_size=0, activation="relu2"), 100, 36),  # K % 32 != 0
    (L(dtype="bfloat16", fc1_bits=4, fc2_bits=2, block_size=16, activation="gelu"), 128, 64),
    (L(dtype="float16", fc1_bits=8, fc2_bits=3, block_size=128, activation="identity", fc2_zp="packed"), 256, 256),
    (L(dtype="bfloat16", fc1_bits=8, fc2_bits=1, fc3_bits=8, has_fc3=True, block_size=32, activation="gelu",
       fc1_zp="packed"), 256, 128),
    (L(dtype="float16", fc1_bits=2, fc2_bits=8, block_size=16, activation="relu", fc2_zp="packed"), 256, 96),
    # 3-bit on the tensor-core engines (no packed zero points): scale per chunk, blocks of 16, row-wise + FC3
    (L(dtype="float16", fc1_bits=3, fc2_bits=3, block_size=128, activation="swiglu", swiglu_fusion=1), 512, 256),
    (L(dtype="bfloat16", scale_dtype="float32", fc1_bits=3, fc2_bits=3, block_size=16, activation="swiglu",
       swiglu_fusion=2), 256, 128),
    (L(dtype="bfloat16", fc1_bits=3, fc2_bits=4, fc3_bits=3, has_fc3=True, block_size=0, activation="silu"), 256, 128),
    # 3-bit packed zero points (two staged words: a zero point may straddle them): blocks of 16, row-wise + FC3
    (L(dtype="float16", fc1_bits=3, fc2_bits=3, block_size=16, activation="swiglu", swiglu_fusion=1,
       fc1_zp="packed", fc2_zp="packed"), 256, 128),
    (L(dtype="bfloat16", fc1_bits=3, fc2_bits=3, fc3_bits=3, has_fc3=True, block_size=0, activation="silu",
       fc3_zp="packed", fc2_zp="packed"), 512, 256),
]


def test_mma_eligibility():
    """Which layouts the tensor-core decode kernels take, and the reason given for the others."""
    ok = L(dtype="float16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)
    assert unsupported_reason(ok, 2048, 768) is None
    assert unsupported_reason(L(dtype="bfloat16", fc1_bits=8, fc2_bits=1, block_size=0, activation="relu")) is None
    assert unsupported_reason(L(dtype="bfloat16", fc1_bits=2, fc2_bits=1, block_size=32, activation="relu")) is None
    assert unsupported_reason(L(dtype="float16", fc1_bits=3, fc2_bits=4, block_size=16, activation="relu")) is None
    assert unsupported_reason(L(dtype="float16", fc1_bits=3, fc2_bits=4, fc1_zp="packed", activation="relu")) is None
    cases = [
        (L(dtype="float32", fc1_bits=4, fc2_bits=4, activation="relu"), "float32"),
        (L(dtype="float16", fc1_bits=4, fc2_bits=4, fc3_bits=8, has_fc3=True, activation="silu"), "FC3"),
        (L(dtype="float16", fc1_bits=4, fc2_bits=4, fc1_zp="offset", activation="relu"), "zero_point_offset"),
        (L(dtype="bfloat16", fc1_bits=1, fc2_bits=4, block_size=16, activation="relu"), "block_size 16"),
    ]
    for layout, word in cases:
        assert word in unsupported_reason(layout, 256, 128), layout
    assert "multiples of 32" in unsupported_reason(L(dtype="float16", fc1_bits=4, fc2_bits=4, activation="relu"), 100, 64)


EXPECTED_KERNELS = {
    "route": {"topk_float32_warp", "topk_float32_rw_float32_warp"},  # 8 experts: the warp-per-row module
    "gemv": {"fc1", "fc2"},
    "gemm": {"group", "fc1_br16", "fc2_br16", "fc1_br64", "fc2_br64", "combine"},
    "mma_decode": {f"fc{i}_br{n}" for i in (1, 2) for n in (8, 16, 32)},
    "mma_batched": {"group", "combine"} | {f"fc{i}_br{n}" for i in (1, 2) for n in (8, 16, 32)},
    "mma_prefill": {"group", "combine"} | {f"fc{i}_br{n}" for i in (1, 2) for n in (16, 32, 64)},
    "wgmma_prefill": {"group", "permute", "combine"} | {f"fc{i}_br{n}" for i in (1, 2) for n in (64, 128)},  # 4 warpgroups
}
EXECUTOR_FAMILIES = tuple(EXPECTED_KERNELS)


#: the decode module's x-ring pair (layers of 3 bits or more, tuning knob mma_x_ring on)
X_RING_KERNELS = {"fc1_br8_xr", "fc2_br8_xr"}


def expected_kernels(spec) -> set:
    return EXPECTED_KERNELS[spec.family] | (X_RING_KERNELS if spec.get("x_ring") else set())


#: The LAYOUTS compiled for sm_80 too (CI time): the families it builds there (route, gemv, gemm, mma_decode,
#: mma_prefill) are the sm_90 ones bar the PDL / FP8 guards, so a subset suffices that still gives every family
#: each dtype, scale dtype, block size, bit width, zero-point mode, (bits, zero point) pair, FC3 or not and
#: aligned or not that the whole list gives it there (test_sm80_layouts_cover_every_family_feature).
SM80 = (0, 1, 4, 6, 9, 10, 12, 15)
CASES = [(arch, *LAYOUTS[i]) for i in range(len(LAYOUTS)) for arch in ("sm_80", "sm_90") if arch == "sm_90" or i in SM80]


def family_features(layout, hidden, inter) -> set:
    """(family, feature, value) of the executor families compiled for sm_80 on ``layout``."""
    tc = unsupported_reason(layout, hidden, inter) is None
    out = {("route", "dtype", layout.dtype)}
    for fam in ("gemv", "gemm") + (("mma_decode", "mma_prefill") if tc else ()):
        out |= {(fam, "dtype", layout.dtype), (fam, "scale", layout.scale_dtype or layout.dtype),
                (fam, "block", layout.block_size), (fam, "fc3", layout.has_fc3),
                (fam, "aligned", hidden % 32 == 0 and inter % 32 == 0)}
        for p in layout.projections:
            out |= {(fam, "bits", layout.bits(p)), (fam, "zp", layout.zp(p)), (fam, "bits+zp", layout.bits(p), layout.zp(p))}
    return out


def test_sm80_layouts_cover_every_family_feature():
    """Dropping a layout's sm_80 compile loses no family's dtype, block size, bit width or zero-point mode there."""
    everything = set().union(*(family_features(*case) for case in LAYOUTS))
    kept = set().union(*(family_features(*LAYOUTS[i]) for i in SM80))
    assert kept == everything, sorted(everything - kept, key=str)
    assert {"mma_decode", "mma_prefill", "gemv", "gemm", "route"} <= {f for f, *_ in kept}


@pytest.mark.parametrize("arch,layout,hidden,inter", CASES, ids=[f"{l.name}-H{h}-I{i}-{a}" for a, l, h, i in CASES])
def test_executor_modules_compile(cache, arch, layout, hidden, inter):
    """Every family that supports the layout compiles (the SIMT ones too: they are the fallbacks), and each
    kernel's argument specs match its C++ parameters in order (tests/support/kernel_signatures.py). The
    batched-decode engine is listed but not compiled here: its kernels are the decode engine's weight
    stream (compiled for every layout) over grouped routes, and tests/kernels/test_register_budget.py compiles
    it for three presets (CI time is short)."""
    cfg = ModelConfig(hidden=hidden, inter=inter, experts=8, k=2, layout=layout)
    tc = unsupported_reason(layout, hidden, inter) is None
    tc_fams = {"mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill"}  # wgmma: sm_90a only (else: traps)
    not_hopper = tc_fams - {"wgmma_prefill"}
    assert {s.family for s in modules_for(cfg)} == {"route"} | (tc_fams if tc else {"gemv", "gemm"})
    assert {s.family for s in modules_for(cfg, arch="sm_80")} == {"route"} | (not_hopper if tc else {"gemv", "gemm"})
    specs = [s for f in EXECUTOR_FAMILIES if get_family(f).supports(cfg) is None for s in get_family(f).specs(cfg)]
    assert not tc or "mma_batched" in {s.family for s in specs}
    specs = [s for s in specs if s.family != "mma_batched" and (arch == "sm_90" or s.family != "wgmma_prefill")]
    tc_here = (tc_fams if arch == "sm_90" else not_hopper) - {"mma_batched"}
    assert {s.family for s in specs} == {"route", "gemv", "gemm"} | (tc_here if tc else set())
    for spec, mod in zip(specs, compile_specs((spec, arch) for spec in specs)):  # side by side (CI time)
        assert all(c[:4] == b"\x7fELF" for c in mod.cubins), spec.name  # SASS cubins, never PTX
        assert set(mod.lowered) >= expected_kernels(spec), (spec.name, sorted(mod.lowered))
        assert all(name.startswith("_Z") for name in mod.lowered.values()), mod.lowered
        for kernel in get_family(spec.family).kernels(spec):  # the specs in the kernel's parameter order
            assert not mismatches(kernel, mod.lowered[kernel.key]), mismatches(kernel, mod.lowered[kernel.key])


#: the compiler defines of a module whose integer codes are tiled, with or without the tiled meta records
TILED_META_DEFINES = {False: (), True: ("-DQMOE_TILED=1", "-DQMOE_TILED_META=1")}


#: What the ring headers need from a generated unit, for units that only test sizes (the kernels' checks, not theirs).
RING_UNIT = ("#define QMOE_MMA_BLOCKS {8, 5}, {16, 4}, {32, 3}\n#define QMOE_MMA_FC1_RING 0\n#define QMOE_MMA_FC2_RING 0\n"
             "#define QMOE_MMA_X_RING_BLOCKS 4\n#define QMOE_MMA_FC1_X_LANE 0\n#define QMOE_MMA_FC2_X_LANE 0\n"
             "#define QMOE_SELF_ROUTE_MAX_ROUTES 64\n")


@pytest.mark.parametrize("tiled_meta", [False, True])
def test_mma_ring_sizes_pass_the_device_checks(tiled_meta):
    """The sizes the host launches the ring engines with pass the device's checks for every bit width, scale size,
    block kind, zp mode and row tiles per warp, with the contract's meta words and the tiled meta records: the
    four rings (kernels/mma_decode.py ring_bytes, which a module's unit hands its kernels: their static_assert
    calls mma_ring_is, called here), a route lane's x ring (x_lane_bytes) and the launch (decode_smem_bytes, with
    and without x rings, against mma_smem_bytes, which a smaller launch traps on)."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.kernels.mma_decode import decode_smem_bytes, ring_bytes, x_lane_bytes, x_ring_bytes

    lines = [RING_UNIT + '#include "engines/mma_decode.cuh"']
    for bits in (1, 2, 3, 4, 8):
        for scale_t, sbytes in (("__half", 2), ("float", 4)):
            for block in (0, 16, 32, 128):
                for zp in (False, True):
                    for rt in (1, 2):  # row tiles per warp (the batched engine's two on tiled codes)
                        stage = f"qmoe::MmaStage<{bits}, {scale_t}, {block}, {'true' if zp else 'false'}, {rt}>"
                        lines.append(f"static_assert(qmoe::mma_ring_is<{stage}, 8>("
                                     f"{ring_bytes(bits, sbytes, block, zp, 5, rt, tiled_meta)}), "
                                     f"\"ring_bytes({bits}, {sbytes}, {block}, {zp}, 5, {rt})\");")
                    lines.append(f"static_assert(qmoe::MmaXRing<qmoe::MmaStage<{bits}, {scale_t}, {block}, "
                                 f"{'true' if zp else 'false'}>>::kLaneBytes == {x_lane_bytes(bits, 5)}, \"x lane\");")
                    want = ring_bytes(bits, sbytes, block, zp, 5, tiled_meta=tiled_meta)
                    stage = f"qmoe::MmaStage<{bits}, {scale_t}, {block}, {'true' if zp else 'false'}>"
                    for R in (1, 3, 64, 512):
                        lines.append(f"static_assert(qmoe::mma_smem_bytes<{stage}>({R}) == {decode_smem_bytes(want, R)},"
                                     f" \"decode_smem_bytes({bits}, {sbytes}, {block}, {zp}, R {R})\");")
                        for xs in (1, 3, 8):  # with the x rings of xs route lanes (engines/x_ring.cuh)
                            have = decode_smem_bytes(want, R, x_ring_bytes(bits, 5, xs))
                            lines.append(f"static_assert(qmoe::mma_smem_bytes<{stage}>({R}, {xs}) == {have},"
                                         f" \"decode_smem_bytes({bits}, {sbytes}, {block}, {zp}, R {R}, xs {xs})\");")
    options = compiler.base_options("sm_90", ("-DQMOE_MMA_STAGES=5", *TILED_META_DEFINES[tiled_meta]))
    compiler.compile_unit("ring_bytes_check", "\n".join(lines) + "\n", {}, "sm_90", options)


def test_signature_check_catches_a_slip():
    """tests/support/kernel_signatures.py on a tiny kernel: its specs pass; a swapped pair, a wrong dtype and a
    missing argument are each named."""
    from qmoe_rtc.jit import KernelDef, Ptr, Scalar, compiler

    src = "template <typename T> __global__ void k(const T* x, int n, __half* y, long long m) {}\n"
    _, lowered, _ = compiler.compile_unit("sig_check", '#include <cuda_fp16.h>\n' + src, {"k": "k<float>"}, "sm_90",
                                         compiler.base_options("sm_90", ()))
    good = (Ptr("x", "float32"), Scalar("n", "int32"), Ptr("y", "float16"), Scalar("m", "int64"))
    assert mismatches(KernelDef("k", "k<float>", good), lowered["k"]) == []
    swapped = (good[1], good[0], *good[2:])
    assert [m.split(":")[0] for m in mismatches(KernelDef("k", "k<float>", swapped), lowered["k"])] == [
        "k argument 0 'n'", "k argument 1 'x'"]
    wrong = (good[0], good[1], Ptr("y", "bfloat16"), good[3])
    assert "'y': spec Ptr(bfloat16), parameter '__half*'" in " ".join(mismatches(KernelDef("k", "k<float>", wrong),
                                                                               lowered["k"]))
    assert "3 argument specs, 4 parameters" in mismatches(KernelDef("k", "k<float>", good[:3]), lowered["k"])[0]


def test_batched_kernel_specs_match_their_parameters(cache):
    """The batched-decode engine's kernels (not compiled by test_executor_modules_compile): argument specs
    in the C++ parameters' order and types, for a tiled float16 layer with zero points (the arguments do
    not depend on the layout)."""
    from qmoe_rtc.specialize.presets import PRESETS

    cfg = PRESETS["qwen3-30b-a3b"].config(dtype="float16", bits=4, zero_points="packed")
    cfg = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, tiled=True))
    fam = get_family("mma_batched")
    spec = fam.spec(cfg)
    (mod,) = compile_specs([(spec, "sm_90")])
    for kernel in fam.kernels(spec):
        assert not mismatches(kernel, mod.lowered[kernel.key]), mismatches(kernel, mod.lowered[kernel.key])


def test_meta_record_bytes_match_the_device():
    """prepack.meta_record_bytes (the records pack_meta writes) equals QuantParams::kMetaBytes (the stride the
    device addresses them with) for every scale size and zero-point mode of integer codes."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.tiled.transform import meta_record_bytes

    lines = ['#include "core/dequant.cuh"']
    for scale_t, sbytes in (("__half", 2), ("__nv_bfloat16", 2), ("float", 4)):
        for zp, mode in ((False, "qmoe::ZP_NONE"), (True, "qmoe::ZP_PACKED")):
            for bits in (1, 3, 4, 8):
                lines.append(f"static_assert(qmoe::QuantParams<{scale_t}, {bits}, 128, {mode}>::kMetaBytes == "
                             f"{meta_record_bytes(sbytes, zp)}, \"meta_record_bytes({sbytes}, {zp})\");")
    options = compiler.base_options("sm_90", TILED_META_DEFINES[True])
    compiler.compile_unit("meta_record_check", "\n".join(lines) + "\n", {}, "sm_90", options)


@pytest.mark.parametrize("tiled_meta", [False, True])
def test_prefill_stage_sizes_pass_the_device_checks(tiled_meta):
    """kernels/mma_prefill.py stage_bytes, which a module's unit hands its kernels to check their PfStage layout
    against (pf_check_smem), is that layout's size for every bit width, scale size, block kind, zp mode and route
    tile, contract meta words or tiled meta records (the kernel traps on a smaller dynamic shared memory)."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.kernels.mma_prefill import TILE_ROUTES, stage_bytes

    lines = ['#define QMOE_PF_STAGE_BYTES {0, 0, 0}\n#define QMOE_PF_STAGES 3\n#define QMOE_PF_MIN_BLOCKS 1\n'
             '#include "engines/mma_prefill.cuh"']
    for bits in (1, 2, 3, 4, 8):
        for scale_t, sbytes in (("__half", 2), ("float", 4)):
            for block in (0, 16, 32, 128):
                for zp in (False, True):
                    for br in TILE_ROUTES:
                        want = stage_bytes(bits, sbytes, block, zp, br, 8, tiled_meta)
                        lines.append(f"static_assert(qmoe::PfStage<{bits}, {scale_t}, {block}, "
                                     f"{'true' if zp else 'false'}, {br}>::kBytes == {want}, "
                                     f"\"stage_bytes({bits}, {sbytes}, {block}, {zp}, {br})\");")
    options = compiler.base_options("sm_90", ("-DQMOE_PF_WARPS=8", *TILED_META_DEFINES[tiled_meta]))
    compiler.compile_unit("stage_bytes_check", "\n".join(lines) + "\n", {}, "sm_90", options)


def _wg_unit(rings, bounds: str = "{32, 2}") -> str:
    """A unit that hands the wgmma header these rings (kernels/wgmma_geometry.py WgRing) and instantiates each
    ring's stage (its static_asserts run), checking that the device reads the host's counts."""
    from qmoe_rtc.kernels.wgmma_geometry import CHUNK

    lines = ["#define QMOE_WG_RINGS " + ", ".join(r.row() for r in rings), f"#define QMOE_WG_FC1_BOUNDS {bounds}",
             '#include "engines/wgmma_prefill.cuh"']
    assert CHUNK == 128  # the stage holds one chunk of K
    for r in rings:
        t = (f"qmoe::WgStage<{r.bits}, {'float' if r.scale_bytes == 4 else '__half'}, {r.block_size}, "
             f"{'true' if r.zpw else 'false'}, {r.br}>")
        lines += [f"template struct {t};",
                  f"static_assert({t}::kStages == {r.stages} && {t}::kGroups == {r.groups} && "
                  f"{t}::kMinBlocks == {r.blocks} && {t}::kBytes == {r.stage_bytes}, \"{r}\");"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("tiled_meta", [False, True])
@pytest.mark.parametrize("groups", [0, 2, 4])
def test_wgmma_host_rings_pass_the_device_checks(groups, tiled_meta):
    """The host's ring (kernels/wgmma_geometry.py ring: stages, warpgroups, blocks an SM, stage bytes) of every bit
    width, scale size, block kind, zp mode and route tile, with the warpgroups forced (2, 4) or the host's
    (0: tile_groups), is what WgStage reads, and passes its checks: the stage layout gives the host's bytes, the
    ring fits the budget (checked by static_asserts compiled with NVRTC)."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.kernels.wgmma_geometry import ring, route_tiles_of, smem_defines

    rings = [ring(bits, sbytes, block, zp, br, tiled_meta, 4, groups)
             for bits in (1, 2, 3, 4, 8) for sbytes in (2, 4) for block in (0, 16, 32, 128) for zp in (False, True)
             for br in route_tiles_of(groups or None)]
    assert {r.groups for r in rings} == ({2, 4} if not groups else {groups})
    assert {r.blocks for r in rings} == ({1} if groups == 4 else {1, 2})
    options = compiler.base_options("sm_90", ("-DQMOE_WG_STAGES=4", *smem_defines(), *TILED_META_DEFINES[tiled_meta]))
    compiler.compile_unit("wg_rings_check", _wg_unit(rings), {}, "sm_90", options)


def test_wgmma_device_refuses_a_ring_it_cannot_hold():
    """A ring whose stage bytes differ from the device's layout, one past the budget, and a stage the unit lists no
    ring for: each fails to compile, naming what is wrong."""
    import dataclasses as dc

    from qmoe_rtc.jit import compiler
    from qmoe_rtc.kernels.wgmma_geometry import SMEM_BUDGET, ring, smem_defines

    good = ring(4, 2, 128, False, 64)
    options = compiler.base_options("sm_90", ("-DQMOE_WG_STAGES=6", *smem_defines()))
    compiler.compile_unit("wg_ring_ok", _wg_unit([good]), {}, "sm_90", options)
    too_deep = dc.replace(good, stages=SMEM_BUDGET // good.stage_bytes + 1)
    for bad, says in ((dc.replace(good, stage_bytes=good.stage_bytes + 1024), "stage bytes"),
                      (too_deep, "budget"), (dc.replace(good, groups=3), "lists no stage")):
        with pytest.raises(CompileError, match=says):
            compiler.compile_unit("wg_ring_bad", _wg_unit([bad]), {}, "sm_90", options)
    unlisted = _wg_unit([good]).replace("template struct qmoe::WgStage<4, __half, 128, false, 64>;",
                                        "template struct qmoe::WgStage<4, __half, 128, false, 32>;")
    with pytest.raises(CompileError, match="lists no stage"):
        compiler.compile_unit("wg_ring_missing", unlisted, {}, "sm_90", options)


def test_expert_flow_decode_module_compiles(cache):
    """The tuning knob mma_expert_flow's decode module (per-expert FC1 counters, FC2 waiting on them) compiles
    for sm_90 (where launches overlap) and sm_80 (where they do not: the counters are then full when FC2
    starts), with every kernel."""
    from qmoe_rtc.settings import knobs

    cfg = ModelConfig(hidden=2048, inter=768, experts=8, k=2, layout=LAYOUTS[0][0])
    with knobs.scope(mma_expert_flow=True):
        spec = get_family("mma_decode").spec(cfg)
    assert spec["expert_flow"] is True
    for arch in ("sm_90", "sm_80"):
        mods = get_cubins(spec_unit(spec), arch)
        assert {key for mod in mods for key in mod.lowered} == expected_kernels(spec), [m.lowered for m in mods]


def test_cubins_are_reproducible():
    """The same unit compiled twice (no cache) gives the same cubin bytes, a tensor-core module and the
    routing one: what lets a refactor of the device code be checked on the CPU (byte-identical cubins).
    Namespace-scope constants with internal linkage broke this (test_code_health.py). Byte identity holds
    with ptxas alone splitting the work (tuning knob ``split_compile=ptxas``: compare refactors with it); with
    the default 'all' the NVVM partitions may order the symbols and global data differently from one
    compile to the next, and each kernel's machine code (its .text section) is still the same."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.settings import knobs

    from support.cubin_sections import text_sections
    from support.side_by_side import in_threads

    cfg = ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=LAYOUTS[0][0])
    units = [spec_unit(get_family(f).spec(cfg)) for f in ("mma_decode", "route")]

    for mode in ("ptxas", "all"):
        with knobs.scope(split_compile=mode):
            options = {u.name: compiler.base_options("sm_90", u.defines) for u in units}

        def build(unit, options=options):
            return compiler.compile_unit(unit.name, unit.source, unit.name_exprs(), "sm_90", options[unit.name])[0]

        mods = in_threads(build, units * 2)  # each unit twice, side by side
        for unit, a, b in zip(units, mods[:2], mods[2:]):
            if mode == "ptxas":
                assert a == b, f"{unit.name}: two compiles differ ({len(a)} / {len(b)} bytes)"
            else:
                assert text_sections(a) == text_sections(b) != {}, f"{unit.name}: two compiles' machine code differs"
