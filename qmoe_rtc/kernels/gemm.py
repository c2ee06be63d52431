"""Kernel family ``gemm``: the SIMT prefill engine (grouped float32 GEMMs), for the layouts the
tensor-core prefill engine does not take (float32 activations, zero_point_offset, sizes not multiples
of 32).

Template ``cuda_src/engines/gemm_simt.cuh``: ``qmoe::fc1_gemm`` (FC1 [+FC3], activation fused, sorted
order), ``qmoe::fc2_gemm`` (FC2 + bias, by route id); with ``group_by_expert`` and ``combine_routes``.
"""

from __future__ import annotations

from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from ._expert import (
    ACT_PARAMS_ARG,
    EXPERT_FIELDS,
    ROUTE_GROUPS_ARG,
    expert_spec,
    fc1_weights,
    fc2_weights,
    template_types,
    tiled_unsupported,
)
from ._grouped import GROUP_MAX_EXPERTS, combine_launch, group_and_combine, group_key, group_launch, grouped_scratch, route_tiles
from .base import KernelFamily, Problem, Slot, register

__all__ = ["GemmFamily", "tile_routes"]

THREADS = 256  # kGemmThreads
TILE_ROUTES = (16, 64)  # BR: routes per tile, 16 when experts get few routes each
BW = 64  # kGemmBW: weight rows per tile
MAX_GRID_Y = 65535


def tile_routes(routes: int, E: int) -> int:
    """Routes per GEMM tile for ``routes`` spread over ``E`` experts: 64 once experts average 32+."""
    return 64 if routes >= 32 * E else 16


@register
class GemmFamily(KernelFamily):
    name = "gemm"
    header = "engines/gemm_simt.cuh"
    depends_on = EXPERT_FIELDS

    def spec(self, config) -> ModuleSpec:
        return expert_spec(self.name, config)

    def supports(self, config, problem: Problem | None = None) -> str | None:
        why = tiled_unsupported(config)
        if why:
            return why
        if config.experts + config.shared > GROUP_MAX_EXPERTS:
            return f"{config.experts + config.shared} experts (grouping handles at most {GROUP_MAX_EXPERTS})"
        if (2 * config.inter + BW - 1) // BW > MAX_GRID_Y or (config.hidden + BW - 1) // BW > MAX_GRID_Y:
            return f"hidden {config.hidden} / inter {config.inter} need more than {MAX_GRID_Y} tiles on grid.y"
        return None

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        out = list(group_and_combine(spec))
        for br in TILE_ROUTES:
            out.append(KernelDef(
                f"fc1_br{br}",
                f"qmoe::fc1_gemm<{t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['B3']}, {t['Z3']}, {t['BLOCK']}, "
                f"{t['ACT']}, {t['GATE']}, {t['ALIGNED']}, {br}>",
                (Ptr("x", dt), ROUTE_GROUPS_ARG, Scalar("E", "int32"), Scalar("k", "int32"), Scalar("H", "int32"),
                 Scalar("I", "int32"), fc1_weights(sdt), ACT_PARAMS_ARG, Ptr("act_sorted", "float32")),
            ))
            out.append(KernelDef(
                f"fc2_br{br}",
                f"qmoe::fc2_gemm<{t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {t['ALIGNED']}, {br}>",
                (Ptr("act_sorted", "float32"), ROUTE_GROUPS_ARG, Scalar("E", "int32"), Scalar("H", "int32"),
                 Scalar("I", "int32"), fc2_weights(sdt), Ptr("y", "float32")),
            ))
        return tuple(out)

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> str:
        if role in ("fc1", "fc2"):
            return f"{role}_br{tile_routes(problem.routes, problem.experts)}"
        return group_key(problem) if role == "group" else role

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> Launch:
        br = tile_routes(problem.routes, problem.experts)
        if role == "group":
            return group_launch(br)
        if role == "combine":
            return combine_launch(problem)
        tiles = route_tiles(problem.routes, problem.experts, br)
        gated = spec["swiglu_fusion"] != 0 or spec["has_fc3"]
        cols = (2 * problem.I if gated else problem.I) if role == "fc1" else problem.H
        return Launch((tiles, (cols + BW - 1) // BW, 1), (THREADS, 1, 1), 0)

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> dict[str, Slot]:
        return grouped_scratch(role, problem, 4)  # act_sorted in float32
