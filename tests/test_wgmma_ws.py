"""The wgmma prefill engine's warp-specialised variant on the CPU: how the knob selects it, its module
key, launch geometry (a persistent grid, the copy warpgroup, the route-tile images) and scratch, and that
its modules compile with argument specs matching the C++ parameters (tests/kernel_signatures.py) for the
three ways its copy warpgroup feeds a stage (tiled codes and records; contract-layout codes; FP8 block
scales, lane by lane). The GPU tests run it as the ``wgmma-ws`` engine (tests/test_mma_prefill_gpu.py)."""

from __future__ import annotations

import pytest
from kernel_signatures import mismatches
from side_by_side import compile_specs

from qmoe_rtc import knobs
from qmoe_rtc.errors import KnobError
from qmoe_rtc.kernels import get_family
from qmoe_rtc.kernels.base import Problem
from qmoe_rtc.kernels.wgmma_geometry import GATHER_ROWS, WS_CONSUMERS, image_rows, padded, variant_of
from qmoe_rtc.specialize import Layout, ModelConfig

QWEN3 = ModelConfig(hidden=2048, inter=768, experts=128, k=8,
                    layout=Layout(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu",
                                  swiglu_fusion=2, tiled=True))


def _spec(config=QWEN3, **kw):
    with knobs.scope(**kw):
        return get_family("wgmma_prefill").spec(config)


def test_the_variant_knob_and_the_module_key():
    tiles, ws = _spec(), _spec(prefill_wg_variant="ws")
    assert variant_of(tiles) == "tiles" and "variant" not in dict(tiles.params)  # the key it had before
    assert variant_of(ws) == "ws" and ws.name != tiles.name and ws["groups"] == WS_CONSUMERS
    assert _spec(prefill_wg_variant="ws", prefill_ws_mw=2).name != ws.name
    with pytest.raises(KnobError, match="QMOE_RTC_PREFILL_WG_VARIANT"):
        _spec(prefill_wg_variant="warp")
    with pytest.raises(KnobError, match="QMOE_RTC_PREFILL_WS_MW"):
        _spec(prefill_wg_variant="ws", prefill_ws_mw=3)
    src = get_family("wgmma_prefill").source(ws)
    assert '#include "engines/wgmma_ws.cuh"' in src and "wgmma_prefill.cuh" not in src


@pytest.mark.parametrize("rows, br", [(512, 64), (4096, 128), (8192, 256)])
def test_persistent_launch_and_images(rows, br):
    """One block per SM at most, a copy warpgroup besides the two MMA warpgroups, the route tile by the
    routes per expert, and images of routes + the largest route tile rows."""
    fam, spec = get_family("wgmma_prefill"), _spec(prefill_wg_variant="ws")
    p = Problem(rows=rows, E=128, H=2048, I=768, k=8, dtype="bfloat16", arch="sm_90a", sms=132)
    assert fam.kernel_for(spec, "fc1", p) == f"fc1_br{br}" and fam.kernel_for(spec, "permute", p) == "permute"
    Rp = image_rows(spec, p)
    assert Rp == p.routes + 256
    gather = fam.launch(spec, "permute", p)  # one block per 8 sorted rows, whatever the route tile
    assert gather.grid == (p.routes // 8, 1, 1) and dict(gather.args) == {"Hp": 2048, "Rp": Rp}
    for role in ("fc1", "fc2"):
        launch = fam.launch(spec, role, p)
        assert launch.grid[0] <= 132 and launch.block == (128 * (WS_CONSUMERS + 1), 1, 1)
        assert dict(launch.args)["Rp"] == Rp and launch.shared_mem <= 227 * 1024
    gather = fam.launch(spec, "permute", p)
    assert gather.grid[0] >= p.routes // br and dict(gather.args)["Rp"] == Rp
    assert fam.scratch(spec, "permute", p)["xs"].nbytes == Rp * padded(2048) * 2
    assert fam.scratch(spec, "fc1", p)["act_sorted"].nbytes == Rp * padded(768) * 2


L = Layout
LAYOUTS = [  # (layout, hidden, inter): tiled codes and records, contract codes, FP8 block scales, 3-bit + zp
    (L(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=32, activation="swiglu", swiglu_fusion=1,
       fc1_zp="packed", fc2_zp="packed", tiled=True), 2880, 2880),
    (L(dtype="float16", scale_dtype="float32", fc1_bits=8, fc2_bits=2, block_size=16, activation="gelu"), 256, 128),
    (L(dtype="bfloat16", fc1_bits=8, fc2_bits=8, fc1_zp="fp8", fc2_zp="fp8", block_size=128, activation="silu",
       tiled=True), 256, 256),
    (L(dtype="float16", fc1_bits=3, fc2_bits=3, fc3_bits=3, has_fc3=True, block_size=0, activation="silu",
       fc3_zp="packed", fc2_zp="packed", tiled=True), 512, 256),
]


@pytest.mark.parametrize("layout,hidden,inter", LAYOUTS, ids=[lay.name for lay, _, _ in LAYOUTS])
def test_ws_modules_compile_with_matching_signatures(cache, layout, hidden, inter):
    cfg = ModelConfig(hidden=hidden, inter=inter, experts=8, k=2, layout=layout)
    for mw in (1, 2) if layout is LAYOUTS[0][0] else (1,):  # two tiles per warp once (CI time)
        spec = _spec(cfg, prefill_wg_variant="ws", prefill_ws_mw=mw)
        mod = compile_specs([(spec, "sm_90")])[0]
        fam = get_family("wgmma_prefill")
        keys = {k.key for k in fam.kernels(spec)}
        assert {f"fc1_br{n}" for n in ((64, 128, 256) if mw == 1 else (64, 128))} <= keys
        for kernel in fam.kernels(spec):
            assert not mismatches(kernel, mod.lowered[kernel.key]), mismatches(kernel, mod.lowered[kernel.key])


def test_gather_rows_mirror_the_device_constant():
    """The gather's grid (GATHER_ROWS sorted rows per block) covers every route only while it says what
    the kernel writes per block (kGatherRows in engines/wg_image.cuh)."""
    import re

    from qmoe_rtc.jit.compiler import cuda_src_dir

    text = (cuda_src_dir() / "engines" / "wg_image.cuh").read_text()
    assert [int(v) for v in re.findall(r"kGatherRows = (\d+);", text)] == [GATHER_ROWS]


def test_the_stamps_build_is_its_own_module_and_compiles(tmp_path):
    """QMOE_RTC_PREFILL_WG_STAMPS (tools/wg_stamps.py) changes the module key and adds the define, and
    the stamped unit compiles with the table the tool reads; the ws variant ignores it."""
    from qmoe_rtc.jit import get_cubin
    from qmoe_rtc.kernels import spec_unit

    fam, plain, stamped = get_family("wgmma_prefill"), _spec(), _spec(prefill_wg_stamps=True)
    assert stamped.name != plain.name and "-DQMOE_WG_STAMPS=1" in fam.defines(stamped)
    assert "-DQMOE_WG_STAMPS=1" not in fam.defines(plain)
    assert _spec(prefill_wg_stamps=True, prefill_wg_variant="ws").name == _spec(prefill_wg_variant="ws").name
    with knobs.scope(cache_dir=tmp_path):
        assert b"qmoe_wg_stamps" in get_cubin(spec_unit(stamped), "sm_90a").cubin
