""":class:`MoEModule`: a layer as a ``torch.nn.Module`` whose forward calls the custom op ``qmoe_rtc::moe``."""

from __future__ import annotations

import torch

from ..errors import QMoEInputError, QMoEUnsupportedError
from .op import moe
from .registry import register

__all__ = ["MoEModule"]


class MoEModule(torch.nn.Module):
    """``MoEModule(layer)``: ``forward(x, router_logits=None, router_weights=None)`` runs ``layer`` (a
    :class:`qmoe_rtc.QMoE`, or an :class:`~qmoe_rtc.distributed.ExpertParallelQMoE`) through the custom op, so a
    model holding it compiles with ``torch.compile(fullgraph=True)`` and captures with ``torch.cuda.graph``.

    The module keeps the layer (``.layer``) and its registry handle (``.handle``): the handle lives as long as the
    module does. The layer's weights are its own GPU buffers, not parameters or buffers of the module
    (``state_dict()`` is empty and ``.to()`` does not move them).
    """

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.handle = register(layer)

    def forward(self, x, router_logits=None, router_weights=None):
        """``x`` [rows, H] or [B, S, H], ``router_logits`` [rows, E] (None with a router GEMM [ext]) -> a new
        tensor like ``x``."""
        return moe(x, router_logits, self.handle, router_weights)

    def reserve(self, max_rows: int, dtype=None, router_dtype=torch.float32, router_weights_dtype=None) -> None:
        """Plan every batch size 1..``max_rows`` and size one scratch pool on torch's current stream
        (:meth:`qmoe_rtc.QMoE.reserve`), so graphs of all those sizes capture with nothing left to plan. Dtypes are
        torch dtypes (or names); ``dtype`` defaults to the layer's."""
        target = getattr(self.layer, "local", self.layer)  # an ExpertParallelQMoE plans its local slice
        if not hasattr(target, "reserve"):
            raise QMoEUnsupportedError(f"{type(self.layer).__name__} has no reserve(): run one eager call per batch "
                                       "size before capturing instead")
        names = [None if d is None else str(d).removeprefix("torch.") for d in (dtype, router_dtype,
                                                                                router_weights_dtype)]
        device = getattr(target, "device_id", None)
        if device is None:
            raise QMoEInputError("layer", "a layer with a device_id (a qmoe_rtc.QMoE)", type(target).__name__)
        stream = torch.cuda.current_stream(device).cuda_stream
        target.reserve(max_rows, names[0], names[1], names[2], stream=stream)

    def extra_repr(self) -> str:
        return f"handle={self.handle}, layer={type(self.layer).__name__}"
