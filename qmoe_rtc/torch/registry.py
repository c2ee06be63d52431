"""Layers by integer handle, for the custom op: a ``torch.library`` op takes tensors and scalars only, so a layer
(a Python object holding GPU weights) is passed as the handle :func:`register` gave it.

The registry holds each layer **weakly**: a handle is valid while its layer is alive (:class:`~qmoe_rtc.torch.MoEModule`
keeps its layer, so its handle lives as long as the module), and the entry goes away with the layer, so the registry
never keeps weights on the GPU. :func:`unregister` drops an entry earlier. Handles count up from 1 and are never
reused in a process: a stale handle finds nothing rather than another layer. Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from ..errors import QMoEInputError

__all__ = ["layer_of", "register", "registered", "unregister"]

_lock = threading.Lock()
_next = itertools.count(1)
_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> layer
_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> handle (one handle per layer)


def register(layer) -> int:
    """The handle of ``layer`` (a :class:`qmoe_rtc.QMoE`, an :class:`~qmoe_rtc.distributed.ExpertParallelQMoE`, or
    any object called as ``layer(input, router_probs, router_weights, out=out)`` that writes ``out``): a new one on
    first registration, the same one again after. The registry keeps only a weak reference: keep the layer alive
    for as long as the handle is used."""
    if not callable(layer):
        raise QMoEInputError("layer", "a layer called as layer(x, router_logits, router_weights, out=out) "
                             "(a qmoe_rtc.QMoE)", type(layer).__name__)
    with _lock:
        try:
            handle = _handles.get(layer)
        except TypeError:  # not hashable, or no weak references
            handle = None
        if handle is not None and _layers.get(handle) is layer:
            return handle
        handle = next(_next)
        try:
            _layers[handle] = layer
            _handles[layer] = handle
        except TypeError as exc:
            _layers.pop(handle, None)
            raise QMoEInputError("layer", "an object that supports weak references (the registry does not keep "
                                 "layers alive)", f"{type(layer).__name__} ({exc})") from None
        return handle


def unregister(handle: int) -> None:
    """Forget ``handle`` (its layer stays as it is; calls through the handle are refused from now on). A handle that
    is not registered is ignored."""
    with _lock:
        layer = _layers.pop(int(handle), None)
        if layer is not None:
            _handles.pop(layer, None)


def layer_of(handle: int):
    """The live layer registered as ``handle``; a :class:`~qmoe_rtc.QMoEInputError` naming ``handle`` otherwise."""
    layer = _layers.get(handle)
    if layer is None:
        raise QMoEInputError("handle", "the handle of a live layer (qmoe_rtc.torch.register(layer), kept alive by "
                             "its caller)", f"{handle!r}, unregistered or its layer freed")
    return layer


def registered() -> dict[int, object]:
    """A snapshot of the live entries, handle -> layer (for diagnostics and tests)."""
    with _lock:
        return dict(_layers.items())
