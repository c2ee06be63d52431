"""The tensor-core decode engine's K split (CPU only): the warp target, then the one-wave rule --
halve the split when that turns a grid a little past the resident blocks into one wave without long
chunks per warp, and only then -- then the deep-K rule: double it for a grid of one to two waves whose
warps keep at least DEEP_CHUNKS chunks (kernels/mma_decode.py k_split)."""

from __future__ import annotations

import pytest

from qmoe_rtc.errors import KnobError
from qmoe_rtc.kernels.arch import DEFAULT_SMS, ArchSpec
from qmoe_rtc.kernels.mma_decode import MIN_BLOCKS, k_split
from qmoe_rtc.settings import knobs

#: The rules' thresholds of an unknown device (the default tuning table, kernels/tuning/), which k_split takes by default.
DEEP_CHUNKS, ONE_WAVE_CHUNKS = ArchSpec().tuning.deep_chunks, ArchSpec().tuning.one_wave_chunks


@pytest.mark.parametrize("what, tiles, experts, K, br, want, want_off", [
    ("qwen3-30b FC1, 1 token: 768 blocks > 660 resident, 384 fit with 8 chunks a warp", 96, 8, 2048, 8, 2, 4),
    ("gpt-oss-120b FC1, 1 token: half still spills (720 blocks)", 360, 4, 2880, 8, 4, 4),
    ("gpt-oss-120b FC2, 1 token: half fits but runs 12 chunks a warp", 180, 4, 2880, 8, 4, 4),
    ("ort-2048 FC1, 1 token: 512 blocks already one wave", 256, 2, 2048, 8, 4, 4),
    ("mixtral FC1, 1 token: no split to halve", 1792, 2, 4096, 8, 1, 1),
])
def test_one_wave_rule(what, tiles, experts, K, br, want, want_off):
    with knobs.scope(mma_deep_split=False):
        assert k_split(tiles, experts, K, br) == want, what
        with knobs.scope(mma_one_wave=False):
            assert k_split(tiles, experts, K, br) == want_off, what


@pytest.mark.parametrize("what, tiles, experts, K, want, want_off", [
    ("mixtral FC1, 1 token: 896 blocks (1.4 waves), 32 chunks -> 16 a warp at split 2", 1792, 2, 4096, 2, 1),
    ("mixtral FC2, 8 tokens: 1024 blocks, 112 chunks -> 28 a warp at split 4", 256, 8, 14336, 4, 2),
    ("ort-2048 FC1, 8 tokens: 1024 blocks but 16 chunks (4 a warp at split 4)", 256, 8, 2048, 2, 2),
    ("qwen3-30b FC1, 8 tokens: 1536 blocks, past two waves", 96, 64, 2048, 1, 1),
    ("gpt-oss-120b FC2, 8 tokens: 1440 blocks, past two waves", 180, 32, 2880, 1, 1),
    ("mixtral FC1, 8 tokens: 3584 blocks", 1792, 8, 4096, 1, 1),
    ("gpt-oss-120b FC1, 1 token: split 4 already", 360, 4, 2880, 4, 4),
])
def test_deep_split_rule(what, tiles, experts, K, want, want_off):
    assert DEEP_CHUNKS == 16 and DEFAULT_SMS * MIN_BLOCKS[8] == 660
    assert k_split(tiles, experts, K, 8) == want, what
    with knobs.scope(mma_deep_split=False):
        assert k_split(tiles, experts, K, 8) == want_off, what


def test_deep_split_rule_is_for_8_routes_per_pass():
    """Measured for up to 8 tokens only: the 16- and 32-route kernels keep the other rules' split."""
    assert k_split(1792, 2, 4096, 8) == 2
    with knobs.scope(mma_deep_split=False):
        off = k_split(1792, 2, 4096, 16)
    assert k_split(1792, 2, 4096, 16) == off


def test_one_wave_rule_counts_the_route_tiles_resident_blocks():
    # 4 experts, K 1024 (8 chunks), 220 tiles: split 4 is 880 blocks, halved 440 -- inside BR = 8's
    # 660 resident blocks, past BR = 32's 396
    assert DEFAULT_SMS * MIN_BLOCKS[8] == 660 and DEFAULT_SMS * MIN_BLOCKS[32] == 396 and ONE_WAVE_CHUNKS == 8
    assert k_split(220, 4, 1024, 8) == 2
    assert k_split(220, 4, 1024, 32) == 4


def test_one_wave_rule_counts_the_blocks_the_kernels_are_built_for():
    """With the tuning knob mma_min_blocks the 8-route kernels are built for more blocks per SM; the split rule
    counts those (qwen3-30b FC1 at 1 token: 768 blocks fit 132 x 6 at once, so split 4 stays)."""
    assert k_split(96, 8, 2048, 8, per_sm=5) == k_split(96, 8, 2048, 8) == 2
    assert k_split(96, 8, 2048, 8, per_sm=6) == 4


def test_min_blocks_knob_reaches_the_spec_and_the_geometry():
    from qmoe_rtc.kernels import Problem, get_family
    from qmoe_rtc.kernels.mma_decode import X_RING_BLOCKS, min_blocks
    from qmoe_rtc.specialize.presets import PRESETS

    fam = get_family("mma_decode")
    cfg = PRESETS["qwen3-30b-a3b"].config(dtype="bfloat16")
    p = Problem(rows=1, E=128, H=2048, I=768, k=8, dtype="bfloat16")
    with knobs.scope(mma_x_ring=False):  # the plain 8-route kernels at 1 token (the x-ring ones are set for 4)
        default = fam.spec(cfg)
    assert min_blocks(default, 8) == MIN_BLOCKS[8] and min_blocks(default, 32) == MIN_BLOCKS[32]
    assert fam.geometry(default, "fc1", p)[0] == 2
    assert min_blocks(fam.spec(cfg), 8, xr=True) == X_RING_BLOCKS and fam.geometry(fam.spec(cfg), "fc1", p)[0] == 2
    with knobs.scope(mma_min_blocks=6, mma_x_ring=False):
        six = fam.spec(cfg)
    assert min_blocks(six, 8) == 6 and min_blocks(six, 16) == MIN_BLOCKS[16]
    assert fam.geometry(six, "fc1", p)[0] == 4
    with pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[mma_min_blocks\]"), knobs.scope(mma_min_blocks=9):
        fam.spec(cfg)


@pytest.mark.parametrize("sms", [132, 114, 108, 58])  # H200/H100 SXM, H100 PCIe, A100, L4
def test_split_rules_follow_the_devices_sm_count(sms):
    """The warp target and the resident blocks scale with the device's multiprocessors: a grid judged
    on an H200 is judged the same on a GPU with proportionally fewer SMs."""
    def scaled(n: int) -> int:  # blocks of the H200 case, scaled to this device
        return n * sms // 132

    # qwen3-30b FC1 at 1 token: 768 blocks against 132 x 5 = 660 resident -> halved to 2 on an H200
    assert k_split(96, 8, 2048, 8) == k_split(96, 8, 2048, 8, sms=132) == 2
    # the one-wave rule counts this device's resident blocks (5 per SM): qwen3's FC1 with its tiles scaled
    # to the device is a little past one wave on each, as on the H200, and is halved the same way
    assert k_split(scaled(96), 8, 2048, 8, sms=sms) == 2
    # the target itself: split until tiles * experts * split reaches 24 warps per SM
    with knobs.scope(mma_one_wave=False, mma_deep_split=False):
        assert k_split(scaled(24 * 132) // 4, 1, 8192, 8, sms=sms) == 4
        assert k_split(24 * sms, 1, 8192, 8, sms=sms) == 1
        assert k_split(24 * sms - 1, 1, 8192, 8, sms=sms) == 2


def test_geometry_takes_the_problems_sm_count():
    """The family sizes its grid from Problem.sms (what the executor reads from the device)."""
    from qmoe_rtc.kernels import Problem, get_family
    from qmoe_rtc.specialize.presets import PRESETS

    fam = get_family("mma_decode")
    with knobs.scope(mma_x_ring=False):  # the plain kernels' five blocks an SM (the x-ring ones': four)
        spec = fam.spec(PRESETS["qwen3-30b-a3b"].config(dtype="bfloat16"))
    p = Problem(rows=1, E=128, H=2048, I=768, k=8, dtype="bfloat16")
    assert p.sm_count == DEFAULT_SMS == 132 and fam.geometry(spec, "fc1", p)[0] == 2  # 768 blocks > 660 resident
    from dataclasses import replace

    # 160 SMs hold 800 blocks at once: the split of 4 (768 blocks) is one wave already and stays
    assert fam.geometry(spec, "fc1", replace(p, sms=160))[0] == 4
