"""What the two grouped (prefill) families share: the grouping kernel, the combine kernel, and the
scratch of the grouped path."""

from __future__ import annotations

from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import CPP_TYPES, ModuleSpec
from .base import Problem, Slot

GROUP_THREADS = 1024  # kGroupThreads
GROUP_MAX_EXPERTS = 512  # kGroupMaxExperts
COMBINE_THREADS = 256


def group_and_combine(spec: ModuleSpec) -> tuple[KernelDef, ...]:
    """group_by_expert (routing/group.cuh) and combine_routes (epilogue/combine.cuh) for the spec's dtype."""
    return (
        KernelDef("group", "qmoe::group_by_expert",
                  (Ptr("topk_ids", "int32"), Scalar("R", "int32"), Scalar("E", "int32"), Scalar("BM", "int32"),
                   Ptr("offsets", "int32"), Ptr("tile_offsets", "int32"), Ptr("sorted", "int32"))),
        KernelDef("combine", f"qmoe::combine_routes<{CPP_TYPES[spec['dtype']]}>",
                  (Ptr("y", "float32"), Ptr("topk_w", "float32"), Scalar("rows", "int32"), Scalar("k", "int32"),
                   Scalar("H", "int32"), Ptr("out", spec["dtype"]))),
    )


def group_launch(tile_routes: int) -> Launch:
    return Launch((1, 1, 1), (GROUP_THREADS, 1, 1), 0, (("BM", tile_routes),))


def combine_launch(problem: Problem) -> Launch:
    return Launch(((problem.rows * problem.H + COMBINE_THREADS - 1) // COMBINE_THREADS, 1, 1), (COMBINE_THREADS, 1, 1), 0)


def grouped_scratch(role: str, problem: Problem, act_itemsize: int) -> dict[str, Slot]:
    R, E = problem.routes, problem.E
    if role == "group":  # offsets / tile_offsets [E + 1] i32, sorted [R] i32
        return {"offsets": Slot(4 * (E + 1)), "tile_offsets": Slot(4 * (E + 1)), "sorted": Slot(4 * R)}
    if role == "fc1":
        return {"act_sorted": Slot(R * problem.I * act_itemsize)}  # [R, I]
    if role == "fc2":
        return {"y": Slot(4 * R * problem.H)}  # [R, H] f32
    return {}


def route_tiles(routes: int, E: int, tile: int) -> int:
    """Upper bound on sum_e ceil(count_e / tile) over the experts that got routes."""
    return (routes + tile - 1) // tile + min(E, routes)
