"""Kernel family ``gemv``: the decode path (few routes, no grouping pass).

Template ``cuda_src/moe_gemv.cuh``: ``qmoe::fc1_gemv`` (FC1 [+FC3] with the activation fused) and
``qmoe::fc2_gemv_combine`` (FC2 with the weighted combine fused, output rounded once to T); their
inner step is ``cuda_src/moe_dot.cuh`` (16-byte weight loads when the spec is ``aligned``). The activation
between them is stored in the activation dtype T.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..jit.family import KernelDef, KernelFamily, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from . import register
from ._moe import EXPERT_FIELDS, expert_spec, projection_args, template_types

THREADS = 128  # kGemvThreads
FC1_ROWS = 8  # weight rows per fc1 block (kFc1Groups groups of 4): 4 gated outputs or 8 plain ones
FC2_ROWS = 4  # kFc2Rows: outputs per fc2 block

ACT_SCALARS = (Scalar("alpha", "float32"), Scalar("beta", "float32"), Scalar("limit", "float32"),
               Scalar("limit_after", "int32"))


@register
class GemvFamily(KernelFamily):
    name = "gemv"
    header = "moe_gemv.cuh"
    depends_on = EXPERT_FIELDS
    variants = ("decode",)

    def specs(self, config: Any, variants: Iterable[str]) -> list[ModuleSpec]:
        return [expert_spec("gemv", config)]

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        fc1 = KernelDef(
            "fc1",
            f"qmoe::fc1_gemv<{t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['B3']}, {t['Z3']}, {t['BLOCK']}, "
            f"{t['ACT']}, {t['GATE']}, {t['ALIGNED']}>",
            (Ptr("x", dt), Ptr("topk_ids", "int32"), Scalar("k", "int32"), Scalar("H", "int32"), Scalar("I", "int32"),
             *projection_args("fc1", sdt), *projection_args("fc3", sdt), Scalar("zp_offset", "float32"),
             *ACT_SCALARS, Ptr("act", dt)),
        )
        fc2 = KernelDef(
            "fc2_combine",
            f"qmoe::fc2_gemv_combine<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {t['ALIGNED']}>",
            (Ptr("act", dt), Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"), Scalar("k", "int32"),
             Scalar("H", "int32"), Scalar("I", "int32"), *projection_args("fc2", sdt), Scalar("zp_offset", "float32"),
             Ptr("out", dt)),
        )
        return (fc1, fc2)

    def launch(self, spec: ModuleSpec, kernel: str, *, rows: int, routes: int, H: int, I: int, k: int = 1,
               **_: Any) -> Launch:
        if kernel == "fc1":
            gated = spec["swiglu_fusion"] != 0 or spec["has_fc3"]
            per_block = FC1_ROWS // 2 if gated else FC1_ROWS  # outputs per block
            return Launch((routes, (I + per_block - 1) // per_block, 1), (THREADS, 1, 1), 0)
        return Launch((rows, (H + FC2_ROWS - 1) // FC2_ROWS, 1), (THREADS, 1, 1), 0)
