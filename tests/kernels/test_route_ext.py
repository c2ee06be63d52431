"""The routing side of shared experts and the router GEMM [ext] (CPU and NVRTC, no GPU): module specs,
kernel keys and argument names per problem, launch geometry and scratch sizes, the limits, the tensor-
core fragment mapping of the router GEMM (emulated in NumPy), and every module variant compiling."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qmoe_rtc.errors import QMoEUnsupportedError
from qmoe_rtc.jit import Launch, Ptr, get_cubin
from qmoe_rtc.kernels import PIPELINES, Problem, get_family, spec_unit
from qmoe_rtc.kernels import route as rt
from qmoe_rtc.runtime.plan import PER_CALL, problem_scalars
from qmoe_rtc.specialize import Layout, ModelConfig

FAM = get_family("route")
ROUTE_ARGS = ("logits", "router_weights", "rows", "E_logits", "k_routed", "S", "H", "normalize", "x",
              "shared_gate_weight", "E_routed", "expert_map", "topk_ids", "topk_w", "expert_counts")
WARP_ARGS = ("logits", "router_weights", "rows", "E_logits", "k_routed", "S", "normalize", "E_routed", "expert_map",
             "topk_ids", "topk_w", "expert_counts")  # route_topk_warp: no gate inputs
GEMM_ARGS = ("x", "router_weight", "router_bias", "rows", "E_logits", "H", "router_logits")
EXT_TABLE = {"shared_gate_weight", "router_weight", "router_bias", "expert_map"}  # what the executor's table adds [ext]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cfg(dtype="bfloat16", E=64, k=4, S=0, gate=False, rgemm="", sparse=False, H=2048):
    lay = Layout(dtype=dtype, fc1_bits=4, fc2_bits=4, block_size=0, activation="swiglu", swiglu_fusion=1)
    return ModelConfig(hidden=H, inter=256, experts=E, k=2 if sparse else k, layout=lay, shared=S, shared_gate=gate,
                       router_gemm=rgemm, use_sparse_mixer=sparse)


def problem(c: ModelConfig, rows=4, router_dtype="float32", rw=None) -> Problem:
    return Problem(rows=rows, E=c.experts, H=c.hidden, I=c.inter, k=c.k, dtype=c.layout.dtype,
                   router_dtype=router_dtype, router_weights_dtype=rw, sparse=c.use_sparse_mixer, shared=c.shared,
                   shared_gate=c.shared_gate, router_gemm=c.router_gemm)


def kdefs(c: ModelConfig) -> dict:
    return {k.key: k for k in FAM.kernels(FAM.spec(c))}


# ---- specs and kernels ---------------------------------------------------------------------------------

def test_plain_module_is_unchanged_and_ext_params_come_from_the_config():
    big = dict(E=512)  # more experts than a warp routes: the block-per-row module
    assert FAM.spec(cfg(**big)).name == "route_bf16" and FAM.spec(cfg().layout).name == "route_bf16"
    assert FAM.spec(cfg(**big, S=2)) == FAM.spec(cfg(**big))  # ungated shared experts: the plain kernels (S is a scalar)
    assert FAM.spec(cfg(S=2, gate=True)).name == "route_bf16_gate1"
    assert FAM.spec(cfg(**big, rgemm="bfloat16")).name == "route_bf16_rgemm1"
    assert FAM.spec(cfg(**big, rgemm="float32")) == FAM.spec(cfg(**big, rgemm="bfloat16"))  # both weight dtypes
    assert FAM.spec(cfg(S=1, gate=True, rgemm="float32")).name == "route_bf16_gate1_rgemm1"
    assert FAM.spec(cfg(sparse=True)).name == "route_bf16"  # the sparse mixer: block kernels
    assert FAM.spec(cfg()).name == "route_bf16_warp1" == FAM.spec(cfg(E=256, S=3)).name
    assert FAM.spec(cfg(rgemm="float32")).name == "route_bf16_rgemm1_warp1"
    assert FAM.depends_on == ("dtype",)
    block = {"topk_float32", "topk_float32_rw_float32", "topk_float32_rw_bfloat16", "sparse_float32", "topk_bfloat16",
             "topk_bfloat16_rw_float32", "topk_bfloat16_rw_bfloat16", "sparse_bfloat16"}
    assert set(kdefs(cfg(**big))) == block
    assert set(kdefs(cfg())) == {k + "_warp" for k in block if k.startswith("topk")}  # no sparse mixer, no gate
    assert set(kdefs(cfg(S=1, gate=True))) == {k + "_gate" for k in block}
    assert '#include "routing/route_warp.cuh"' in FAM.source(FAM.spec(cfg()))
    assert "route_warp.cuh" not in FAM.source(FAM.spec(cfg(**big)))
    assert '#include "routing/router_gemm.cuh"' in FAM.source(FAM.spec(cfg(rgemm="float32")))
    assert "router_gemm.cuh" not in FAM.source(FAM.spec(cfg()))


@pytest.mark.parametrize("E", [64, 512])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_router_gemm_module_kernels(dtype, E):
    ks = kdefs(cfg(dtype, E=E, rgemm="float32"))
    dts = ["float32"] if dtype == "float32" else ["float32", dtype]
    want = {"topk_gemm", "sparse_gemm"} | {f"topk_gemm_rw_{d}" for d in dts}
    if E <= rt.WARP_MAX_EXPERTS:  # the warp module: its routing kernels only
        want = {k + "_warp" for k in want if k.startswith("topk")}
    want |= {"logits_float32_gemv", "logits_float32_tiled"}
    if dtype != "float32":
        want |= {f"logits_{dtype}_mma", f"logits_{dtype}_mma_tiled"}
    assert set(ks) == want
    for key, kd in ks.items():
        if key.startswith("logits_"):
            assert kd.arg_names() == GEMM_ARGS, key
            wt = key.split("_")[1]
            assert [a.dtype for a in kd.args if isinstance(a, Ptr)] == [dtype, wt, "float32", "float32"]
        else:
            args = WARP_ARGS if key.endswith("_warp") else ROUTE_ARGS
            assert kd.arg_names() == ("router_logits",) + args[1:], key
            assert kd.args[0].dtype == "float32"


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_route_kernel_arguments(dtype, gate):
    kds = {**kdefs(cfg(dtype, S=1 if gate else 0, gate=gate)), **kdefs(cfg(dtype, E=512, S=1 if gate else 0, gate=gate))}
    assert any(k.endswith("_warp") for k in kds) != gate and any(not k.endswith("_warp") for k in kds)
    for key, kd in kds.items():
        by = {a.name: a for a in kd.args}
        assert by["router_weights"].nullable and by["expert_map"].nullable
        if key.endswith("_warp"):
            assert kd.arg_names() == WARP_ARGS and not gate and "route_topk_warp<" in kd.name_expr, key
            continue
        assert kd.arg_names() == ROUTE_ARGS, key
        assert by["x"].dtype == dtype and by["x"].nullable and by["shared_gate_weight"].nullable
        assert by["shared_gate_weight"].dtype == "float32"
        assert key.endswith("_gate") == gate
        assert f"{'true' if gate else 'false'}, false>" in kd.name_expr  # GATE, then COUNT (no expert statistics)


CASES = {  # config, problem keywords -> routing key (_warp: one warp per row)
    "plain": (cfg(), {}, "topk_float32_warp"),
    "logits in T": (cfg(), {"router_dtype": "bfloat16"}, "topk_bfloat16_warp"),
    "router weights": (cfg(S=2), {"rw": "bfloat16"}, "topk_float32_rw_bfloat16_warp"),
    "256 experts": (cfg(E=256), {}, "topk_float32_warp"),
    "257 experts": (cfg(E=257), {}, "topk_float32"),
    "512 experts, router weights": (cfg(E=512, S=1), {"rw": "float32"}, "topk_float32_rw_float32"),
    "gated": (cfg(S=2, gate=True), {"rw": "float32"}, "topk_float32_rw_float32_gate"),
    "sparse shared": (cfg(S=1, sparse=True), {}, "sparse_float32"),
    "sparse gated": (cfg(S=1, gate=True, sparse=True), {"router_dtype": "bfloat16"}, "sparse_bfloat16_gate"),
    "gemm": (cfg(rgemm="bfloat16"), {}, "topk_gemm_warp"),
    "gemm, 512 experts": (cfg(E=512, rgemm="bfloat16"), {}, "topk_gemm"),
    "gemm rw gated": (cfg(S=2, gate=True, rgemm="float32"), {"rw": "bfloat16"}, "topk_gemm_rw_bfloat16_gate"),
    "gemm sparse": (cfg(rgemm="float32", sparse=True), {}, "sparse_gemm"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_for_route(name):
    c, kw, key = CASES[name]
    spec = FAM.spec(c)
    p = problem(c, **kw)
    assert FAM.kernel_for(spec, "route", p) == key and key in kdefs(c)
    if key.endswith("_warp"):
        want = Launch((cdiv(p.rows, rt.WARP_ROWS), 1, 1), (32 * rt.WARP_ROWS, 1, 1), 0, overlap=True)
    else:
        want = Launch((p.rows, 1, 1), (rt.THREADS, 1, 1), 0, overlap=True)
    assert FAM.launch(spec, "route", p) == want


@pytest.mark.parametrize("rows", [1, 4, 5, 4096])
def test_warp_route_launch_covers_the_rows(rows):
    c = cfg(E=128, k=8)
    spec, p = FAM.spec(c), problem(c, rows)
    assert FAM.kernel_for(spec, "route", p) == "topk_float32_warp"
    launch = FAM.launch(spec, "route", p)
    assert launch == Launch((cdiv(rows, rt.WARP_ROWS), 1, 1), (32 * rt.WARP_ROWS, 1, 1), 0, overlap=True)


@pytest.mark.parametrize("rows,wt,kind", [(1, "bfloat16", "mma"), (256, "bfloat16", "mma"),
                                          (257, "bfloat16", "mma_tiled"), (1, "float32", "gemv"),
                                          (64, "float32", "gemv"), (65, "float32", "tiled")])
def test_kernel_for_logits(rows, wt, kind):
    c = cfg(rgemm=wt)
    assert FAM.kernel_for(FAM.spec(c), "logits", problem(c, rows)) == f"logits_{wt}_{kind}"


def test_spec_and_problem_must_agree():
    with pytest.raises(QMoEUnsupportedError, match="shared_gate"):
        FAM.kernel_for(FAM.spec(cfg(S=1)), "route", problem(cfg(S=1, gate=True)))
    with pytest.raises(QMoEUnsupportedError, match="router"):
        FAM.kernel_for(FAM.spec(cfg()), "route", problem(cfg(rgemm="float32")))
    with pytest.raises(QMoEUnsupportedError, match="router GEMM"):
        FAM.kernel_for(FAM.spec(cfg()), "logits", problem(cfg()))
    with pytest.raises(QMoEUnsupportedError, match="one warp per row"):
        FAM.kernel_for(FAM.spec(cfg()), "route", problem(cfg(E=512)))
    with pytest.raises(QMoEUnsupportedError, match="one block per row"):
        FAM.kernel_for(FAM.spec(cfg(E=512)), "route", problem(cfg()))


# ---- geometry and scratch ------------------------------------------------------------------------------

@pytest.mark.parametrize("wt", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 65, 300, 4096])
@pytest.mark.parametrize("E,H", [(8, 64), (60, 2880), (256, 2048), (512, 7168), (128, 100)])
def test_logits_launch_covers_the_output(wt, rows, E, H):
    c = cfg(E=E, H=H, rgemm=wt, k=2)
    p = problem(c, rows)
    kind = rt.logits_kind(p)
    launch = FAM.launch(FAM.spec(c), "logits", p)
    (gx, gy, gz), (bx, by, bz) = launch.grid, launch.block
    assert gz == by == bz == 1 and bx % 32 == 0 and gy <= rt.MAX_GRID_Y
    kw = bx // 32
    if kind == "tiled":
        assert (gx, gy, bx, launch.shared_mem) == (cdiv(E, 64), cdiv(rows, 64), 256, 0)
        kw = 1  # 256 threads over one tile, no K split
    elif kind == "gemv":
        assert (gx, gy) == (cdiv(E, rt.GEMV_TE), cdiv(rows, rt.GEMV_RB)) and 1 <= kw <= 16 and launch.shared_mem == 0
        assert kw <= cdiv(cdiv(H, 8), 32)  # every lane of every warp has a chunk of 8 to read
    else:
        mt, nt, u, most = rt.MMA_SMALL if kind == "mma" else rt.MMA_LARGE
        assert (gx, gy) == (cdiv(E, 16 * mt), cdiv(rows, 8 * nt)) and 1 <= kw <= most
        assert launch.shared_mem == (kw - 1) * mt * nt * 4 * 32 * 4 <= 48 * 1024
        assert kw <= cdiv(cdiv(H, 32), u)  # every warp has a round of U steps
    assert gx * gy * kw <= max(rt.target_warps(p.sm_count), gx * gy)  # K splits never push the grid past the target


def test_decode_router_gemm_spreads_the_weights():
    """E 512, H 2048, bf16 weights, one row: 32 blocks of 16 warps, each warp one round of 4 steps."""
    c = cfg(E=512, H=2048, rgemm="bfloat16")
    launch = FAM.launch(FAM.spec(c), "logits", problem(c, 1))
    assert launch.grid == (32, 1, 1) and launch.block == (512, 1, 1) and launch.shared_mem == 15 * 8 * 128
    c = cfg(E=512, H=2048, rgemm="float32")
    launch = FAM.launch(FAM.spec(c), "logits", problem(c, 1))
    assert launch.grid == (128, 1, 1) and launch.block == (256, 1, 1)  # 8 warps: one chunk of 8 per lane


@pytest.mark.parametrize("S,gate,rgemm", [(0, False, ""), (2, False, ""), (3, True, ""), (1, True, "bfloat16"),
                                          (0, False, "float32")])
@pytest.mark.parametrize("rows", [1, 37])
def test_scratch_sizes(S, gate, rgemm, rows):
    c = cfg(E=60, k=4, S=S, gate=gate, rgemm=rgemm)
    p = problem(c, rows)
    spec = FAM.spec(c)
    R = rows * (4 + S)
    assert p.routes == R
    want = {"topk_ids": 4 * R, "topk_w": 4 * R}
    if rgemm:
        want["router_logits"] = 4 * rows * 60
        assert {n: s.nbytes for n, s in FAM.scratch(spec, "logits", p).items()} == {"router_logits": 4 * rows * 60}
    got = FAM.scratch(spec, "route", p)
    assert {n: s.nbytes for n, s in got.items()} == want and not any(s.zero for s in got.values())


def test_supports():
    assert FAM.supports(cfg(S=30, k=2)) is None  # slots beyond 32: routing keeps only the k picks in shared memory
    assert "513 experts" in FAM.supports(cfg(E=513))
    assert "k = 33" in FAM.supports(cfg(E=64, k=33))
    why = FAM.supports(cfg("bfloat16", rgemm="float16"))
    assert "router_weight in float16" in why and "float32 or the activation dtype" in why
    assert FAM.supports(cfg("float16", rgemm="float16")) is None and FAM.supports(cfg("float32", rgemm="float32")) is None
    c = cfg(rgemm="float32")
    assert FAM.supports(c, problem(c, 65535 * 64)) is None
    assert "rows" in FAM.supports(c, problem(c, 65535 * 64 + 1))
    assert FAM.supports(cfg(), problem(cfg(), 65535 * 64 + 1)) is None  # no GEMM: no such limit


@pytest.mark.parametrize("c", [cfg(S=2, gate=True), cfg(rgemm="bfloat16", S=1), cfg("float32", rgemm="float32"),
                               cfg(rgemm="float32", S=2, gate=True, sparse=True)], ids=["gate", "gemm", "f32", "all"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_routing_steps_bind_every_argument(c, rows):
    """As tests/kernels/test_pipelines.py, for [ext] layers: every argument of the routing steps binds by name."""
    from qmoe_rtc.contract import QMoEAttributes
    from qmoe_rtc.runtime.tensors import layer_table

    table = set(layer_table({p: (object(), object(), None, None) for p in ("fc1", "fc2")},
                            QMoEAttributes.from_kwargs(k=2))) | EXT_TABLE
    p = problem(c, rows)
    spec = FAM.spec(c)
    steps = [st for st in PIPELINES[0].steps_for(c) if st.family == "route"]
    assert [st.role for st in steps] == (["logits"] if c.router_gemm else []) + ["route"]
    scratch = set().union(*(FAM.scratch(spec, st.role, p) for st in steps))
    bound = table | set(problem_scalars(p)) | scratch | set(PER_CALL)
    for st in steps:
        kd = kdefs(c)[FAM.kernel_for(spec, st.role, p)]
        assert not [a.name for a in kd.args if a.name not in bound], kd.key
    assert "router_logits" in scratch if c.router_gemm else "router_logits" not in scratch


# ---- the tensor-core fragment mapping, emulated ----------------------------------------------------------

def _emulated_mma_tile(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    """out [8, 16] of one 16-expert × 8-row tile, built the way router_logits_mma does it: per 32-k step
    lane (g, t) holds the 8 k at 8t of rows g, g + 8 of W and row g of X; the mma of u takes words
    {2u, 2u + 1} as A = {lo(g), lo(g+8), hi(g), hi(g+8)}, B = {lo, hi}, with PTX's m16n8k16 layouts."""
    D = np.zeros((16, 8))
    for k0 in range(0, W.shape[1], 32):
        for u in range(2):
            A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                word = lambda row, j: row[k0 + 8 * t + 2 * j: k0 + 8 * t + 2 * j + 2]  # noqa: E731
                regs = [word(W[g], 2 * u), word(W[g + 8], 2 * u), word(W[g], 2 * u + 1), word(W[g + 8], 2 * u + 1)]
                A[g, 2 * t: 2 * t + 2], A[g + 8, 2 * t: 2 * t + 2] = regs[0], regs[1]  # a0a1, a2a3
                A[g, 2 * t + 8: 2 * t + 10], A[g + 8, 2 * t + 8: 2 * t + 10] = regs[2], regs[3]  # a4a5, a6a7
                B[2 * t: 2 * t + 2, g], B[2 * t + 8: 2 * t + 10, g] = word(X[g], 2 * u), word(X[g], 2 * u + 1)
            assert not np.isnan(A).any() and not np.isnan(B).any()  # every fragment element is some lane's
            D += A @ B
    out = np.full((8, 16), np.nan)
    for lane in range(32):  # the kernel's store: c -> expert g + 8(c >> 1), row 2t + (c & 1)
        g, t = lane >> 2, lane & 3
        for c in range(4):
            out[2 * t + (c & 1), g + 8 * (c >> 1)] = D[g + 8 * (c >> 1), 2 * t + (c & 1)]
    return out


def test_mma_fragment_k_order_is_a_permutation(rng):
    W = rng.integers(-8, 8, (16, 96)).astype(np.float64)
    X = rng.integers(-8, 8, (8, 96)).astype(np.float64)
    np.testing.assert_array_equal(_emulated_mma_tile(W, X), X @ W.T)  # integers: exact in any order


# ---- compile -------------------------------------------------------------------------------------------

VARIANTS = [dict(dtype=d, **ext) for d in ("float32", "float16", "bfloat16")
            for ext in ({}, {"gate": 1}, {"rgemm": 1}, {"gate": 1, "rgemm": 1}, {"warp": 1}, {"rgemm": 1, "warp": 1})]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("params", VARIANTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_every_variant_compiles(cache, arch, params):
    from qmoe_rtc.specialize import ModuleSpec

    spec = ModuleSpec.make("route", **params)
    mod = get_cubin(spec_unit(spec), arch)
    assert mod.cubin[:4] == b"\x7fELF"
    assert set(mod.lowered) == {k.key for k in FAM.kernels(spec)}
    assert all(v.startswith("_ZN4qmoe") for v in mod.lowered.values())


def test_problem_slots_view():
    p = problem(cfg(E=60, k=4, S=3, gate=True), rows=5)
    assert (p.slots, p.experts, p.routes) == (7, 63, 35)
    assert problem_scalars(p)["E_routed"] == 60 and problem_scalars(p)["k_routed"] == 4
    assert dataclasses.replace(p, shared=0).routes == 20


def test_router_gemm_split_follows_the_devices_sm_count():
    """The K split's warp target scales with the device's multiprocessors (an H200's 132 give 2048)."""
    from dataclasses import replace

    assert rt.target_warps(132) == rt.TARGET_WARPS == 2048 and rt.target_warps(66) == 1024
    c = cfg(E=512, H=2048, rgemm="bfloat16")
    p = problem(c, 1)
    big = FAM.launch(FAM.spec(c), "logits", p).block[0] // 32
    small = FAM.launch(FAM.spec(c), "logits", replace(p, sms=8)).block[0] // 32
    assert big == 16 and small < big  # 32 blocks: 16 warps each on an H200, fewer when 8 SMs hold them
