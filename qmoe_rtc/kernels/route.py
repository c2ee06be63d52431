"""Kernel family ``route``: softmax top-k routing (and the Phi-3.5 sparse mixer), one block per row.

Template ``cuda_src/routing/route.cuh``: ``qmoe::route_topk<LT, WT, HAS_RW, SPARSE>``. One module per
activation dtype holds every logits / router-weights dtype combination (float32 or T).
"""

from __future__ import annotations

from ..jit import KernelDef, Launch, Ptr, Scalar
from ..specialize import CPP_TYPES, ModuleSpec
from .base import KernelFamily, Problem, Slot, register

THREADS = 128  # kRouteThreads
MAX_EXPERTS = 512  # kRouteMaxExperts
MAX_K = 32  # kRouteMaxK


def kernel_key(logits_dtype: str, rw_dtype: str | None, sparse: bool) -> str:
    if sparse:
        return f"sparse_{logits_dtype}"
    return f"topk_{logits_dtype}" + (f"_rw_{rw_dtype}" if rw_dtype else "")


def _args(lt: str, wt: str) -> tuple:
    return (Ptr("logits", lt), Ptr("router_weights", wt, nullable=True), Scalar("rows", "int32"),
            Scalar("E", "int32"), Scalar("k", "int32"), Scalar("normalize", "int32"),
            Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"))


@register
class RouteFamily(KernelFamily):
    name = "route"
    header = "routing/route.cuh"
    depends_on = ("dtype",)

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        dts = ["float32"] if spec["dtype"] == "float32" else ["float32", spec["dtype"]]
        out = []
        for lt in dts:
            L = CPP_TYPES[lt]
            for rw in [None, *dts]:
                flag = "true" if rw else "false"
                out.append(KernelDef(kernel_key(lt, rw, False), f"qmoe::route_topk<{L}, {CPP_TYPES[rw or lt]}, {flag}, false>",
                                     _args(lt, rw or lt)))
            out.append(KernelDef(kernel_key(lt, None, True), f"qmoe::route_topk<{L}, {L}, false, true>", _args(lt, lt)))
        return tuple(out)

    def supports(self, config, problem: Problem | None = None) -> str | None:
        if config.experts > MAX_EXPERTS:
            return f"{config.experts} experts (routing handles at most {MAX_EXPERTS})"
        if config.k > MAX_K:
            return f"k = {config.k} (routing handles at most {MAX_K})"
        return None

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem) -> str:
        return kernel_key(problem.router_dtype, problem.router_weights_dtype, problem.sparse)

    def launch(self, spec: ModuleSpec, role: str, problem: Problem) -> Launch:
        return Launch((problem.rows, 1, 1), (THREADS, 1, 1), 0)

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem) -> dict[str, Slot]:
        R = problem.routes
        return {"topk_ids": Slot(4 * R), "topk_w": Slot(4 * R)}  # [R] i32, [R] f32
