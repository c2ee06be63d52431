"""Pipelines as data (CPU only): every argument of every kernel a pipeline launches is bound by name
from the executor's table, the scratch the pipeline declares, its launch scalars or the per-call
arrays; every pipeline step names a kernel its module has; the engine choice and its reasons."""

from __future__ import annotations

import dataclasses

import pytest

from qmoe_rtc.kernels import PIPELINES, Problem, choose, decode_limit, get_family
from qmoe_rtc.kernels.arch import ArchSpec
from qmoe_rtc.specialize import Layout, ModelConfig

from support.bindings import check_every_argument_bound

L = Layout
CONFIGS = [
    ModelConfig(hidden=2048, inter=768, experts=128, k=8,
                layout=L(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)),
    ModelConfig(hidden=256, inter=128, experts=8, k=2,
                layout=L(dtype="float16", fc1_bits=2, fc2_bits=8, fc3_bits=2, has_fc3=True, block_size=16,
                         activation="silu", fc1_zp="packed", fc3_zp="packed")),
    ModelConfig(hidden=256, inter=128, experts=16, k=4,
                layout=L(dtype="float32", fc1_bits=3, fc2_bits=4, block_size=0, activation="geglu", swiglu_fusion=2,
                         fc2_zp="offset")),
    ModelConfig(hidden=100, inter=36, experts=8, k=2, layout=L(dtype="float16", fc1_bits=4, fc2_bits=4, activation="relu")),
    # [ext] shared experts with the gate and the router GEMM; shared only; router GEMM in float32 on float32
    ModelConfig(hidden=2048, inter=512, experts=512, k=10, shared=1, shared_gate=True, router_gemm="bfloat16",
                layout=L(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)),
    ModelConfig(hidden=256, inter=128, experts=8, k=2, shared=2,
                layout=L(dtype="float16", fc1_bits=8, fc2_bits=8, activation="gelu", fc1_zp="packed", fc2_zp="packed")),
    ModelConfig(hidden=256, inter=128, experts=16, k=4, router_gemm="float32",
                layout=L(dtype="float32", fc1_bits=4, fc2_bits=4, activation="silu")),
    # [ext] an expert slice (4 of 16 experts held) with a shared expert and the router GEMM
    ModelConfig(hidden=256, inter=128, experts=4, k=6, all_experts=16, shared=1, router_gemm="float16",
                layout=L(dtype="float16", fc1_bits=4, fc2_bits=4, block_size=64, activation="swiglu", swiglu_fusion=1)),
]
ROWS = (1, 7, 64, 1000)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.layout.name for c in CONFIGS])
@pytest.mark.parametrize("rows", ROWS)
def test_every_kernel_argument_is_bound_by_name(cfg, rows):
    check_every_argument_bound(cfg, rows)


def test_choice_prefers_tensor_cores_and_says_why_not():
    tc = CONFIGS[0]
    assert choose(tc, None, "decode").pipeline.name == "decode-mma"
    assert choose(tc, None, "prefill").pipeline.name == "prefill-wgmma"  # the first that runs it (device unknown)
    many = Problem(rows=100, E=tc.experts, H=tc.hidden, I=tc.inter, k=tc.k, dtype="bfloat16")
    c = choose(tc, many, "decode")  # 800 routes: more than one decode block scans
    assert c.pipeline.name == "decode-gemv" and "800 routes" in c.skipped[0][1]
    simt = choose(CONFIGS[2], None, "prefill")
    assert simt.pipeline.name == "prefill-simt" and "float32" in simt.skipped[0][1]
    odd = choose(CONFIGS[3], None, "decode")
    assert odd.pipeline.name == "decode-gemv" and "multiples of 32" in odd.skipped[0][1]


def test_decode_limit_is_the_measured_crossover():
    """Tensor-core layers: 4 tokens (the batched-decode engine is faster from 8, docs/performance-log.md
    session 11); SIMT-only layers: 8 tokens for experts up to ~12 MB, 16 for mixtral's 88 MB ones."""
    lay = CONFIGS[0].layout
    assert decode_limit(CONFIGS[0]) == 4 * 8  # qwen3-30b-a3b: k 8
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=lay)
    assert decode_limit(mixtral) == 4 * 2
    assert decode_limit(dataclasses.replace(mixtral, k=64, experts=256)) == 256
    assert decode_limit(dataclasses.replace(mixtral, k=200, experts=256)) == 512  # what one decode block scans
    simt = dataclasses.replace(mixtral, layout=dataclasses.replace(lay, dtype="float32", scale_dtype="float32"))
    assert decode_limit(simt) == 16 * 2
    assert decode_limit(dataclasses.replace(simt, inter=2048)) == 8 * 2


def _problem(cfg, rows, arch="sm_90a"):
    return Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype, arch=arch)


def test_prefill_engine_by_device_and_size():
    """On a device whose arch has no measured crossovers (here: unknown), wgmma from MIN_ROUTES_PER_EXPERT routes
    per expert, whatever the block size (no warning below: it is a measured preference); below it the
    batched-decode engine up to its own bound, then mma.sync; mma.sync on other devices (a warning: a limit);
    the knob forces either. sm_90a's measured rule: tests/kernels/test_engine_choice.py."""
    from qmoe_rtc.settings import knobs
    MIN_ROUTES_PER_EXPERT = ArchSpec().tuning.wgmma_min_routes  # an unknown device's table (the default)

    tc = CONFIGS[0]  # 128 experts, k 8: rows r give r / 16 routes per expert
    for block in (0, 32, 128):
        cfg = dataclasses.replace(tc, layout=dataclasses.replace(tc.layout, block_size=block))
        for rows in (16 * MIN_ROUTES_PER_EXPERT, 4096):
            for arch in ("", "sm_90a"):
                c = choose(cfg, _problem(cfg, rows, arch), "prefill")
                assert c.pipeline.name == "prefill-wgmma" and not c.skipped and not c.passed, (block, rows, arch)
    below = choose(tc, _problem(tc, 16 * (MIN_ROUTES_PER_EXPERT - 1), ""), "prefill")
    assert below.pipeline.name != "prefill-wgmma" and f"(< {MIN_ROUTES_PER_EXPERT}:" in dict(below.passed)["prefill-wgmma"]
    small_rows = 16 * 4
    small = choose(tc, _problem(tc, small_rows), "prefill")
    assert small.pipeline.name == "prefill-batched" and not small.skipped
    assert [n for n, _ in small.passed] == ["prefill-wgmma"]
    a100 = choose(tc, _problem(tc, 4096, "sm_80"), "prefill")
    assert a100.pipeline.name == "prefill-mma" and "sm_90a" in a100.skipped[0][1]
    assert [n for n, _ in a100.passed] == ["prefill-batched"] and "routes per expert" in a100.passed[0][1]
    with knobs.scope(prefill_engine="wgmma"):
        assert choose(tc, _problem(tc, small_rows), "prefill").pipeline.name == "prefill-wgmma"
    with knobs.scope(prefill_engine="mma"):
        assert choose(tc, _problem(tc, 4096), "prefill").pipeline.name == "prefill-mma"
    with knobs.scope(prefill_engine="batched"):
        assert choose(tc, _problem(tc, 4096), "prefill").pipeline.name == "prefill-batched"


def test_wgmma_narrow_tiles_and_their_blocks_per_sm():
    """Up to NARROW_ROUTES routes per expert the call takes 32-route tiles (64 above). Their rings of four
    stages fit three times an SM: FC1's launch leaves room for a third block from THIRD_BLOCK_ROUNDS rounds of
    two (asks for its ring only), and on a shorter grid, like FC2's always, asks for enough shared memory
    that a third does not fit; the knob forces FC1 either way."""
    from qmoe_rtc.kernels.wgmma_geometry import SM_SMEM, ring_bytes
    from qmoe_rtc.settings import knobs

    NARROW_ROUTES, THIRD_BLOCK_ROUNDS = ArchSpec().tuning.wgmma_narrow_routes, ArchSpec().tuning.wgmma_third_block_rounds

    fam = get_family("wgmma_prefill")
    gpt_oss = ModelConfig(hidden=2880, inter=2880, experts=128, k=4, layout=dataclasses.replace(CONFIGS[0].layout, block_size=32))
    ort = ModelConfig(hidden=2048, inter=2048, experts=8, k=2, layout=CONFIGS[0].layout)

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
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=CONFIGS[0].layout)
    spec = fam.spec(mixtral)

    def fc2(rows, sms=132):
        p = dataclasses.replace(_problem(mixtral, rows), sms=sms)
        launch, permute = fam.launch(spec, "fc2", p), fam.launch(spec, "permute", p)
        return launch.grid[0], dict(launch.args)["KS"], dict(permute.args).get("y_zero", 0)  # (pairs: no y_zero)

    # 512 rows: (1024 / 128 + 8) route tiles (groups of 8) × 4096 / 256 weight tiles = 256 ≤ 2 × 132
    assert fc2(512) == (2 * 256, 2, 1024 * 4096)
    assert fc2(1024)[1:] == (1, 0)  # 24 × 16 = 384 tiles: more than FC2_SPLIT_ROUNDS rounds
    assert fc2(4096, sms=1152 // FC2_SPLIT_ROUNDS)[1] == 2  # 72 × 16 = 1152 tiles
    ort = ModelConfig(hidden=2048, inter=2048, experts=8, k=2, layout=CONFIGS[0].layout)  # 16 chunks of K
    assert dict(fam.launch(fam.spec(ort), "fc2", dataclasses.replace(_problem(ort, 512), sms=132)).args)["KS"] == 1
    with knobs.scope(prefill_fc2_split="off"):
        assert fc2(512) == (256, 1, 0)
    with knobs.scope(prefill_fc2_split="on"):
        assert fc2(4096)[1:] == (2, 8192 * 4096)
    short = ModelConfig(hidden=4096, inter=128, experts=8, k=2, layout=CONFIGS[0].layout)  # one chunk of K
    with knobs.scope(prefill_fc2_split="on"):
        assert dict(fam.launch(fam.spec(short), "fc2", _problem(short, 512)).args)["KS"] == 1
    with pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[prefill_fc2_split\]"), knobs.scope(prefill_fc2_split="maybe"):
        fc2(512)


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
    lay = CONFIGS[0].layout
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=lay)
    qwen3 = CONFIGS[0]
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
    qwen3 = CONFIGS[0]  # 128 experts, k 8: 512 rows give 32 routes per expert (64-route tiles), 4096 give 256
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
    cfg = CONFIGS[0]
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
    cfg = CONFIGS[0]
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
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=CONFIGS[0].layout)
    assert fam.supports(mixtral, _problem(mixtral, 149_796)) is None  # 299592 routes × 14336 < 2^32
    why = fam.supports(mixtral, _problem(mixtral, 149_797))
    assert why and "2^32" in why and "299594 routes × 14336" in why
    skipped = choose(mixtral, _problem(mixtral, 149_797), "prefill").skipped
    assert skipped and skipped[0][0] == "prefill-wgmma" and "2^32" in skipped[0][1]


def test_batched_engine_by_routes_per_expert():
    """The batched-decode engine runs up to 6 routes per expert on layers whose routes reach many
    experts, up to 12 on layers of few experts (measured, session 11); with two row tiles per warp (tiled
    codes, a scale per chunk) up to 8 / 16 (session 12); a pass holds twice the average routes."""
    from qmoe_rtc.kernels.mma_batched import row_tiles, tile_routes

    fam = get_family("mma_batched")
    qwen3 = CONFIGS[0]  # 128 experts, k 8: rows r give r / 16 routes per expert
    assert fam.slower(qwen3, _problem(qwen3, 96)) is None  # 6 per expert
    assert "routes per expert" in fam.slower(qwen3, _problem(qwen3, 128))  # 8
    mixtral = ModelConfig(hidden=4096, inter=14336, experts=8, k=2, layout=qwen3.layout)  # rows r: r / 4
    assert fam.slower(mixtral, _problem(mixtral, 48)) is None  # 12 per expert
    assert fam.slower(mixtral, _problem(mixtral, 64)) is not None
    # on a device of no measured crossovers; on sm_90a mixtral's large experts take wgmma (test_engine_choice.py)
    assert choose(mixtral, _problem(mixtral, 8, ""), "prefill").pipeline.name == "prefill-batched"
    assert choose(mixtral, _problem(mixtral, 8), "prefill").pipeline.name == "prefill-wgmma"
    tiled = dataclasses.replace(qwen3.layout, tiled=True)
    assert (row_tiles(True, 128), row_tiles(True, 0), row_tiles(True, 32), row_tiles(False, 128)) == (2, 2, 1, 1)
    qwen3_t, mixtral_t = (dataclasses.replace(c, layout=tiled) for c in (qwen3, mixtral))
    assert fam.spec(qwen3_t)["row_tiles"] == 2 and fam.spec(qwen3)["row_tiles"] == 1
    assert fam.slower(qwen3_t, _problem(qwen3_t, 128)) is None  # 8 per expert
    assert fam.slower(qwen3_t, _problem(qwen3_t, 144)) is not None  # 9
    assert fam.slower(mixtral_t, _problem(mixtral_t, 64)) is None  # 16
    assert fam.slower(mixtral_t, _problem(mixtral_t, 68)) is not None  # 17
    # BR: the fewest of 8, 16, 32 routes per pass >= 2 × the average routes per expert
    assert [tile_routes(_problem(mixtral, r)) for r in (8, 16, 17, 32, 33, 64, 512)] == [8, 8, 16, 16, 32, 32, 32]


@pytest.mark.parametrize("arch", ["", "sm_90a"])
def test_prefill_engine_counts_only_a_slices_own_routes(arch):
    """An expert slice [ext] computes only the routes to its experts (the rest are skipped), so the
    wgmma / batched crossover counts its expected share: a slice of 64 of 128 experts sees the same
    routes per expert as the whole layer at the same rows (counting every route would double it). Unknown
    device: MIN_ROUTES_PER_EXPERT (8) routes per expert; sm_90a: the measured 4.5 (kernels/engine_choice.py)."""
    MIN_ROUTES_PER_EXPERT = ArchSpec().tuning.wgmma_min_routes  # an unknown device's table (the default)

    tc = CONFIGS[0]  # 128 experts, k 8
    below, at = (16 * (MIN_ROUTES_PER_EXPERT - 1), 16 * MIN_ROUTES_PER_EXPERT) if not arch else (64, 80)  # 4.07 / 5.0
    half = dataclasses.replace(_problem(tc, below, arch), E=64, all_experts=128)
    assert get_family("wgmma_prefill").slower(tc, half) is not None
    assert get_family("wgmma_prefill").slower(tc, dataclasses.replace(half, rows=at)) is None
    # the whole layer at the same rows: the same routes per expert, the same answer
    assert get_family("wgmma_prefill").slower(tc, _problem(tc, below, arch)) is not None
    assert get_family("wgmma_prefill").slower(tc, _problem(tc, at, arch)) is None


def test_warm_modules_cover_both_prefill_engines():
    """The wgmma family runs only at some sizes: the warm tool also gets the mma.sync modules after it,
    and on a non-Hopper arch only those."""
    from qmoe_rtc.kernels import modules_for

    fams = {s.family for s in modules_for(CONFIGS[0], ("prefill",))}
    assert {"wgmma_prefill", "mma_prefill"} <= fams and "gemm" not in fams
    assert "wgmma_prefill" not in {s.family for s in modules_for(CONFIGS[0], ("prefill",), arch="sm_80")}
    for arch in ("sm_90", "sm_90a"):  # the same target
        assert "wgmma_prefill" in {s.family for s in modules_for(CONFIGS[0], ("prefill",), arch=arch)}


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


def test_the_readme_engine_table_is_the_one_pipelines_give():
    """README.md's engine table is generated from PIPELINES (``python -m qmoe_rtc info --engines`` prints it, to paste
    between the markers): one source, so a pipeline added or changed shows in the table or fails here."""
    import subprocess
    import sys
    from pathlib import Path

    from qmoe_rtc.kernels.pipelines import engine_table

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    table = engine_table()
    begin, end = "<!-- engine table: python -m qmoe_rtc info --engines -->\n", "<!-- end of engine table -->\n"
    assert begin + table + end in readme, "paste `python -m qmoe_rtc info --engines` between the README's markers"
    assert all(f"`{p.name}`" in table and p.engine and p.takes for p in PIPELINES)
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "info", "--engines"], capture_output=True, text=True,
                       cwd=root, timeout=60)
    assert r.returncode == 0 and r.stdout == table, r.stderr


#: A layer with the router GEMM, routed a warp a row (mixtral-8x7b's shape), and one routed a block a row (512 experts,
#: a gated shared expert): the families that make per-call choices, at token counts from decode to prefill.
CALL_CONFIGS = {"mixtral rgemm": ModelConfig(hidden=4096, inter=14336, experts=8, k=2, router_gemm="bfloat16",
                                             layout=CONFIGS[0].layout), "shared gate": CONFIGS[4]}
CALL_PIPELINES = ("decode-mma", "prefill-batched", "prefill-mma", "prefill-wgmma")


class _Kernels(dict):
    """A loaded module stand-in for Plan.build: each kernel as its key."""

    def __missing__(self, key):
        return key


@pytest.mark.parametrize("name", CALL_CONFIGS)
@pytest.mark.parametrize("pipeline_name", CALL_PIPELINES)
@pytest.mark.parametrize("rows", [1, 4, 64, 512, 4096])
def test_a_plan_makes_each_familys_call_choices_once(monkeypatch, name, pipeline_name, rows):
    """launched() and Plan.build each ask each family's configure once per call and hand the result to kernel_for /
    launch / scratch, which give with it what they give computing it themselves (every step of the routing, decode,
    batched, mma.sync and wgmma pipelines)."""
    from qmoe_rtc.runtime.plan import Plan, launched

    cfg = CALL_CONFIGS[name]
    p = dataclasses.replace(_problem(cfg, rows), sms=132, shared=cfg.shared, shared_gate=cfg.shared_gate,
                            router_gemm=cfg.router_gemm)
    pipeline = next(pl for pl in PIPELINES if pl.name == pipeline_name)
    if any(get_family(f).supports(cfg, p) for f in pipeline.families):
        assert pipeline_name == "decode-mma" and p.routes > 512  # one decode block scans at most 512 routes
        return
    specs = {f: get_family(f).spec(cfg) for f in pipeline.families}
    real = {f: type(get_family(f)).configure for f in pipeline.families}
    calls = {f: real[f](get_family(f), specs[f], p) for f in pipeline.families}
    assert all(c is not None for c in calls.values())  # each of these families has choices to share
    counted = []
    for f in pipeline.families:
        monkeypatch.setattr(type(get_family(f)), "configure",
                            lambda self, s, q, f=f: counted.append(f) or real[f](self, s, q))
    keys = launched(pipeline, specs, cfg, p)
    assert sorted(counted) == sorted(pipeline.families) and all(keys.values())
    plan = Plan.build(cfg, p, pipeline, specs, {spec: _Kernels() for spec in specs.values()})
    assert sorted(counted) == sorted(2 * pipeline.families)
    for st, built in zip(pipeline.steps_for(cfg), plan.steps, strict=True):
        fam, spec, call = get_family(st.family), specs[st.family], calls[st.family]
        assert fam.kernel_for(spec, st.role, p, call) == fam.kernel_for(spec, st.role, p) == built.kernel
        assert fam.launch(spec, st.role, p, call) == fam.launch(spec, st.role, p) == built.launch
        assert fam.scratch(spec, st.role, p, call) == fam.scratch(spec, st.role, p) == built.scratch
