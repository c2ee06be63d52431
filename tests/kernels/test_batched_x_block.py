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
    """qwen3-30b-a3b (128 experts: the deeper ring, 4 stages and registers for 4 blocks an SM) takes the x stages in
    both GEMMs from 16 tokens (one K slice: 40 + 9 KiB a block, four an SM), at 8 in FC2 only (FC1's K split over two
    warps: two chunks a stage); ort-2048 (8 experts: 3 stages, 5 blocks) in FC1, not in FC2 (K over four warps)."""
    cfgs = configs()
    for name, rows, want in (("qwen3-30b-a3b tiled=1", 64, (True, True)), ("qwen3-30b-a3b tiled=1", 16, (True, True)),
                             ("qwen3-30b-a3b tiled=1", 8, (False, True)), ("ort-2048 tiled=1", 8, (True, False))):
        spec = FAM.spec(cfgs[name])
        p = problem(cfgs[name], rows, "sm_90a")
        call = FAM.configure(spec, p)
        assert call.xb == want, (name, rows, call)


def test_layers_of_many_experts_take_the_deeper_ring():
    """4 stages with registers for 4 blocks an SM from 64 experts (qwen3-30b-a3b's 128, qwen3-next's 512), 3 and 5
    below (ort-2048's 8, mixtral's 8, phi-3.5-moe's 16); the knobs override either."""
    cfgs = configs()
    for name, want in (("qwen3-30b-a3b tiled=1", (4, 4)), ("qwen3-next-80b-a3b tiled=1", (4, 4)),
                       ("ort-2048 tiled=1", (3, 5)), ("mixtral-8x7b tiled=1", (3, 5)), ("phi-3.5-moe tiled=1", (3, 5))):
        spec = FAM.spec(cfgs[name])
        assert (spec["stages"], spec["min_blocks"]) == want, (name, spec["stages"], spec["min_blocks"])
    with knobs.scope(batched_stages=3, batched_min_blocks=5):
        spec = FAM.spec(cfgs["qwen3-30b-a3b tiled=1"])
        assert (spec["stages"], spec["min_blocks"]) == (3, 5)


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
