"""Kernel family ``group``: count / scan / scatter routes by expert in one block (prefill only).

Template ``cuda_src/moe_group.cuh``: ``qmoe::group_by_expert``. Independent of the layout: one
module for every layer.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..jit.family import KernelDef, KernelFamily, Launch, Ptr, Scalar
from ..specialize import ModuleSpec
from . import register

THREADS = 1024


@register
class GroupFamily(KernelFamily):
    name = "group"
    header = "moe_group.cuh"
    depends_on = ()
    variants = ("prefill",)

    def specs(self, config: Any, variants: Iterable[str]) -> list[ModuleSpec]:
        return [ModuleSpec.make("group")]

    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        args = (Ptr("topk_ids", "int32"), Scalar("R", "int32"), Scalar("E", "int32"), Scalar("BM", "int32"),
                Ptr("offsets", "int32"), Ptr("tile_offsets", "int32"), Ptr("sorted", "int32"))
        return (KernelDef("group_by_expert", "qmoe::group_by_expert", args),)

    def launch(self, spec: ModuleSpec, kernel: str = "", **_: Any) -> Launch:
        return Launch((1, 1, 1), (THREADS, 1, 1), 0)
