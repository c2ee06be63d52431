"""Block geometry of the wgmma prefill engine (kernels/wgmma_prefill.py), decided here once: each GEMM's ring
(stages, warpgroups per block, blocks an SM: :func:`ring_of`) and FC1's launch bounds (:func:`fc1_bound`), which
the generated unit hands the device (:func:`unit_decisions`; ``cuda_src/engines/wg_mainloop.cuh`` reads them and
only checks that they fit its stage layout and the budget), the shared memory a launch asks for, and the route
tile of a call. Also the K order of a chunk (``core/wg_order.cuh``), for the CPU tests' reference."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import QMoEUnsupportedError
from ..settings import knobs
from ..specialize import ModuleSpec
from ._expert import meta_words, tiled_meta
from ._grouped import staged_projection, weight_tiles
from .arch import SMEM_OPTIN
from .base import Problem
from .engine_choice import expected_experts
from .tuning import Tuning

__all__ = ["CHUNK", "MAX_FC2_PARTS", "SMEM_OPTIN_SM90", "SM_SMEM", "TILE_ROUTES", "WgRing", "fc1_bound", "fc2_parts",
           "groups_of", "image_rows", "launch_smem", "padded", "resident", "ring", "ring_bytes", "ring_of",
           "route_tiles_of", "smem_defines", "spec_tiles", "stage_bytes", "stages", "tile_groups", "tile_routes",
           "unit_decisions", "wg_logical", "wg_natural"]

TILE_ROUTES = (32, 64, 128, 256)  # BR (with 4 warpgroups, 256 does not fit the 128 registers a thread has)
#: Opt-in dynamic shared memory per block of the one target this engine runs on (sm_90a: 227 KiB; the table of
#: kernels/arch.py). The rings are sized to it here and the device takes the results from the generated unit
#: (:func:`unit_decisions`) and the budget as a define (:func:`smem_defines`) to check them against.
SMEM_OPTIN_SM90 = SMEM_OPTIN[90]
#: An SM's shared memory (H200, 228 KiB: the opt-in limit and the system's 1 KiB), from which two blocks of 2
#: warpgroups each take their ring, 1 KiB of alignment slack, 1 KiB the system's and ~1 KiB static
#: (:func:`tile_groups`, :func:`resident`).
SM_SMEM = SMEM_OPTIN_SM90 + 1024
MAX_STAGES = 4  # QMOE_WG_STAGES
INFLIGHT = 1  # QMOE_WG_INFLIGHT: MMAs a warpgroup keeps in flight (2 measured no faster)
RING = 0  # QMOE_WG_RING: the ring's hand-off (1: a block barrier a chunk; 2: a stage's barriers; 0: 2 on 4 warpgroups)
SHRINK = 3  # QMOE_WG_SHRINK: widths a tail tile's MMAs shrink to (1: BR / 2; 2: BR / 2 and BR / 4; 3: down to 16 routes)
SMEM_BUDGET = SMEM_OPTIN_SM90 - 1024 - 4096  # kWgSmemBudget: a block's stages (alignment slack, 4 KiB static)
CHUNK = 128  # K per pipeline stage; the permuted layouts pad K to a multiple of it
GATHER_ROWS = 8  # kGatherRows: sorted rows per block of the gather into a route-tile image (engines/wg_image.cuh)
MAX_FC2_PARTS = 8  # parts FC2 may run K in (fc2_parts; y holds one [R, H] plane each)


def smem_defines() -> tuple[str, ...]:
    """The budget of a block's stages, which the device checks every ring of the unit against."""
    return (f"-DQMOE_WG_STAGE_BUDGET={SMEM_BUDGET}",)


def padded(K: int) -> int:
    """K rounded up to a whole chunk (the row length of ``xp`` and ``act_sorted``)."""
    return (K + CHUNK - 1) // CHUNK * CHUNK


def _pair_order(bits: int) -> tuple[int, int]:
    """(pairs, codes) per 32-bit word of the device's pair order (MmaDeq); 3-bit codes take 4-bit's."""
    order = 4 if bits == 3 else bits
    return 16 // order, 32 // order


def wg_natural(l: int, bits: int, tiled: bool = False) -> int:  # noqa: E741
    """Natural k (0..127) of logical column ``l`` of a chunk (the reference the CPU tests hold the device's
    wg_natural to; ``tiled``: codes in the tiled layout's pair order, pair i = natural codes 2i, 2i + 1)."""
    P, C = _pair_order(bits)
    s, j = l >> 4, l & 15
    pair = 2 * s + (j >> 3)
    if tiled:
        return 32 * ((j & 7) >> 1) + 2 * pair + (j & 1)
    return 32 * ((j & 7) >> 1) + (pair // P) * C + pair % P + (j & 1) * P


def wg_logical(n: int, bits: int, tiled: bool = False) -> int:
    """Logical column of natural k ``n`` (0..127): the inverse of :func:`wg_natural`."""
    P, C = _pair_order(bits)
    t, r = n >> 5, n & 31
    w = r % C
    pair, hi = (r >> 1, r & 1) if tiled else ((r // C) * P + w % P, w // P)
    return 16 * (pair >> 1) + 8 * (pair & 1) + 2 * t + hi


def stage_bytes(bits: int, scale_bytes: int, block_size: int, zp_packed: bool, br: int, groups: int,
                tiled_meta: bool = False) -> int:
    """One pipeline stage's bytes, rounded to 1024 (the layout of wg_mainloop.cuh WgStage, which checks them):
    the route tile, then each m16 weight tile's codes and meta (4 a warpgroup)."""
    words = meta_words(bits, scale_bytes, block_size, zp_packed, tiled_meta) if block_size else 0
    raw = br * 256 + 4 * groups * (2 * 32 * 4 * bits + 2 * words * 128)
    return (raw + 1023) // 1024 * 1024


def stages(stage: int, max_stages: int = MAX_STAGES, budget: int = SMEM_BUDGET) -> int:
    """Stages of the ring: as many as fit ``budget``, at most ``max_stages``."""
    return min(max_stages, budget // stage)


def tile_groups(bits: int, scale_bytes: int, block_size: int, zp_packed: bool, br: int, tiled_meta: bool = False,
                max_stages: int = MAX_STAGES) -> int:
    """Warpgroups per block of a GEMM by default: 2 at 32- and 64-route tiles where four
    stages of 2 warpgroups fit twice in an SM, so two blocks share it and one's first copies and epilogue
    overlap the other's main loop (H200, against 4: int4 gpt-oss-120b at 512 / 1024 tokens
    -9.4 / -6.6 %, qwen3-30b-a3b -4.0 / -4.2 %), else 4 (int8, whose ring fits once: 2 measured 12-16 %
    slower)."""
    if br > 64 or max_stages < 4:
        return 4
    st = stage_bytes(bits, scale_bytes, block_size, zp_packed, br, 2, tiled_meta)
    return 2 if 2 * (4 * st + 3072) <= SM_SMEM else 4


def _staged(spec: ModuleSpec, role: str) -> tuple:
    """(bits, scale bytes, block size, zp packed) of the projection a GEMM stages."""
    bits, zp = staged_projection(spec, role)
    return bits, 4 if spec["scale_dtype"] == "float32" else 2, spec["block_size"], zp


@dataclass(frozen=True)
class WgRing:
    """One GEMM's ring (the device's WgRing, engines/wg_mainloop.cuh), keyed by what its stage holds: ``bits`` of
    the codes, ``zpw`` packed zero-point words, ``scale_bytes`` and ``block_size`` of the scales, route tile ``br``;
    the host's ``stages``, ``groups`` (warpgroups per block) and ``blocks`` an SM, and the ``stage_bytes`` the
    device's layout must give."""

    bits: int
    zpw: bool
    scale_bytes: int
    block_size: int
    br: int
    stages: int
    groups: int
    blocks: int
    stage_bytes: int

    @property
    def smem(self) -> int:
        """Dynamic shared memory of a block: the stages and 1024 bytes of alignment slack."""
        return self.stages * self.stage_bytes + 1024

    def row(self) -> str:
        """The row of the generated unit's QMOE_WG_RINGS."""
        return "{" + ", ".join(str(int(v)) for v in (self.bits, self.zpw, self.scale_bytes, self.block_size, self.br,
                                                     self.stages, self.groups, self.blocks, self.stage_bytes)) + "}"


@functools.lru_cache(maxsize=1024)
def ring(bits: int, scale_bytes: int, block_size: int, zp_packed: bool, br: int, tiled_meta: bool = False,
         max_stages: int = MAX_STAGES, groups: int = 0) -> WgRing:
    """The ring of a BR-route GEMM staging these codes: ``groups`` warpgroups (0: :func:`tile_groups`), as many
    stages of :func:`stage_bytes` as :func:`stages` gives, and two blocks an SM where a block has 2 warpgroups, at
    most 64 routes and its ring fits twice (with 1 KiB the system's and ~1 KiB static each), else one."""
    g = groups or tile_groups(bits, scale_bytes, block_size, zp_packed, br, tiled_meta, max_stages)
    st = stage_bytes(bits, scale_bytes, block_size, zp_packed, br, g, tiled_meta)
    n = stages(st, max_stages)
    two = g == 2 and br <= 64 and 2 * (n * st + 1024 + 2048) <= SM_SMEM
    return WgRing(bits, zp_packed, scale_bytes, block_size, br, n, g, 2 if two else 1, st)


def ring_of(spec: ModuleSpec, role: str, br: int) -> WgRing:
    """The spec's BR-route ``role`` GEMM's ring (:func:`ring`; knobs prefill_wg_groups and prefill_wg_stages)."""
    return ring(*_staged(spec, role), br, tiled_meta(spec), spec["stages"], spec.get("groups") or 0)


def groups_of(spec: ModuleSpec, role: str, br: int) -> int:
    """Warpgroups per block of the spec's BR-route ``role`` GEMM (knob prefill_wg_groups, else
    :func:`tile_groups`)."""
    return ring_of(spec, role, br).groups


def ring_bytes(spec: ModuleSpec, role: str, br: int) -> int:
    """Dynamic shared memory of a BR-route GEMM's launch: its ring of stages, 1024 bytes of alignment slack."""
    return ring_of(spec, role, br).smem


def resident(spec: ModuleSpec, role: str, br: int) -> int:
    """Blocks of a GEMM an SM holds, which its launch bounds set registers for (:func:`ring`; FC1's third block at
    32 routes: :func:`launch_smem`)."""
    return ring_of(spec, role, br).blocks


def launch_smem(spec: ModuleSpec, role: str, br: int, blocks: int, sms: int, tuning: Tuning) -> int:
    """Dynamic shared memory a BR-route GEMM's launch of ``blocks`` blocks on ``sms`` SMs asks for: its ring
    (:func:`ring_bytes`), more where an SM would otherwise hold more blocks than :func:`resident` says. The
    exception, FC1 at 32-route tiles from the arch's ``wgmma_third_block_rounds`` rounds of ``blocks`` (``tuning``,
    kernels/tuning/, where the measurement is; knob ``prefill_wg_fc1_blocks``): its ring of four stages fits three
    times an SM, and where ptxas gave it at most 80 registers (its launch bounds: :func:`fc1_bound`) a third block
    starts (a third FC2 block measured slower)."""
    own = ring_bytes(spec, role, br)
    n = resident(spec, role, br)
    if role == "fc1" and br <= 32 and n == 2:
        third = spec["fc1_blocks"]  # 0: by the grid
        if third == 3 or (not third and blocks >= tuning.wgmma_third_block_rounds * n * sms):
            return own
    return own if (n + 1) * (own + 2048) > SM_SMEM else (SM_SMEM // (n + 1) - 2048) // 1024 * 1024 + 1024


def fc1_bound(spec: ModuleSpec, br: int) -> int:
    """Blocks an SM the BR-route FC1 kernels' launch bounds set registers for: its ring's (:func:`resident`), at
    32-route tiles with two an SM the knob ``prefill_wg_fc1_blocks``'s 3, else 2 (:func:`launch_smem`)."""
    n = resident(spec, "fc1", br)
    return (3 if spec["fc1_blocks"] == 3 else 2) if br <= 32 and n == 2 else n


def unit_decisions(spec: ModuleSpec) -> tuple[str, ...]:
    """The lines of the generated unit that hand the device the host's decisions: QMOE_WG_RINGS, each GEMM's ring
    (:func:`ring_of`; FC1 and FC2 share a row where they stage the same), and QMOE_WG_FC1_BOUNDS (:func:`fc1_bound`)."""
    rows: dict[tuple, tuple[WgRing, list[str]]] = {}
    for br in spec_tiles(spec):
        for role in ("fc1", "fc2"):
            r = ring_of(spec, role, br)
            have = rows.setdefault((r.bits, r.zpw, r.scale_bytes, r.block_size, br), (r, []))
            if have[0] != r:  # one stage type, two rings: the device could not tell them apart
                raise QMoEUnsupportedError(f"module {spec.name}: {role} at {br} routes stages what {have[1]} stage with "
                                           f"another ring ({r} against {have[0]}), which its device code cannot tell apart")
            have[1].append(role)
    bounds = ", ".join(f"{{{br}, {fc1_bound(spec, br)}}}" for br in spec_tiles(spec))
    listed = [f"  {ring.row()} /* {' '.join(roles)} */" for ring, roles in rows.values()]
    return ("// The host's decisions (kernels/wgmma_geometry.py), which engines/wg_mainloop.cuh reads and checks:",
            "// each GEMM's ring {bits, packed zp words, scale bytes, block size, route tile, stages, warpgroups, blocks an SM,",
            "// stage bytes}",
            "#define QMOE_WG_RINGS \\", *(f"{row}, \\" for row in listed[:-1]), listed[-1],
            "// FC1's launch bounds {route tile, blocks an SM its registers are set for}",
            f"#define QMOE_WG_FC1_BOUNDS {bounds}")


def route_tiles_of(groups: int | None) -> tuple[int, ...]:
    """The route tiles a module with ``groups`` warpgroups per block has (None: by tile, :func:`tile_groups`)."""
    return TILE_ROUTES if groups == 2 else TILE_ROUTES[:3]


def spec_tiles(spec: ModuleSpec) -> tuple[int, ...]:
    """The route tiles the spec's module has."""
    return route_tiles_of(spec.get("groups"))


def image_rows(spec: ModuleSpec, problem: Problem) -> int:
    """Rp, the rows of the route-tile images (of the pairs): the routes plus the largest route tile (a tile's copy
    reads BR rows from its first one)."""
    return problem.routes + max(spec_tiles(spec))


#: The route tile whose GEMMs also run as pairs of blocks in a cluster (``fc1_br128_pair``,
#: ``fc2_br128_pair``: cuda_src/engines/wg_mainloop.cuh), where its blocks have 4 warpgroups, from the arch's
#: ``wgmma_pair_min_fc1_tiles`` FC1 weight tiles a route tile (and where FC2 would not split K; kernels/tuning/).
PAIR_ROUTES = 128


def pair_kernels(spec: ModuleSpec) -> bool:
    """Whether the spec's module has the pair forms of its PAIR_ROUTES GEMMs (4 warpgroups)."""
    return PAIR_ROUTES in spec_tiles(spec) and \
        groups_of(spec, "fc1", PAIR_ROUTES) == groups_of(spec, "fc2", PAIR_ROUTES) == 4


def tile_routes(routes: int, E: int, tuning: Tuning, groups: int | None = None, have: tuple[int, ...] = ()) -> int:
    """BR for a call: the route tile the average expert fills best among ``have`` (default: those of a module
    with ``groups`` warpgroups), by the arch's ``wgmma_narrow_routes`` / ``wgmma_tile64_routes`` /
    ``wgmma_tile128_routes`` (``tuning``, kernels/tuning/; knob ``prefill_route_tile`` forces one of them, for
    tuning)."""
    have = have or route_tiles_of(groups)
    forced = knobs.get("prefill_route_tile") or 0
    if forced in have:
        return forced
    per_expert = routes / max(1, min(E, routes))
    if per_expert <= tuning.wgmma_narrow_routes and 32 in have:
        return 32
    if per_expert <= tuning.wgmma_tile64_routes:
        return 64
    return 128 if per_expert <= tuning.wgmma_tile128_routes or 256 not in have else 256


def fc2_parts(spec: ModuleSpec, problem: Problem, br: int) -> int:
    """Parts FC2 runs K in at route tile ``br``: 1 (whole tiles, or the halves of
    :meth:`~qmoe_rtc.kernels.wgmma_prefill.WgmmaPrefillFamily._k_split`), or n, each part a block that stores its
    sums into its own plane of y [n, R, H], which the combine adds in plane order (engines/wgmma_prefill.cuh).

    By the arch's rule (kernels/tuning/, where the measurements are): as many parts as the call's expected whole
    tiles (the experts hit under uniform routing, or its routes over ``br`` if more, times FC2's weight tiles) fit
    whole in ``wgmma_fc2_part_rounds`` rounds of the SMs' FC2 blocks, each of at least ``wgmma_fc2_part_chunks`` chunks
    of K, at most MAX_FC2_PARTS, and no more than keep the planes' extra traffic (each plane past the first written
    once and read once, 8·R·H bytes) within ``wgmma_fc2_part_bytes`` of the codes FC2 streams; fewer than two: 1.
    Knob ``prefill_fc2_parts``: n forces n parts (at most K's chunks), 1 none."""
    nch = padded(problem.I) // CHUNK
    forced = knobs.get("prefill_fc2_parts") or 0
    if forced:
        return max(1, min(forced, nch))
    t = problem.device.tuning
    if not t.wgmma_fc2_part_rounds or not problem.rows:
        return 1
    per_expert = weight_tiles(spec, "fc2", problem.H, 4 * groups_of(spec, "fc2", br))
    hit = expected_experts(problem.rows, problem.E, problem.k, problem.logit_count) + problem.shared
    tiles = max(hit, problem.routes / br) * per_expert
    slots = problem.sm_count * resident(spec, "fc2", br)
    codes = hit * problem.H * nch * CHUNK * spec["fc2_bits"] / 8
    by_bytes = 1 + int(t.wgmma_fc2_part_bytes * codes / (8 * problem.routes * problem.H))
    n = min(MAX_FC2_PARTS, nch // t.wgmma_fc2_part_chunks, by_bytes, int(t.wgmma_fc2_part_rounds * slots / tiles))
    return n if n >= 2 else 1
