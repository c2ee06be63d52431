"""qmoe_rtc layers in torch models: the custom op ``qmoe_rtc::moe`` (``torch.library``, with a fake implementation)
and :class:`MoEModule`, so that ``torch.compile(model, fullgraph=True)`` traces a model that calls a layer and
``torch.cuda.graph`` captures it. Needs PyTorch (``pip install qmoe_rtc[torch]``); ``import qmoe_rtc`` never imports
torch, only ``import qmoe_rtc.torch`` does (and registers the op).

::

    import torch, qmoe_rtc
    from qmoe_rtc.torch import MoEModule
    moe = MoEModule(qmoe_rtc.QMoE(**weights, **attributes))   # registers the layer: moe.handle
    model = torch.compile(MyBlock(moe), fullgraph=True)      # MyBlock.forward calls moe(h, router_logits)
    with torch.inference_mode():
        y = model(x)

Or without a module: ``h = register(layer)`` then ``moe(x, logits, h)`` (= ``torch.ops.qmoe_rtc.moe(x, logits,
None, h)``). The registry holds layers weakly (:mod:`.registry`): keep the layer alive while its handle is used
(a :class:`MoEModule` does); :func:`unregister` forgets one. Why the op is functional: :mod:`.op`.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (absolute: PyTorch itself, not this package)
except ImportError as exc:
    raise ImportError(f"qmoe_rtc.torch needs PyTorch, which qmoe_rtc does not install by itself: "
                      f"pip install qmoe_rtc[torch] ({exc})") from exc

from .module import MoEModule
from .op import OP_NAME, check_inputs, moe
from .registry import layer_of, register, registered, unregister

__all__ = ["OP_NAME", "MoEModule", "check_inputs", "layer_of", "moe", "register", "registered", "unregister"]
