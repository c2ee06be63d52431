"""Kernel family ``wgmma_prefill``: the Hopper (sm_90a) prefill engine, warpgroup MMAs with the weights
dequantized exactly in registers (float16/bfloat16, 1/2/3/4/8-bit weights).

One block per tile (``cuda_src/engines/wgmma_prefill.cuh``): ``qmoe::fc1_wgmma`` / ``qmoe::fc2_wgmma``, every warp
both copies and computes. Route tiles of 64 routes, on 2 warpgroups where two such blocks fit an SM
(``wgmma_geometry.tile_groups``), or 128 on 4 (256 too when ``prefill_wg_groups`` forces 2). The block geometry
(stages, warpgroups, route tiles) is in ``kernels/wgmma_geometry.py``. (A warp-specialised, persistent variant, a copy
warpgroup feeding two MMA warpgroups, measured 0.98-1.02x of these kernels at mixtral-8x7b 4096 tokens and 1.2-1.5x
slower elsewhere; it was removed, its numbers stay in docs/performance-log.md.)

The engine permutes the input's K chunks into the order the MMA's shared-memory operand needs
(``core/wg_order.cuh``: ``qmoe::wg_prepare``, which from 32 experts also writes the tile table its
GEMMs read in one round of loads, ``engines/wg_tiles.cuh``), run FC1 [+FC3] with the activation fused (sorted
order, written in FC2's order), FC2 + bias by route id, and ``group_by_expert`` / ``combine_routes`` as in
``mma_prefill``. FC2 may run a tile as two blocks, each over half of K, adding into ``y`` (zeroed
by ``wg_prepare``), when whole tiles would leave the last round of SMs at most half busy (:meth:`WgmmaPrefillFamily.configure`;
the device decides per call, the same for every tile, so a route's sum does not depend on its tile), or, where its
whole tiles would fill well under a round (``wgmma_geometry.fc2_parts``), as n blocks over parts of K, each storing
into its own plane of ``y`` [n, R, H], which the combine adds in plane order.
The route tile is chosen from the routes per expert of the call. The 128-route GEMMs on 4 warpgroups
also come as pairs of blocks in a cluster (``fc1_br128_pair``, ``fc2_br128_pair``, with ``permute_image`` gathering x
into a route-tile image), which copy a route tile once for both blocks; :meth:`WgmmaPrefillFamily.pairs` chooses them
per call. The steps after the routing
are launched overlapping the kernel before them (:func:`overlapped`, programmatic dependent launch).

It runs on sm_90a only (the executor compiles every module for sm_90a on Hopper); on other targets the
module compiles to kernels that trap and :meth:`WgmmaPrefillFamily.supports` refuses the device.
Where it is slower than the batched-decode engine, :meth:`WgmmaPrefillFamily.slower` says so: on sm_90 by the
measured rule of :mod:`~qmoe_rtc.kernels.engine_choice` (small experts up to 4.5 routes per expert), on another
device (the warm tool, CPU: unknown) below its tuning table's ``wgmma_min_routes`` routes per expert (kernels/tuning/).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import KnobError
from ..jit import KernelDef, Launch, Ptr, Scalar
from ..settings import knobs
from ..specialize import CPP_TYPES, ModuleSpec
from ._expert import (
    ACT_PARAMS_ARG,
    EXPERT_FIELDS,
    ROUTE_GROUPS_ARG,
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
    GROUP_THREADS,
    combine_launch,
    group_and_combine,
    group_key,
    group_launch,
    grouped_scratch,
    lead_kernels,
    route_group,
    route_tiles,
    tile_slots,
    tiled_launch,
    tuning_knob,
    weight_tiles,
)
from .base import KernelFamily, Problem, Slot, register
from .engine_choice import crossovers, wgmma_passed_for_batched
from .route import routes_in_group
from .tuning import knob as tuned_knob
from .wgmma_geometry import (
    CHUNK,
    GATHER_ROWS,
    INFLIGHT,
    MAX_STAGES,
    PAIR_ROUTES,
    RING,
    SHRINK,
    SMEM_OPTIN_SM90,
    fc2_parts,
    groups_of,
    image_rows,
    launch_smem,
    padded,
    pair_kernels,
    resident,
    smem_defines,
    spec_tiles,
    tile_routes,
    unit_decisions,
)

__all__ = ["WgCall", "WgmmaPrefillFamily"]


def overlapped(problem: Problem) -> bool:
    """Whether the steps after the routing (grouping, wg_prepare, FC1, FC2, combine) are launched
    overlapping the kernel before them (programmatic dependent launch, where the plan allows it:
    :func:`qmoe_rtc.runtime.plan.overlap_allowed`): each starts while the one before finishes and waits for it
    before reading its output; FC2's blocks find their tile and set up their rows under FC1's last round
    (cuda_src/engines/wgmma_prefill.cuh). Knob ``prefill_wg_overlap``, by default the arch's (kernels/tuning/)."""
    return bool(tuned_knob("prefill_wg_overlap", problem.device))


@dataclass(frozen=True)
class WgCall:
    """One call's choices (:meth:`WgmmaPrefillFamily.configure`), made once per plan and read by the kernel choice,
    every launch and the scratch."""

    br: int  # routes a tile (wgmma_geometry.tile_routes)
    pair: bool  # the GEMMs as pairs of blocks in a cluster (WgmmaPrefillFamily.pairs)
    fc2_ks: int  # blocks FC2 launches a tile: 2 where it may split K in halves, n for n parts (1 for pairs)
    fc2_parts: int  # y's planes: KS where FC2 runs K in parts (each part its plane, the combine adds them), else 1
    Hp: int  # H padded to whole chunks: x's permuted rows [rows, Hp]
    Ip: int  # I padded to whole chunks: act_sorted [R, Ip]
    rp: int  # rows of the pairs' route-tile images (image_rows), 0 without pairs
    slots: int  # route-tile slots of the tile table, which the FC1 / FC2 grids cover (tile_slots)
    group: int  # G: route tiles launched side by side for each weight tile (_grouped.route_group)
    lead: bool = False  # the group step routes the call and does the permute step's work (route.routes_in_group)


@register
class WgmmaPrefillFamily(KernelFamily):
    name = "wgmma_prefill"
    solo = ("fc1_", "fc2_")  # each GEMM kernel its own NVRTC program (compile time: docs/runtime-compilation.md)
    header = "engines/wgmma_prefill.cuh"
    depends_on = (*EXPERT_FIELDS, "tiled")
    conditional = True  # sm_90a only, and only from some routes per expert (slower)

    def spec(self, config) -> ModuleSpec:
        """The layout's fields plus warpgroups per block, the ring's depth and hand-off, the tail tiles' widths (tuning
        knobs, read here once per spec, so the module key and the launch geometry always agree)."""
        stamps = {"stamps": True} if knobs.get("prefill_wg_stamps") else {}  # diagnostics
        groups = tuning_knob("prefill_wg_groups", 0, (0, 2, 4))
        return expert_spec(self.name, config, **({"groups": groups} if groups else {}),  # none: tile_groups
                           stages=tuning_knob("prefill_wg_stages", MAX_STAGES, range(2, 7)),
                           inflight=tuning_knob("prefill_wg_inflight", INFLIGHT, (1, 2)), **stamps,
                           shrink=tuning_knob("prefill_wg_shrink", SHRINK, (1, 2, 3)),
                           fc1_blocks=tuning_knob("prefill_wg_fc1_blocks", 0, (0, 2, 3)),
                           ring=tuning_knob("prefill_wg_ring", RING, (0, 1, 2)), **tiled_spec(config))

    def defines(self, spec: ModuleSpec) -> tuple[str, ...]:
        return (f"-DQMOE_WG_STAGES={spec['stages']}", f"-DQMOE_WG_INFLIGHT={spec['inflight']}",
                f"-DQMOE_WG_SHRINK={spec['shrink']}", f"-DQMOE_WG_RING={spec['ring']}",
                *(("-DQMOE_WG_STAMPS=1",) if spec.get("stamps") else ()), *smem_defines(),
                *tiled_define(spec))

    def decisions(self, spec: ModuleSpec) -> tuple[str, ...]:
        """Each GEMM's ring and FC1's launch bounds (kernels/wgmma_geometry.py unit_decisions)."""
        return unit_decisions(spec)

    def parts(self, spec: ModuleSpec) -> tuple[tuple[str, ...], ...]:
        """As :attr:`solo` says, except the stamped build (tuning knob ``prefill_wg_stamps``): one program, so its one
        stamps table holds both GEMMs' (tools/stamps.py wgmma reads it)."""
        return () if spec.get("stamps") else super().parts(spec)

    def specs(self, config) -> list[ModuleSpec]:
        return [] if self.supports(config) else [self.spec(config)]

    def supports(self, config, problem: Problem | None = None) -> str | None:
        if config.experts + config.shared > GROUP_MAX_EXPERTS:
            return f"{config.experts + config.shared} experts (grouping handles at most {GROUP_MAX_EXPERTS})"
        why = tensor_core_unsupported(config, problem)
        if why:
            return why
        if problem is not None and not problem.device.warpgroup_mma:  # sm_90 builds as sm_90a
            return f"warpgroup MMA needs sm_90a (this device: {problem.arch})"
        if problem is not None and problem.smem_limit < SMEM_OPTIN_SM90:
            return (f"its rings are sized for {SMEM_OPTIN_SM90} bytes of shared memory a block (sm_90a), more than the "
                    f"device's {problem.smem_limit} (its opt-in limit per block)")
        if problem is not None and problem.rows and knobs.get("prefill_engine") in ("mma", "batched"):
            return f"QMOE_RTC_TUNE=prefill_engine={knobs.get('prefill_engine')}"
        if problem is not None and max(problem.rows * padded(problem.H), problem.routes * padded(problem.I)) >= 1 << 32:
            return (f"{problem.rows} rows × {padded(problem.H)} or {problem.routes} routes × {padded(problem.I)} values "
                    "reach 2^32 (a route tile's rows are 32-bit offsets)")
        return None

    def slower(self, config, problem: Problem | None = None) -> str | None:
        if problem is None or problem.rows == 0 or knobs.get("prefill_engine") == "wgmma":
            return None
        if crossovers(problem.arch) is not None:
            return wgmma_passed_for_batched(problem, getattr(config, "layout", config))
        # routes that reach a held expert: an expert slice [ext] holds E of the layer's logit_count
        # experts, so it expects that share of the k routed picks (the rest are skipped); shared ones all
        routes = problem.rows * (problem.k * problem.E / problem.logit_count + problem.shared)
        per_expert = routes / max(1, min(problem.experts, routes))
        least = problem.device.tuning.wgmma_min_routes
        if per_expert < least:
            return f"{per_expert:.0f} routes per expert (< {least}: the mma.sync engines are faster)"
        return None

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        out = list(group_and_combine(spec, lead=False))
        table = (Scalar("slots", "int32"), Ptr("tile_info", "int32"), Ptr("tile_rows", "int32"))
        out.append(KernelDef("permute", f"qmoe::wg_prepare<{CPP_TYPES[dt]}, {t['B1']}>",
                             (Ptr("x", dt), Scalar("rows", "int32"), Scalar("H", "int32"), Scalar("Hp", "int32"),
                              Ptr("xp", dt), Ptr("y", "float32"), Scalar("y_zero", "int64"), ROUTE_GROUPS_ARG,
                              Scalar("E", "int32"), Scalar("BR", "int32"), *table)))
        # the group step where it routes the call: also the permute step's work (x permuted, y zeroed, the tile table)
        out += lead_kernels(spec, f"qmoe::wg_route_group<{CPP_TYPES[dt]}, {t['B1']}, {{}}>", "wg_route_group",
                            (Ptr("x", dt), Scalar("H", "int32"), Scalar("Hp", "int32"), Ptr("xp", dt), Ptr("y", "float32"),
                             Scalar("y_zero", "int64"), *table))
        pair = pair_kernels(spec)
        if pair:  # the pairs' input: x's route-tile image xs [Hp / 64, Rp, 64] (engines/wg_image.cuh), and the tile table
            out.append(KernelDef("permute_image", f"qmoe::wg_prepare_image<{CPP_TYPES[dt]}, {t['B1']}>",
                                 (Ptr("x", dt), Scalar("H", "int32"), Scalar("Hp", "int32"), Scalar("Rp", "int32"),
                                  Ptr("xs", dt), ROUTE_GROUPS_ARG, Scalar("E", "int32"), Scalar("k", "int32"),
                                  Scalar("BR", "int32"), Scalar("slots", "int32"), Ptr("tile_info", "int32"),
                                  Ptr("tile_rows", "int32"))))
        # (br, suffix, FC1's input): each route tile's GEMMs, and PAIR_ROUTES's pair forms (Rp: their images' rows)
        forms = [(br, "", "xp") for br in spec_tiles(spec)] + ([(PAIR_ROUTES, "_pair", "xs")] if pair else [])
        for br, suffix, src in forms:
            out.append(KernelDef(
                f"fc1_br{br}{suffix}",
                f"qmoe::fc1_wgmma{suffix}<{t['GATE']}, {t['T']}, {t['S']}, {t['B1']}, {t['B2']}, {t['Z1']}, {t['Z3']}, "
                f"{t['BLOCK']}, {t['ACT']}, {br}>",
                (Ptr(src, dt), ROUTE_GROUPS_ARG, Ptr("tile_info", "int32"), Ptr("tile_rows", "int32"),
                 Scalar("E", "int32"), Scalar("k", "int32"), Scalar("H", "int32"), Scalar("Hp", "int32"), Scalar("I", "int32"),
                 Scalar("Ip", "int32"), Scalar("Rp", "int32"), Scalar("NT", "int32"), Scalar("G", "int32"), fc1_weights(sdt),
                 ACT_PARAMS_ARG, Ptr("act_sorted", dt)),
            ))
            out.append(KernelDef(
                f"fc2_br{br}{suffix}",
                f"qmoe::fc2_wgmma{suffix}<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {br}>",
                (Ptr("act_sorted", dt), ROUTE_GROUPS_ARG, Ptr("tile_info", "int32"), Ptr("tile_rows", "int32"),
                 Scalar("E", "int32"), Scalar("H", "int32"), Scalar("I", "int32"), Scalar("Ip", "int32"), Scalar("Rp", "int32"),
                 Scalar("NT", "int32"), Scalar("G", "int32"), Scalar("KS", "int32"), Scalar("SMS", "int32"),
                 Scalar("YS", "int64"), fc2_weights(sdt), Ptr("y", "float32")),
            ))
        return tuple(out)

    def pairs(self, spec: ModuleSpec, problem: Problem) -> bool:
        """Whether the call's GEMMs run as pairs of blocks in a cluster (``fc1_br128_pair`` / ``fc2_br128_pair``): the
        two blocks of a pair compute consecutive weight tiles of one route tile and copy it once for both, each half
        of a chunk into both blocks' shared memory (cuda_src/engines/wg_mainloop.cuh), from route-tile images (x's
        gathered by ``permute_image``, FC1's output written as one). Only where the module has them (:func:`pair_kernels`)
        and the call's route tile is PAIR_ROUTES; knob ``prefill_wg_pairs``: 'on' / 'off' force them there / never,
        'auto' (the default) from the arch's ``wgmma_pair_min_fc1_tiles`` FC1 weight tiles a route tile and where FC2
        would not split K (kernels/tuning/, where the measurements are)."""
        return self.configure(spec, problem).pair

    def _pairs(self, spec: ModuleSpec, problem: Problem, br: int, ks: int) -> bool:
        """:meth:`pairs` at route tile ``br`` with FC2's ``ks`` blocks a tile (:meth:`_k_split`)."""
        mode = knobs.get("prefill_wg_pairs")
        if mode not in ("auto", "on", "off"):
            raise KnobError(knobs.label("prefill_wg_pairs"), "one of ['auto', 'on', 'off']", repr(mode))
        if mode == "off" or not pair_kernels(spec) or br != PAIR_ROUTES or routes_in_group(problem):
            return False  # (a group step that routes permutes x in rows, not into an image)
        nt1 = weight_tiles(spec, "fc1", padded(problem.I), 4 * groups_of(spec, "fc1", PAIR_ROUTES))
        return mode == "on" or (nt1 >= problem.device.tuning.wgmma_pair_min_fc1_tiles and ks == 1)

    def configure(self, spec: ModuleSpec, problem: Problem) -> WgCall:
        """The call's route tile, pairs or not, FC2's parts of K (:func:`~.wgmma_geometry.fc2_parts`) and blocks a tile
        (1 for pairs, the parts, else :meth:`_k_split`), padded K and the images' rows, the grid's grouping and tiles:
        each decided here once."""
        br = tile_routes(problem.routes, problem.experts, problem.device.tuning, have=spec_tiles(spec))
        parts = fc2_parts(spec, problem, br)
        ks = parts if parts > 1 else self._k_split(spec, problem, br)
        pair = self._pairs(spec, problem, br, ks)
        group = route_group()
        return WgCall(br, pair, 1 if pair else ks, parts, padded(problem.H), padded(problem.I),
                      image_rows(spec, problem) if pair else 0, tile_slots(problem, br, group), group,
                      routes_in_group(problem))

    def _k_split(self, spec: ModuleSpec, problem: Problem, br: int) -> int:
        """KS, the blocks FC2 launches a tile at route tile ``br``: 2 (its halves of K, when the device
        finds they fill the last round better: fc2_splits) where FC2 has at most the arch's ``wgmma_fc2_split_rounds``
        rounds of tiles (SMs × the blocks an SM holds: the host's bound; past it the device would not split and
        zeroing y would be wasted) and ``wgmma_fc2_split_chunks`` chunks of K or more (on a shorter K a split tile's
        second prologue and epilogue cost more than the idle SMs), else 1 (kernels/tuning/). Knob
        ``prefill_fc2_split``: 'on' / 'off' force 2 (from two chunks of K) / 1 ('on' still leaves the choice
        to the device's rule), 'auto' as described."""
        mode = knobs.get("prefill_fc2_split")
        if mode not in ("auto", "on", "off"):
            raise KnobError(knobs.label("prefill_fc2_split"), "one of ['auto', 'on', 'off']", repr(mode))
        if mode == "off" or padded(problem.I) < 2 * CHUNK:
            return 1
        m16 = 4 * groups_of(spec, "fc2", br)  # m16 weight tiles per block
        tiles = route_tiles(problem.routes, problem.experts, br) * weight_tiles(spec, "fc2", problem.H, m16)
        slots = problem.sm_count * resident(spec, "fc2", br)
        t = problem.device.tuning
        few = tiles <= t.wgmma_fc2_split_rounds * slots and padded(problem.I) >= t.wgmma_fc2_split_chunks * CHUNK
        return 2 if mode == "on" or few else 1

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call: WgCall | None = None) -> str:
        c = call or self.configure(spec, problem)
        if role in ("fc1", "fc2"):
            return f"{role}_br{c.br}" + ("_pair" if c.pair else "")
        if role == "group":
            return group_key(problem, "wg_route_group", c.lead)
        return "permute_image" if role == "permute" and c.pair else role

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call: WgCall | None = None) -> Launch:
        c = call or self.configure(spec, problem)
        br, Hp, Ip = c.br, c.Hp, c.Ip
        if role == "group" and c.lead:  # block 0 routes, groups and writes the tile table, the blocks after it do the
            # permute step's work (its geometry in blocks of GROUP_THREADS)
            p = self.launch(spec, "permute", problem, c)
            units = -(-p.grid[0] * p.block[0] // GROUP_THREADS)
            return Launch((1 + units, 1, 1), (GROUP_THREADS, 1, 1), 0, p.args, overlap=overlapped(problem))
        if role in ("group", "combine"):  # each waits for the kernel before it (core/pdl.cuh)
            launch = group_launch(br) if role == "group" else combine_launch(problem, c.fc2_parts)
            return replace(launch, overlap=overlapped(problem))
        if role == "permute" and c.pair:  # the gather into an image: one block per GATHER_ROWS sorted rows (of every
            # route: the held ones are a prefix the kernel reads from the grouping); it also writes the tile table
            return Launch((max(1, -(-problem.routes // GATHER_ROWS)), 1, 1), (256, 1, 1), 0,
                          (("Hp", Hp), ("Rp", c.rp), ("BR", br), ("slots", c.slots)), overlap=overlapped(problem))
        if role == "permute":  # also zeroes y when FC2 may add its halves of K into it, and writes the tile table
            y_zero = problem.routes * problem.H if c.fc2_ks == 2 and c.fc2_parts == 1 else 0
            return Launch((max(1, (problem.rows * Hp // 8 + 255) // 256), 1, 1), (256, 1, 1), 0,
                          (("Hp", Hp), ("y_zero", y_zero), ("BR", br), ("slots", c.slots)), overlap=overlapped(problem))
        wgs = groups_of(spec, role, br)
        m16 = 4 * wgs  # m16 weight tiles per block
        # FC1 covers Ip: its padding columns are written as zeros (FC2 reads them)
        nt = weight_tiles(spec, role, Ip if role == "fc1" else problem.H, m16)
        if c.pair:  # a pair's blocks take weight tiles 2j, 2j + 1: where NT is odd, the last one past the outputs (its
            nt += nt % 2  # rows clamped, nothing stored)
        smem = launch_smem(spec, role, br, c.slots * nt, problem.sm_count, problem.device.tuning)
        if role == "fc2":  # KS blocks a tile: its parts of K (halves: fc2_splits decides on the device); YS: y's
            # plane, where each part stores into its own
            slots = problem.sm_count * resident(spec, role, br)
            ys = problem.routes * problem.H if c.fc2_parts > 1 else 0
            launch = tiled_launch(c.slots, c.group, nt, 128 * wgs, smem, (("Hp", Hp), ("Ip", Ip), ("Rp", c.rp),
                                                                        ("KS", c.fc2_ks), ("SMS", slots), ("YS", ys)))
            return replace(launch, grid=(launch.grid[0] * c.fc2_ks, 1, 1), overlap=overlapped(problem))
        launch = tiled_launch(c.slots, c.group, nt, 128 * wgs, smem, (("Hp", Hp), ("Ip", Ip), ("Rp", c.rp)))
        return replace(launch, overlap=overlapped(problem))

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call: WgCall | None = None) -> dict[str, Slot]:
        c = call or self.configure(spec, problem)
        item = 2  # T is float16 / bfloat16
        if role == "group" and c.lead:  # the permute step's buffers too
            return {**grouped_scratch(role, problem, item), **self.scratch(spec, "permute", problem, c)}
        if role == "permute":  # the tile table (wg_tiles.cuh); xp [rows, Hp] and y [parts, R, H] f32 (zeroed for halves),
            # or for pairs xs [Hp / 64, Rp, 64]
            table = {"tile_info": Slot(16 * c.slots), "tile_rows": Slot(4 * c.slots * c.br)}  # [slots] int4, [slots, BR] i32
            if c.pair:
                return {"xs": Slot(c.rp * c.Hp * item), **table}
            return {"xp": Slot(problem.rows * c.Hp * item), **grouped_scratch("fc2", problem, item, c.fc2_parts), **table}
        if role == "fc1":  # [Ip / 64, Rp, 64] for pairs, else [R, Ip]
            return {"act_sorted": Slot((c.rp if c.pair else problem.routes) * c.Ip * item)}
        return grouped_scratch(role, problem, item, c.fc2_parts)  # FC2's y [parts, R, H], also the permute step's
