"""Kernel family ``route``: softmax top-k routing (and the Phi-3.5 sparse mixer), one warp per row (up to
256 experts, no sparse mixer, no shared-expert gate) or one block per row, or grouped sigmoid routing [ext]
(one block per row), with the shared experts [ext] as every row's last S slots (role ``route``); and the
router GEMM [ext], the layer's own float32 logits (role ``logits``).

Templates: ``cuda_src/routing/route.cuh``: ``qmoe::route_topk<LT, WT, T, HAS_RW, SPARSE, GATE, COUNT>``;
``cuda_src/routing/route_warp.cuh``: ``qmoe::route_topk_warp<LT, WT, HAS_RW, COUNT>`` (``warp`` modules);
``cuda_src/routing/route_grouped.cuh``: ``qmoe::route_grouped<LT, WT, T, HAS_RW, GATE, COUNT>`` (``sigmoid`` modules);
``cuda_src/routing/router_gemm.cuh``: ``qmoe::router_logits_mma<T, MT, NT, U, KMAX>`` (router_weight in
T: tensor cores), ``router_logits_gemv<T>`` and ``router_logits_tiled<T>`` (router_weight in float32).

One module per activation dtype holds every logits / router-weights dtype combination (float32 or T).
Five [ext] parameters, set from the :class:`~qmoe_rtc.specialize.ModelConfig` (not the layout, so
``depends_on`` stays the dtype): ``gate`` (the shared experts have a sigmoid gate: the gated variants
instead of the plain ones), ``rgemm`` (the layer computes its logits: both router-GEMM weight dtypes, and
routing variants that read the GEMM's float32 ``router_logits`` scratch instead of the call's ``logits``)
``warp`` (:func:`routes_by_warp`: the module holds only the warp-per-row kernels, no block kernels
and no sparse mixer; bf16 on a 2-core CPU: 0.52–0.72 s against 0.68–1.04 s for the block module),
``sigmoid`` (the layer routes by grouped sigmoid scores [ext]: the module holds only those kernels; its
``n_group``, ``groups_kept`` and ``routed_scaling`` are the layer's scalars, not code) and ``counts`` (expert
statistics [ext]: the kernels add each routed pick to the layer's ``expert_counts`` [E] int64; without it they
never read the pointer).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KnobError, QMoEUnsupportedError
from ..jit import KernelDef, Launch, Ptr, Scalar
from ..settings import knobs
from ..specialize import CPP_TYPES, ModuleSpec
from .arch import DEFAULT_SMS
from .base import KernelFamily, Problem, Slot, register

THREADS = 128  # kRouteThreads
WARP_HEADER = "routing/route_warp.cuh"
WARP_ROWS = 4  # kRouteWarpRows: rows (one warp each) per block of the warp-per-row kernel
WARP_MAX_EXPERTS = 256  # kRouteWarpMaxExperts
MAX_EXPERTS = 512  # kRouteMaxExperts
MAX_K = 32  # kRouteMaxK
GEMM_HEADER = "routing/router_gemm.cuh"
GROUPED_HEADER = "routing/route_grouped.cuh"
MAX_GROUPS = 128  # kRouteThreads: a group's value and kept flag per thread of the block

#: Router GEMM geometry (router_gemm.cuh). Tensor cores: (MT, NT, U, KMAX) = 16·MT experts × 8·NT rows
#: per block, U steps of 32 k per round, at most KMAX K-split warps. The row switches are not measured.
MMA_SMALL = (1, 2, 4, 16)  # rows <= MMA_SMALL_ROWS: 16 × 16 tiles, up to 16 warps over K
MMA_LARGE = (2, 8, 2, 4)  # 32 × 64 tiles, up to 4 warps over K
MMA_SMALL_ROWS = 256
GEMV_TE, GEMV_RB, GEMV_MAX_WARPS = 4, 8, 16  # kRgTE, kRgRB, kRgMaxWarps
GEMV_ROWS = 64  # float32 router_weight: the gemv kernel up to here, the tiled one above
TILE, TILE_THREADS = 64, 256  # kRgTile, kRgTileThreads
#: K splits grow until the grid has about this many warps on a device of DEFAULT_SMS (an H200's 132,
#: ~16 per SM), scaled by the device's own multiprocessor count
TARGET_WARPS = 2048
MAX_GRID_Y = 65535


def kernel_key(logits_dtype: str, rw_dtype: str | None, sparse: bool, gate: bool = False, sigmoid: bool = False) -> str:
    """Routing kernel key; ``logits_dtype`` "gemm": reads the router GEMM's float32 ``router_logits``; ``sigmoid``:
    grouped sigmoid routing [ext]."""
    head = "sparse" if sparse else "grouped" if sigmoid else "topk"
    key = f"{head}_{logits_dtype}" + (f"_rw_{rw_dtype}" if rw_dtype and not sparse else "")
    return key + ("_gate" if gate else "")


def routes_by_warp(logits: int, sparse: bool, gate: bool, sigmoid: bool = False) -> bool:
    """Whether a layer routes one warp per row (routing/route_warp.cuh): up to WARP_MAX_EXPERTS logits a
    row, softmax routing without the sparse mixer, no shared-expert gate; else one block per row
    (routing/route.cuh, or routing/route_grouped.cuh for grouped sigmoid routing [ext])."""
    return logits <= WARP_MAX_EXPERTS and not sparse and not gate and not sigmoid


def warp_kernel(problem: Problem) -> bool:
    """:func:`routes_by_warp` for a problem."""
    return routes_by_warp(problem.logit_count, problem.sparse, bool(problem.shared_gate), problem.sigmoid_routing)


#: routing/route_group.cuh: routing and grouping in one block. kLeadMaxRoutes (the ids' copy in shared memory), and
#: the routes up to which ``route_in_group`` 'auto' takes it: measured (H100, one process, the peers' layers) 0.5-2.9 %
#: faster up to 64 routes (gpt-oss-120b 8 tokens, mixtral-8x7b 4-32, qwen3-30b-a3b 4-8, ort-2048 4-32), slower from
#: 128 (its one block routes 32 rows at a time and writes a 128-expert layer's tile table alone: qwen3 64 tokens
#: +5.7 %, ort 64 +3.7 %, gpt-oss 32-64 +1.1 to +1.8 %). At 64 routes gpt-oss 16 tokens (the wgmma engine, whose
#: tile table that one block writes with L2 reads) is taken though 0.4-0.6 % slower (H200 / H100).
LEAD_MAX_ROUTES = 2048
LEAD_ROUTES = 64


def _routed_inside(knob: str, problem: Problem) -> str | None:
    """The mode of ``knob`` ('auto' / 'on'), or None where no other launch may route the call: the knob 'off', or a layer
    or call the warp kernel's code cannot route (:func:`warp_kernel`: softmax a warp a row), a router GEMM or expert
    statistics [ext], router weights [ext] (their routing keeps its own launch: fewer kernels for the engines' modules
    to compile), or logits neither float32 nor the activation dtype."""
    mode = knobs.get(knob)
    if mode not in ("auto", "on", "off"):
        raise KnobError(knobs.label(knob), "one of ['auto', 'on', 'off']", repr(mode))
    if (mode == "off" or not warp_kernel(problem) or problem.router_gemm or problem.expert_counts
            or problem.router_weights_dtype or problem.router_dtype not in ("float32", problem.dtype)):
        return None
    return mode


def routes_in_group(problem: Problem) -> bool:
    """Whether a grouped (prefill-path) engine's first launch routes the call itself, a warp a row, and groups its routes
    in the same block (routing/route_group.cuh; the wgmma engine's also does wg_prepare's work): one launch instead of
    the routing kernel's and the grouping's (and wg_prepare's). The pipelines drop the steps it absorbs (their
    ``into``), the grouped families launch its kernel for their group step: both read this one decision. Only where
    another launch may route the call (:func:`_routed_inside`), at most LEAD_MAX_ROUTES routes; knob
    ``route_in_group``: 'auto' up to LEAD_ROUTES routes (rows·(k + S)), 'on' up to LEAD_MAX_ROUTES, 'off' never."""
    mode = _routed_inside("route_in_group", problem)
    return mode is not None and 0 < problem.routes <= (LEAD_MAX_ROUTES if mode == "on" else LEAD_ROUTES)


#: engines/self_route.cuh: a decode block routes the call itself. The routes it takes at most (FC2's weights in shared
#: memory; the decode module's generated unit hands the device this value), and the rows one block routes, a warp each
#: (kernels/mma_decode.py WARPS, which tests/kernels/test_self_route.py checks).
SELF_ROUTE_MAX_ROUTES = 64
SELF_ROUTE_ROWS = 4


def routes_in_decode(problem: Problem) -> bool:
    """Whether the tensor-core decode kernels route the call themselves (engines/self_route.cuh): every FC1 and FC2
    block reads the logits and routes the call's rows a warp a row, as the routing kernel does, so the forward has no
    routing launch and FC1's blocks know their experts without waiting for another kernel's ids. The decode pipeline
    drops its routing step (its ``into``), the decode family passes the kernels ``self_route``: both read this one
    decision. Only where another launch may route the call (:func:`_routed_inside`), at most SELF_ROUTE_ROWS rows and
    SELF_ROUTE_MAX_ROUTES routes (rows·(k + S)); knob ``route_in_decode``: 'auto' / 'on' there, 'off' never. Off by
    default: the kernels compile and their plans are checked on the CPU, but their GPU tests and timings have not run
    yet (docs/performance-log.md)."""
    return (_routed_inside("route_in_decode", problem) is not None and 0 < problem.rows <= SELF_ROUTE_ROWS
            and problem.routes <= SELF_ROUTE_MAX_ROUTES)


def routes_inside(role: str, problem: Problem) -> bool:
    """Whether the step of ``role`` routes the call itself at ``problem`` (a pipeline's routing step with ``into`` =
    role is then not launched): 'group' (:func:`routes_in_group`), 'fc1' (:func:`routes_in_decode`)."""
    if role == "group":
        return routes_in_group(problem)
    if role == "fc1":
        return routes_in_decode(problem)
    raise QMoEUnsupportedError(f"no step of role {role!r} routes a call itself (only 'group' and 'fc1')")


def logits_key(weight_dtype: str, kind: str) -> str:
    """Router GEMM kernel key: ``kind`` "gemv" / "tiled" (float32 weight), "mma" / "mma_tiled" (T)."""
    return f"logits_{weight_dtype}_{kind}"


COUNTS_ARG = Ptr("expert_counts", "int64", nullable=True)  # [E] i64, read by the ``counts`` modules only


def _warp_args(lt: str, wt: str, gemm: bool) -> tuple:
    return (Ptr("router_logits" if gemm else "logits", lt), Ptr("router_weights", wt, nullable=True),
            Scalar("rows", "int32"), Scalar("E_logits", "int32"), Scalar("k_routed", "int32"), Scalar("S", "int32"),
            Scalar("normalize", "int32"), Scalar("E_routed", "int32"), Ptr("expert_map", "int32", nullable=True),
            Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"), COUNTS_ARG)


def _route_args(lt: str, wt: str, t: str, gemm: bool) -> tuple:
    return (Ptr("router_logits" if gemm else "logits", lt), Ptr("router_weights", wt, nullable=True),
            Scalar("rows", "int32"), Scalar("E_logits", "int32"), Scalar("k_routed", "int32"), Scalar("S", "int32"),
            Scalar("H", "int32"), Scalar("normalize", "int32"), Ptr("x", t, nullable=True),
            Ptr("shared_gate_weight", "float32", nullable=True), Scalar("E_routed", "int32"),
            Ptr("expert_map", "int32", nullable=True), Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"), COUNTS_ARG)


def _grouped_args(lt: str, wt: str, t: str, gemm: bool) -> tuple:
    head = _route_args(lt, wt, t, gemm)[:-3]  # every argument of the block kernel but the outputs
    return (*head, Ptr("router_score_bias", "float32", nullable=True), Scalar("n_group", "int32"),
            Scalar("groups_kept", "int32"), Scalar("routed_scaling", "float32"), Ptr("topk_ids", "int32"),
            Ptr("topk_w", "float32"), COUNTS_ARG)


def _gemm_args(t: str, wt: str) -> tuple:
    return (Ptr("x", t), Ptr("router_weight", wt), Ptr("router_bias", "float32", nullable=True),
            Scalar("rows", "int32"), Scalar("E_logits", "int32"), Scalar("H", "int32"), Ptr("router_logits", "float32"))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def target_warps(sms: int) -> int:
    """The router GEMM's warp target on a device of ``sms`` multiprocessors (TARGET_WARPS on an H200)."""
    return TARGET_WARPS * sms // DEFAULT_SMS


def _k_split(blocks: int, work: int, most: int, sms: int) -> int:
    """Warps per block over K: doubled while the grid stays under the device's warp target and each warp
    keeps work."""
    kw = 1
    while kw * 2 <= most and blocks * kw * 2 <= target_warps(sms) and kw * 2 <= work:
        kw *= 2
    return kw


def logits_kind(problem: Problem) -> str:
    """Which router GEMM kernel runs ``problem`` (``problem.router_gemm``: the weight dtype)."""
    if problem.router_gemm == "float32":
        return "gemv" if problem.rows <= GEMV_ROWS else "tiled"
    return "mma" if problem.rows <= MMA_SMALL_ROWS else "mma_tiled"


def logits_geometry(problem: Problem, kind: str | None = None) -> tuple[str, Launch]:
    """(kind, launch) of the router GEMM for ``problem``; ``kind`` forces one (tests)."""
    kind = kind or logits_kind(problem)
    rows, E, H = problem.rows, problem.logit_count, problem.H
    if kind == "gemv":
        gx, gy = _cdiv(E, GEMV_TE), _cdiv(rows, GEMV_RB)
        kw = _k_split(gx * gy, _cdiv(_cdiv(H, 8), 32), GEMV_MAX_WARPS, problem.sm_count)
        return kind, Launch((gx, gy, 1), (32 * kw, 1, 1), 0)
    if kind == "tiled":
        return kind, Launch((_cdiv(E, TILE), _cdiv(rows, TILE), 1), (TILE_THREADS, 1, 1), 0)
    mt, nt, u, most = MMA_SMALL if kind == "mma" else MMA_LARGE
    gx, gy = _cdiv(E, 16 * mt), _cdiv(rows, 8 * nt)
    kw = _k_split(gx * gy, _cdiv(_cdiv(H, 32), u), most, problem.sm_count)
    return kind, Launch((gx, gy, 1), (32 * kw, 1, 1), (kw - 1) * mt * nt * 4 * 32 * 4)


@dataclass(frozen=True)
class RouteCall:
    """One call's choices (:meth:`RouteFamily.configure`), made once per plan and read by the kernel choice and the
    launches."""

    key: str  # the routing kernel (kernel_key; '_warp': one warp a row)
    grid: int  # the routing launch's blocks: one a row, or WARP_ROWS rows (one warp each) a block
    threads: int  # its threads a block: THREADS, or a warp a row
    logits: str  # the router GEMM's kind (logits_kind: gemv / tiled / mma / mma_tiled), '' without one
    logits_launch: Launch | None  # its grid, block (the K-split warps) and shared memory (logits_geometry)


@register
class RouteFamily(KernelFamily):
    name = "route"
    header = "routing/route.cuh"
    depends_on = ("dtype",)

    def spec(self, config) -> ModuleSpec:
        layout = getattr(config, "layout", config)
        ext = {}
        if getattr(config, "shared_gate", False):
            ext["gate"] = 1
        if getattr(config, "router_gemm", ""):
            ext["rgemm"] = 1
        if getattr(config, "expert_counts", False):
            ext["counts"] = 1
        if getattr(config, "scoring_func", "softmax") == "sigmoid":
            ext["sigmoid"] = 1
        elif config is not layout and routes_by_warp(config.all_experts or config.experts, config.use_sparse_mixer,
                                                     config.shared_gate):
            ext["warp"] = 1
        return ModuleSpec.make(self.name, dtype=layout.dtype, **ext)

    def source(self, spec: ModuleSpec) -> str:
        src = super().source(spec)
        if spec.get("warp"):
            src = src.replace(f'#include "{self.header}"\n', f'#include "{self.header}"\n#include "{WARP_HEADER}"\n')
        if spec.get("rgemm"):
            src = src.replace(f'#include "{self.header}"\n', f'#include "{self.header}"\n#include "{GEMM_HEADER}"\n')
        if spec.get("sigmoid"):
            src = src.replace(f'#include "{self.header}"\n', f'#include "{self.header}"\n#include "{GROUPED_HEADER}"\n')
        return src

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        T = spec["dtype"]
        dts = ["float32"] if T == "float32" else ["float32", T]
        gate, rgemm, warp = bool(spec.get("gate")), bool(spec.get("rgemm")), bool(spec.get("warp"))
        sigmoid = bool(spec.get("sigmoid"))
        g = "true" if gate else "false"
        n = "true" if spec.get("counts") else "false"  # expert statistics [ext]
        CT = CPP_TYPES[T]
        out = []
        for lt in ["gemm"] if rgemm else dts:  # "gemm": the router GEMM's float32 logits
            ltype = "float32" if lt == "gemm" else lt
            L = CPP_TYPES[ltype]
            for rw in [None, *dts]:
                flag = "true" if rw else "false"
                if sigmoid:  # a sigmoid module holds only these (its layer routes by nothing else)
                    out.append(KernelDef(kernel_key(lt, rw, False, gate, sigmoid=True),
                                         f"qmoe::route_grouped<{L}, {CPP_TYPES[rw or ltype]}, {CT}, {flag}, {g}, {n}>",
                                         _grouped_args(ltype, rw or ltype, T, rgemm)))
                elif warp:  # a warp module holds only these (its layer has no sparse mixer and no gate)
                    out.append(KernelDef(kernel_key(lt, rw, False) + "_warp",
                                         f"qmoe::route_topk_warp<{L}, {CPP_TYPES[rw or ltype]}, {flag}, {n}>",
                                         _warp_args(ltype, rw or ltype, rgemm)))
                else:
                    out.append(KernelDef(kernel_key(lt, rw, False, gate),
                                         f"qmoe::route_topk<{L}, {CPP_TYPES[rw or ltype]}, {CT}, {flag}, false, {g}, {n}>",
                                         _route_args(ltype, rw or ltype, T, rgemm)))
            if not warp and not sigmoid:
                out.append(KernelDef(kernel_key(lt, None, True, gate),
                                     f"qmoe::route_topk<{L}, {L}, {CT}, false, true, {g}, {n}>",
                                     _route_args(ltype, ltype, T, rgemm)))
        if rgemm:
            out += [KernelDef(logits_key("float32", "gemv"), f"qmoe::router_logits_gemv<{CT}>", _gemm_args(T, "float32")),
                    KernelDef(logits_key("float32", "tiled"), f"qmoe::router_logits_tiled<{CT}>",
                              _gemm_args(T, "float32"))]
            if T != "float32":
                for kind, cfg in (("mma", MMA_SMALL), ("mma_tiled", MMA_LARGE)):
                    out.append(KernelDef(logits_key(T, kind), f"qmoe::router_logits_mma<{CT}, {', '.join(map(str, cfg))}>",
                                         _gemm_args(T, T)))
        return tuple(out)

    def supports(self, config, problem: Problem | None = None) -> str | None:
        E = config.all_experts or config.experts  # routing sees all of a slice's layer [ext]
        if E > MAX_EXPERTS:
            return f"{E} experts (routing handles at most {MAX_EXPERTS})"
        if config.k > MAX_K:
            return f"k = {config.k} (routing handles at most {MAX_K})"
        if getattr(config, "n_group", 0) > MAX_GROUPS:
            return f"n_group = {config.n_group} (grouped routing handles at most {MAX_GROUPS} groups)"
        rg = getattr(config, "router_gemm", "")
        if rg and rg not in ("float32", config.layout.dtype):
            return (f"router_weight in {rg} with {config.layout.dtype} activations (the router GEMM takes float32 "
                    "or the activation dtype)")
        if rg and problem is not None and _cdiv(problem.rows, TILE) > MAX_GRID_Y:
            return f"{problem.rows} rows (the router GEMM's grid holds at most {MAX_GRID_Y * TILE})"
        return None

    def configure(self, spec: ModuleSpec, problem: Problem) -> RouteCall:
        """The call's routing kernel and grid and its router GEMM's kind and geometry, each decided here once; refused
        where the module was made for another kind of layer (shared-expert gate, router GEMM, a warp or a block a
        row)."""
        gate, rgemm, warp = bool(spec.get("gate")), bool(spec.get("rgemm")), bool(spec.get("warp"))
        sigmoid = bool(spec.get("sigmoid"))
        if gate != bool(problem.shared_gate) or rgemm != bool(problem.router_gemm) or sigmoid != problem.sigmoid_routing:
            raise QMoEUnsupportedError(f"module {spec.name} was made for shared_gate={gate}, router GEMM={rgemm}, "
                                       f"sigmoid routing={sigmoid}; the problem has shared_gate={problem.shared_gate}, "
                                       f"router_gemm={problem.router_gemm!r}, sigmoid routing={problem.sigmoid_routing}")
        if warp != warp_kernel(problem):
            raise QMoEUnsupportedError(f"module {spec.name} routes one {'warp' if warp else 'block'} per row; the "
                                       f"problem ({problem.logit_count} experts, sparse mixer {problem.sparse}, "
                                       f"shared gate {problem.shared_gate}) needs the other kind")
        lt = "gemm" if rgemm else problem.router_dtype
        key = kernel_key(lt, problem.router_weights_dtype, problem.sparse, gate, sigmoid) + ("_warp" if warp else "")
        kind, logits = logits_geometry(problem) if problem.router_gemm else ("", None)
        grid, threads = (_cdiv(problem.rows, WARP_ROWS), 32 * WARP_ROWS) if warp else (problem.rows, THREADS)
        return RouteCall(key, grid, threads, kind, logits)

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call: RouteCall | None = None) -> str:
        c = call or self.configure(spec, problem)
        if role == "logits":
            return logits_key(problem.router_gemm, self._logits(spec, problem, c))
        return c.key

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call: RouteCall | None = None) -> Launch:
        c = call or self.configure(spec, problem)
        if role == "logits":
            self._logits(spec, problem, c)
            return c.logits_launch
        return Launch((c.grid, 1, 1), (c.threads, 1, 1), 0, overlap=True)  # waits for the router GEMM

    @staticmethod
    def _logits(spec: ModuleSpec, problem: Problem, call: RouteCall) -> str:
        """The call's router GEMM kind, refused where the module or the problem has none."""
        if not call.logits:
            raise QMoEUnsupportedError(f"module {spec.name} has no router GEMM for this problem (router_gemm "
                                       f"{problem.router_gemm!r}): make the spec from a config with router_gemm")
        return call.logits

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call: RouteCall | None = None) -> dict[str, Slot]:
        """The step's buffers, sized by the problem alone (no choice of the call's)."""
        logits = {"router_logits": Slot(4 * problem.rows * problem.logit_count)} if problem.router_gemm else {}  # [rows, E] f32
        if role == "logits":
            return logits
        R = problem.routes  # rows·(k + S)
        return {"topk_ids": Slot(4 * R), "topk_w": Slot(4 * R), **logits}  # [R] i32, [R] f32
