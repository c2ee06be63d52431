"""Expert statistics [ext] of a GPU layer (``QMoE(expert_counts=True)``): the routes each expert gets, counted inside
the routing kernel (routing/route.cuh ``count_route``) into one int64 [E] buffer of the layer's binding table, so
every call, graph replay and capture adds to it with no extra launch and no host synchronisation.
"""

from __future__ import annotations

from ..errors import QMoEUnsupportedError
from .interop import cupy, cupy_stream

__all__ = ["ExpertCounts"]


class ExpertCounts:
    """:class:`~qmoe_rtc.executor.QMoE`'s expert statistics: reads ``_table['expert_counts']`` (None when the
    layer does not count), ``device_id`` and ``_stream_of`` (the last call's stream getter, or None)."""

    @property
    def expert_counts(self):
        """Expert statistics [ext]: int64 [E] on the device, the routes each of the layer's E experts got (the
        routed picks; shared experts are not counted; a slice counts the whole layer's), added inside the routing
        kernel on every call, replay and capture since construction or :meth:`reset_expert_counts`. The layer's own
        buffer: read it after the calls (``.get()`` synchronises), do not write it. Per-call counts: reset first."""
        counts = self._table.get("expert_counts")
        if counts is None:
            raise QMoEUnsupportedError("this layer does not count its experts' routes: build it with "
                                       "QMoE(..., expert_counts=True)")
        return counts

    def reset_expert_counts(self, stream=None) -> None:
        """Zero :attr:`expert_counts` on ``stream`` (a raw handle or a stream object; default: the current stream of
        the last call's kind, torch's or CuPy's): an asynchronous memset, so inside a capture it is recorded too."""
        counts = self.expert_counts
        if stream is None:
            handle = self._stream_of(self.device_id) if self._stream_of else cupy().cuda.get_current_stream().ptr
        else:
            handle = int(getattr(stream, "cuda_stream", getattr(stream, "ptr", stream)))
        with cupy_stream(handle, self.device_id):
            counts.fill(0)
