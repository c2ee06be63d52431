"""The custom op ``qmoe_rtc::moe``: a layer call that ``torch.compile`` traces and ``torch.cuda.graph`` captures.

Schema: ``qmoe_rtc::moe(Tensor input, Tensor? router_probs, Tensor? router_weights, int handle) -> Tensor``, with
the contract's input names (docs/contract.md): ``input`` [rows, H] or [B, S, H] float16 / bfloat16 / float32,
``router_probs`` [rows, E] logits (float32 or the input's dtype; None for a layer with a router GEMM [ext]),
``router_weights`` [rows, E] or None, ``handle`` the layer's (:func:`qmoe_rtc.torch.register`). The result is a
new tensor of the input's shape and dtype, contiguous, on the input's device.

The op is **functional** (``mutates_args=()``): it allocates its output with ``torch.empty`` and returns it. An
``out`` argument declared as mutated would work too, but ``torch.compile`` then wraps each call in
``auto_functionalized`` and needs its re-inplacing pass to drop a copy; a functional op needs neither: the fake
returns a fresh tensor and Inductor plans its buffer like any other. Inside ``torch.cuda.graph`` (and the CUDA graphs
of ``mode="reduce-overhead"``) the allocation comes from torch's caching allocator, which serves captures from the
graph's private pool, so nothing in the op is unsafe to capture. The layer itself is always called with ``out=``, as
its capture contract asks (README, "Graphs"): no allocation, compile or synchronisation of its own, on torch's
current stream. As for the layer called directly, plan each batch size before a capture (one eager or compiled run
at that size, or ``MoEModule.reserve``). A caller that wants the output in a buffer of its own calls the layer
directly: ``layer(x, logits, out=buf)``.

The real implementation copies a non-contiguous or not 16-byte aligned ``input`` and non-contiguous router tensors
first (an Inductor graph may hand a view, and torch's own ops take any strides; the copy is torch's, so it is
capturable where the layer would refuse an unaligned input), otherwise it passes the tensors as they are; the layer
checks them against its sizes. The fake (meta) implementation checks what metadata tells (ranks, dtypes, rows,
devices: the refusals the real one makes before the layer, :class:`~qmoe_rtc.QMoEInputError` naming the input) and
returns ``input.new_empty(input.shape)``; it reads no data and launches nothing, so tracing needs no GPU. No autograd
formula is registered: the op is for inference (run the model under ``torch.no_grad()`` or
``torch.inference_mode()``; a backward through it is torch's error "no autograd formula was registered").
"""

from __future__ import annotations

import torch

from ..errors import DeviceError, QMoEInputError
from .registry import layer_of

__all__ = ["OP_NAME", "check_inputs", "moe"]

OP_NAME = "qmoe_rtc::moe"
_SCHEMA = "(Tensor input, Tensor? router_probs, Tensor? router_weights, int handle) -> Tensor"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(t) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def check_inputs(input, router_probs, router_weights) -> None:
    """Refuse what the tensors' metadata shows to be wrong (no data read, so it runs on fake and meta tensors too):
    a :class:`~qmoe_rtc.QMoEInputError` naming the input, what was expected and what was given; a
    :class:`~qmoe_rtc.DeviceError` for tensors on different devices. The layer checks its own sizes (H, E) when it
    runs."""
    if not isinstance(input, torch.Tensor):
        raise QMoEInputError("input", "a torch tensor [rows, H] or [B, S, H]", type(input).__name__)
    if input.dim() not in (2, 3):
        raise QMoEInputError("input", "rank 2 ([rows, H]) or 3 ([B, S, H])", f"shape {_shape(input)}")
    if input.dtype not in _FLOATS:
        raise QMoEInputError("input", f"dtype in {tuple(_name(d) for d in _FLOATS)}", f"dtype {_name(input.dtype)}")
    rows = input.shape[0] if input.dim() == 2 else input.shape[0] * input.shape[1]
    for name, t in (("router_probs", router_probs), ("router_weights", router_weights)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise QMoEInputError(name, "a torch tensor [rows, E] or None", type(t).__name__)
        if t.dim() != 2 or t.shape[0] != rows:
            raise QMoEInputError(name, f"[rows, E] with rows = {rows} (the input's rows)", f"shape {_shape(t)}")
        if t.dtype not in (torch.float32, input.dtype):
            want = tuple(dict.fromkeys(("float32", _name(input.dtype))))
            raise QMoEInputError(name, f"dtype in {want}", f"dtype {_name(t.dtype)}")
        if t.device != input.device:
            raise DeviceError(f"input '{name}': expected {input.device} (the input's device), got {t.device}")
    if router_probs is not None and router_weights is not None and router_weights.shape[1] != router_probs.shape[1]:
        raise QMoEInputError("router_weights", f"shape {_shape(router_probs)} (router_probs')",
                             f"shape {_shape(router_weights)}")


@torch.library.custom_op(OP_NAME, mutates_args=(), schema=_SCHEMA)
def _moe_op(input, router_probs, router_weights, handle):
    layer = layer_of(handle)
    check_inputs(input, router_probs, router_weights)
    if not input.is_contiguous() or input.data_ptr() % 16:  # the layer reads rows with 16-byte loads
        input = input.clone(memory_format=torch.contiguous_format)
    if router_probs is not None:
        router_probs = router_probs.contiguous()
    if router_weights is not None:
        router_weights = router_weights.contiguous()
    out = torch.empty(input.shape, dtype=input.dtype, device=input.device)  # [rows, H] or [B, S, H], the input's dtype
    layer(input, router_probs, router_weights, out=out)  # on torch's current stream; no allocation of its own
    return out


@_moe_op.register_fake
def _moe_fake(input, router_probs, router_weights, handle):
    layer_of(handle)  # a stale handle is refused when the graph is traced, not only when it runs
    check_inputs(input, router_probs, router_weights)
    return input.new_empty(input.shape)  # contiguous, as the real output


def moe(input, router_probs, handle: int, router_weights=None):
    """``torch.ops.qmoe_rtc.moe(input, router_probs, router_weights, handle)``: the layer registered as ``handle``
    on ``input`` [rows, H] or [B, S, H] and ``router_probs`` [rows, E]; returns a new tensor like ``input``."""
    return torch.ops.qmoe_rtc.moe.default(input, router_probs, router_weights, handle)
