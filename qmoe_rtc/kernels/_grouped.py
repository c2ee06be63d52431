"""What the grouped (prefill) families share: the grouping kernel, the combine kernel, the scratch of
the grouped path, and the tile grid of the tensor-core GEMMs.

The grouping (``group_by_expert``, routing/group.cuh) is a stable counting sort: ``sorted`` lists each
expert's routes in ascending route id, the same on every launch (``np.argsort(ids, kind="stable")`` with
ids of -1 left out), so which routes share a GEMM tile never depends on the GPU's timing and a graph replay
computes every route exactly as an eager call does."""

from __future__ import annotations

from ..errors import KnobError
from ..jit import KernelDef, Launch, Ptr, Scalar
from ..settings import knobs
from ..specialize import CPP_TYPES, ModuleSpec
from ._expert import gate_of
from .base import Problem, Slot
from .route import routes_in_group

GROUP_THREADS = 1024  # kGroupThreads
GROUP_MAX_EXPERTS = 1023  # kGroupMaxExperts: routed + shared experts [ext] (the kernel takes 256 a pass)
COMBINE_THREADS = 256  # at most; a thread owns COMBINE_COLS columns of a row
COMBINE_COLS = 8  # kCombineCols
GROUP = 8  # route tiles launched side by side for each weight tile (L2 reuse; pf_tile in engines/tile_rows.cuh)


#: group_by_expert (routing/group.cuh): ids [R] in; offsets / tile_offsets [E + 1] and sorted [R] out.
GROUP_KERNEL = KernelDef("group", "qmoe::group_by_expert<>",
                         (Ptr("topk_ids", "int32"), Scalar("R", "int32"), Scalar("E", "int32"), Scalar("BR", "int32"),
                          Ptr("offsets", "int32"), Ptr("tile_offsets", "int32"), Ptr("sorted", "int32")))


def lead_args(lt: str) -> tuple:
    """Arguments of routing/route_group.cuh's ``route_group`` (logits in ``lt``): the warp routing's without router
    weights, then the grouping's."""
    return (Ptr("logits", lt), Scalar("rows", "int32"),
            Scalar("E_logits", "int32"), Scalar("k_routed", "int32"), Scalar("S", "int32"), Scalar("normalize", "int32"),
            Scalar("E_routed", "int32"), Ptr("expert_map", "int32", nullable=True), Ptr("topk_ids", "int32"),
            Ptr("topk_w", "float32"), *GROUP_KERNEL.args[1:])


def lead_kernels(spec: ModuleSpec, template: str = "qmoe::route_group<{}>", key: str = "route_group",
                 extra: tuple = ()) -> tuple[KernelDef, ...]:
    """The group step's kernels for calls that route in it (:func:`~.route.routes_in_group`, which leaves calls with
    router weights to the routing kernel), one per logits dtype (float32 or the activations'): ``template`` formatted
    with ``LT``, keys :func:`group_key`'s, ``extra`` arguments after the grouping's. Two kernels, not the
    routing module's six: each grouped module compiles them (each costs about a second of NVRTC on a CI core)."""
    T = spec["dtype"]
    dts = ["float32"] if T == "float32" else ["float32", T]
    return tuple(KernelDef(f"{key}_{lt}", template.format(CPP_TYPES[lt]), lead_args(lt) + extra)
                 for lt in dts)


def group_key(problem: Problem, key: str = "route_group", lead: bool | None = None) -> str:
    """The group step's kernel: ``group`` (the routing ran before it), or where it routes the call itself
    (``lead``, a family's configure() result; None: :func:`~.route.routes_in_group`) :func:`lead_kernels`' for the
    call's logits dtype."""
    return f"{key}_{problem.router_dtype}" if (routes_in_group(problem) if lead is None else lead) else "group"


def group_and_combine(spec: ModuleSpec, lead: bool = True) -> tuple[KernelDef, ...]:
    """group_by_expert (routing/group.cuh), with ``lead`` :func:`lead_kernels` (the family's header includes
    routing/route_group.cuh), and combine_routes (epilogue/combine.cuh) for the spec's dtype."""
    return (
        GROUP_KERNEL,
        *(lead_kernels(spec) if lead else ()),
        KernelDef("combine", f"qmoe::combine_routes<{CPP_TYPES[spec['dtype']]}>",
                  (Ptr("y", "float32"), Scalar("parts", "int32"), Scalar("plane", "int64"), Ptr("topk_ids", "int32"),
                   Ptr("topk_w", "float32"), Scalar("rows", "int32"), Scalar("k", "int32"), Scalar("H", "int32"),
                   Ptr("out", spec["dtype"]))),
    )


def group_launch(tile_routes: int) -> Launch:
    """One block of GROUP_THREADS threads (static shared memory only: a 32 KB per-warp count table), route
    tiles of ``tile_routes`` (``BR``)."""
    return Launch((1, 1, 1), (GROUP_THREADS, 1, 1), 0, (("BR", tile_routes),))


def combine_launch(problem: Problem, parts: int = 1) -> Launch:
    """One block row per output row, (at most) COMBINE_THREADS threads of COMBINE_COLS columns each; y in ``parts``
    planes of [R, H] (an FC2 split over K into parts, which the combine adds in order; usually one)."""
    col_threads = (problem.H + COMBINE_COLS - 1) // COMBINE_COLS
    threads = min(COMBINE_THREADS, (col_threads + 31) // 32 * 32)
    return Launch((problem.rows, (col_threads + threads - 1) // threads, 1), (threads, 1, 1), 0,
                  (("parts", parts), ("plane", problem.routes * problem.H)))


def grouped_scratch(role: str, problem: Problem, act_itemsize: int, planes: int = 1) -> dict[str, Slot]:
    """A grouped step's scratch; ``planes``: y's [R, H] planes (an FC2 that runs K in parts, each its own plane)."""
    R, E = problem.routes, problem.experts
    if role == "group":  # offsets / tile_offsets [E + 1] i32, sorted [R] i32; routing in it: topk_ids / topk_w [R]
        routes = {"topk_ids": Slot(4 * R), "topk_w": Slot(4 * R)} if routes_in_group(problem) else {}
        return {"offsets": Slot(4 * (E + 1)), "tile_offsets": Slot(4 * (E + 1)), "sorted": Slot(4 * R), **routes}
    if role == "fc1":
        return {"act_sorted": Slot(R * problem.I * act_itemsize)}  # [R, I]
    if role == "fc2":
        return {"y": Slot(4 * planes * R * problem.H)}  # [planes, R, H] f32
    return {}


def route_tiles(routes: int, E: int, tile: int) -> int:
    """Upper bound on sum_e ceil(count_e / tile) over the experts that got routes."""
    return (routes + tile - 1) // tile + min(E, routes)


def staged_projection(spec: ModuleSpec, role: str) -> tuple[int, bool]:
    """(bits, packed zero-point words staged) of what a tensor-core FC1 / FC2 kernel streams: FC1 stages
    FC3's zero-point word too when FC3 has packed zero points."""
    if role == "fc1":
        return spec["fc1_bits"], spec["fc1_zp"] == "packed" or (spec["has_fc3"] and spec["fc3_zp"] == "packed")
    return spec["fc2_bits"], spec["fc2_zp"] == "packed"


def weight_tiles(spec: ModuleSpec, role: str, n: int, m16_per_block: int) -> int:
    """Weight tiles of a tensor-core FC1 / FC2 step over ``n`` outputs (FC1: I or its padding, an m16 tile
    holding 8 gated or 16 plain outputs; FC2: H rows, 16 per m16 tile)."""
    per_m16 = 8 if role == "fc1" and gate_of(spec) != "none" else 16
    return (n + m16_per_block * per_m16 - 1) // (m16_per_block * per_m16)


def route_group() -> int:
    """G, the route tiles a tensor-core FC1 / FC2 grid launches side by side for each weight tile (knob
    ``prefill_group``, else GROUP): the families read it once a call, in their ``configure``."""
    return knobs.get("prefill_group") or GROUP


def tile_slots(problem: Problem, route_tile: int, group: int | None = None) -> int:
    """The route tiles a tensor-core FC1 / FC2 grid covers (:func:`tiled_launch`): the bound on the call's
    route tiles rounded up to whole groups of ``group`` (G; None: :func:`route_group`)."""
    group = group or route_group()
    return (route_tiles(problem.routes, problem.experts, route_tile) + group - 1) // group * group


def tiled_launch(slots: int, group: int, nt: int, threads: int, smem: int, extra: tuple = ()) -> Launch:
    """The grid of a tensor-core FC1 / FC2 step: G = ``group`` consecutive route tiles × every weight tile, then the
    next G, over ``slots`` route tiles (:func:`tile_slots`); ``NT`` and ``G`` as launch scalars."""
    return Launch((slots * nt, 1, 1), (threads, 1, 1), smem, (("NT", nt), ("G", group), *extra))


def tuning_knob(name: str, default: int, allowed) -> int:
    """A tuning knob's value (0 or unset: ``default``), refused when not in ``allowed``."""
    n = knobs.get(name) or default
    if n not in allowed:
        raise KnobError(knobs.label(name), f"one of {list(allowed)}", str(n))
    return n
