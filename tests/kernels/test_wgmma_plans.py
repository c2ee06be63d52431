"""The wgmma prefill engine's plans (CPU only): route tiles and blocks an SM, FC2's K split, pairs of blocks,
warpgroups by route tile and layout, the tile table over the grid, overlapped launches, the 32-bit row offset
limit, and the K order of a chunk (a permutation matching the pairs, on contract and tiled codes)."""

from __future__ import annotations

import dataclasses

import pytest

from qmoe_rtc.kernels import Problem, choose, get_family
from qmoe_rtc.kernels.arch import ArchSpec
from qmoe_rtc.specialize import Layout, ModelConfig

#: qwen3-30b-a3b's shape and layout (bf16, int4 blocks of 128, swiglu fusion 1), the layer most tests vary.
QWEN3 = ModelConfig(hidden=2048, inter=768, experts=128, k=8,
                    layout=Layout(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu",
                                  swiglu_fusion=1))


def _problem(cfg, rows, arch="sm_90a"):
    return Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype, arch=arch)


def test_wgmma_narrow_tiles_and_their_blocks_per_sm():
    """Up to NARROW_ROUTES routes per expert the call takes 32-route tiles (64 above). Their rings of four
    stages fit three times an SM: FC1's launch leaves room for a third block from THIRD_BLOCK_ROUNDS rounds of
    two (asks for its ring only), and on a shorter grid, like FC2's always, asks for enough shared memory
    that a third does not fit; the knob forces FC1 either way."""
    from qmoe_rtc.kernels.wgmma_geometry import SM_SMEM, ring_bytes
    from qmoe_rtc.settings import knobs

    NARROW_ROUTES, THIRD_BLOCK_ROUNDS = ArchSpec().tuning.wgmma_narrow_routes, ArchSpec().tuning.wgmma_third_block_rounds

    fam = get_family("wgmma_prefill")
    gpt_oss = ModelConfig(hidden=2880, inter=2880, experts=128, k=4, layout=dataclasses.replace(QWEN3.layout, block_size=32))
    ort = ModelConfig(hidden=2048, inter=2048, experts=8, k=2, layout=QWEN3.layout)

    def blocks(cfg, rows, role):
        """(route tile, blocks an SM holds by shared memory, blocks launched)"""
        spec, p = fam.spec(cfg), dataclasses.replace(_problem(cfg, rows), sms=132)
        launch = fam.launch(spec, role, p)
        br = int(fam.kernel_for(spec, role, p)[6:].removesuffix("_pair"))
        assert launch.shared_mem >= ring_bytes(spec, role, br)
        return br, SM_SMEM // (launch.shared_mem + 2048), launch.grid[0]

    assert blocks(gpt_oss, 32 * NARROW_ROUTES, "fc1")[0] == 32 and blocks(gpt_oss, 32 * NARROW_ROUTES + 32, "fc1")[0] == 64
    br, fit, grid = blocks(gpt_oss, 512, "fc1")  # 16 routes per expert: 192 route tiles × 45 weight tiles
    assert (br, fit) == (32, 3) and grid >= THIRD_BLOCK_ROUNDS * 2 * 132
    assert blocks(gpt_oss, 512, "fc2")[:2] == (32, 2)
    br, fit, grid = blocks(ort, 64, "fc1")  # 16 routes per expert on 8 experts: one round
    assert (br, fit) == (32, 2) and grid < THIRD_BLOCK_ROUNDS * 2 * 132
    with knobs.scope(prefill_wg_fc1_blocks=3):
        assert blocks(ort, 64, "fc1")[1] == 3
    with knobs.scope(prefill_wg_fc1_blocks=2):
        assert blocks(gpt_oss, 512, "fc1")[1] == 2
    assert blocks(gpt_oss, 4096, "fc1")[:2] == (128, 1)  # 128 routes per expert: one block of 4 warpgroups


def test_wgmma_fc2_k_split_launch():
    """The tiles variant's FC2 launches two blocks a tile (its halves of K) up to FC2_SPLIT_ROUNDS rounds of
    tiles and from two chunks of K, and the permute step then zeroes y [R, H] for the halves to add into;
    otherwise one block a tile and nothing zeroed. The knob forces either; a bad value is refused."""
    from qmoe_rtc.errors import KnobError
    from qmoe_rtc.settings import knobs
    FC2_SPLIT_ROUNDS = ArchSpec().tuning.wgmma_fc2_split_rounds

    fam = get_family("wgmma_prefill")
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=QWEN3.layout)
    spec = fam.spec(mixtral)

    def fc2(rows, sms=132):
        p = dataclasses.replace(_problem(mixtral, rows), sms=sms)
        launch, permute = fam.launch(spec, "fc2", p), fam.launch(spec, "permute", p)
        return launch.grid[0], dict(launch.args)["KS"], dict(permute.args).get("y_zero", 0)  # (pairs: no y_zero)

    # 512 rows: (1024 / 128 + 8) route tiles (groups of 8) × 4096 / 256 weight tiles = 256 ≤ 2 × 132
    assert fc2(512) == (2 * 256, 2, 1024 * 4096)
    assert fc2(1024)[1:] == (1, 0)  # 24 × 16 = 384 tiles: more than FC2_SPLIT_ROUNDS rounds
    assert fc2(4096, sms=1152 // FC2_SPLIT_ROUNDS)[1] == 2  # 72 × 16 = 1152 tiles
    ort = ModelConfig(hidden=2048, inter=2048, experts=8, k=2, layout=QWEN3.layout)  # 16 chunks of K
    assert dict(fam.launch(fam.spec(ort), "fc2", dataclasses.replace(_problem(ort, 512), sms=132)).args)["KS"] == 1
    with knobs.scope(prefill_fc2_split="off"):
        assert fc2(512) == (256, 1, 0)
    with knobs.scope(prefill_fc2_split="on"):
        assert fc2(4096)[1:] == (2, 8192 * 4096)
    short = ModelConfig(hidden=4096, inter=128, experts=8, k=2, layout=QWEN3.layout)  # one chunk of K
    with knobs.scope(prefill_fc2_split="on"):
        assert dict(fam.launch(fam.spec(short), "fc2", _problem(short, 512)).args)["KS"] == 1
    with pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[prefill_fc2_split\]"), knobs.scope(prefill_fc2_split="maybe"):
        fc2(512)


def test_wgmma_fc2_k_parts_launch():
    """FC2 runs K in parts where two or more parts' worth of the call's expected tiles fit the arch's rounds
    (mixtral-8x7b at 4 tokens: ~5.5 experts hit, 32 weight tiles each, on 132 SMs × 2 blocks): KS blocks a tile, y
    [KS, R, H] (YS its plane, in the permute's and FC2's scratch, not zeroed) and the combine adding KS planes; not
    where the planes' traffic would pass the arch's share of FC2's codes (512 tokens) nor where the whole tiles fill
    too much of a round (gpt-oss-120b at 8 tokens: ~28 experts × 23 tiles, 2.4 rounds).
    The knob forces a count (at most K's chunks) or none (1: the halves' rule of test_wgmma_fc2_k_split_launch)."""
    from qmoe_rtc.kernels.wgmma_geometry import MAX_FC2_PARTS
    from qmoe_rtc.settings import knobs

    fam = get_family("wgmma_prefill")
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=QWEN3.layout)
    gpt_oss = ModelConfig(hidden=2880, inter=2880, experts=128, k=4, layout=dataclasses.replace(QWEN3.layout, block_size=32))

    def plan(cfg, rows):
        spec, p = fam.spec(cfg), dataclasses.replace(_problem(cfg, rows), sms=132)
        fc2, comb = dict(fam.launch(spec, "fc2", p).args), dict(fam.launch(spec, "combine", p).args)
        y = {r: fam.scratch(spec, r, p)["y"].nbytes for r in ("permute", "fc2")}
        zero = dict(fam.launch(spec, "permute", p).args).get("y_zero", 0)
        return fc2["KS"], fc2["YS"], comb["parts"], comb["plane"], y, zero, p.routes * p.H

    ks, ys, parts, plane, y, zero, rh = plan(mixtral, 4)
    assert 2 <= ks <= MAX_FC2_PARTS and (ys, parts, plane, zero) == (rh, ks, rh, 0)
    assert y == {"permute": 4 * ks * rh, "fc2": 4 * ks * rh}
    ks, ys, parts, _, y, zero, rh = plan(mixtral, 512)  # the halves, as before
    assert (ks, ys, parts, zero) == (2, 0, 1, rh) and y["fc2"] == 4 * rh
    assert plan(gpt_oss, 8)[:3] == (1, 0, 1)
    with knobs.scope(prefill_fc2_parts=1):  # none: the halves' rule as before (the device finds them no help here)
        assert plan(mixtral, 4)[1:3] == (0, 1)
    with knobs.scope(prefill_fc2_parts=3):
        assert plan(mixtral, 512)[:3] == (3, 512 * 2 * 4096, 3)
    short = ModelConfig(hidden=4096, inter=256, experts=8, k=2, layout=QWEN3.layout)  # two chunks of K
    with knobs.scope(prefill_fc2_parts=8):
        assert plan(short, 4)[:3] == (2, 4 * 2 * 4096, 2)


def test_wgmma_pairs_by_call():
    """128-route tiles of 4 warpgroups run as pairs of blocks in a cluster ('auto') from PAIR_MIN_FC1_TILES FC1
    weight tiles a route tile where FC2 would not split K: mixtral-8x7b at 4096 tokens (112 tiles) and 1024, not at
    512 (FC2 splits) nor qwen3-30b-a3b (6 tiles) or gpt-oss-120b (23) at 4096 nor gpt-oss-120b at 512 (32-route
    tiles). A paired call gathers x into a route-tile image (permute_image, one block per GATHER_ROWS sorted rows),
    launches an even number of weight tiles, FC2 never splits, and FC1's output and FC2's input are images of Rp
    rows; the knob forces either way where the module has pairs; a bad value is refused."""
    from qmoe_rtc.errors import KnobError
    from qmoe_rtc.kernels.wgmma_geometry import GATHER_ROWS, image_rows, padded, pair_kernels
    from qmoe_rtc.settings import knobs

    PAIR_MIN_FC1_TILES = ArchSpec().tuning.wgmma_pair_min_fc1_tiles

    fam = get_family("wgmma_prefill")
    lay = QWEN3.layout
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=lay)
    qwen3 = QWEN3
    gpt_oss = ModelConfig(hidden=2880, inter=2880, experts=128, k=4, layout=dataclasses.replace(lay, block_size=32))
    odd = ModelConfig(hidden=4096, inter=4224, experts=8, k=2, layout=lay)  # 33 FC1 weight tiles

    def kernels(cfg, rows):
        spec, p = fam.spec(cfg), dataclasses.replace(_problem(cfg, rows), sms=132)
        return [fam.kernel_for(spec, role, p) for role in ("permute", "fc1", "fc2")]

    assert kernels(mixtral, 4096) == ["permute_image", "fc1_br128_pair", "fc2_br128_pair"]
    assert kernels(mixtral, 1024) == ["permute_image", "fc1_br128_pair", "fc2_br128_pair"]
    assert kernels(mixtral, 512) == ["permute", "fc1_br128", "fc2_br128"]  # FC2 splits K
    assert kernels(qwen3, 4096) == ["permute", "fc1_br128", "fc2_br128"]  # 768 / 128 = 6 < PAIR_MIN_FC1_TILES
    assert kernels(gpt_oss, 512) == ["permute", "fc1_br32", "fc2_br32"]
    assert kernels(gpt_oss, 4096)[1] == "fc1_br128" and PAIR_MIN_FC1_TILES > 23

    spec, p = fam.spec(odd), dataclasses.replace(_problem(odd, 4096), sms=132)
    assert pair_kernels(spec) and fam.pairs(spec, p)
    permute, fc1, fc2 = (fam.launch(spec, role, p) for role in ("permute", "fc1", "fc2"))
    rp = image_rows(spec, p)
    assert rp == p.routes + 128 and dict(permute.args)["Rp"] == dict(fc1.args)["Rp"] == dict(fc2.args)["Rp"] == rp
    assert permute.grid[0] == -(-p.routes // GATHER_ROWS) and "y_zero" not in dict(permute.args)
    assert dict(fc1.args)["NT"] == 34 and fc1.grid[0] % 2 == 0  # 33 FC1 weight tiles, rounded up to pairs
    assert dict(fc2.args)["NT"] == 16 and dict(fc2.args)["KS"] == 1 and fc2.grid[0] % 2 == 0
    scratch = {**fam.scratch(spec, "permute", p), **fam.scratch(spec, "fc1", p)}
    assert scratch["xs"].nbytes == rp * padded(4096) * 2 and scratch["act_sorted"].nbytes == rp * padded(4224) * 2
    assert "xp" not in scratch

    with knobs.scope(prefill_wg_pairs="off"):
        assert kernels(mixtral, 4096) == ["permute", "fc1_br128", "fc2_br128"]
    with knobs.scope(prefill_wg_pairs="on"):
        assert kernels(qwen3, 4096)[1:] == ["fc1_br128_pair", "fc2_br128_pair"]
        assert kernels(mixtral, 512)[1:] == ["fc1_br128_pair", "fc2_br128_pair"]
        assert dict(fam.launch(fam.spec(mixtral), "fc2", dataclasses.replace(_problem(mixtral, 512), sms=132)).args)["KS"] == 1
        assert kernels(gpt_oss, 512)[1] == "fc1_br32"  # no pair form of 32-route tiles
    with knobs.scope(prefill_wg_groups=2):  # 128-route tiles on 2 warpgroups: no pair forms
        assert not pair_kernels(fam.spec(mixtral)) and "_pair" not in kernels(mixtral, 4096)[1]
    with pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[prefill_wg_pairs\]"), knobs.scope(prefill_wg_pairs="maybe"):
        kernels(mixtral, 4096)


def test_wgmma_warpgroups_by_route_tile_and_layout():
    """Two warpgroups a block at 64-route tiles where four stages of theirs fit twice in an SM (two blocks an
    SM: FC2's device rule then counts 2 × SMs), four at 128 routes and where they do not fit twice (int8);
    knob prefill_wg_groups forces either for every tile (in the generated unit's rings, part of the key)."""
    from qmoe_rtc.kernels.wgmma_geometry import tile_groups
    from qmoe_rtc.settings import knobs

    assert [tile_groups(4, 2, 128, False, br) for br in (64, 128)] == [2, 4]
    assert [tile_groups(b, 2, 32, False, 64, True) for b in (2, 3, 4, 8)] == [2, 2, 2, 4]
    assert tile_groups(4, 2, 128, False, 64, max_stages=3) == 4  # a shallower ring measured slower
    fam = get_family("wgmma_prefill")
    qwen3 = QWEN3  # 128 experts, k 8: 512 rows give 32 routes per expert (64-route tiles), 4096 give 256
    spec = fam.spec(qwen3)
    assert spec.get("groups") is None and not any("GROUPS" in d for d in fam.defines(spec))
    assert "{4, 0, 2, 128, 64, 4, 2, 2, " in fam.source(spec) and "{4, 0, 2, 128, 128, 4, 4, 1, " in fam.source(spec)

    def fc(role, rows, cfg=qwen3):
        launch = fam.launch(fam.spec(cfg), role, dataclasses.replace(_problem(cfg, rows), sms=132))
        return launch.block[0], dict(launch.args).get("SMS")

    assert (fc("fc1", 512), fc("fc2", 512)) == ((256, None), (256, 2 * 132))
    assert (fc("fc1", 4096), fc("fc2", 4096)) == ((512, None), (512, 132))
    lay = qwen3.layout
    int8 = dataclasses.replace(qwen3, layout=dataclasses.replace(lay, fc1_bits=8, fc2_bits=8))
    assert (fc("fc1", 512, int8), fc("fc2", 512, int8)) == ((512, None), (512, 132))
    with knobs.scope(prefill_wg_groups=4):
        assert fam.spec(qwen3)["groups"] == 4 and "{4, 0, 2, 128, 64, 4, 4, 1, " in fam.source(fam.spec(qwen3))
        assert fc("fc2", 512) == (512, 132)
    with knobs.scope(prefill_wg_groups=2):
        assert fc("fc1", 4096) == (256, None) and fc("fc2", 512) == (256, 2 * 132)


@pytest.mark.parametrize("rows", [1, 300, 512, 4096])
def test_wgmma_tile_table_covers_the_grid(rows):
    """wg_prepare writes the tile table for `slots` route tiles (engines/tile_rows.cuh) and FC1 / FC2 read
    entry t of it for every route tile t their grid covers: the table's buffers hold `slots` entries of the
    call's route tile, and each GEMM's grid is exactly slots × its weight tiles (FC2: × its K halves), with
    slots at least the bound on the call's route tiles."""
    from qmoe_rtc.kernels._grouped import route_tiles
    from qmoe_rtc.kernels.wgmma_geometry import spec_tiles, tile_routes

    fam = get_family("wgmma_prefill")
    cfg = QWEN3
    spec, prob = fam.spec(cfg), dataclasses.replace(_problem(cfg, rows), sms=132)
    br = tile_routes(prob.routes, prob.experts, prob.device.tuning, have=spec_tiles(spec))
    prep = dict(fam.launch(spec, "permute", prob).args)
    slots = prep["slots"]
    assert prep["BR"] == br and slots >= route_tiles(prob.routes, prob.experts, br)
    scratch = fam.scratch(spec, "permute", prob)
    assert scratch["tile_info"].nbytes == 16 * slots and scratch["tile_rows"].nbytes == 4 * slots * br
    for role in ("fc1", "fc2"):
        launch = fam.launch(spec, role, prob)
        args = dict(launch.args)
        assert launch.grid[0] == slots * args["NT"] * args.get("KS", 1), role


def test_wgmma_overlapped_launches():
    """The wgmma engine launches every step after the routing overlapping the kernel before it (each waits for it
    before reading its output; FC2 reads the grouping's and wg_prepare's outputs before its wait, complete once FC1's
    wait returned, and FC1 releases FC2 only after it); knob prefill_wg_overlap=0 launches all of them the ordinary
    way."""
    from qmoe_rtc.settings import knobs

    fam = get_family("wgmma_prefill")
    cfg = QWEN3
    prob = dataclasses.replace(_problem(cfg, 512), sms=132)
    roles = ("group", "permute", "fc1", "fc2", "combine")

    def overlaps(**kw):
        with knobs.scope(**kw):
            spec = fam.spec(cfg)
            return [fam.launch(spec, r, prob).overlap for r in roles]

    assert all(overlaps())
    assert not any(overlaps(prefill_wg_overlap=False))


def test_wgmma_refuses_past_32_bit_row_offsets():
    """A route tile's rows are 32-bit element offsets into xp [rows, Hp] and act_sorted [R, Ip]: past 2^32
    values the engine is refused (the executor then warns and runs mma.sync)."""
    fam = get_family("wgmma_prefill")
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=QWEN3.layout)
    assert fam.supports(mixtral, _problem(mixtral, 149_796)) is None  # 299592 routes × 14336 < 2^32
    why = fam.supports(mixtral, _problem(mixtral, 149_797))
    assert why and "2^32" in why and "299594 routes × 14336" in why
    skipped = choose(mixtral, _problem(mixtral, 149_797), "prefill").skipped
    assert skipped and skipped[0][0] == "prefill-wgmma" and "2^32" in skipped[0][1]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_wgmma_k_order_is_a_permutation_matching_the_pairs(bits):
    """The logical K order of the wgmma operands is a bijection of each 128-chunk, and logical columns
    2t, 2t+1 (+8) of k16 step s are the codes lane t's pairs 2s, 2s+1 hold (core/mma_pair.cuh)."""
    from qmoe_rtc.kernels.wgmma_geometry import wg_logical, wg_natural

    nat = [wg_natural(l, bits) for l in range(128)]
    assert sorted(nat) == list(range(128))
    assert [wg_logical(n, bits) for n in nat] == list(range(128))
    order = 4 if bits == 3 else bits  # 3-bit codes pair as 4-bit ones (core/mma_pair.cuh)
    P, C = 16 // order, 32 // order
    for s in range(8):
        for t in range(4):
            for half in range(2):
                pair = 2 * s + half
                first = (pair // P) * C + pair % P  # MmaDeq::first_code
                assert nat[16 * s + 8 * half + 2 * t] == 32 * t + first
                assert nat[16 * s + 8 * half + 2 * t + 1] == 32 * t + first + P


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_wgmma_k_order_on_tiled_codes(bits):
    """With tiled codes (pair i = natural codes 2i, 2i + 1 of the lane's 32) the wgmma K order is again a
    bijection of each 128-chunk, logical columns 2t, 2t+1 (+8) of k16 step s being lane t's pairs 2s,
    2s+1, and wg_logical inverts it."""
    from qmoe_rtc.kernels.wgmma_geometry import wg_logical, wg_natural

    nat = [wg_natural(l, bits, tiled=True) for l in range(128)]
    assert sorted(nat) == list(range(128))
    assert [wg_logical(n, bits, tiled=True) for n in nat] == list(range(128))
    for s in range(8):
        for t in range(4):
            for half in range(2):
                pair = 2 * s + half
                assert nat[16 * s + 8 * half + 2 * t: 16 * s + 8 * half + 2 * t + 2] == [32 * t + 2 * pair,
                                                                                      32 * t + 2 * pair + 1]
