"""GPU: the route family's [ext] kernels launched directly, against NumPy (skipped without a GPU).

Routing with shared slots (with and without the sigmoid gate), the sparse mixer and the router_weights
gather with S > 0, S = 0 bit-identical to the routed slots of S > 0; the router GEMM against float64
x·Wᵀ + b for float32 / float16 / bfloat16 weights, every kernel kind, scalar-tail and misaligned
inputs; the GEMM feeding routing. Fresh random data per case; outputs are poisoned before each launch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.reference import route as reference_route
from qmoe_rtc.kernels import Problem, get_family
from qmoe_rtc.kernels import route as rt
from qmoe_rtc.runtime.plan import problem_scalars
from qmoe_rtc.specialize import ModuleSpec

pytestmark = pytest.mark.gpu

FAM = get_family("route")
BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
DTYPES = ("float32", "float16", "bfloat16")


def dev(a, offset: int = 0):
    """A NumPy array on the device (bfloat16 as its uint16 bits); ``offset`` elements into a larger
    buffer, so that the array is not 16-byte aligned."""
    import cupy as cp

    if a is None:
        return None
    flat = np.ascontiguousarray(a).reshape(-1)
    if a.dtype == BF16:
        flat = flat.view(np.uint16)
    if not offset:
        return cp.asarray(flat)
    buf = cp.zeros(flat.size + offset, dtype=flat.dtype)
    buf[offset:] = cp.asarray(flat)
    return buf[offset:]


def module(dtype: str, gate=False, rgemm=False, warp=False):
    """The route module (``warp``: the warp-per-row one, see ``kernels.route.routes_by_warp``)."""
    from qmoe_rtc.jit import load_module

    ext = {**({"gate": 1} if gate else {}), **({"rgemm": 1} if rgemm else {}), **({"warp": 1} if warp else {})}
    spec = ModuleSpec.make("route", dtype=dtype, **ext)
    return spec, load_module(FAM.unit(spec))


def step(mod, spec, role: str, p: Problem, kind: str | None = None, **arrays):
    """Launch the kernel the family picks for ``role`` at ``p`` (or the router GEMM ``kind``), binding
    every argument by name as the plan does."""
    if role == "logits" and kind:
        key, launch = rt.logits_key(p.router_gemm, kind), rt.logits_geometry(p, kind)[1]
    else:
        key, launch = FAM.kernel_for(spec, role, p), FAM.launch(spec, role, p)
    kern = mod[key]
    values = dict(problem_scalars(p), **dict(launch.args), **arrays)
    kern(launch.grid, launch.block, [values.get(n) for n in kern.kdef.arg_names()], shared_mem=launch.shared_mem)


def sigmoid_gate(x, g):
    return 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ g.astype(np.float64))))


# ---- routing with shared slots ---------------------------------------------------------------------------

def run_route(rng, dtype, lt, rows, E, k, S, gate, rw_dt=None, normalize=False, sparse=False, H=256, offset=0,
              data=None):
    """(ids [rows, k + S], weights [rows, k + S], inputs) of one routing launch on fresh (or given) data."""
    import cupy as cp

    spec, mod = module(dtype, gate=gate, warp=rt.routes_by_warp(E, sparse, gate))
    if data is None:
        data = dict(logits=rng.standard_normal((rows, E)).astype(np.float32).astype(NP[lt]),
                    rw=rng.uniform(0.05 if normalize else -0.5, 1.0, (rows, E)).astype(np.float32).astype(NP[rw_dt])
                    if rw_dt else None,  # normalised: no sums near 0 (their float32 rounding is not the point)
                    x=rng.standard_normal((rows, H)).astype(np.float32).astype(NP[dtype]),
                    g=(rng.standard_normal(H) / np.sqrt(H)).astype(np.float32))
    slots = k + S
    ids = cp.full(rows * slots, -7, dtype=cp.int32)
    w = cp.full(rows * slots, np.nan, dtype=cp.float32)
    p = Problem(rows=rows, E=E, H=H, I=32, k=k, dtype=dtype, router_dtype=lt, router_weights_dtype=rw_dt,
                sparse=sparse, shared=S, shared_gate=gate)
    step(mod, spec, "route", p, logits=dev(data["logits"]), router_weights=dev(data["rw"]), normalize=int(normalize),
         x=dev(data["x"], offset) if gate else None, shared_gate_weight=dev(data["g"]) if gate else None,
         topk_ids=ids, topk_w=w)
    return ids.get().reshape(rows, slots), w.get().reshape(rows, slots), data


def check_route(ids, w, data, k, S, gate, normalize=False, sparse=False):
    rows = ids.shape[0]
    E = data["logits"].shape[1]
    attrs = QMoEAttributes.from_kwargs(k=k, normalize_routing_weights=int(normalize), use_sparse_mixer=int(sparse))
    want_ids, want_w = reference_route(data["logits"].astype(np.float32), attrs, data["rw"])
    np.testing.assert_array_equal(ids[:, :k], want_ids)
    np.testing.assert_allclose(w[:, :k], want_w, rtol=2e-5, atol=1e-8)
    np.testing.assert_array_equal(ids[:, k:], np.broadcast_to(E + np.arange(S), (rows, S)))
    if gate:
        d_abs = np.abs(data["x"].astype(np.float64)) @ np.abs(data["g"].astype(np.float64))
        want = np.broadcast_to(sigmoid_gate(data["x"], data["g"])[:, None], (rows, S))
        assert np.all(np.abs(w[:, k:] - want) <= 1e-6 * (1.0 + d_abs)[:, None])
    else:
        assert np.all(w[:, k:] == 1.0)


ROUTE_CASES = [  # rows, E, k, S, gate, router_weights dtype ("T": the activation dtype), normalize, logits ("T")
    (1, 8, 2, 0, False, None, True, "float32"),
    (7, 60, 4, 1, False, None, False, "float32"),
    (300, 512, 8, 2, True, None, True, "T"),
    (64, 128, 6, 2, True, "float32", True, "float32"),
    (7, 60, 4, 3, False, "T", False, "T"),
    (5, 512, 32, 1, True, "T", True, "float32"),  # 33 slots
    (33, 256, 1, 4, True, None, False, "T"),
    (4097, 128, 8, 0, False, None, True, "float32"),  # one warp per row (routing/route_warp.cuh), last block part full
    (9, 256, 32, 2, False, "float32", False, "T"),  # the warp kernel's largest E and k
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "r{}-E{}-k{}-S{}-g{:d}-rw{}-n{:d}-l{}".format(*c))
@pytest.mark.parametrize("H", [256, 100, 2880])
def test_route_with_shared_slots(rng, dtype, case, H):
    rows, E, k, S, gate, rw, normalize, lt = case
    rw = dtype if rw == "T" else rw
    lt = dtype if lt == "T" else lt
    ids, w, data = run_route(rng, dtype, lt, rows, E, k, S, gate, rw, normalize, H=H)
    check_route(ids, w, data, k, S, gate, normalize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,E,S,gate,lt", [(7, 16, 1, False, "float32"), (33, 60, 2, True, "T"),
                                              (300, 512, 3, True, "float32")])
def test_sparse_mixer_with_shared_slots(rng, dtype, rows, E, S, gate, lt):
    lt = dtype if lt == "T" else lt
    ids, w, data = run_route(rng, dtype, lt, rows, E, 2, S, gate, sparse=True, H=512)
    check_route(ids, w, data, 2, S, gate, sparse=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sparse,rw", [(False, None), (False, "float32"), (True, None)])
def test_no_shared_slots_is_bit_identical_to_the_routed_slots(rng, dtype, sparse, rw):
    rows, E, k = 19, 100, 2 if sparse else 6
    ids0, w0, data = run_route(rng, dtype, "float32", rows, E, k, 0, False, rw, True, sparse=sparse)
    ids2, w2, _ = run_route(rng, dtype, "float32", rows, E, k, 2, False, rw, True, sparse=sparse, data=data)
    np.testing.assert_array_equal(ids2[:, :k], ids0)
    np.testing.assert_array_equal(w2[:, :k].view(np.uint32), w0.view(np.uint32))
    idsg, wg, _ = run_route(rng, dtype, "float32", rows, E, k, 2, True, rw, True, sparse=sparse, data=data)
    np.testing.assert_array_equal(idsg[:, :k], ids0)  # the gate changes only the shared slots
    np.testing.assert_allclose(wg[:, :k], w0, rtol=1e-6, atol=0)
    check_route(ids0, w0, data, k, 0, False, True, sparse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_is_the_same_sum_with_vector_and_scalar_loads(rng, dtype):
    """A misaligned x takes element loads: the same FMAs in the same order, so the same bits."""
    ids_a, w_a, data = run_route(rng, dtype, "float32", 9, 64, 4, 2, True, H=1024)
    ids_m, w_m, _ = run_route(rng, dtype, "float32", 9, 64, 4, 2, True, H=1024, offset=1, data=data)
    np.testing.assert_array_equal(ids_a, ids_m)
    np.testing.assert_array_equal(w_a.view(np.uint32), w_m.view(np.uint32))
    check_route(ids_a, w_a, data, 4, 2, True)


# ---- the router GEMM -------------------------------------------------------------------------------------

GEMM_PAIRS = [("float32", "float32"), ("float16", "float32"), ("bfloat16", "float32"), ("float16", "float16"),
              ("bfloat16", "bfloat16")]  # (activation dtype, router_weight dtype)


def run_logits(rng, dtype, wt, rows, E, H, bias=True, kind=None, offset=0, data=None):
    """(router_logits [rows, E], float64 reference, Σ|x·w| + |b| per element, data)."""
    import cupy as cp

    spec, mod = module(dtype, rgemm=True, warp=rt.routes_by_warp(E, False, False))  # the module a layer of E gets
    if data is None:
        data = dict(x=rng.standard_normal((rows, H)).astype(np.float32).astype(NP[dtype]),
                    W=(rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32).astype(NP[wt]),
                    b=rng.standard_normal(E).astype(np.float32) if bias else None)
    out = cp.full(rows * E, np.nan, dtype=cp.float32)
    p = Problem(rows=rows, E=E, H=H, I=32, k=1, dtype=dtype, router_gemm=wt)
    step(mod, spec, "logits", p, kind, x=dev(data["x"], offset), router_weight=dev(data["W"], offset),
         router_bias=dev(data["b"]), router_logits=out)
    x64, w64 = data["x"].astype(np.float64), data["W"].astype(np.float64)
    b64 = np.zeros(E) if data["b"] is None else data["b"].astype(np.float64)
    return out.get().reshape(rows, E), x64 @ w64.T + b64, np.abs(x64) @ np.abs(w64).T + np.abs(b64), data


def check_logits(got, want, scale, tensor_cores: bool):
    assert np.isfinite(got).all()  # every element written
    tol = (5e-5 if tensor_cores else 1e-5) * scale + 1e-30
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} beyond tolerance, worst {np.max(np.abs(got - want) / scale)}"


@pytest.mark.parametrize("dtype,wt", GEMM_PAIRS)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("E", [8, 60, 256, 512])
@pytest.mark.parametrize("H", [64, 2048, 2880])
def test_router_logits_match_float64(rng, dtype, wt, rows, E, H):
    got, want, scale, _ = run_logits(rng, dtype, wt, rows, E, H, bias=rows in (7, 300))
    check_logits(got, want, scale, wt != "float32")


@pytest.mark.parametrize("dtype,wt", GEMM_PAIRS)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("H,offset", [(2880, 0), (100, 0), (1032, 1)])  # H % 8 != 0, misaligned: element loads
def test_every_logits_kind(rng, dtype, wt, rows, H, offset):
    kinds = ("gemv", "tiled") if wt == "float32" else ("mma", "mma_tiled")
    data = None
    results = []
    for kind in kinds:
        got, want, scale, data = run_logits(rng, dtype, wt, rows, 60, H, kind=kind, offset=offset, data=data)
        check_logits(got, want, scale, wt != "float32")
        results.append(got)
    again = run_logits(rng, dtype, wt, rows, 60, H, kind=kinds[0], offset=offset, data=data)[0]
    np.testing.assert_array_equal(again.view(np.uint32), results[0].view(np.uint32))  # deterministic


@pytest.mark.parametrize("dtype,wt", GEMM_PAIRS)
@pytest.mark.parametrize("rows,S,gate,rw", [(1, 0, False, None), (7, 2, True, "float32"), (300, 1, False, None)])
def test_router_gemm_feeds_routing(rng, dtype, wt, rows, S, gate, rw):
    """The logits step writes router_logits; the route step's gemm variant reads it (as the plan binds)."""
    import cupy as cp

    E, H, k = 128, 512, 4
    spec, mod = module(dtype, gate=gate, rgemm=True, warp=rt.routes_by_warp(E, False, gate))
    x = rng.standard_normal((rows, H)).astype(np.float32).astype(NP[dtype])
    W = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32).astype(NP[wt])
    g = (rng.standard_normal(H) / np.sqrt(H)).astype(np.float32)
    rwa = rng.uniform(0.0, 1.0, (rows, E)).astype(np.float32) if rw else None
    p = Problem(rows=rows, E=E, H=H, I=32, k=k, dtype=dtype, router_weights_dtype=rw, shared=S, shared_gate=gate,
                router_gemm=wt)
    lg = cp.full(rows * E, np.nan, dtype=cp.float32)
    ids = cp.full(rows * (k + S), -7, dtype=cp.int32)
    w = cp.full(rows * (k + S), np.nan, dtype=cp.float32)
    xd = dev(x)
    step(mod, spec, "logits", p, x=xd, router_weight=dev(W), router_bias=None, router_logits=lg)
    step(mod, spec, "route", p, router_logits=lg, router_weights=dev(rwa), normalize=1, x=xd,
         shared_gate_weight=dev(g) if gate else None, topk_ids=ids, topk_w=w)
    logits = lg.get().reshape(rows, E)
    want = x.astype(np.float64) @ W.astype(np.float64).T
    check_logits(logits, want, np.abs(x.astype(np.float64)) @ np.abs(W.astype(np.float64)).T, wt != "float32")
    check_route(ids.get().reshape(rows, k + S), w.get().reshape(rows, k + S), dict(logits=logits, rw=rwa, x=x, g=g),
                k, S, gate, normalize=True)
