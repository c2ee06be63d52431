"""Kernel family ``mma_prefill``: the tensor-core prefill engine (float16/bfloat16, 1/2/3/4/8-bit weights).

Template ``cuda_src/engines/mma_prefill.cuh``: ``qmoe::fc1_prefill`` (FC1 [+FC3] with the activation
fused, sorted order, output in T) and ``qmoe::fc2_prefill`` (FC2 + bias, by route id); with
``group_by_expert`` (device-side grouping and tile list) and ``combine_routes`` (the k routes of a
row in slot order). Route tiles of 16, 32 or 64 routes (``BR``), chosen from the routes per expert
of the call and the device's shared memory: a block takes ``stages`` stages of a BR-route tile
(:func:`ring_smem`), and where that passes the device's opt-in limit per block (99 KiB on sm_86 / sm_89:
int8 and FP8 at 64 routes) the call takes the largest smaller tile that fits (:meth:`MmaPrefillFamily.route_tile`);
where not even 16 routes fit (tuning knobs only), :meth:`MmaPrefillFamily.supports` refuses the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from ._expert import (
    ACT_PARAMS_ARG,
    EXPERT_FIELDS,
    ROUTE_GROUPS_ARG,
    expert_spec,
    fc1_weights,
    fc2_weights,
    meta_words,
    template_types,
    tensor_core_unsupported,
    tiled_define,
    tiled_meta,
    tiled_spec,
)
from ._grouped import (
    GROUP_MAX_EXPERTS,
    combine_launch,
    group_and_combine,
    group_key,
    group_launch,
    grouped_scratch,
    route_group,
    staged_projection,
    tile_slots,
    tiled_launch,
    tuning_knob,
    weight_tiles,
)
from .base import KernelFamily, Problem, Slot, register
from .tuning import Tuning

__all__ = ["MmaPrefillCall", "MmaPrefillFamily", "ring_smem", "stage_bytes", "tile_routes"]

MW = 2  # kPfMW: m16 weight tiles per warp
TILE_ROUTES = (16, 32, 64)  # BR: routes per block tile
STAGES = 3  # pipeline stages (the device's kPfStages: -DQMOE_PF_STAGES)
WARPS = 4  # warps a block (-DQMOE_PF_WARPS): a block tile is 32·WARPS weight rows
MIN_BLOCKS = 2  # blocks per SM the register budget is set for (-DQMOE_PF_MIN_BLOCKS)


@dataclass(frozen=True)
class MmaPrefillCall:
    """One call's choices (:meth:`MmaPrefillFamily.configure`), made once per plan and read by the kernel choice and
    every launch."""

    br: int  # routes a block tile (MmaPrefillFamily.route_tile: 16, 32, 64)
    group: int  # G: route tiles launched side by side for each weight tile (_grouped.route_group)
    slots: int  # route tiles the FC1 / FC2 grids cover (_grouped.tile_slots)
    fc1_tiles: int  # NT of FC1: weight tiles over I, warps·MW m16 tiles of 8 gated or 16 plain outputs each
    fc2_tiles: int  # NT of FC2: weight tiles over H, warps·MW m16 tiles of 16 rows each
    fc1_smem: int  # dynamic shared memory of an FC1 block, bytes (ring_smem at br)
    fc2_smem: int  # dynamic shared memory of an FC2 block, bytes


def tile_routes(routes: int, E: int, tuning: Tuning) -> int:
    """BR for a call: the smallest route tile (16, 32, 64 routes) that the average expert fills, by the arch's
    ``mma_tile16_routes`` / ``mma_tile32_routes`` (``tuning``, kernels/tuning/; knob ``prefill_route_tile`` forces
    one, for tuning)."""
    forced = tuning_knob("prefill_route_tile", 0, (0, *TILE_ROUTES))
    if forced:
        return forced
    per_expert = routes / max(1, min(E, routes))
    if per_expert <= tuning.mma_tile16_routes:
        return 16
    return 32 if per_expert <= tuning.mma_tile32_routes else 64


def stage_bytes(bits: int, scale_bytes: int, block_size: int, zp_packed: bool, br: int, warps: int = WARPS,
                tiled_meta: bool = False) -> int:
    """One pipeline stage's bytes: activation tile + every warp's codes and meta words (the layout of
    mma_prefill.cuh PfStage, which checks them: :meth:`MmaPrefillFamily.decisions`)."""
    words = meta_words(bits, scale_bytes, block_size, zp_packed, tiled_meta) if block_size else 0
    warp = MW * 2 * 32 * 4 * bits + MW * 2 * words * 128
    return br * 256 + warps * warp


def ring_smem(spec: ModuleSpec, role: str, br: int) -> int:
    """Dynamic shared memory of a BR-route ``role`` GEMM's block: ``stages`` stages (mma_prefill.cuh pf_check_smem)."""
    return spec["stages"] * _stage(spec, role, br)


def _stage(spec: ModuleSpec, role: str, br: int) -> int:
    """:func:`stage_bytes` of the spec's BR-route ``role`` GEMM."""
    bits, zp = staged_projection(spec, role)
    scale_bytes = 4 if spec["scale_dtype"] == "float32" else 2
    return stage_bytes(bits, scale_bytes, spec["block_size"], zp, br, spec["warps"], tiled_meta(spec))


@functools.lru_cache(maxsize=256)
def fitting_tiles(spec: ModuleSpec, budget: int) -> tuple[int, ...]:
    """The route tiles whose FC1 and FC2 blocks both fit ``budget`` bytes of dynamic shared memory (per spec and
    device: planning asks for every launch)."""
    return tuple(br for br in TILE_ROUTES if max(ring_smem(spec, r, br) for r in ("fc1", "fc2")) <= budget)


@register
class MmaPrefillFamily(KernelFamily):
    name = "mma_prefill"
    solo = ("fc1_", "fc2_")  # each GEMM kernel its own NVRTC program (compile time: docs/runtime-compilation.md)
    header = "engines/mma_prefill.cuh"
    depends_on = (*EXPERT_FIELDS, "tiled")

    def spec(self, config) -> ModuleSpec:
        """The layout's fields plus the pipeline depth and warps per block (tuning knobs, read here once
        per spec, so the module key and the launch geometry always agree)."""
        return expert_spec(self.name, config,
                           stages=tuning_knob("prefill_stages", STAGES, range(2, 7)),
                           warps=tuning_knob("prefill_warps", WARPS, (4, 8)),
                           min_blocks=tuning_knob("prefill_min_blocks", MIN_BLOCKS,
                                                  (1, 2, 3, 4)),
                           **tiled_spec(config))

    def specs(self, config) -> list[ModuleSpec]:
        return [] if self.supports(config) else [self.spec(config)]

    def supports(self, config, problem: Problem | None = None) -> str | None:
        if config.experts + config.shared > GROUP_MAX_EXPERTS:
            return f"{config.experts + config.shared} experts (grouping handles at most {GROUP_MAX_EXPERTS})"
        why = tensor_core_unsupported(config, problem)
        if why is None and problem is not None:
            spec = self.spec(config)
            if not fitting_tiles(spec, problem.smem_limit):
                need = max(ring_smem(spec, r, TILE_ROUTES[0]) for r in ("fc1", "fc2"))
                why = (f"a block of {TILE_ROUTES[0]} routes needs {need} bytes of shared memory ({spec['stages']} stages, "
                       f"{spec['warps']} warps), more than the device's {problem.smem_limit} (its opt-in limit per block)")
        return why

    def defines(self, spec: ModuleSpec) -> tuple[str, ...]:
        return (f"-DQMOE_PF_STAGES={spec['stages']}", f"-DQMOE_PF_WARPS={spec['warps']}",
                f"-DQMOE_PF_MIN_BLOCKS={spec['min_blocks']}", *tiled_define(spec))

    def decisions(self, spec: ModuleSpec) -> tuple[str, ...]:
        """Each GEMM's stage bytes by route tile (:func:`stage_bytes`, which sizes its launch), which
        engines/mma_prefill.cuh checks its stage layout against."""
        rows = ", ".join(f"{{{i}, {br}, {_stage(spec, role, br)}}}" for i, role in ((1, "fc1"), (2, "fc2"))
                         for br in TILE_ROUTES)
        return ("// The host's stage bytes (kernels/mma_prefill.py), which engines/mma_prefill.cuh checks:",
                "// {1 for FC1 or 2 for FC2, route tile, bytes}", f"#define QMOE_PF_STAGE_BYTES {rows}")

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        out = list(group_and_combine(spec))
        for br in TILE_ROUTES:
            out.append(KernelDef(
                f"fc1_br{br}",
                f"qmoe::fc1_prefill<{t['GATE']}, {t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['Z3']}, {t['BLOCK']}, "
                f"{t['ACT']}, {br}>",
                (Ptr("x", dt), ROUTE_GROUPS_ARG, Scalar("E", "int32"), Scalar("k", "int32"), Scalar("H", "int32"),
                 Scalar("I", "int32"), Scalar("NT", "int32"), Scalar("G", "int32"), fc1_weights(sdt), ACT_PARAMS_ARG,
                 Ptr("act_sorted", dt)),
            ))
            out.append(KernelDef(
                f"fc2_br{br}",
                f"qmoe::fc2_prefill<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {br}>",
                (Ptr("act_sorted", dt), ROUTE_GROUPS_ARG, Scalar("E", "int32"), Scalar("H", "int32"), Scalar("I", "int32"),
                 Scalar("NT", "int32"), Scalar("G", "int32"), fc2_weights(sdt), Ptr("y", "float32")),
            ))
        return tuple(out)

    def route_tile(self, spec: ModuleSpec, problem: Problem) -> int:
        """BR of a call: :func:`tile_routes`'s, or where its FC1 or FC2 block would pass the device's shared memory
        (``problem.smem_limit``) the largest smaller tile that fits (:meth:`supports` refuses a device none fits)."""
        want = tile_routes(problem.routes, problem.experts, problem.device.tuning)
        fit = [br for br in fitting_tiles(spec, problem.smem_limit) if br <= want]
        return fit[-1] if fit else TILE_ROUTES[0]

    def configure(self, spec: ModuleSpec, problem: Problem) -> MmaPrefillCall:
        """The call's route tile, grid grouping and tiles, each GEMM's weight tiles and shared memory: each decided
        here once."""
        br, group = self.route_tile(spec, problem), route_group()
        nt = {role: weight_tiles(spec, role, problem.I if role == "fc1" else problem.H, spec["warps"] * MW)
              for role in ("fc1", "fc2")}
        return MmaPrefillCall(br, group, tile_slots(problem, br, group), nt["fc1"], nt["fc2"],
                              ring_smem(spec, "fc1", br), ring_smem(spec, "fc2", br))

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call: MmaPrefillCall | None = None) -> str:
        if role in ("fc1", "fc2"):
            return f"{role}_br{(call or self.configure(spec, problem)).br}"
        return group_key(problem) if role == "group" else role

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call: MmaPrefillCall | None = None) -> Launch:
        c = call or self.configure(spec, problem)
        if role == "group":
            return group_launch(c.br)
        if role == "combine":
            return combine_launch(problem)
        nt, smem = (c.fc1_tiles, c.fc1_smem) if role == "fc1" else (c.fc2_tiles, c.fc2_smem)
        return tiled_launch(c.slots, c.group, nt, 32 * spec["warps"], smem)

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call: MmaPrefillCall | None = None) -> dict[str, Slot]:
        """The grouped path's buffers (act_sorted in T): sized by the problem alone, no choice of the call's."""
        return grouped_scratch(role, problem, 2)
