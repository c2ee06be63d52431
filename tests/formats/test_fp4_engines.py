"""FP4 experts [ext] on the GPU engines, the CPU/compile tier: the 'mxfp4' / 'nvfp4' formats of
4-bit projections (decode trait 'fp4'), which engine runs an FP4 layer, the in-register e2m1 decode's bit arithmetic, and NVRTC
compiles of every family that claims an FP4 layout. The GPU results are tests/formats/test_fp4_gpu.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qmoe_rtc import errors
from qmoe_rtc.formats.fp4 import decode_e2m1
from qmoe_rtc.kernels import Problem, choose, get_family, modules_for
from qmoe_rtc.kernels._expert import template_types, tiled_define
from qmoe_rtc.specialize import CPP_ZP, ZP_MODES, Layout, ModelConfig

from support.side_by_side import compile_specs

L = Layout
MX = dict(fc1_bits=4, fc2_bits=4, fc1_format="mxfp4", fc2_format="mxfp4", scale_dtype="float32", block_size=32)
NV = dict(MX, fc1_format="nvfp4", fc2_format="nvfp4", block_size=16)


def config(layout, hidden=256, inter=128, experts=8, k=2):
    return ModelConfig(hidden=hidden, inter=inter, experts=experts, k=k, layout=layout)


def test_fp4_formats_are_4_bit_projections_with_one_decode_trait():
    assert "fp4" not in ZP_MODES and CPP_ZP["fp4"] == "qmoe::ZP_FP4"
    lay = L(dtype="bfloat16", activation="swiglu", swiglu_fusion=1, **MX)
    nv = L(dtype="bfloat16", activation="swiglu", swiglu_fusion=1, **NV)
    assert lay.decode_trait("fc1") == nv.decode_trait("fc2") == "fp4"  # MXFP4 and NVFP4 decode alike
    int4 = dataclasses.replace(lay, fc1_format="int", fc2_format="int")
    assert lay != int4 and lay.digest != int4.digest and "fc1-b4-zpE" in lay.name
    for fam in ("gemv", "gemm", "mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill", "dequant"):
        a, b = get_family(fam).specs(config(lay)), get_family(fam).specs(config(int4))
        assert {s.digest for s in a}.isdisjoint({s.digest for s in b}), fam
    assert template_types(get_family("gemv").spec(config(lay)))["Z1"] == "qmoe::ZP_FP4"
    with pytest.raises(errors.QMoEAttributeError) as ei:
        L(dtype="float16", fc1_bits=8, fc1_format="mxfp4", block_size=32, scale_dtype="float32")
    assert ei.value.name == "fc1_bits"
    for bad, name in ((dict(block_size=16), "block_size"), (dict(scale_dtype="float16"), "scale_dtype"),
                      (dict(fc2_zp="offset"), "fc2_zp")):  # the format's own block, float32 scales, no zero points
        with pytest.raises(errors.QMoEAttributeError) as ei:
            L(**{**dict(dtype="float16", activation="relu"), **MX, **bad})
        assert ei.value.name == name


def test_tiled_fp4_codes_read_scales_as_meta_records():
    """Like integer codes (and unlike FP8's square blocks), tiled FP4 scales become meta records."""
    lay = L(dtype="float16", activation="silu", tiled=True, **NV)
    spec = get_family("mma_decode").spec(config(lay))
    assert tiled_define(spec) == ("-DQMOE_TILED=1", "-DQMOE_TILED_META=1")


@pytest.mark.parametrize("dtype, rows, path, engine", [
    ("bfloat16", 1, "decode", "decode-mma"), ("float16", 8, "decode", "decode-mma"),
    ("bfloat16", 56, "prefill", "prefill-wgmma"), ("float16", 4096, "prefill", "prefill-wgmma"),
    ("float32", 2, "decode", "decode-gemv"), ("float32", 512, "prefill", "prefill-simt"),
])
def test_engines_of_an_fp4_layer(dtype, rows, path, engine):
    """FP4 needs no conversion instruction: the tensor-core engines run it on any arch they run on."""
    cfg = config(L(dtype=dtype, activation="swiglu", swiglu_fusion=1, **MX), 256, 128, 16, 4)
    for arch in ("sm_90a", "sm_80"):
        prob = Problem(rows=rows, E=16, H=256, I=128, k=4, dtype=dtype, arch=arch)
        want = "prefill-mma" if (engine == "prefill-wgmma" and arch != "sm_90a") else engine
        assert choose(cfg, prob, path).pipeline.name == want, (arch, rows)


def test_the_e2m1_bit_placement_is_exact_in_float16_and_bfloat16():
    """core/mma_pair.cuh e2m1x2_bits: exponent and mantissa at f16 bits 11-9 (bf16 8-6), sign at 15, is
    e2m1 · 2^-14 (2^-126) for every code, code 1 (0.5) landing on the type's subnormal; the multiply by
    2^14 (2^126) in the type itself is exact."""
    import ml_dtypes

    c = np.arange(16, dtype=np.uint16)
    want = decode_e2m1(c.astype(np.uint8))
    for dt, shift, unit in ((np.float16, 9, 2.0**14), (ml_dtypes.bfloat16, 6, 2.0**126)):
        h = (((c & 7) << shift) | ((c & 8) << 12)).view(dt)
        np.testing.assert_array_equal(h.astype(np.float64) * unit, want)
        np.testing.assert_array_equal((h * dt(unit)).astype(np.float32), want)
    # core/dequant.cuh e2m1_to_float: float32 bits (em + 252) << 22 for exponents 1..3
    em = np.arange(2, 8, dtype=np.uint32)
    np.testing.assert_array_equal(((em + 252) << 22).view(np.float32), decode_e2m1(em.astype(np.uint8)))


COMPILE = [
    # (layout, hidden, inter): MXFP4 tiled bf16 (gpt-oss: interleaved swiglu rows), NVFP4 contract f16
    (L(dtype="bfloat16", activation="swiglu", swiglu_fusion=1, tiled=True, **MX), 256, 128),
    (L(dtype="float16", activation="silu", **NV), 256, 128),
]


@pytest.mark.parametrize("layout, hidden, inter", COMPILE, ids=[c[0].name for c in COMPILE])
def test_fp4_modules_compile(cache, layout, hidden, inter):
    """Every module an FP4 layer loads on sm_90 compiles (and the float32 SIMT engines' and the dequant
    kernel's for the contract layout)."""
    cfg = config(layout, hidden, inter)
    specs = list(modules_for(cfg, arch="sm_90"))
    assert {s.family for s in specs} >= {"mma_decode", "mma_prefill", "wgmma_prefill"}
    if not layout.tiled:
        f32 = config(dataclasses.replace(layout, dtype="float32"), hidden, inter)
        specs += [s for f in ("gemv", "gemm") for s in get_family(f).specs(f32)] + get_family("dequant").specs(cfg)
    for spec, mod in zip(specs, compile_specs([(s, "sm_90") for s in specs])):
        assert all(c[:4] == b"\x7fELF" for c in mod.cubins), spec.name
