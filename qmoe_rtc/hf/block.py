""":class:`QMoEBlock`: a transformers MoE block's replacement, a ``torch.nn.Module`` whose forward runs a qmoe_rtc
layer through the custom op ``qmoe_rtc::moe`` (:mod:`qmoe_rtc.torch`), so the model still compiles with
``torch.compile(fullgraph=True)`` and captures in ``torch.cuda.graph``."""

from __future__ import annotations

import torch

from ..torch.module import MoEModule
from .families import Family

__all__ = ["QMoEBlock", "reserve_blocks"]


class QMoEBlock(torch.nn.Module):
    """The MoE block of decoder layer ``layer_index`` as one qmoe_rtc layer (routed experts, shared experts and their
    gate, the routing; with ``router_in_layer`` the router's linear too).

    ``forward(hidden_states)`` takes what the replaced block took (``[B, S, H]``, or ``[T, H]``) and returns what it
    returned: the new hidden states of the input's shape and dtype, or for gpt-oss's ``GptOssMLP`` the pair
    ``(hidden_states, router_scores)``. The router module of the replaced block stays a child under its own name
    (``gate``, or ``router`` for gpt-oss), so ``state_dict`` keys and transformers' ``output_router_logits`` hooks
    still find it. Without ``router_in_layer`` its forward computes the logits exactly as the model does (in the
    block input's dtype, or float32 for DeepSeek-V3) and the layer routes from them (the router's own top-k is
    discarded; ``torch.compile`` drops it where unused; gpt-oss's scores are returned as the block returned them).
    With ``router_in_layer`` the layer's router GEMM [ext] computes the logits from a copy of the router's weights
    taken at replacement, the router module is not called, and gpt-oss's second output is None (the decoder layer
    discards it). Inference only: the op has no backward."""

    def __init__(self, layer, family: Family, router: torch.nn.Module, *, router_in_layer: bool, layer_index: int,
                 dtype: str):
        super().__init__()
        self.moe = MoEModule(layer)
        self.add_module(family.router, router)
        self.router_name = family.router
        self.router_in_layer = bool(router_in_layer)
        self.returns_scores = family.scores
        self.family = family.name
        self.layer_index = int(layer_index)
        self.dtype = dtype  # the activations' (a name)
        self.logits_dtype = "float32" if router_in_layer or family.float32_logits else dtype

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]: the routers' and the op's rows
        scores = None
        if self.router_in_layer:
            y = self.moe(x, None)
        else:
            logits, scores, _ = getattr(self, self.router_name)(x)
            y = self.moe(x, logits)
        y = y.view(hidden_states.shape)
        return (y, scores) if self.returns_scores else y

    def reserve(self, max_rows: int) -> None:
        """Plan every row count 1..``max_rows`` of this block (rows = batch · sequence) on torch's current stream, with
        the dtypes its forward calls the layer with, so CUDA graphs of those sizes capture with nothing left to plan
        (:meth:`qmoe_rtc.torch.MoEModule.reserve`)."""
        self.moe.reserve(max_rows, self.dtype, self.logits_dtype)

    def extra_repr(self) -> str:
        where = "layer" if self.router_in_layer else "torch"
        return f"family={self.family}, layer_index={self.layer_index}, router={where}"


def reserve_blocks(model, max_rows: int) -> int:
    """:meth:`QMoEBlock.reserve` on every replaced block of ``model``; returns how many there are."""
    blocks = [m for m in model.modules() if isinstance(m, QMoEBlock)]
    for b in blocks:
        b.reserve(max_rows)
    return len(blocks)
