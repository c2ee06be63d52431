"""Kernel family ``gemv``: the SIMT decode engine (few routes, no grouping pass), for the layouts the
tensor-core decode engine does not take.

Template ``cuda_src/engines/gemv.cuh``: ``qmoe::fc1_gemv`` (FC1 [+FC3] with the activation fused) and
``qmoe::fc2_gemv_combine`` (FC2 with the weighted combine fused, output rounded once to T); their
inner step is ``cuda_src/engines/dot.cuh`` (16-byte weight loads when the spec is ``aligned``). The
activation between them is stored in the activation dtype T.
"""

from __future__ import annotations

from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from ._expert import (
    ACT_PARAMS_ARG,
    EXPERT_FIELDS,
    expert_spec,
    fc1_weights,
    fc2_weights,
    template_types,
    tiled_unsupported,
)
from .base import KernelFamily, Problem, Slot, register

__all__ = ["GemvFamily"]

THREADS = 128  # kGemvThreads
FC1_ROWS = 8  # weight rows per fc1 block (kFc1Groups groups of 4): 4 gated outputs or 8 plain ones
FC2_ROWS = 4  # kFc2Rows: outputs per fc2 block
MAX_GRID_Y = 65535


@register
class GemvFamily(KernelFamily):
    name = "gemv"
    header = "engines/gemv.cuh"
    depends_on = EXPERT_FIELDS

    def spec(self, config) -> ModuleSpec:
        return expert_spec(self.name, config)

    def supports(self, config, problem: Problem | None = None) -> str | None:
        why = tiled_unsupported(config)
        if why:
            return why
        if (config.inter + 3) // 4 > MAX_GRID_Y or (config.hidden + FC2_ROWS - 1) // FC2_ROWS > MAX_GRID_Y:
            return f"hidden {config.hidden} / inter {config.inter} need more than {MAX_GRID_Y} blocks on grid.y"
        return None

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        t = template_types(spec)
        dt, sdt = spec["dtype"], spec["scale_dtype"]
        fc1 = KernelDef(
            "fc1",
            f"qmoe::fc1_gemv<{t['T']}, {t['S']}, {t['B1']}, {t['Z1']}, {t['B3']}, {t['Z3']}, {t['BLOCK']}, "
            f"{t['ACT']}, {t['GATE']}, {t['ALIGNED']}>",
            (Ptr("x", dt), Ptr("topk_ids", "int32"), Scalar("k", "int32"), Scalar("H", "int32"), Scalar("I", "int32"),
             fc1_weights(sdt), ACT_PARAMS_ARG, Ptr("act", dt)),
        )
        fc2 = KernelDef(
            "fc2",
            f"qmoe::fc2_gemv_combine<{t['T']}, {t['S']}, {t['B2']}, {t['Z2']}, {t['BLOCK']}, {t['ALIGNED']}>",
            (Ptr("act", dt), Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"), Scalar("k", "int32"),
             Scalar("H", "int32"), Scalar("I", "int32"), fc2_weights(sdt), Ptr("out", dt)),
        )
        return (fc1, fc2)

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> Launch:
        if role == "fc1":
            gated = spec["swiglu_fusion"] != 0 or spec["has_fc3"]
            per_block = FC1_ROWS // 2 if gated else FC1_ROWS  # outputs per block
            return Launch((problem.routes, (problem.I + per_block - 1) // per_block, 1), (THREADS, 1, 1), 0)
        return Launch((problem.rows, (problem.H + FC2_ROWS - 1) // FC2_ROWS, 1), (THREADS, 1, 1), 0)

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> dict[str, Slot]:
        itemsize = 4 if spec["dtype"] == "float32" else 2
        return {"act": Slot(problem.routes * problem.I * itemsize)} if role == "fc1" else {}  # [R, I] T

