"""Kernel family ``route``: softmax top-k routing (and the Phi-3.5 sparse mixer), one block per row.

Template ``cuda_src/moe_route.cuh``: ``qmoe::route_topk<LT, WT, HAS_RW, SPARSE>``. One module per
activation dtype holds every logits / router-weights dtype combination (float32 or T).
"""

from __future__ import annotations

from typing import Any, Iterable

from ..jit.family import CPP_TYPES, KernelDef, KernelFamily, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from . import register

THREADS = 128  # kRouteThreads


def kernel_key(logits_dtype: str, rw_dtype: str | None, sparse: bool) -> str:
    if sparse:
        return f"sparse_{logits_dtype}"
    return f"topk_{logits_dtype}" + (f"_rw_{rw_dtype}" if rw_dtype else "")


@register
class RouteFamily(KernelFamily):
    name = "route"
    header = "moe_route.cuh"
    depends_on = ("dtype",)
    variants = None

    def specs(self, config: Any, variants: Iterable[str]) -> list[ModuleSpec]:
        layout = getattr(config, "layout", config)
        return [ModuleSpec.make("route", dtype=layout.dtype)]

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        dts = ["float32"] if spec["dtype"] == "float32" else ["float32", spec["dtype"]]
        out = []
        for lt in dts:
            L = CPP_TYPES[lt]
            for rw in [None, *dts]:
                W = CPP_TYPES[rw or lt]
                args = (Ptr("logits", lt), Ptr("router_weights", rw or lt, nullable=True), Scalar("rows", "int32"),
                        Scalar("E", "int32"), Scalar("k", "int32"), Scalar("normalize", "int32"),
                        Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"))
                flag = "true" if rw else "false"
                out.append(KernelDef(kernel_key(lt, rw, False), f"qmoe::route_topk<{L}, {W}, {flag}, false>", args))
            args = (Ptr("logits", lt), Ptr("router_weights", lt, nullable=True), Scalar("rows", "int32"),
                    Scalar("E", "int32"), Scalar("k", "int32"), Scalar("normalize", "int32"),
                    Ptr("topk_ids", "int32"), Ptr("topk_w", "float32"))
            out.append(KernelDef(kernel_key(lt, None, True), f"qmoe::route_topk<{L}, {L}, false, true>", args))
        return tuple(out)

    def launch(self, spec: ModuleSpec, kernel: str = "", *, rows: int, **_: Any) -> Launch:
        return Launch((rows, 1, 1), (THREADS, 1, 1), 0)
