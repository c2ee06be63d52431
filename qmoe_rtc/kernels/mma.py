"""Kernel family ``mma``: the tensor-core decode path (float16/bfloat16, 1/2/4/8-bit weights).

Template ``cuda_src/moe_mma.cuh``: ``qmoe::fc1_mma`` (FC1 [+FC3], activation fused) and
``qmoe::fc2_mma_combine`` (FC2, routing weight and bias applied, the last block of each output tile
adds the routes in slot order). Expert-grouped: every expert's weights are read once per call
however many of the rows chose it. One module holds both kernels for route groups of 8, 16 and 32
routes per pass (``NG`` 1, 2, 4).

Layouts the template does not cover fall back to the SIMT ``gemv`` family; :func:`unsupported_reason`
says why (the executor logs it).
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import QMoEAttributeError
from ..jit.family import KernelDef, KernelFamily, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from . import register
from ._moe import EXPERT_FIELDS, expert_spec, gate_mode, projection_args, template_types

THREADS = 128  # kMmaThreads (4 warps)
WARPS = 4
MAX_ROUTES = 512  # kMmaMaxRoutes: route ids one block scans
ROUTE_GROUPS = (1, 2, 4)  # NG: route groups of 8 served per pass over an expert's weights
TARGET_WARPS = 132 * 24  # enough warps for every SM of an H200 to keep ~24 in flight

STAGES = 3  # kMmaStages: cp.async ring depth per warp


def stages() -> int:
    """Ring depth (knob ``mma_stages`` overrides it for tuning runs; it is part of the module key)."""
    from .. import knobs

    n = knobs.get("mma_stages") or STAGES
    if not 2 <= n <= 8:
        raise QMoEAttributeError("QMOE_RTC_MMA_STAGES", "2..8", str(n))
    return n


def ring_bytes(bits: int, scale_bytes: int, block_size: int, zp_packed: bool) -> int:
    """Dynamic shared memory of one block (moe_mma.cuh MmaStage): 4 warps × stages × stage bytes."""
    kst = 1 if bits >= 8 else 8 // bits
    nsb = 2 if block_size == 16 else 1
    words = (2 if nsb == 2 and scale_bytes == 4 else 1) + (1 if zp_packed else 0)
    stage = kst * 2 * 32 * 4 * bits + kst * 2 * words * 32 * 4
    return WARPS * stages() * stage


ACT_SCALARS = (Scalar("alpha", "float32"), Scalar("beta", "float32"), Scalar("limit", "float32"),
               Scalar("limit_after", "int32"))


def unsupported_reason(layout: Any, hidden: int | None = None, inter: int | None = None) -> str | None:
    """Why the tensor-core decode path cannot run ``layout`` (None: it can)."""
    if layout.dtype not in ("float16", "bfloat16"):
        return f"{layout.dtype} activations (the tensor-core path computes in float16/bfloat16)"
    bits = [layout.fc1_bits, layout.fc2_bits] + ([layout.fc3_bits] if layout.has_fc3 else [])
    if 3 in bits:
        return "3-bit weights (codes straddle 32-bit words)"
    if layout.has_fc3 and layout.fc3_bits != layout.fc1_bits:
        return "FC3 bit width differs from FC1's"
    zps = [layout.fc1_zp, layout.fc2_zp] + ([layout.fc3_zp] if layout.has_fc3 else [])
    if "offset" in zps:
        return "a zero_point_offset (not exact in float16/bfloat16)"
    if layout.block_size == 16 and 1 in bits:
        return "1-bit weights with block_size 16"
    if hidden is not None and (hidden % 32 or inter % 32):
        return f"hidden_size {hidden} / inter_size {inter} not multiples of 32"
    return None


def route_groups(rows: int) -> int:
    """NG for a call with ``rows`` tokens: an expert has at most ``rows`` routes."""
    for ng in ROUTE_GROUPS:
        if rows <= 8 * ng:
            return ng
    return ROUTE_GROUPS[-1]


def k_split(tiles: int, experts: int, K: int) -> int:
    """Warps of a block that split K (1, 2 or 4): the fewest that give about TARGET_WARPS warps,
    keeping at least two 128-code chunks per warp."""
    from .. import knobs

    target = knobs.get("mma_target_warps") or TARGET_WARPS
    chunks = (K + 127) // 128
    for ks in (1, 2, 4):
        if tiles * experts * ks >= target or chunks < 2 * 2 * ks:
            return ks
    return 4


@register
class MmaFamily(KernelFamily):
    name = "mma"
    header = "moe_mma.cuh"
    depends_on = EXPERT_FIELDS
    variants = ("decode",)

    def specs(self, config: Any, variants: Iterable[str]) -> list[ModuleSpec]:
        layout = getattr(config, "layout", config)
        if unsupported_reason(layout, getattr(config, "hidden", None), getattr(config, "inter", None)):
            return []
        return [expert_spec("mma", config)]

    def defines(self, spec: ModuleSpec) -> tuple[str, ...]:
        return (f"-DQMOE_MMA_STAGES={stages()}",)

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        out = []
        for ng in ROUTE_GROUPS:
            out.append(KernelDef(
                f"fc1_ng{ng}",
                f"qmoe::fc1_mma<{gate_mode(spec)}, {t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['Z3']}, {t['BLOCK']}, "
                f"{t['ACT']}, {ng}>",
                (Ptr("x", dt), Ptr("topk_ids", "int32"), Scalar("R", "int32"), Scalar("k", "int32"),
                 Scalar("H", "int32"), Scalar("I", "int32"), Scalar("KS", "int32"),
                 *projection_args("fc1", sdt), *projection_args("fc3", sdt), Scalar("zp_offset", "float32"),
                 *ACT_SCALARS, Ptr("act", dt)),
            ))
            out.append(KernelDef(
                f"fc2_ng{ng}",
                f"qmoe::fc2_mma_combine<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {ng}>",
                (Ptr("act", dt), Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"), Scalar("R", "int32"),
                 Scalar("k", "int32"), Scalar("H", "int32"), Scalar("I", "int32"), Scalar("KS", "int32"),
                 *projection_args("fc2", sdt), Scalar("zp_offset", "float32"), Ptr("y", "float32"),
                 Ptr("counters", "uint32"), Ptr("out", dt)),
            ))
        return tuple(out)

    def geometry(self, spec: ModuleSpec, kernel: str, *, routes: int, E: int, H: int, I: int) -> tuple[int, int]:
        """(KS, grid.x) of ``kernel`` ("fc1" or "fc2"): K-split warps and output tiles."""
        experts = min(routes, E)
        if kernel == "fc1":
            gated = spec["swiglu_fusion"] != 0 or spec["has_fc3"]
            per_tile, n_out, K = (8 if gated else 16), I, H
        else:
            per_tile, n_out, K = 16, H, I
        tiles = (n_out + per_tile - 1) // per_tile
        ks = k_split(tiles, experts, K)
        per_block = per_tile * (WARPS // ks)
        return ks, (n_out + per_block - 1) // per_block

    def launch(self, spec: ModuleSpec, kernel: str, *, routes: int, E: int, H: int, I: int, **_: Any) -> Launch:
        _, gx = self.geometry(spec, kernel, routes=routes, E=E, H=H, I=I)
        scale_bytes = 4 if spec["scale_dtype"] == "float32" else 2
        if kernel == "fc1":
            zp = spec["fc1_zp"] == "packed" or (spec["has_fc3"] and spec["fc3_zp"] == "packed")
            smem = ring_bytes(spec["fc1_bits"], scale_bytes, spec["block_size"], zp)
        else:
            smem = ring_bytes(spec["fc2_bits"], scale_bytes, spec["block_size"], spec["fc2_zp"] == "packed")
        return Launch((gx, routes, 1), (THREADS, 1, 1), smem)
