"""FP8 (float8 e4m3fn) experts on the GPU engines, the CPU/compile tier: the layout (format 'fp8_e4m3',
decode trait 'fp8'), the layer's ModelConfig, which engine runs it on which device and why, the scales the upload
binds, and NVRTC compiles of every family that claims an FP8 layout (sm_80, sm_89, sm_90). The GPU
results are tests/formats/test_fp8_gpu.py."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from qmoe_rtc import errors
from qmoe_rtc.contract import QMoEAttributes, describe_layer
from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.kernels import Problem, choose, get_family, modules_for
from qmoe_rtc.kernels._expert import template_types, tensor_core_unsupported
from qmoe_rtc.runtime.layer import layer_config
from qmoe_rtc.runtime.tensors import layer_scale_dtype, upload_projections
from qmoe_rtc.specialize import CPP_ZP, ZP_MODES, Layout, ModelConfig

from support.side_by_side import compile_specs

L = Layout
FP8 = dict(fc1_bits=8, fc2_bits=8, fc1_format="fp8_e4m3", fc2_format="fp8_e4m3")
INT8 = dict(fc1_format="int", fc2_format="int")


def config(layout, hidden=256, inter=128, experts=8, k=2):
    return ModelConfig(hidden=hidden, inter=inter, experts=experts, k=k, layout=layout)


# ---- the layout ---------------------------------------------------------------------------------------

def test_fp8_is_a_format_of_8_bit_projections_with_its_own_decode_trait():
    assert "fp8" not in ZP_MODES and CPP_ZP["fp8"] == "qmoe::ZP_FP8"
    lay = L(dtype="float16", scale_dtype="float32", activation="swiglu", swiglu_fusion=1, **FP8)
    assert lay.decode_trait("fc1") == lay.decode_trait("fc2") == "fp8" and lay.fc1_zp == "none"
    int8 = dataclasses.replace(lay, **INT8)
    assert lay != int8 and lay.digest != int8.digest
    assert "fc1-b8-zpF" in lay.name and "fc2-b8-zpF" in lay.name and lay.name != int8.name
    for fam in ("gemv", "gemm", "mma_decode", "mma_prefill", "wgmma_prefill"):
        a, b = get_family(fam).spec(config(lay)), get_family(fam).spec(config(int8))
        assert a != b and a.name != b.name and a.digest != b.digest, fam
    assert template_types(get_family("gemv").spec(config(lay)))["Z1"] == "qmoe::ZP_FP8"
    with pytest.raises(errors.QMoEAttributeError) as ei:
        L(dtype="float16", fc1_bits=4, fc1_format="fp8_e4m3")
    assert ei.value.name == "fc1_bits"
    with pytest.raises(errors.QMoEAttributeError) as ei:  # e4m3fn has no zero point
        L(dtype="float16", fc1_bits=8, fc1_format="fp8_e4m3", fc1_zp="packed")
    assert ei.value.name == "fc1_zp"


def test_fp8_square_blocks_may_be_partial_integer_blocks_may_not():
    lay = L(dtype="bfloat16", block_size=64, activation="relu", **FP8)
    assert config(lay, hidden=160, inter=96).layout.aligned  # 160 and 96 are not multiples of 64
    with pytest.raises(errors.QMoEAttributeError, match="block_size"):
        config(dataclasses.replace(lay, **INT8), hidden=160, inter=96)
    mixed = dataclasses.replace(lay, fc2_bits=4, fc2_format="int")  # the integer projection keeps its rule
    assert config(mixed, hidden=160, inter=128).hidden == 160
    with pytest.raises(errors.QMoEAttributeError, match="inter=96"):
        config(mixed, hidden=160, inter=96)


# ---- the layer's config and its upload ----------------------------------------------------------------

@pytest.mark.parametrize("bs, sdt", [(0, "float32"), (128, "bfloat16"), (64, "float32")])
def test_layer_config_of_an_fp8_layer(rng, bs, sdt):
    H, I = 160, 96
    w, a = random_layer(rng, E=4, H=H, I=I, k=2, block_size=bs, dtype="bfloat16", scale_dtype=sdt, format="fp8_e4m3")
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    assert (layer.fc1.zp_mode, layer.fc2.format, layer.fc1.bits, layer.fc1.row_bytes) == ("none", "fp8_e4m3", 8, H)
    assert layer.fc1.decode_trait == "fp8"
    cfg = layer_config(layer, "bfloat16", layer_scale_dtype(layer))
    lay = cfg.layout
    assert (lay.fc1_bits, lay.fc2_bits, lay.fc1_format, lay.fc2_format, lay.block_size) == (8, 8, "fp8_e4m3",
                                                                                             "fp8_e4m3", bs)
    assert lay.scale_dtype == ("float32" if bs == 0 else sdt) and lay.aligned
    assert layer.fc1.scale_input == ("fc1_global_scale" if bs == 0 else "fc1_scales")


class _Dev(np.ndarray):
    """A host array with a CuPy-like ``.data.ptr`` (what upload_projections reads of device arrays)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy():
    import contextlib

    dev = lambda a: np.ascontiguousarray(a).view(_Dev)  # noqa: E731
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: contextlib.nullcontext()),
                                 float32=np.float32, uint8=np.uint8, ascontiguousarray=dev,
                                 zeros=lambda n, dtype: np.zeros(n, dtype).view(_Dev))


@pytest.mark.parametrize("bs", [0, 32])
def test_upload_binds_the_global_or_the_block_scales(rng, bs):
    """block_size 0: the scale tensor is fc*_global_scale [E] float32; else the square blocks."""
    E, H, I = 4, 64, 48
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, block_size=bs, dtype="float16", format="fp8_e4m3")
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    dev = {n: np.ascontiguousarray(v).view(_Dev) for n, v in w.items()}
    sdt, proj = upload_projections(_fake_cupy(), dev, layer, 0)
    assert sdt == ("float32" if bs == 0 else "float16")
    for p, (N, K) in (("fc1", (2 * I, H)), ("fc2", (H, I))):
        codes, scales, zp, bias = proj[p]
        assert codes.shape == (E, N, K) and codes.dtype == np.uint8 and zp is None and bias is None
        want = w[f"{p}_global_scale"] if bs == 0 else w[f"{p}_scales"]
        assert scales.shape == ((E,) if bs == 0 else (E, -(-N // bs), -(-K // bs)))
        assert np.array_equal(np.asarray(scales).view(np.uint8), np.asarray(want).view(np.uint8))


def test_float8_weights_are_viewed_as_their_uint8_codes():
    import ml_dtypes

    from qmoe_rtc.runtime.interop import _codes_view

    codes = np.arange(256, dtype=np.uint8).reshape(4, 8, 8)
    v = _codes_view(codes.view(ml_dtypes.float8_e4m3fn))
    assert v.dtype == np.uint8 and v.shape == codes.shape and np.shares_memory(v, codes)


# ---- which engine runs an FP8 layer ---------------------------------------------------------------------

FP8_F16 = config(L(dtype="float16", activation="swiglu", swiglu_fusion=1, **FP8), 256, 128, 16, 4)


def _problem(cfg, rows, arch):
    return Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype, arch=arch)


@pytest.mark.parametrize("arch, decode, prefill", [
    ("", "decode-mma", "prefill-wgmma"),  # unknown device: assumed able (module listing)
    ("sm_90a", "decode-mma", "prefill-wgmma"),
    ("sm_89", "decode-mma", "prefill-mma"),
    ("sm_120", "decode-mma", "prefill-mma"),
    ("sm_86", "decode-gemv", "prefill-simt"),
    ("sm_80", "decode-gemv", "prefill-simt"),
])
def test_tensor_core_engines_need_sm89_for_fp8(arch, decode, prefill):
    d = choose(FP8_F16, _problem(FP8_F16, 2, arch), "decode")
    p = choose(FP8_F16, _problem(FP8_F16, 4096, arch), "prefill")
    assert (d.pipeline.name, p.pipeline.name) == (decode, prefill)
    if decode == "decode-gemv":
        for choice in (d, p):
            assert choice.skipped, choice
            for _name, why in choice.skipped:
                assert "FP8" in why and "sm_89" in why and arch in why, why


def test_fp8_sm89_rule_is_only_for_fp8():
    int8 = config(dataclasses.replace(FP8_F16.layout, **INT8), 256, 128, 16, 4)
    assert choose(int8, _problem(int8, 2, "sm_80"), "decode").pipeline.name == "decode-mma"
    assert tensor_core_unsupported(FP8_F16, _problem(FP8_F16, 2, "sm_80"))
    assert tensor_core_unsupported(FP8_F16) is None  # no device: module listing assumes sm_89+


def test_fp8_float32_activations_and_unaligned_shapes_run_simt():
    f32 = config(dataclasses.replace(FP8_F16.layout, dtype="float32", scale_dtype="float32"), 256, 128, 16, 4)
    unaligned = config(FP8_F16.layout, 144, 80, 16, 4)
    for cfg in (f32, unaligned):
        assert choose(cfg, _problem(cfg, 2, "sm_90a"), "decode").pipeline.name == "decode-gemv"
        assert choose(cfg, _problem(cfg, 4096, "sm_90a"), "prefill").pipeline.name == "prefill-simt"


def test_modules_for_an_fp8_layer_per_device():
    fams = lambda arch: {s.family for s in modules_for(FP8_F16, arch=arch)}  # noqa: E731
    assert fams("sm_90") == {"route", "mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill"}
    assert fams("sm_89") == {"route", "mma_decode", "mma_batched", "mma_prefill"}
    assert fams("sm_80") == {"route", "gemv", "gemm"}


def test_every_fp8_kernel_argument_is_bound_by_name():
    from support.bindings import check_every_argument_bound as check

    for cfg in (FP8_F16, config(L(dtype="float32", block_size=64, activation="relu", **FP8), 160, 96)):
        for rows in (1, 7, 64, 1000):
            check(cfg, rows)


# ---- compiles ----------------------------------------------------------------------------------------

COMPILE = [
    # (layout, hidden, inter, archs)
    (L(dtype="float16", scale_dtype="float32", activation="swiglu", swiglu_fusion=1, **FP8), 256, 128,
     ("sm_90", "sm_80")),  # global scales
    (L(dtype="bfloat16", block_size=128, activation="silu", **FP8), 320, 192, ("sm_89",)),  # partial K blocks
    (L(dtype="float16", block_size=16, activation="gelu", **FP8), 128, 64, ("sm_90",)),  # two blocks per lane
    (L(dtype="float32", block_size=64, activation="relu", **FP8), 160, 96, ("sm_80",)),  # SIMT only
]
TC = {"mma_decode", "mma_prefill", "wgmma_prefill"}


@pytest.mark.parametrize("layout, hidden, inter, archs", COMPILE, ids=[c[0].name for c in COMPILE])
def test_fp8_modules_compile(cache, layout, hidden, inter, archs):
    """Every family that claims the layout on an arch compiles for it (sm_80: the SIMT engines, and the
    tensor-core decode engine's software e4m3 path, which no device runs but which must still build)."""
    cfg = config(layout, hidden, inter)
    pairs = []
    for arch in archs:
        specs = list(modules_for(cfg, arch=arch))
        fams = {s.family for s in specs}
        if layout.dtype == "float32":
            assert fams == {"route", "gemv", "gemm"}
        elif arch == "sm_80":
            assert fams == {"route", "gemv", "gemm"}
            specs += get_family("mma_decode").specs(cfg)
        else:
            assert fams >= TC - ({"wgmma_prefill"} if arch != "sm_90" else set()), (arch, fams)
        if arch == "sm_90" and layout.dtype != "float32":  # the SIMT fallbacks build for every layout too
            specs += [s for f in ("gemv", "gemm") for s in get_family(f).specs(cfg)]
        specs += get_family("dequant").specs(cfg)
        pairs += [(spec, arch) for spec in specs]
    for (spec, _), mod in zip(pairs, compile_specs(pairs)):  # side by side (CI time)
        assert all(c[:4] == b"\x7fELF" for c in mod.cubins), spec.name


def test_e4m3_conversion_is_the_hardware_cvt_from_sm89(cache):
    """The tensor-core decode uses cvt.rn.f16x2.e4m3x2 on sm_89+ and the software decode below."""
    from qmoe_rtc.jit import compiler

    src = ('#include "core/mma_pair.cuh"\n'
           'extern "C" __global__ void k(const unsigned* w, unsigned* o, float s) {\n'
           '  qmoe::Coef c = qmoe::MmaDeq<__half, 8, qmoe::ZP_FP8>::coef(qmoe::ScaleZp{s, 0.0f});\n'
           '  const unsigned v[8] = {w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]};\n'
           '  o[threadIdx.x] = qmoe::MmaDeq<__half, 8, qmoe::ZP_FP8>::pair<false>(v, threadIdx.x & 15, c) ^\n'
           '                   qmoe::MmaDeq<__nv_bfloat16, 8, qmoe::ZP_FP8>::pair<true>(v, threadIdx.x & 15, c);\n'
           '}\n')
    for arch, hw in (("sm_89", True), ("sm_90", True), ("sm_80", False)):
        ptx = compiler.compile_ptx_listing("e4m3_cvt", src, {}, arch, compiler.base_options(arch))
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == hw, arch
