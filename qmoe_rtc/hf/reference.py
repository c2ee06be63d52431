""":class:`ReferenceLayer`: the float64 CPU reference (:func:`qmoe_rtc.contract.reference.qmoe`) with a layer's call
signature, behind ``replace_moe_blocks(..., backend="reference")``: a slow correctness check of a replaced model on
the CPU (no GPU needed), never a way to serve one. It takes CPU tensors only, so a model on a GPU cannot use it."""

from __future__ import annotations

import numpy as np
import torch

from ..contract import QMoEAttributes
from ..contract.reference import qmoe as reference
from ..errors import DeviceError
from ..runtime.check import check_layer

__all__ = ["ReferenceLayer"]


def _numpy(t):
    """A CPU tensor as a NumPy array of the same dtype (bfloat16 through ml_dtypes), or None."""
    if t is None:
        return None
    if t.device.type != "cpu":
        raise DeviceError(f"backend='reference' runs on the CPU: got a tensor on {t.device}")
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensor(a: np.ndarray):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class ReferenceLayer:
    """``ReferenceLayer(weights, attributes)``: a layer whose call ``layer(input, router_probs, router_weights=None,
    out=None)`` on CPU tensors writes the float64 reference's output (rounded once to the input's dtype) into ``out``.
    The layer is validated at construction by the function ``QMoE()`` validates with, so it refuses what ``QMoE()``
    would; each call then costs a float64 NumPy evaluation of every route."""

    def __init__(self, weights: dict, attributes: dict):
        check_layer(weights, QMoEAttributes.from_kwargs(**attributes), prepack="off")
        self.weights, self.attributes = dict(weights), dict(attributes)
        self.calls = 0

    def __call__(self, input, router_probs, router_weights=None, out=None):
        x = _numpy(input)
        y = reference(x.reshape(-1, x.shape[-1]), _numpy(router_probs), router_weights=_numpy(router_weights),
                      **self.weights, **self.attributes)
        y = _tensor(y).reshape(input.shape)
        self.calls += 1
        if out is None:
            return y
        out.copy_(y)
        return out
