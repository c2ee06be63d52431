"""Compile-only (NVRTC, no GPU): every executor module family instantiates for a representative set of
layouts — every bit width, mixed widths, all zero-point modes, block sizes, dtypes, activations and
gate sources — for sm_80 and sm_90. A template that stops compiling for some layout fails here, in CI."""

from __future__ import annotations

import pytest

from qmoe_rtc.jit import get_cubin
from qmoe_rtc.kernels.mma import unsupported_reason
from qmoe_rtc.specialize import Layout, ModelConfig, modules_for

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
]


def test_mma_eligibility():
    """Which layouts the tensor-core decode kernels take, and the reason given for the others."""
    ok = L(dtype="float16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)
    assert unsupported_reason(ok, 2048, 768) is None
    assert unsupported_reason(L(dtype="bfloat16", fc1_bits=8, fc2_bits=1, block_size=0, activation="relu")) is None
    cases = [
        (L(dtype="float32", fc1_bits=4, fc2_bits=4, activation="relu"), "float32"),
        (L(dtype="float16", fc1_bits=3, fc2_bits=4, activation="relu"), "3-bit"),
        (L(dtype="float16", fc1_bits=4, fc2_bits=4, fc3_bits=8, has_fc3=True, activation="silu"), "FC3"),
        (L(dtype="float16", fc1_bits=4, fc2_bits=4, fc1_zp="offset", activation="relu"), "zero_point_offset"),
        (L(dtype="bfloat16", fc1_bits=1, fc2_bits=4, block_size=16, activation="relu"), "block_size 16"),
    ]
    for layout, word in cases:
        assert word in unsupported_reason(layout, 256, 128), layout
    assert "multiples of 32" in unsupported_reason(ok, 100, 64)


EXPECTED_KERNELS = {
    "route": {"topk_float32", "topk_float32_rw_float32", "sparse_float32"},
    "group": {"group_by_expert"},
    "gemv": {"fc1", "fc2_combine"},
    "gemm": {"fc1_bm16", "fc2_bm16", "fc1_bm64", "fc2_bm64", "combine"},
    "mma": {f"fc{i}_ng{g}" for i in (1, 2) for g in (1, 2, 4)},
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("layout,hidden,inter", LAYOUTS, ids=[f"{l.name}-H{h}-I{i}" for l, h, i in LAYOUTS])
def test_executor_modules_compile(cache, arch, layout, hidden, inter):
    cfg = ModelConfig(hidden=hidden, inter=inter, experts=8, k=2, layout=layout)
    specs = modules_for(cfg, families=("route", "group", "gemv", "gemm", "mma"))
    tc = unsupported_reason(layout, hidden, inter) is None
    assert {s.family for s in specs} == {"route", "group", "gemv", "gemm"} | ({"mma"} if tc else set())
    for spec in specs:
        mod = get_cubin(spec, arch)
        assert mod.cubin[:4] == b"\x7fELF", spec.name  # SASS cubin, never PTX
        assert set(mod.lowered) >= EXPECTED_KERNELS[spec.family], (spec.name, sorted(mod.lowered))
        assert all(name.startswith("_Z") for name in mod.lowered.values()), mod.lowered


def test_mma_ring_bytes_match_the_device_struct():
    """The host's dynamic shared memory size (kernels/mma.py ring_bytes) equals the device's
    kMmaWarps·kMmaStages·MmaStage::kBytes for every bit width, scale size, block kind and zp mode
    (a mismatch would trap the kernel): checked by static_asserts compiled with NVRTC."""
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.kernels.mma import ring_bytes, stages

    lines = ['#include "moe_mma.cuh"']
    for bits in (1, 2, 4, 8):
        for scale_t, sbytes in (("__half", 2), ("float", 4)):
            for block in (0, 16, 32, 128):
                for zp in (False, True):
                    want = ring_bytes(bits, sbytes, block, zp)
                    lines.append(f"static_assert(qmoe::kMmaWarps * qmoe::kMmaStages * "
                                 f"qmoe::MmaStage<{bits}, {scale_t}, {block}, {'true' if zp else 'false'}>::kBytes"
                                 f" == {want}, \"ring_bytes({bits}, {sbytes}, {block}, {zp})\");")
    options = compiler.base_options("sm_90", (f"-DQMOE_MMA_STAGES={stages()}",))
    compiler.compile_unit("ring_bytes_check", "\n".join(lines) + "\n", {}, "sm_90", options)
