"""Kernel family ``mma_batched``: the batched-decode engine (float16/bfloat16, 1/2/3/4/8-bit weights) for
calls with a few to a few dozen routes per expert (batched decode, chunked prefill).

Template ``cuda_src/engines/mma_batched.cuh``: ``qmoe::fc1_batched`` (FC1 [+FC3], activation fused,
sorted order) and ``qmoe::fc2_batched`` (FC2 + bias, by route id), with ``group_by_expert`` and
``combine_routes`` as the prefill engines. The decode engine's weight stream (a cp.async ring per warp,
K split over a block's warps) on grouped routes: no route limit, one block per (output tile, expert),
``BR`` routes per pass over the weights (8, 16 or 32, :func:`tile_routes`) chosen from the routes per
expert. On tiled codes with a scale per 128-code chunk a warp computes two 16-row tiles
(:func:`row_tiles`), each group of 8 routes' activations loaded once for both. Where they fit beside the blocks an
SM (:func:`x_block`), a block copies its routes' activations once into shared memory for all its warps (the ``_xb``
kernels, ``cuda_src/engines/x_block.cuh``).
Above :func:`max_routes_per_expert` routes per expert the tile engines (mma_prefill, wgmma_prefill),
which read each weight once per 16-256 routes, are faster (measured, docs/performance-log.md) and
:meth:`MmaBatchedFamily.slower` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import KnobError
from ..jit import KernelDef, Launch, Ptr, Scalar
from ..settings import knobs
from ..specialize import ModuleSpec
from ._expert import (
    ACT_PARAMS_ARG,
    EXPERT_FIELDS,
    expert_spec,
    fc1_weights,
    fc2_weights,
    template_types,
    tensor_core_unsupported,
    tiled_define,
    tiled_spec,
)
from ._grouped import (
    GROUP_MAX_EXPERTS,
    combine_launch,
    group_and_combine,
    group_key,
    group_launch,
    grouped_scratch,
    tuning_knob,
)
from .base import KernelFamily, Problem, Slot, register
from .mma_decode import (
    MIN_BLOCKS,
    MIN_BLOCKS_ALLOWED,
    THREADS,
    TILE_ROUTES,
    RingGemm,
    launch_smem,
    ring_decisions,
    ring_gemm,
    smem_refusal,
    stage_chunks,
)

__all__ = ["BatchedCall", "MmaBatchedFamily", "max_routes_per_expert", "per_expert", "tile_routes",
           "row_tiles", "x_block", "x_block_bytes"]

#: Route tiles the grouping step's tile offsets count in (BR of group_by_expert): the batched GEMMs read only the
#: offsets and the sorted routes, not the tile offsets.
GROUP_ROUTES = 8


def per_expert(problem: Problem) -> float:
    """Average routes of the experts that get routes (expert slices [ext]: the routed share held)."""
    routes = problem.rows * (problem.k * problem.E / problem.logit_count + problem.shared)
    return routes / max(1, min(problem.experts, routes))


def tile_routes(problem: Problem) -> int:
    """BR: the fewest routes per pass (8, 16, 32) that hold twice the average expert's routes, so that
    most experts take one pass over their weights (an expert with more routes takes more); knob
    ``batched_route_tile`` forces one. Measured on the H200 (bf16 int4), every shape at
    average 2 to 64 routes per expert: the rule picks the fastest BR at all 18 points but one (ort-2048
    at 16 per expert: BR 32 81.3 µs, BR 16 76.4); BR sized to the average itself (the first rule) lost
    17-21 % at 8 and 16 per expert, where skewed experts took a second pass."""
    forced = tuning_knob("batched_route_tile", 0, (0, *TILE_ROUTES))
    if forced:
        return forced
    avg = per_expert(problem)
    return next((br for br in TILE_ROUTES if 2 * avg <= br), TILE_ROUTES[-1])


def row_tiles(tiled: bool, block_size: int) -> int:
    """16-row tiles per warp (RT): 2 on tiled codes with one scale per row over a 128-code chunk (block
    size 0 or ≥ 128), where a half chunk's activations are 8 consecutive words of x that both tiles' MMAs
    read (half the activation loads per weight byte, two independent MMA chains per warp); else 1 --
    contract codes permute x per tile, and smaller blocks scale every pair (twice the coefficient
    registers). Measured on the H200 (bf16 int4, batched engine forced, RT 1 → 2):
    mixtral-8x7b 8 / 32 / 64 tokens −2 / −12 / −18 %, qwen3-30b-a3b −1 / −4 / −5 %, ort-2048 −4 / +4 /
    −8 %; gpt-oss-120b (blocks of 32) +8 / +5 / +3 %. Knob ``batched_row_tiles`` forces 1 or 2 (2 only
    on tiled codes)."""
    forced = tuning_knob("batched_row_tiles", 0, (0, 1, 2))
    if forced == 2 and not tiled:
        raise KnobError(knobs.label("batched_row_tiles"), "1 for a layer in the contract layout (2 reads tiled "
                                 "codes: QMoE(prepack='on'))", "2")
    return forced or (2 if tiled and (block_size == 0 or block_size >= 128) else 1)


#: Blocks per SM the two-row-tile kernels' registers are set for, by BR (8 routes per pass keep the decode engine's):
#: with two row tiles, route groups of 16 / 32 routes hold twice the accumulators (ptxas, NVRTC 13.5, mixtral-8x7b
#: bf16 int4: at the decode engine's 4 / 3 they spilled 8-24 / 28-32 bytes; at 3 / 2 none).
MIN_BLOCKS_TWO_TILES = {16: 3, 32: 2}


def min_blocks(spec: ModuleSpec, br: int) -> int:
    """Resident blocks per SM the registers of the ``br``-route kernels are set for."""
    if br == 8:
        return spec["min_blocks"]
    return MIN_BLOCKS_TWO_TILES[br] if spec["row_tiles"] == 2 else MIN_BLOCKS[br]


#: The ring depth and the 8-route kernels' blocks an SM (tuning knobs batched_stages, batched_min_blocks): the decode
#: engine's, and on layers of DEEP_RING_EXPERTS experts or more a ring of 4 stages with registers for 4 blocks an SM,
#: whose rings and x stages still fit them. H100, `bench ab` on the peers' layer (docs/performance-log.md), 4 stages and 4
#: blocks against 3 and 5: qwen3-30b-a3b (128 experts) at 3 / 4 / 8 / 16 / 32 / 64 tokens 53.7 → 52.2, 58.3 → 57.0,
#: 88.0 → 85.4, 115.8 → 102.8, 141.8 → 133.8, 158.6 → 149.0 µs; ort-2048 (8 experts, its K split over the warps, where
#: the deeper ring leaves no room for FC1's x stages) at 3 / 4 / 8 / 16 tokens +3.8 / +1.6 / +5.5 / +6.3 %. Registers
#: for 4 blocks with 3 stages: qwen3 −5.4 to 0 %, ort −0.3 to −3.0 % (one call, not taken). Nothing was measured
#: between 8 and 128 experts.
STAGES = 3
DEEP_STAGES = 4
STAGES_ALLOWED = (2, 3, 4, 5, 6)
MIN_BLOCKS_8 = MIN_BLOCKS[8]
DEEP_MIN_BLOCKS_8 = 4
DEEP_RING_EXPERTS = 64
#: XBlock<N8>::kRowBytes (engines/x_block.cuh): one route's 128 activations of a chunk (2 bytes each), then 32 bytes
#: of padding.
X_ROW_BYTES = 256 + 32
#: Shared memory the device keeps per resident block (sm_80-sm_90): an SM holds the opt-in limit per block plus this.
SMEM_RESERVED = 1024


def x_block_bytes(spec: ModuleSpec, role: str, br: int, ks: int) -> int:
    """Shared memory of a block's x stages (engines/x_block.cuh x_block_bytes): the ring's stages of ``ks`` · KST
    chunks (KST: the weight stage's chunks, kernels/mma_decode.py stage_chunks) of ``br`` routes' activations."""
    bits = spec["fc1_bits"] if role == "fc1" else spec["fc2_bits"]
    return spec["stages"] * ks * stage_chunks(bits, spec["row_tiles"]) * br * X_ROW_BYTES


def x_block(ring: RingGemm, x_bytes: int, per_sm: int, smem_limit: int) -> bool:
    """Whether a GEMM's blocks stage their activations in shared memory (the ``_xb`` kernels): where the rings and
    the x stages still fit the ``per_sm`` blocks an SM the kernels' registers are set for (an SM holds
    ``smem_limit`` + 1 KiB, each block 1 KiB of it), so the copies cost no resident warps. Tuning knob
    ``batched_x_block``: 'on' wherever one block fits ``smem_limit``, 'off' never."""
    mode = knobs.get("batched_x_block")
    if mode == "off":
        return False
    per_sm = 1 if mode == "on" else per_sm
    return (ring.smem + x_bytes + SMEM_RESERVED) * per_sm <= smem_limit + SMEM_RESERVED


def max_routes_per_expert(problem: Problem, tiles: int = 1) -> int:
    """Routes per expert (average over the experts that get routes) up to which this engine runs with ``tiles`` row
    tiles per warp, for calls whose routes reach up to the arch's ``batched_few_experts`` experts / more (its tuning
    table, kernels/tuning/: where the measurements are); above it the tile engines (mma_prefill, wgmma_prefill)
    are faster."""
    t = problem.device.tuning
    experts = min(problem.experts, max(1, problem.routes))
    return (t.batched_max_routes if experts <= t.batched_few_experts else t.batched_max_routes_many)[tiles]


@dataclass(frozen=True)
class BatchedCall:
    """One call's choices (:meth:`MmaBatchedFamily.configure`), made once per plan and read by the kernel choice and
    every launch."""

    br: int  # routes a pass over an expert's weights (tile_routes: 8, 16, 32)
    fc1: RingGemm  # FC1's K split, blocks of output rows (grid.y: the experts) and shared memory (its x stages too)
    fc2: RingGemm
    xb: tuple[bool, bool] = (False, False)  # FC1's, FC2's activations staged by the block (x_block: the _xb kernels)

    def gemm(self, role: str) -> RingGemm:
        """The choices of ``role``'s GEMM ('fc1' or 'fc2')."""
        return self.fc1 if role == "fc1" else self.fc2

    def x_block(self, role: str) -> bool:
        """Whether ``role``'s blocks stage their activations in shared memory."""
        return self.xb[0] if role == "fc1" else self.xb[1]


@register
class MmaBatchedFamily(KernelFamily):
    name = "mma_batched"
    solo = ("fc1_", "fc2_")  # each GEMM kernel its own NVRTC program (compile time: docs/runtime-compilation.md)
    header = "engines/mma_batched.cuh"
    depends_on = (*EXPERT_FIELDS, "tiled")
    conditional = True  # only up to max_routes_per_expert routes per expert

    def spec(self, config) -> ModuleSpec:
        """The layout's fields plus the ring depth and the 8-route kernels' blocks per SM (:data:`STAGES` and
        :data:`MIN_BLOCKS_8`, the deeper ring's on layers of :data:`DEEP_RING_EXPERTS` experts or more; tuning knobs
        batched_stages, batched_min_blocks) and the row tiles per warp."""
        tiled = tiled_spec(config)
        rt = row_tiles(bool(tiled), getattr(config, "layout", config).block_size)
        deep = getattr(config, "experts", 0) >= DEEP_RING_EXPERTS
        stages = tuning_knob("batched_stages", DEEP_STAGES if deep else STAGES, STAGES_ALLOWED)
        blocks = tuning_knob("batched_min_blocks", DEEP_MIN_BLOCKS_8 if deep else MIN_BLOCKS_8, MIN_BLOCKS_ALLOWED)
        return expert_spec(self.name, config, stages=stages, row_tiles=rt, min_blocks=blocks, **tiled)

    def specs(self, config) -> list[ModuleSpec]:
        return [] if self.supports(config) else [self.spec(config)]

    def supports(self, config, problem: Problem | None = None) -> str | None:
        if config.experts + config.shared > GROUP_MAX_EXPERTS:
            return f"{config.experts + config.shared} experts (grouping handles at most {GROUP_MAX_EXPERTS})"
        why = tensor_core_unsupported(config, problem)
        if why:
            return why
        forced = knobs.get("prefill_engine")
        if problem is not None and problem.rows and forced in ("mma", "wgmma"):
            return f"QMOE_RTC_TUNE=prefill_engine={forced}"
        if problem is not None:
            spec = self.spec(config)
            return smem_refusal(spec, problem.smem_limit, 0, spec["row_tiles"], knob="batched_stages")
        return None

    def slower(self, config, problem: Problem | None = None) -> str | None:
        if problem is None or problem.rows == 0 or knobs.get("prefill_engine") == "batched":
            return None
        layout = getattr(config, "layout", config)
        avg, most = per_expert(problem), max_routes_per_expert(problem, row_tiles(layout.tiled, layout.block_size))
        if avg > most:
            return f"{avg:.0f} routes per expert (> {most}: the tile engines are faster)"
        return None

    def defines(self, spec: ModuleSpec) -> tuple[str, ...]:
        return (f"-DQMOE_MMA_STAGES={spec['stages']}", f"-DQMOE_BATCHED_RT={spec['row_tiles']}", *tiled_define(spec))

    def decisions(self, spec: ModuleSpec) -> tuple[str, ...]:
        """The rings and each route tile's blocks an SM (kernels/mma_decode.py ring_decisions, :func:`min_blocks`)."""
        return ring_decisions(spec, {br: min_blocks(spec, br) for br in TILE_ROUTES}, spec["row_tiles"])

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        out = list(group_and_combine(spec))
        grouped = (Ptr("sorted", "int32"), Ptr("offsets", "int32"))
        for br in TILE_ROUTES:
            for xb, suffix in ((False, ""), (True, "_xb")):  # _xb: the block stages the activations (x_block)
                out.append(KernelDef(
                    f"fc1_br{br}{suffix}",
                    f"qmoe::fc1_batched<{t['GATE']}, {t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['Z3']}, {t['BLOCK']}, "
                    f"{t['ACT']}, {br}, {str(xb).lower()}>",
                    (Ptr("x", dt), *grouped, Scalar("k", "int32"), Scalar("H", "int32"), Scalar("I", "int32"),
                     Scalar("KS", "int32"), fc1_weights(sdt), ACT_PARAMS_ARG, Ptr("act_sorted", dt)),
                ))
                out.append(KernelDef(
                    f"fc2_br{br}{suffix}",
                    f"qmoe::fc2_batched<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {br}, {str(xb).lower()}>",
                    (Ptr("act_sorted", dt), *grouped, Scalar("H", "int32"), Scalar("I", "int32"), Scalar("KS", "int32"),
                     fc2_weights(sdt), Ptr("y", "float32")),
                ))
        return tuple(out)

    def configure(self, spec: ModuleSpec, problem: Problem) -> BatchedCall:
        """The call's route tile and each GEMM's K split, grid and shared memory: each decided here once."""
        br = tile_routes(problem)
        rt = spec["row_tiles"]  # a warp tile's 16-row tiles, by the decode engine's rule (kernels/mma_decode.py ring_gemm)
        per_sm = min_blocks(spec, br)
        gemms, xb = [], []
        for role in ("fc1", "fc2"):
            g = ring_gemm(spec, role, problem, br, per_sm, launch_smem(spec, role, 0, rt), rt)
            x_bytes = x_block_bytes(spec, role, br, g.ks)
            xb.append(x_block(g, x_bytes, per_sm, problem.smem_limit))
            gemms.append(replace(g, smem=g.smem + x_bytes) if xb[-1] else g)
        return BatchedCall(br, *gemms, xb=tuple(xb))

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call: BatchedCall | None = None) -> str:
        if role in ("fc1", "fc2"):
            call = call or self.configure(spec, problem)
            return f"{role}_br{call.br}{'_xb' if call.x_block(role) else ''}"
        return group_key(problem) if role == "group" else role

    def geometry(self, spec: ModuleSpec, role: str, problem: Problem, call: BatchedCall | None = None) -> tuple[int, int]:
        """(KS, grid.x) of ``role``: K-split warps and blocks of output rows (:meth:`configure`)."""
        g = (call or self.configure(spec, problem)).gemm(role)
        return g.ks, g.blocks

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call: BatchedCall | None = None) -> Launch:
        if role == "group":
            return group_launch(GROUP_ROUTES)
        if role == "combine":
            return combine_launch(problem)
        g = (call or self.configure(spec, problem)).gemm(role)
        return Launch((g.blocks, problem.experts, 1), (THREADS, 1, 1), g.smem, (("KS", g.ks),))

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call: BatchedCall | None = None) -> dict[str, Slot]:
        """The grouped path's buffers (act_sorted in T): sized by the problem alone, no choice of the call's."""
        return grouped_scratch(role, problem, 2)
