"""CPU: the batched-decode engine's choice of block-staged activations (kernels/mma_batched.py x_block, the ``_xb``
kernels of engines/x_block.cuh), made once per plan: where a plan takes them its blocks' shared memory holds the x
stages and still fits the blocks an SM the kernels' registers are set for; where it does not, they would not fit.
The GPU side (same output as the warps' own loads, every element written, replay = eager) is
tests/kernels/test_mma_prefill_gpu.py test_batched_x_block_agrees_with_own_loads."""

from __future__ import annotations

import pytest

from qmoe_rtc.kernels import get_family
from qmoe_rtc.kernels.mma_batched import SMEM_RESERVED, min_blocks, x_block_bytes
from qmoe_rtc.kernels.mma_decode import launch_smem
from qmoe_rtc.settings import knobs

from support.plan_walk import SMS, configs, problem

FAM = get_family("mma_batched")
ROWS = (3, 4, 8, 16, 32, 64, 200)


def _calls(arch: str):
    """(name, rows, spec, problem, BatchedCall) of every tiled layout's batched plan, the engine forced."""
    with knobs.scope(prefill_engine="batched"):
        for name, cfg in configs().items():
            if not cfg.layout.tiled or FAM.supports(cfg) is not None:
                continue
            spec = FAM.spec(cfg)
            for rows in ROWS:
                p = problem(cfg, rows, arch)
                if FAM.supports(cfg, p) is None:
                    yield name, rows, spec, p, FAM.configure(spec, p)


@pytest.mark.parametrize("arch", sorted(SMS))
def test_x_stages_fit_the_blocks_an_sm(arch):
    """Auto: a GEMM takes the x stages exactly where the rings and the stages fit its kernels' blocks an SM; its
    launch's shared memory is then the rings plus the stages, and the kernel is the _xb one."""
    taken = 0
    for name, rows, spec, p, call in _calls(arch):
        per_sm = min_blocks(spec, call.br)
        for role in ("fc1", "fc2"):
            g, ring = call.gemm(role), launch_smem(spec, role, 0, spec["row_tiles"])
            x = x_block_bytes(spec, role, call.br, g.ks)
            fits = (ring + x + SMEM_RESERVED) * per_sm <= p.smem_limit + SMEM_RESERVED
            label = f"{name} {rows} rows {role}: {call}"
            assert call.x_block(role) == fits, label
            assert g.smem == ring + (x if fits else 0), label
            assert FAM.kernel_for(spec, role, p, call).endswith("_xb") == fits, label
            taken += fits
    # 99 KiB an SM (sm_86, sm_89) holds five blocks of the rings alone, none with the stages
    assert (taken > 0) == (arch in ("sm_80", "sm_90a")), f"{taken} GEMMs on {arch} take the x stages"


def test_the_bench_shapes_decode_points():
    """qwen3-30b-a3b's batched points from 6 to 64 tokens take the x stages in both GEMMs (8-route passes, one K
    slice: ~37 KiB a block, five an SM); ort-2048's FC1 takes them, its FC2 (K split over four warps at 8 tokens:
    four chunks a stage) does not."""
    cfgs = configs()
    for name, rows, want in (("qwen3-30b-a3b tiled=1", 64, (True, True)), ("qwen3-30b-a3b tiled=1", 8, (True, True)),
                             ("ort-2048 tiled=1", 8, (True, False))):
        spec = FAM.spec(cfgs[name])
        p = problem(cfgs[name], rows, "sm_90a")
        call = FAM.configure(spec, p)
        assert call.xb == want, (name, rows, call)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_the_knob_forces_the_choice(mode):
    """batched_x_block=on: the x stages wherever one block fits the device's limit; off: never."""
    with knobs.scope(batched_x_block=mode):
        for name, rows, spec, p, call in _calls("sm_90a"):
            for role in ("fc1", "fc2"):
                x = x_block_bytes(spec, role, call.br, call.gemm(role).ks)
                want = mode == "on" and launch_smem(spec, role, 0, spec["row_tiles"]) + x <= p.smem_limit
                assert call.x_block(role) == want, (name, rows, role, call)


def test_the_module_holds_both_kernels_of_each_route_tile():
    """Each route tile's GEMMs with and without the x stages (a plan compiles only the pieces it launches)."""
    spec = FAM.spec(configs()["qwen3-30b-a3b tiled=1"])
    keys = {k.key for k in FAM.kernels(spec)}
    assert {f"fc{i}_br{br}{x}" for i in (1, 2) for br in (8, 16, 32) for x in ("", "_xb")} <= keys, sorted(keys)
