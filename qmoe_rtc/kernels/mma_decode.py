"""Kernel family ``mma_decode``: the tensor-core decode engine (float16/bfloat16, 1/2/3/4/8-bit weights).

Template ``cuda_src/engines/mma_decode.cuh``: ``qmoe::fc1_mma`` (FC1 [+FC3], activation fused) and
``qmoe::fc2_mma_combine`` (FC2, routing weight and bias applied, the last block of each output tile
adds the routes in slot order). Expert-grouped: every expert's weights are read once per call
however many of the rows chose it. One module holds both kernels for 8, 16 and 32 routes per pass
(``BR``, the routes a tile serves, as in every engine), and for calls of up to the arch's ``x_ring_tokens`` (its
tuning table, kernels/tuning/) tokens the
8-route pair that stages the activations in shared memory with the weights (``fc1_br8_xr``, ``fc2_br8_xr``:
engines/x_ring.cuh, :func:`x_staged`). A block's dynamic shared memory is its four warps'
rings of ``stages`` stages and the route lists (:func:`launch_smem`); where that passes the device's opt-in
limit per block (tuning knobs only: three stages of any layout take at most 76 KiB with 512 routes),
:meth:`MmaDecodeFamily.supports` refuses the device and the decode path runs the SIMT engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KnobError
from ..jit import KernelDef, Launch, Ptr, Scalar, Struct
from ..settings import knobs
from ..specialize import ModuleSpec
from ._expert import (
    ACT_PARAMS_ARG,
    EXPERT_FIELDS,
    expert_spec,
    fc1_weights,
    fc2_weights,
    gate_of,
    meta_words,
    template_types,
    tensor_core_unsupported,
    tiled_define,
    tiled_meta,
    tiled_spec,
)
from ._grouped import tuning_knob
from .arch import DEFAULT_SMS, ArchSpec
from .base import KernelFamily, Problem, Slot, register
from .route import SELF_ROUTE_MAX_ROUTES, routes_in_decode
from .tuning import Tuning

__all__ = ["DecodeCall", "MmaDecodeFamily", "RingGemm", "decode_smem_bytes", "launch_smem", "ring_bytes", "ring_decisions",
           "ring_gemm", "smem_refusal", "stage_chunks", "tile_routes", "x_lane_bytes", "x_ring", "x_ring_bytes", "x_staged"]

THREADS = 128  # kMmaThreads (4 warps)
WARPS = 4
MAX_ROUTES = 512  # kMmaMaxRoutes: route ids one block scans
TILE_ROUTES = (8, 16, 32)  # BR: routes served per pass over an expert's weights
STAGES = 3  # cp.async ring depth per warp (the device's kMmaStages: -DQMOE_MMA_STAGES)
MIN_BLOCKS = {8: 5, 16: 4, 32: 3}  # resident blocks per SM the BR-route kernels' registers are set for (ring_decisions)
MIN_BLOCKS_ALLOWED = (4, 5, 6, 7, 8)  # tuning knob mma_min_blocks (BR 8 only: up to 8 tokens)
PREFETCH_CHUNKS = 4  # chunks of its two rows a warp warms L2 with before the route scan (kernel scalar PF)
X_CHUNK_BYTES = 256  # XRing::kChunkBytes: one route lane's 128 activations of a chunk
X_RING_BLOCKS = 4  # resident blocks per SM the x-ring kernels' registers are set for (measured faster than 5, H100)
#: core/args.cuh SelfRoute: the kernels' own routing (engines/self_route.cuh), on where routes_in_decode says
SELF_ROUTE_ARG = Struct("sr", "SelfRoute", (Scalar("self_route", "int32"), Ptr("logits", None, nullable=True),
                                            Scalar("logits_f32", "int32"), Scalar("E_logits", "int32"),
                                            Scalar("k_routed", "int32"), Scalar("S", "int32"),
                                            Scalar("normalize", "int32"), Ptr("expert_map", "int32", nullable=True)))


def _stages() -> int:
    n = knobs.get("mma_stages") or STAGES
    if not 2 <= n <= 8:
        raise KnobError(knobs.label("mma_stages"), "2..8", str(n))
    return n


def stage_chunks(bits: int, row_tiles: int = 1) -> int:
    """KST, the 128-code chunks a ring stage holds (engines/mma_stage.cuh MmaStage::KST): 2 KiB of codes a stage."""
    return 1 if bits >= 8 else max(1, 8 // bits // row_tiles)


def ring_bytes(bits: int, scale_bytes: int, block_size: int, zp_packed: bool, stages: int, row_tiles: int = 1,
               tiled_meta: bool = False) -> int:
    """Dynamic shared memory of one block (engines/mma_stage.cuh MmaStage): 4 warps × stages × stage bytes, a stage
    holding ``kst`` chunks of the warp's ``2·row_tiles`` lane rows."""
    kst = stage_chunks(bits, row_tiles)
    words = meta_words(bits, scale_bytes, block_size, zp_packed, tiled_meta)
    rows = 2 * row_tiles
    stage = kst * rows * 32 * 4 * bits + kst * rows * words * 32 * 4
    return WARPS * stages * stage


def decode_smem_bytes(ring: int, routes: int, x_rings: int = 0) -> int:
    """Dynamic shared memory of a decode launch: the four rings, then two lists of ``routes`` route ids
    (s_ids, s_list; engines/mma_decode.cuh), then, with ``x_rings`` bytes (the four warps' x rings:
    :func:`x_ring_bytes`), those from the next 16-byte boundary (mma_ring.cuh mma_smem_bytes)."""
    return (ring + 8 * routes + 15) // 16 * 16 + x_rings if x_rings else ring + 8 * routes


def x_ring(config) -> bool:
    """Whether the layer's decode module stages activations in x rings (tuning knob ``mma_x_ring``, on by default):
    codes of 3 bits or more, whose stages hold at most two chunks (1- / 2-bit stages hold eight / four, whose x
    rings would take 4 / 2 times the shared memory: 192 KiB a block at 8 tokens for 1-bit codes)."""
    lay = getattr(config, "layout", config)
    return bool(knobs.get("mma_x_ring")) and min(lay.fc1_bits, lay.fc2_bits) >= 3


def x_staged(spec: ModuleSpec, problem: Problem) -> int:
    """XS, the route lanes of an 8-route pass whose activations the decode kernels stage in shared memory with
    the weights (the ``_xr`` kernels, engines/x_ring.cuh), for the call: its tokens (an expert has at most one
    route a token) up to the arch's ``x_ring_tokens`` (kernels/tuning/; sm_90: 4, measured on the H100: at 8 tokens
    the rings take 48 KiB more a block, three blocks an SM instead of five) where the module has them (tuning knob
    ``mma_x_ring``, on by default), else 0 (the kernels that load them from global memory)."""
    rows = problem.rows
    return rows if spec.get("x_ring") and 0 < rows <= problem.device.tuning.x_ring_tokens else 0


def x_lane_bytes(bits: int, stages: int) -> int:
    """A route lane's part of a warp's x ring (engines/x_ring.cuh XRing::kLaneBytes, which the kernels check against
    it): ``stages`` stages of KST chunks (as :func:`ring_bytes`'s) of 256 bytes, padded by 32 bytes."""
    return stages * stage_chunks(bits) * X_CHUNK_BYTES + 32


def x_ring_bytes(bits: int, stages: int, xs: int) -> int:
    """Shared memory of the four warps' x rings of a block: per warp ``xs`` route lanes' parts (:func:`x_lane_bytes`)."""
    return WARPS * xs * x_lane_bytes(bits, stages)


def launch_smem(spec: ModuleSpec, role: str, routes: int, row_tiles: int = 1, xs: int = 0) -> int:
    """Dynamic shared memory of a ``role`` ("fc1" / "fc2") block of the spec's ring engine: the rings of the
    projection it streams (FC1 stages FC3's zero-point word too), then, with ``routes`` > 0, the decode kernels'
    two route lists and the x rings of ``xs`` route lanes (:func:`decode_smem_bytes`; the batched engine's
    kernels have neither: ``routes`` 0)."""
    scale_bytes = 4 if spec["scale_dtype"] == "float32" else 2
    if role == "fc1":
        bits, zp = spec["fc1_bits"], spec["fc1_zp"] == "packed" or (spec["has_fc3"] and spec["fc3_zp"] == "packed")
    else:
        bits, zp = spec["fc2_bits"], spec["fc2_zp"] == "packed"
    ring = ring_bytes(bits, scale_bytes, spec["block_size"], zp, spec["stages"], row_tiles, tiled_meta(spec))
    if not routes:
        return ring
    return decode_smem_bytes(ring, routes, x_ring_bytes(bits, spec["stages"], xs) if xs else 0)


def smem_refusal(spec: ModuleSpec, budget: int, routes: int = 0, row_tiles: int = 1, xs: int = 0,
                 knob: str = "mma_stages") -> str | None:
    """Why a ring engine's blocks (:func:`launch_smem`) do not fit ``budget`` bytes of dynamic shared memory (the
    device's opt-in limit per block), None where both projections' do; ``knob`` sets the engine's ring depth."""
    need = max(launch_smem(spec, role, routes, row_tiles, xs) for role in ("fc1", "fc2"))
    if need <= budget:
        return None
    return (f"a block needs {need} bytes of shared memory (rings of {spec['stages']} stages: QMOE_RTC_TUNE={knob}), more "
            f"than the device's {budget} (its opt-in limit per block)")


def ring_decisions(spec: ModuleSpec, blocks: dict[int, int], row_tiles: int = 1) -> tuple[str, ...]:
    """The lines of a ring engine's generated unit (this one's, kernels/mma_batched.py's) that hand the device the
    host's decisions, which engines/mma_stage.cuh reads and checks: ``blocks`` an SM each route tile's kernels set
    registers for, and each GEMM's four rings' bytes (:func:`launch_smem` without the route lists)."""
    rings = {role: launch_smem(spec, role, 0, row_tiles) for role in ("fc1", "fc2")}
    return ("// The host's decisions (kernels/mma_decode.py), which engines/mma_stage.cuh reads and checks:",
            "// blocks an SM each route tile's kernels set their registers for {route tile, blocks}",
            "#define QMOE_MMA_BLOCKS " + ", ".join(f"{{{br}, {n}}}" for br, n in sorted(blocks.items())),
            f"// the bytes of each GEMM's four rings of {spec['stages']} stages",
            f"#define QMOE_MMA_FC1_RING {rings['fc1']}", f"#define QMOE_MMA_FC2_RING {rings['fc2']}")


def min_blocks(spec: ModuleSpec, br: int, xr: bool = False) -> int:
    """Resident blocks per SM the registers of the ``br``-route kernels (``xr``: the x-ring kernels) are set for."""
    if xr:
        return X_RING_BLOCKS
    return spec["min_blocks"] if br == 8 else MIN_BLOCKS[br]


def tile_routes(rows: int) -> int:
    """BR for a call with ``rows`` tokens: an expert has at most ``rows`` routes."""
    return next((br for br in TILE_ROUTES if rows <= br), TILE_ROUTES[-1])


def k_split(tiles: int, experts: int, K: int, br: int = 8, per_sm: int | None = None, sms: int = DEFAULT_SMS,
            tuning: Tuning | None = None) -> int:
    """Warps of a block that split K (1, 2 or 4) on a device of ``sms`` multiprocessors whose tuning table is
    ``tuning`` (kernels/tuning/; None: an unknown device's): the fewest that
    give about ``target_warps_per_sm`` warps per SM, keeping at least two 128-code chunks per warp; then
    one wave instead of a sliver more: when that split puts more blocks in the grid than are resident
    at once (``sms`` SMs × ``per_sm``,
    the blocks per SM of the ``br``-route kernels, default ``MIN_BLOCKS[br]``) and half of it fits them in
    one wave with at most ``one_wave_chunks`` chunks per warp, half it is. Measured on the H200 in one
    process (docs/performance-log.md):
    qwen3-30b-a3b's FC1 at 1 token (768 blocks for 660 resident, or 384) took the layer 34.4 → 31.1 µs,
    while halving where the half still spills or runs long chunks lost (gpt-oss-120b 56.5 → 57.9 / 65.8).
    Last the deep-K rule (8 routes per pass only, where it was measured): a grid of one to two waves
    whose K is long enough that twice the split still leaves every warp ``deep_chunks`` chunks splits
    twice as deep -- twice the warps over the same bytes, the second wave no longer mostly idle.
    Measured on the H200 in one process, layers timed in turns: mixtral-8x7b FC1 at 1 token
    (896 blocks, 32 chunks) 126.1 → 121.6 µs, its FC2 at 8 tokens (1024 blocks, 112 chunks) 375.2 →
    366.6; the short-K grids it leaves alone measured slower split deeper (ort-2048 FC1 at 8 tokens,
    16 chunks: +2.2 %, qwen3-30b-a3b FC1 at 8 tokens, 2.3 waves: +3.4 %)."""
    t = tuning or ArchSpec().tuning
    target = knobs.get("mma_target_warps") or t.target_warps_per_sm * sms
    chunks = (K + 127) // 128
    resident = sms * (per_sm or MIN_BLOCKS[br])

    def blocks(s: int) -> int:  # grid.x · experts (grid.x = tiles / (WARPS / s))
        return experts * ((tiles * s + WARPS - 1) // WARPS)

    ks = next((s for s in (1, 2, 4) if tiles * experts * s >= target or chunks < 2 * 2 * s), 4)
    if ks > 1 and knobs.get("mma_one_wave", t.knobs["mma_one_wave"]):
        half = ks // 2
        if blocks(ks) > resident >= blocks(half) and (chunks + half - 1) // half <= t.one_wave_chunks:
            ks = half
    if (ks < 4 and br == 8 and knobs.get("mma_deep_split", t.knobs["mma_deep_split"]) and resident < blocks(ks) < 2 * resident
            and chunks >= t.deep_chunks * 2 * ks):
        ks *= 2
    return ks


@dataclass(frozen=True)
class RingGemm:
    """One ring GEMM's launch choices for a call (this engine's and the batched engine's FC1 or FC2)."""

    ks: int  # KS: warps of a block that split K (1, 2 or 4: k_split)
    blocks: int  # grid.x: blocks of output rows, 16-row tiles × WARPS / KS (grid.y: the routes or the experts)
    smem: int  # dynamic shared memory of a block, bytes (launch_smem)


def ring_gemm(spec: ModuleSpec, role: str, problem: Problem, br: int, per_sm: int, smem: int,
              row_tiles: int = 1) -> RingGemm:
    """``role``'s ("fc1" / "fc2") choices at route tile ``br``: the K split (:func:`k_split`, over the experts that get
    routes, ``per_sm`` resident blocks of its kernels) and the blocks of output rows (a warp tile: ``row_tiles``
    16-row tiles, or 8 gated outputs each for FC1), with ``smem`` bytes a block."""
    experts = min(problem.routes, problem.experts)
    if role == "fc1":
        per_tile, n_out, K = (8 if gate_of(spec) != "none" else 16), problem.I, problem.H
    else:
        per_tile, n_out, K = 16, problem.H, problem.I
    per_tile *= row_tiles
    tiles = (n_out + per_tile - 1) // per_tile
    ks = k_split(tiles, experts, K, br, per_sm, problem.sm_count, problem.device.tuning)
    per_block = per_tile * (WARPS // ks)
    return RingGemm(ks, (n_out + per_block - 1) // per_block, smem)


@dataclass(frozen=True)
class DecodeCall:
    """One call's choices (:meth:`MmaDecodeFamily.configure`), made once per plan and read by the kernel choice and
    every launch."""

    br: int  # routes a pass serves (tile_routes: 8, 16, 32)
    xs: int  # route lanes whose activations the x rings stage (x_staged), 0: the kernels that read x from memory
    pf: int  # chunks of its two rows a warp warms L2 with before the route scan (knob mma_prefetch_chunks)
    self_route: bool  # the blocks route the call themselves (routes_in_decode): no routing launch before FC1
    fc1: RingGemm
    fc2: RingGemm

    def gemm(self, role: str) -> RingGemm:
        """The choices of ``role``'s GEMM ('fc1' or 'fc2')."""
        return self.fc1 if role == "fc1" else self.fc2


@register
class MmaDecodeFamily(KernelFamily):
    name = "mma_decode"
    solo = ("fc1_", "fc2_")  # each GEMM kernel its own NVRTC program (compile time: docs/runtime-compilation.md)
    header = "engines/mma_decode.cuh"
    depends_on = (*EXPERT_FIELDS, "tiled")

    def spec(self, config) -> ModuleSpec:
        """The layout's fields plus the ring depth and the resident blocks per SM of the 8-route kernels
        (tuning knobs, read here once per spec, so the module key, the launch's shared memory and the
        K split always agree)."""
        stamps = {"stamps": True} if knobs.get("decode_stamps") else {}  # diagnostics: tools/stamps.py decode
        return expert_spec(self.name, config, stages=_stages(),
                           min_blocks=tuning_knob("mma_min_blocks", MIN_BLOCKS[8],
                                                  MIN_BLOCKS_ALLOWED),
                           expert_flow=bool(knobs.get("mma_expert_flow")), x_ring=x_ring(config), **tiled_spec(config),
                           **stamps)

    def specs(self, config) -> list[ModuleSpec]:
        return [] if tensor_core_unsupported(config) else [self.spec(config)]

    def supports(self, config, problem: Problem | None = None) -> str | None:
        why = tensor_core_unsupported(config, problem)
        if why is None and problem is not None and problem.routes > MAX_ROUTES:
            why = f"{problem.routes} routes (one block scans at most {MAX_ROUTES})"
        if why is None and problem is not None:
            spec = self.spec(config)
            why = smem_refusal(spec, problem.smem_limit, max(problem.routes, 1), xs=x_staged(spec, problem))
        return why

    def defines(self, spec: ModuleSpec) -> tuple[str, ...]:
        return (f"-DQMOE_MMA_STAGES={spec['stages']}", f"-DQMOE_MMA_EXPERT_FLOW={int(spec['expert_flow'])}",
                *tiled_define(spec), *(("-DQMOE_DECODE_STAMPS=1",) if spec.get("stamps") else ()))

    def parts(self, spec: ModuleSpec) -> tuple[tuple[str, ...], ...]:
        """As :attr:`solo` says, except the stamped build (tuning knob ``decode_stamps``): one program, so FC1 and FC2
        write one stamps table (tools/stamps.py decode reads it)."""
        return () if spec.get("stamps") else super().parts(spec)

    def decisions(self, spec: ModuleSpec) -> tuple[str, ...]:
        """The rings (:func:`ring_decisions`, the blocks of :func:`min_blocks`), then the x-ring kernels' blocks an SM
        and a route lane's x-ring bytes of each GEMM (:func:`x_lane_bytes`), then the routes of a self-routed call
        (kernels/route.py SELF_ROUTE_MAX_ROUTES)."""
        lanes = {role: x_lane_bytes(spec[f"{role}_bits"], spec["stages"]) for role in ("fc1", "fc2")}
        return (*ring_decisions(spec, {br: min_blocks(spec, br) for br in TILE_ROUTES}),
                "// the x-ring kernels' blocks an SM, and the bytes of a route lane's x ring of each GEMM",
                f"#define QMOE_MMA_X_RING_BLOCKS {X_RING_BLOCKS}",
                f"#define QMOE_MMA_FC1_X_LANE {lanes['fc1']}", f"#define QMOE_MMA_FC2_X_LANE {lanes['fc2']}",
                "// the routes a call whose blocks route it themselves has at most (engines/self_route.cuh)",
                f"#define QMOE_SELF_ROUTE_MAX_ROUTES {SELF_ROUTE_MAX_ROUTES}")

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        gate = t["GATE"]
        out = []
        variants = [(br, "", "") for br in TILE_ROUTES] + ([(8, "_xr", ", true")] if spec.get("x_ring") else [])
        for br, suffix, xr in variants:
            out.append(KernelDef(
                f"fc1_br{br}{suffix}",
                f"qmoe::fc1_mma<{gate}, {t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['Z3']}, {t['BLOCK']}, {t['ACT']}, {br}"
                f"{xr}>",
                (Ptr("x", dt), Ptr("topk_ids", "int32"), Scalar("R", "int32"), Scalar("k", "int32"),
                 Scalar("H", "int32"), Scalar("I", "int32"), Scalar("KS", "int32"), Scalar("PF", "int32"),
                 Scalar("XS", "int32"), fc1_weights(sdt), ACT_PARAMS_ARG, SELF_ROUTE_ARG, Ptr("act", dt),
                 Ptr("fc1_done", "uint32")),
            ))
            out.append(KernelDef(
                f"fc2_br{br}{suffix}",
                f"qmoe::fc2_mma_combine<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {br}{xr}>",
                (Ptr("act", dt), Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"), Scalar("R", "int32"),
                 Scalar("k", "int32"), Scalar("H", "int32"), Scalar("I", "int32"), Scalar("KS", "int32"),
                 Scalar("PF", "int32"), Scalar("XS", "int32"), fc2_weights(sdt), SELF_ROUTE_ARG, Ptr("y", "float32"),
                 Ptr("counters", "uint32"), Ptr("out", dt), Ptr("fc1_done", "uint32"), Ptr("fc2_seen", "uint32"),
                 Scalar("FC1_TILES", "int32")),
            ))
        return tuple(out)

    def configure(self, spec: ModuleSpec, problem: Problem) -> DecodeCall:
        """The call's route tile, x-ring lanes, prefetch chunks, own routing and each GEMM's K split, grid and shared
        memory: each decided here once."""
        br, xs = tile_routes(problem.rows), x_staged(spec, problem)
        fc1, fc2 = (ring_gemm(spec, role, problem, br, min_blocks(spec, br, xs > 0),
                              launch_smem(spec, role, problem.routes, xs=xs)) for role in ("fc1", "fc2"))
        return DecodeCall(br, xs, knobs.get("mma_prefetch_chunks") or PREFETCH_CHUNKS, routes_in_decode(problem), fc1,
                          fc2)

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call: DecodeCall | None = None) -> str:
        c = call or self.configure(spec, problem)
        return f"{role}_br8_xr" if c.xs else f"{role}_br{c.br}"

    def geometry(self, spec: ModuleSpec, role: str, problem: Problem, call: DecodeCall | None = None) -> tuple[int, int]:
        """(KS, grid.x) of ``role`` ("fc1" or "fc2"): K-split warps and output tiles."""
        g = (call or self.configure(spec, problem)).gemm(role)
        return g.ks, g.blocks

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call: DecodeCall | None = None) -> Launch:
        c = call or self.configure(spec, problem)
        g = c.gemm(role)
        # overlap: FC1 waits for the ids, FC2 reads the ids and prefetches its weights, then waits for act (with
        # self_route FC1 is the forward's first launch, so it is not overlapped: runtime/plan.py)
        args = (("KS", g.ks), ("PF", c.pf), ("XS", c.xs), ("self_route", int(c.self_route)),
                ("logits_f32", int(problem.router_dtype == "float32")))
        if role == "fc2":  # expert flow: an expert's FC1 blocks, which its FC2 blocks wait for
            args += (("FC1_TILES", c.fc1.blocks),)
        return Launch((g.blocks, problem.routes, 1), (THREADS, 1, 1), g.smem, args, overlap=True)

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call: DecodeCall | None = None) -> dict[str, Slot]:
        """The step's buffers, sized by the problem alone (no choice of the call's)."""
        R = problem.routes
        if role == "fc1":
            # act [R, I] T; the expert flow's counters [E + S] u32 each, zero between calls (FC2 resets
            # them), declared with the flow off too so every argument binds by name (then never read); topk_ids,
            # topk_w [R] i32 / f32, the routing step's, declared here too for calls whose blocks route themselves
            # (no routing step then: routes_in_decode), where the kernels never read them
            return {"act": Slot(R * problem.I * 2), "fc1_done": Slot(4 * problem.experts, zero=True),
                    "fc2_seen": Slot(4 * problem.experts, zero=True), "topk_ids": Slot(4 * R),
                    "topk_w": Slot(4 * R)}
        # y [R, H] f32; counters [ceil(H / 16) + 1] u32, zero between calls (the counting kernel resets them)
        return {"y": Slot(4 * R * problem.H), "counters": Slot(4 * (problem.H // 16 + 1), zero=True)}
