"""The tensor-core prefill-path engines (families ``mma_batched``, ``mma_prefill`` and, on sm_90a,
``wgmma_prefill``) vs the float64 reference on the GPU.

Each test runs on every engine. Covers bit widths 1/2/4/8 and mixed, block sizes 0/16/32/64/128, zero points, every
gate source and activation, biases, float16/bfloat16, K not a multiple of 128, every route tile (16/32/64 routes for mma.sync,
32/64/128/256 for wgmma), padded tiles, experts with no routes, and 64 … 4096 rows. Outputs are NaN-poisoned first;
graph replay must equal the eager call bitwise.
"""

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.settings import knobs

from support.gpu_checks import TENSOR_CORE_3BIT, TOL, eager_and_replay, rel_err, to_dev

pytestmark = pytest.mark.gpu

ENGINES = ["batched", "mma", "wgmma"]


@pytest.fixture(params=ENGINES)
def engine(request):
    """Each test once per prefill engine (the tuning knob prefill_engine forces it); wgmma needs sm_90a."""
    import cupy as cp

    kind = request.param
    if kind == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    with knobs.scope(prefill_engine=kind):
        yield "prefill-" + kind

# (name, random_layer kwargs, E, H, I)
LAYERS = [
    ("b4-bs128-swiglu1", dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4,
                              activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0), 16, 256, 128),
    ("b4-bs32-zp-swiglu2-bias", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu",
                                     swiglu_fusion=2, k=2, bias=True), 8, 160, 96),  # K % 128 != 0
    ("b8-rowwise-relu", dict(bits=8, block_size=0, activation_type="relu", k=2), 8, 256, 128),
    ("b8-bs64-zp-gelu-bias", dict(bits=8, block_size=64, zero_points=True, activation_type="gelu", k=2, bias=True),
     8, 128, 192),
    ("b2-bs16-zp-silu-fc3", dict(bits=2, block_size=16, zero_points=True, activation_type="silu", fc3=True, k=4),
     16, 128, 64),
    ("b1-bs32-relu2", dict(bits=1, block_size=32, activation_type="relu2", k=2), 8, 128, 64),
    ("b4-rowwise-zp-identity", dict(bits=4, block_size=0, zero_points=True, activation_type="identity", k=3),
     12, 256, 160),
    ("mixed-4-8-4-fc3-zp", dict(bits=(4, 8, 4), block_size=16, zero_points=(True, False, True),
                                activation_type="swiglu", fc3=True, swiglu_fusion=0, k=2, bias=True), 8, 128, 64),
    ("mixed-2-1-geglu1", dict(bits=(2, 1, 2), block_size=0, activation_type="geglu", swiglu_fusion=1, k=2),
     4, 128, 64),
    *TENSOR_CORE_3BIT,  # test_executor_gpu.py
    ("f32-scales-b4-bs16-swiglu1", dict(bits=4, block_size=16, activation_type="swiglu", swiglu_fusion=1, k=2,
                                        scale_dtype="float32"), 8, 128, 96),
]
ROWS = [64, 200, 1000]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, kw, E, H, I", LAYERS, ids=[c[0] for c in LAYERS])
def test_prefill_vs_reference(rng, name, kw, E, H, I, dtype, engine):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    moe = QMoE(**to_dev(w), **a, decode_max_routes=0)  # the prefill path at every row count
    worst = 0.0
    for rows in ROWS:
        assert moe.plan(rows, dtype, "float32").engine == engine, (name, rows)
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        want = reference(x, lg, **w, **a)
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
        moe(cp.asarray(x), cp.asarray(lg), out=out)
        e = rel_err(cp.asnumpy(out), want)
        worst = max(worst, e)
        assert e <= TOL[dtype], f"{name} {dtype} rows={rows}: rel err {e:.3e}"
    print(f"prefill {engine} {name} {dtype}: worst rel err {worst:.3e}")


@pytest.mark.parametrize("rows, E, hot", [(4096, 8, None), (2048, 64, None), (300, 32, 5), (64, 128, None)])
def test_prefill_route_tiles_and_skewed_experts(rng, rows, E, hot, engine):
    """Large and small routes-per-expert (every route tile size), one expert taking most routes, and
    experts with no routes at all; graph replay equals the eager call bitwise."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    H, I = 256, 128
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="bfloat16", bits=4, block_size=64,
                        activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)
    x, lg, _ = random_inputs(rng, rows, H, E, "bfloat16")
    lg = lg.astype(np.float32)
    if hot is not None:
        lg[:, hot] += 30.0  # every row's first choice
        lg[:, : E // 2] -= 30.0  # half the experts get nothing
    moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
    assert moe.plan(rows, "bfloat16", "float32").engine == engine
    xd, ld = cp.asarray(x), cp.asarray(lg)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    moe(xd, ld, out=out)
    assert rel_err(cp.asnumpy(out), reference(x, lg, **w, **a)) <= TOL["bfloat16"]
    g = moe.capture(xd, ld)
    g.output.fill(cp.nan)
    g.replay()
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(g.output), cp.asnumpy(out))


def test_prefill_decode_agree_at_the_crossover(rng, engine):
    """At the shapes where the default switch changes path, both paths give the reference result."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = random_layer(rng, E=32, H=256, I=128, k=4, bits=4, block_size=128, dtype="float16",
                        activation_type="swiglu", swiglu_fusion=1)
    dev = to_dev(w)
    for rows in (16, 64, 128):
        x, lg, _ = random_inputs(rng, rows, 256, 32, "float16")
        want = reference(x, lg, **w, **a)
        for limit in (0, 512):
            moe = QMoE(**dev, **a, decode_max_routes=limit)
            got = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg)))
            assert rel_err(got, want) <= TOL["float16"], (rows, limit)


def test_prefill_combine_scalar_path_same_bits(rng, engine):
    """The combine's vector (16-byte) and scalar paths: an output view 2 bytes past a 16-byte boundary
    takes the scalar one, and must hold the same bits as an aligned output, every element written."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    rows, E, H, I = 200, 16, 256, 128
    w, a = random_layer(rng, E=E, H=H, I=I, k=6, dtype="bfloat16", bits=4, block_size=64,
                        activation_type="swiglu", swiglu_fusion=1)  # k = 6: a full and a partial slot batch
    x, lg, _ = random_inputs(rng, rows, H, E, "bfloat16")
    moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
    assert moe.plan(rows, "bfloat16", "float32").engine == engine
    xd, ld = cp.asarray(x), cp.asarray(lg)
    aligned = cp.full((rows, H), cp.nan, dtype=xd.dtype)
    moe(xd, ld, out=aligned)
    flat = cp.full(rows * H + 1, cp.nan, dtype=xd.dtype)
    shifted = flat[1:].reshape(rows, H)
    assert shifted.data.ptr % 16 != 0
    moe(xd, ld, out=shifted)
    cp.cuda.get_current_stream().synchronize()
    assert rel_err(cp.asnumpy(aligned), reference(x, lg, **w, **a)) <= TOL["bfloat16"]
    np.testing.assert_array_equal(cp.asnumpy(shifted), cp.asnumpy(aligned))


def knob_sweep(rng, knob: str, values, *, rows: int, E: int, H: int, I: int, layer: dict, k: int = 2,  # noqa: E741
               fixed: dict | None = None, check_plan=None, engine: str = "wgmma") -> dict:
    """The prefill ``engine``'s output on one random bf16 layer (``random_layer`` with ``layer``) under each of
    ``values`` of ``knob`` (with the knobs ``fixed``), by value: each eager into a poisoned buffer against the
    float64 reference, then a replay equal to it bitwise (:func:`eager_and_replay`). ``check_plan(plan)`` asserts
    on each value's plan. The wgmma engine: skips off sm_90."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    if engine == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype="bfloat16", **layer)
    x, lg, _ = random_inputs(rng, rows, H, E, "bfloat16")
    want = reference(x, lg, **w, **a)
    outs = {}
    for v in values:
        with knobs.scope(prefill_engine=engine, **{knob: v}, **(fixed or {})):
            moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
            if check_plan is not None:
                check_plan(moe.plan(rows, "bfloat16", "float32"))
            outs[v] = eager_and_replay(moe, x, lg, want, f"{knob}={v}")
    return outs


@pytest.mark.parametrize("bias", [False, True])
def test_wgmma_fc2_split_k_halves(rng, bias):
    """The wgmma FC2 with K split over two blocks a tile (each adds its half into a y zeroed by the permute
    step, the first with the bias) against one block a tile: both meet the reference, every element
    written, replay equals eager bitwise in each mode, and the split did run (its sums round differently
    somewhere). 600 rows on 8 experts: few enough tiles that the device splits; Ip = 384: three chunks of
    K, halves of one and two."""
    outs = knob_sweep(rng, "prefill_fc2_split", ("on", "off"), rows=600, E=8, H=256, I=384,
                      layer=dict(bits=4, block_size=64, bias=bias, activation_type="swiglu", swiglu_fusion=1))
    assert not np.array_equal(outs["on"], outs["off"]), "the split FC2 gave the unsplit sums bit for bit: did it run?"


@pytest.mark.parametrize("bias, zp", [(False, False), (True, True)])
def test_wgmma_fc2_k_parts(rng, bias, zp):
    """The wgmma FC2 with K in parts (knob prefill_fc2_parts: each part a block storing its sums into its own plane
    of y, the first with the bias, the combine adding the planes in order) against whole tiles: each meets the
    reference with every element written, replay equals eager bitwise, the plan's FC2 launches KS = parts blocks a
    tile with y's plane stride, and the parts did run (their sums round differently somewhere: an fp32 sum in
    another order rounds to another bfloat16 at about one output in 10^4, hence 600 rows). On 8 experts, Ip = 640:
    five chunks of K, three parts of one, two and two, five of one."""

    seen = []

    def fc2_parts(plan):
        args = dict(next(s for s in plan.steps if s.role == "fc2").launch.args)
        assert (args["KS"] > 1) == (args["YS"] > 0), args
        seen.append(args["KS"])

    outs = knob_sweep(rng, "prefill_fc2_parts", (1, 3, 5), rows=600, E=8, H=256, I=640, check_plan=fc2_parts,
                      fixed=dict(prefill_fc2_split="off"), layer=dict(bits=4, block_size=64, bias=bias, zero_points=zp,
                                                                      activation_type="swiglu", swiglu_fusion=1))
    assert seen == [1, 3, 5], seen
    assert not np.array_equal(outs[1], outs[3]) and not np.array_equal(outs[1], outs[5]), \
        "FC2 in parts gave the whole tiles' sums bit for bit: did the parts run?"


@pytest.mark.parametrize("rows, E", [(200, 32), (400, 32), (2100, 8)])
def test_wgmma_tail_tile_widths(rng, rows, E):
    """Tuning knob prefill_wg_shrink 1 (tail tiles' MMAs at half or the whole tile), 2 (also a quarter, at least
    32 routes) and 3 (down to 16 routes at 2 warpgroups a block): each meets the reference with every element
    written, replay equals eager bitwise, and all give the same output (a route's sums do not depend on the
    width of the MMA that computes them). 200 / 400 rows on 32 experts: 32- / 64-route tiles on 2 warpgroups,
    tails of every size (16-route MMAs with 3); 2100 on 8: 128-route tiles with tails."""

    def on_wgmma(plan):
        assert plan.engine == "prefill-wgmma", plan.engine

    outs = knob_sweep(rng, "prefill_wg_shrink", (1, 2, 3), rows=rows, E=E, H=256, I=256, check_plan=on_wgmma,
                      layer=dict(bits=4, block_size=64, activation_type="swiglu", swiglu_fusion=1))
    np.testing.assert_array_equal(outs[1], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])


@pytest.mark.parametrize("rows, E", [(200, 32), (1200, 128)])
def test_wgmma_fc1_blocks_an_sm(rng, rows, E):
    """FC1 at 32-route tiles with its registers set for two or three blocks an SM, the third started by the
    grid (0: 200 rows on 32 experts, one round, two blocks; 1200 on 128, nine routes per expert, more than
    four rounds, three) or always (3): each meets the reference with every element written, replay equals
    eager bitwise, and all give the same output."""

    def fc1_at_32_routes(plan):
        step = next(s for s in plan.steps if s.role == "fc1")
        assert step.kernel.key == "fc1_br32", step.kernel.key

    outs = knob_sweep(rng, "prefill_wg_fc1_blocks", (0, 2, 3), rows=rows, E=E, H=256, I=1024, k=2 if E == 32 else 1,
                      check_plan=fc1_at_32_routes, layer=dict(bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=1))
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[0], outs[3])


# (rows, E, random_layer kwargs, stages): 32-route tiles (two blocks an SM), 128-route tiles on int8 (4
# warpgroups), 256-route tiles with zero points and FC3, a ring of two stages
RINGS = [(200, 32, dict(bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=2, bias=True), 0),
         (1000, 8, dict(bits=8, block_size=64, activation_type="gelu"), 0),
         (2100, 8, dict(bits=4, block_size=16, zero_points=True, activation_type="silu", fc3=True), 0),
         (1000, 8, dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1), 2)]


@pytest.mark.parametrize("rows, E, kw, stages", RINGS)
def test_wgmma_ring_hand_offs_agree(rng, rows, E, kw, stages):
    """The wgmma ring's two hand-offs (a block barrier a chunk; a stage's barriers with phases, warps drifting
    apart): each meets the reference with every element written, replay equals eager bitwise, and both give
    the same output (the same MMAs in the same order)."""
    outs = knob_sweep(rng, "prefill_wg_ring", (1, 2), rows=rows, E=E, H=256, I=512, layer=kw,
                      fixed=dict(prefill_wg_stages=stages))
    np.testing.assert_array_equal(outs[1], outs[2])


def test_a_plan_loads_only_the_pieces_it_launches(rng):
    """A plan loads the pieces of the wgmma module its steps launch: at 400 rows on 32 experts the 64-route
    tile's GEMMs, not the 128-route tile's; a plan at 2100 rows on 8 experts adds those to the same module.
    Both calls meet the reference, every element written, replay equal to eager bitwise. The loaded modules
    are forgotten first (another test in this process may have loaded the same module whole; the disk
    entries stay, so nothing recompiles)."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.jit import clear_memory, load_modules
    from qmoe_rtc.kernels import get_family

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill engine needs an sm_90 GPU")
    H, I = 256, 256
    clear_memory()
    with knobs.scope(prefill_engine="wgmma", prefill_route_tile=0):
        for rows, E, tile in ((400, 32, 64), (2100, 8, 128)):
            w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="bfloat16", bits=4, block_size=64,
                                activation_type="swiglu", swiglu_fusion=1)
            x, lg, _ = random_inputs(rng, rows, H, E, "bfloat16")
            moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
            plan = moe.plan(rows, "bfloat16", "float32")
            step = next(s for s in plan.steps if s.family == "wgmma_prefill" and s.role == "fc1")
            (module,) = load_modules([get_family("wgmma_prefill").unit(step.spec)], moe.device_id, [()])  # loads nothing
            gemms = sorted(k for k in module.kernels if k.startswith("fc"))
            assert step.kernel.key == f"fc1_br{tile}" and f"fc2_br{tile}" in gemms
            if tile == 64:
                assert gemms == ["fc1_br64", "fc2_br64"], gemms  # the 128-route pieces were not compiled
                first = module
            else:
                assert module is first and gemms == ["fc1_br128", "fc1_br64", "fc2_br128", "fc2_br64"]
            eager_and_replay(moe, x, lg, reference(x, lg, **w, **a), f"{rows} rows")


# (rows, E, I, random_layer kwargs): 128-route tiles on 4 warpgroups with tails of every width; I = 2176: 17 FC1
# weight tiles (the pair's second block of the last is past the outputs), H = 256: one FC2 weight tile (likewise)
PAIRS = [(2100, 8, 2176, dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=1)),
         (1000, 8, 512, dict(bits=8, block_size=64, zero_points=True, activation_type="gelu", bias=True)),
         (3000, 8, 384, dict(bits=4, block_size=16, zero_points=True, activation_type="silu", fc3=True)),
         (1500, 4, 256, dict(bits=(2, 8, 2), block_size=32, activation_type="swiglu", fc3=True, swiglu_fusion=0)),
         (1000, 8, 640, dict(bits=3, block_size=0, activation_type="relu"))]


@pytest.mark.parametrize("rows, E, I, kw", PAIRS, ids=[f"{r}-{e}-{i}" for r, e, i, _ in PAIRS])
def test_wgmma_pairs_agree_with_single_blocks(rng, rows, E, I, kw):  # noqa: E741
    """128-route tiles as pairs of blocks in a cluster (tuning knob prefill_wg_pairs=on: the route tile copied once
    for both from a route-tile image, FC1 writing one) and as single blocks: each meets the reference with every
    element written, replay equals eager bitwise, and both give the same output (the same MMAs in the same
    order; FC2 unsplit in both)."""

    def paired(plan):  # (called inside the value's knob scope)
        keys = [s.kernel.key for s in plan.steps if s.family == "wgmma_prefill"]
        want = knobs.get("prefill_wg_pairs") == "on"
        assert ("fc1_br128_pair" in keys and "fc2_br128_pair" in keys and "permute_image" in keys) == want, keys

    outs = knob_sweep(rng, "prefill_wg_pairs", ("on", "off"), rows=rows, E=E, H=256, I=I, layer=kw,
                      fixed=dict(prefill_fc2_split="off"), check_plan=paired)
    np.testing.assert_array_equal(outs["on"], outs["off"])


# (rows, E, H, I, k, random_layer kwargs): two row tiles (tiled int4 row-wise) at 8-route passes with FC1's K split
# over 4 warps and K % 128 != 0 (H 1056: its last chunk a quarter); 32-route passes (N8 4); 3-bit codes (shared
# 16-byte code copies, K over 2 warps); 8-bit row-wise with zero points; one row tile with scaled pairs, zero points
# and FC3 at 16-route passes (two chunks a stage); 2-bit (four chunks a stage); 64 experts: the deeper ring (4 stages)
X_BLOCK = [(24, 16, 1056, 256, 2, dict(bits=4, block_size=0, activation_type="swiglu", swiglu_fusion=1, bias=True)),
           (300, 8, 256, 384, 2, dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=2)),
           (24, 16, 512, 256, 2, dict(bits=3, block_size=128, activation_type="relu")),
           (24, 16, 256, 512, 2, dict(bits=8, block_size=0, zero_points=True, activation_type="gelu")),
           (48, 16, 384, 256, 2, dict(bits=4, block_size=32, zero_points=True, activation_type="silu", fc3=True)),
           (24, 16, 512, 256, 2, dict(bits=2, block_size=64, activation_type="swiglu", swiglu_fusion=1)),
           (40, 64, 512, 256, 4, dict(bits=4, block_size=128, activation_type="swiglu", swiglu_fusion=2, bias=True))]


@pytest.mark.parametrize("rows, E, H, I, k, kw", X_BLOCK, ids=[f"{r}-{e}-{h}-{i}" for r, e, h, i, _, _ in X_BLOCK])
def test_batched_x_block_agrees_with_own_loads(rng, rows, E, H, I, k, kw):  # noqa: E741
    """The batched engine's blocks with their routes' activations staged once in shared memory (knob
    batched_x_block on: the _xb kernels, a barrier a stage) and with each warp loading its own (off): each meets
    the reference with every element written, replay equals eager bitwise, both give the same output (the same
    activations into the same MMAs), and the plans launch the kernels the knob names. K split over 4 warps (the first
    layout's FC1) and 2 (the 3-, 8- and 2-bit layouts' FC1 or FC2), 8-, 16- and 32-route passes."""

    def kernels(plan):  # (called inside the value's knob scope)
        keys = [s.kernel.key for s in plan.steps if s.role in ("fc1", "fc2")]
        assert plan.engine == "prefill-batched" and len(keys) == 2, (plan.engine, keys)
        want = knobs.get("batched_x_block") == "on"
        assert all(key.endswith("_xb") == want for key in keys), keys

    outs = knob_sweep(rng, "batched_x_block", ("off", "on"), rows=rows, E=E, H=H, I=I, k=k, layer=kw,
                      check_plan=kernels, engine="batched")
    np.testing.assert_array_equal(outs["on"], outs["off"])
