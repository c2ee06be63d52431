"""Kernel family ``gemm``: the prefill path (many routes), grouped by expert.

Template ``cuda_src/moe_gemm.cuh``: ``qmoe::fc1_gemm`` (FC1 [+FC3], activation fused, sorted order),
``qmoe::fc2_gemm`` (FC2 + bias, scattered back to route order) and ``qmoe::combine_routes``.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..jit.family import KernelDef, KernelFamily, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from . import register
from ._moe import EXPERT_FIELDS, expert_spec, projection_args, template_types
from .gemv import ACT_SCALARS

THREADS = 256
TILE_ROWS = (16, 64)  # routes per tile (template BM): 16 when experts get few routes each


def tile_rows(routes: int, E: int) -> int:
    """Routes per GEMM tile for ``routes`` spread over ``E`` experts: 64 once experts average 32+."""
    return 64 if routes >= 32 * E else 16
BW = 64  # weight rows per tile (kGemmBW)
COMBINE_THREADS = 256
_GROUP_ARGS = (Ptr("sorted", "int32"), Ptr("offsets", "int32"), Ptr("tile_offsets", "int32"))


@register
class GemmFamily(KernelFamily):
    name = "gemm"
    header = "moe_gemm.cuh"
    depends_on = EXPERT_FIELDS
    variants = ("prefill",)

    def specs(self, config: Any, variants: Iterable[str]) -> list[ModuleSpec]:
        return [expert_spec("gemm", config)]

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        out = []
        for bm in TILE_ROWS:
            out.append(KernelDef(
                f"fc1_bm{bm}",
                f"qmoe::fc1_gemm<{t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['B3']}, {t['Z3']}, {t['BLOCK']}, "
                f"{t['ACT']}, {t['GATE']}, {t['ALIGNED']}, {bm}>",
                (Ptr("x", dt), *_GROUP_ARGS, Scalar("E", "int32"), Scalar("k", "int32"), Scalar("H", "int32"),
                 Scalar("I", "int32"), *projection_args("fc1", sdt), *projection_args("fc3", sdt),
                 Scalar("zp_offset", "float32"), *ACT_SCALARS, Ptr("act_sorted", "float32")),
            ))
            out.append(KernelDef(
                f"fc2_bm{bm}",
                f"qmoe::fc2_gemm<{t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {t['ALIGNED']}, {bm}>",
                (Ptr("act_sorted", "float32"), *_GROUP_ARGS, Scalar("E", "int32"), Scalar("H", "int32"),
                 Scalar("I", "int32"), *projection_args("fc2", sdt), Scalar("zp_offset", "float32"),
                 Ptr("y", "float32")),
            ))
        out.append(KernelDef(
            "combine",
            f"qmoe::combine_routes<{t['T']}>",
            (Ptr("y", "float32"), Ptr("topk_w", "float32"), Scalar("rows", "int32"), Scalar("k", "int32"),
             Scalar("H", "int32"), Ptr("out", dt)),
        ))
        return tuple(out)

    def launch(self, spec: ModuleSpec, kernel: str, *, rows: int, routes: int, E: int, H: int, I: int,
               **_: Any) -> Launch:
        bm = tile_rows(routes, E)
        tiles = (routes + bm - 1) // bm + E  # upper bound on sum_e ceil(count_e / BM)
        if kernel.startswith("fc1"):
            gated = spec["swiglu_fusion"] != 0 or spec["has_fc3"]
            cols = 2 * I if gated else I
            return Launch((tiles, (cols + BW - 1) // BW, 1), (THREADS, 1, 1), 0)
        if kernel.startswith("fc2"):
            return Launch((tiles, (H + BW - 1) // BW, 1), (THREADS, 1, 1), 0)
        return Launch(((rows * H + COMBINE_THREADS - 1) // COMBINE_THREADS, 1, 1), (COMBINE_THREADS, 1, 1), 0)
