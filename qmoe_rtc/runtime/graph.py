"""CUDA graphs of one forward, recorded on the caller's own arrays (:meth:`qmoe_rtc.QMoE.capture`)."""

from __future__ import annotations

from .._arrays import dtype_name, shape_str
from ..errors import QMoEInputError
from .interop import cupy, cupy_stream, signature

__all__ = ["QMoEGraph", "capture_launches"]


def capture_launches(bound, stream: int, ptrs: tuple, device_id: int):
    """A CuPy graph of ``bound``'s launches with the addresses ``ptrs``, captured on a side stream that
    first waits for ``stream`` (so the capture sees everything queued before it)."""
    cp = cupy()
    with cp.cuda.Device(device_id):
        caller = cupy_stream(stream, device_id)
        cap = cp.cuda.Stream(non_blocking=True)
        cap.wait_event(caller.record())
        cap.begin_capture()
        try:
            if bound is not None:
                bound.launch(cap.ptr, ptrs)
        finally:
            graph = cap.end_capture()
        cap.synchronize()
    return graph


class QMoEGraph:
    """A captured forward. ``input`` / ``router_probs`` / ``router_weights`` are the caller's arrays it
    reads (write new values into them, then :meth:`replay`); ``output`` is the array it writes."""

    def __init__(self, graph, x, logits, rw, out, device_id: int, stream_of, keepalive=()):
        self.graph = graph
        self._keepalive = keepalive  # scratch and weights the recorded kernels point into
        self.input = x
        self.router_probs = logits
        self.router_weights = rw
        self.output = out
        self.device_id = device_id
        self._stream_of = stream_of  # device -> the caller's current stream (torch's or CuPy's)

    def update(self, input=None, router_probs=None, router_weights=None) -> None:
        """Copy new values into the captured arrays (same shapes and dtypes), on the current stream."""
        for name, dst, src in (("input", self.input, input), ("router_probs", self.router_probs, router_probs),
                               ("router_weights", self.router_weights, router_weights)):
            if src is None:
                continue
            if dst is None:
                raise QMoEInputError(name, "None (the graph was captured without it)", "an array")
            if tuple(src.shape) != tuple(dst.shape) or dtype_name(src) != dtype_name(dst):
                raise QMoEInputError(name, f"{dtype_name(dst)} {shape_str(dst.shape)} (fixed per graph)",
                                     f"{dtype_name(src)} {shape_str(src.shape)}")
            if signature(dst)[0] == signature(src)[0] and hasattr(dst, "copy_"):
                dst.copy_(src)  # torch -> torch on torch's current stream
            else:
                cp = cupy()
                with cupy_stream(self._stream_of(self.device_id), self.device_id):
                    cp.from_dlpack(dst)[...] = cp.asarray(src) if not hasattr(src, "__dlpack__") else cp.from_dlpack(src)

    def replay(self, stream=None):
        """Launch the graph on ``stream`` (a raw handle or a stream object; default: the current stream
        of the captured arrays' kind); returns ``output``."""
        handle = self._stream_of(self.device_id) if stream is None else \
            int(getattr(stream, "cuda_stream", getattr(stream, "ptr", stream)))
        self.graph.launch(cupy_stream(handle, self.device_id))
        return self.output
